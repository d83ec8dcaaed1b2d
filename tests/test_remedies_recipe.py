"""Remedies are checked against the model's recipe: nothing already in effect is suggested."""

from __future__ import annotations

from diag.analysis.effects import spread_sentence
from diag.analysis.remedies import (
    GENERIC_SPREAD,
    SEARCH_REMEDY,
    Suggestion,
    applicable_suggestions,
    spread_remedies,
)


def _per_channel() -> Suggestion:
    return Suggestion(
        "w",
        "per-tensor",
        "per-channel-weights",
        {"per_channel": True},
        "per_channel=True",
        "quantize_dynamic",
        "",
        ["fc"],
    )


def test_per_channel_remedy_is_replaced_by_its_reason_on_a_per_channel_recipe() -> None:
    out = applicable_suggestions([_per_channel()], {"mode": "dynamic", "per_channel": True})
    assert [s.remedy for s in out] == ["exclude-consumers"]
    assert "already in effect" in out[0].note
    assert out[0].recipe == {"nodes_to_exclude": ["fc"]}


def test_per_channel_remedy_stays_on_a_per_tensor_recipe() -> None:
    out = applicable_suggestions([_per_channel()], {"mode": "dynamic", "per_channel": False})
    assert [s.remedy for s in out] == ["per-channel-weights"]


def test_static_recipe_is_not_told_to_use_static_calibration() -> None:
    items = spread_remedies("qdq", {"mode": "static", "per_channel": True, "activation_type": "QUInt8"})
    assert items == ["16-bit activations (QDQ)", "an exclusion search (diag exclude)"]
    assert "per_channel=True" not in spread_remedies("dynamic", {"mode": "dynamic", "per_channel": True})


def test_weight_only_model_gets_only_weight_only_remedies() -> None:
    settings = {"mode": "weight_only", "bits": 4, "block_size": 32, "is_symmetric": False, "accuracy_level": 4}
    text = ", ".join(spread_remedies("matmulnbits", settings))
    for int8_advice in ("per_channel", "static calibration", "16-bit activations"):
        assert int8_advice not in text
    assert "block_size (16)" in text and "is_symmetric=True" in text and "accuracy_level=0" in text


def test_spread_sentence_carries_the_generic_list_until_the_recipe_is_known() -> None:
    """The spread headline's remedies are a typed slot: the generic list for the format until
    diagnose sets the recipe on it, then only what changes something for that recipe."""
    headline = spread_sentence([], None, "dynamic")
    assert headline.kind == "spread" and headline.spread is not None
    assert headline.text().endswith("What fits spread error: " + ", ".join(GENERIC_SPREAD) + ", or " + SEARCH_REMEDY)
    headline.spread.settings, headline.spread.recipe_known = {"mode": "dynamic", "per_channel": True}, True
    assert headline.text().endswith(
        "What fits spread error: static calibration instead of dynamic, or an exclusion search (diag exclude)"
    )


def test_per_channel_dynamic_model_never_gets_a_per_channel_remedy(built, tmp_path) -> None:
    """Real quantization with per_channel=True, the recipe inferred back: no remedy repeats it."""
    from diag.analysis.compare import CompareOptions
    from diag.cli.verbs import diagnose
    from diag.core.feeds import FeedSpec
    from diag.fixtures.quantize import quantize

    b = built("convnet")
    int8 = quantize(b.fp32, tmp_path / "pc.onnx", "dynamic", per_channel=True)
    r = diagnose(b.fp32, int8, FeedSpec(inputs=str(b.inputs_path), batch=8), CompareOptions(progress=False))
    assert r.fix_recipe is not None and r.fix_recipe["settings"]["per_channel"] is True
    assert not [s for s in r.suggestions if s.recipe.get("per_channel")]
    assert "What fits spread error: per_channel=True" not in r.cause_sentence
    assert ", ".join(GENERIC_SPREAD) not in r.cause_sentence
