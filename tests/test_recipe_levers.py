"""Recipe settings as causes (issue 42 item 1): each changed alone, re-quantized, measured.

The ``per_channel_spread`` fixture's error is spread over its 6 MatMuls (no one of them recovers
half of it) and comes from one setting: per-tensor weight scales, while every weight's columns
span 100x. quantize_dynamic with onnxruntime's defaults made the INT8 model. diag must read the
recipe back, prove it rebuilds that model exactly, re-quantize with each setting changed alone,
and name ``per_channel=False`` as the cause with the share of the error ``per_channel=True``
removes, a figure recomputed here with plain onnxruntime on the user's files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnxruntime.quantization import quantize_dynamic

from diag.analysis.levers import RecipeChange, RecipeLevers, recipe_changes
from diag.cli import commands as cli
from diag.fixtures import models

#: The effect check's samples: the first 8 of the inputs.
SAMPLES = 8


def _error(fp32: Path, model: Path, feeds: dict[str, np.ndarray]) -> float:
    """Σ(INT8 - FP32)² of the output ``y``; FP32 in exact mode, the INT8 model as onnxruntime runs it by default."""
    exact = ort.SessionOptions()
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(fp32), exact, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return float(((got.astype(np.float64) - ref.astype(np.float64)) ** 2).sum())


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("settings")
    fx = models.build("per_channel_spread")
    fp, q, x = d / "mlp.fp32.onnx", d / "mlp.int8.onnx", d / "mlp.npz"
    onnx.save(fx.model, fp)
    quantize_dynamic(str(fp), str(q))  # onnxruntime's defaults: per-tensor weights
    feeds = fx.make_inputs(64, 1)
    np.savez(x, **feeds)
    return fp, q, x, feeds


@pytest.fixture(scope="module")
def diagnosed(spread, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    fp, q, x, _ = spread
    out = tmp_path_factory.mktemp("settings-out")
    buffer = io.StringIO()  # a module-scoped fixture has no capsys
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--out", str(out), "--quiet"])
    assert code in (0, 3)
    doc = json.loads((out / "diag.json").read_text())
    return doc, buffer.getvalue(), (out / "summary.md").read_text() + (out / "report.html").read_text()


def test_the_headline_names_per_channel_with_the_share_it_removes(diagnosed) -> None:
    doc, printed, _ = diagnosed
    settings = doc["recipe_settings"]
    assert settings["proved"] is True and settings["source"] == "inferred"
    assert settings["proof"].startswith("the recipe rebuilds your INT8 model exactly")
    best = settings["effects"][0]
    assert (best["key"], best["before"], best["after"]) == ("per_channel", False, True)
    assert best["recovered"] > 0.95
    # no node alone explains the error: the effect check's best is far below the setting
    assert max(e["recovered"] for e in doc["effects"]["effects"]) < 0.5
    assert doc["verdict"]["headline"]["kind"] == "setting"
    headline = doc["verdict"]["cause"]
    assert headline.startswith("cause: per_channel=False: the recipe read back from your model with per_channel=True")
    assert f"recovers {best['recovered']:.0%} of the error of y on {SAMPLES} samples" in headline
    assert "fix: per_channel=True" in headline
    assert headline in printed
    assert not any(n["role"] == "root-cause" for n in doc["nodes"])


def test_a_document_whose_cause_is_a_setting_reads_back(diagnosed, tmp_path, capsys) -> None:
    """diag report / check read the document back (its schema knows the "setting" headline)."""
    doc, _, _ = diagnosed
    path = tmp_path / "diag.json"
    path.write_text(json.dumps(doc))
    code, _, err = run_cli(["report", path, "--out", tmp_path / "again"], capsys)
    assert code == 0, err
    assert (
        "cause: `per_channel=False`: the recipe read back from your model"
        in (tmp_path / "again" / "summary.md").read_text()
    )
    code, out, _ = run_cli(["check", path, "--max-grade", "marginal"], capsys)
    assert code == 0, out


def test_the_measured_share_is_what_plain_onnxruntime_gives_on_the_users_files(spread, diagnosed, tmp_path) -> None:
    fp, q, _, feeds = spread
    doc, _, _ = diagnosed
    first = {k: v[:SAMPLES] for k, v in feeds.items()}
    fixed = tmp_path / "per_channel.onnx"
    quantize_dynamic(str(fp), str(fixed), per_channel=True)  # the user's call with the one change
    truth = 1 - _error(fp, fixed, first) / _error(fp, q, first)
    measured = {e["key"]: e for e in doc["recipe_settings"]["effects"]}
    assert measured["per_channel"]["recovered"] == pytest.approx(truth, abs=0.01)
    # a change that rebuilds the user's model byte for byte is said to do nothing, not measured as 0 %
    assert measured["extra_options.ActivationSymmetric"]["identical"] is True


def test_every_surface_carries_the_same_line(diagnosed) -> None:
    doc, printed, rendered = diagnosed
    line = RecipeLevers.from_dict(doc["recipe_settings"]).line()
    assert line.startswith("recipe settings, each changed alone and re-quantized, on the error of y")
    assert "per_channel=True removes" in line and "ActivationSymmetric=True changes nothing" in line
    assert f"  {line}\n" in printed
    assert line in rendered  # summary.md (plain text for this line) and report.html
    assert 'id="recipe-settings"' in rendered
    # a byte-identical setting sorts last in the report's table, not first
    assert '<td class="num" data-sort="-1e9">byte-identical</td>' in rendered


def test_a_recipe_that_does_not_rebuild_the_model_measures_nothing(spread, tmp_path, capsys) -> None:
    fp, q, x, _ = spread
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"mode": "dynamic", "reduce_range": True}))  # not how the model was made
    code, out, _ = run_cli(
        ["compare", fp, q, "--inputs", x, "--recipe", recipe, "--out", tmp_path / "o", "--quiet"], capsys
    )
    assert code in (0, 3)
    doc = json.loads((tmp_path / "o" / "diag.json").read_text())
    settings = doc["recipe_settings"]
    assert settings["proved"] is False and settings["effects"] == [] and settings["source"] == "given"
    assert "recipe settings not measured: the recipe does not rebuild your INT8 model" in out
    assert doc["verdict"]["headline"]["kind"] == "spread"


def test_no_settings_turns_the_check_off(spread, tmp_path, capsys) -> None:
    fp, q, x, _ = spread
    code, out, _ = run_cli(
        ["compare", fp, q, "--inputs", x, "--settings", "off", "--out", tmp_path / "o", "--quiet"], capsys
    )
    assert code in (0, 3)
    doc = json.loads((tmp_path / "o" / "diag.json").read_text())
    assert "recipe_settings" not in doc and "recipe settings" not in out
    assert doc["verdict"]["cause"].startswith("no single root cause")


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"mode": "dynamic"},
            ["per_channel=True", "weight_type=QUInt8", "ActivationSymmetric=True", "WeightSymmetric=False"],
        ),
        (
            {"mode": "dynamic", "weight_type": "QUInt8", "per_channel": True, "reduce_range": True},
            ["reduce_range=False", "weight_type=QInt8", "ActivationSymmetric=True", "WeightSymmetric=True"],
        ),
        (
            {"mode": "static", "activation_type": "QUInt8", "extra_options": {"WeightSymmetric": False}},
            [
                "per_channel=True",
                "weight_type=QUInt8",
                "activation_type=QInt8",
                "ActivationSymmetric=True",
                "WeightSymmetric=True",
            ],
        ),
        ({"mode": "weight_only", "bits": 4}, []),
    ],
)
def test_the_changes_follow_onnxruntimes_defaults(settings: dict, expected: list[str]) -> None:
    # WeightSymmetric's default follows the weight type (signed: symmetric), as onnxruntime's base quantizer
    assert [c.setting for c in recipe_changes(settings)] == expected
    assert RecipeChange("extra_options.WeightSymmetric", True, False).lever == "WeightSymmetric=True"


def test_a_setting_that_explains_less_than_a_group_leaves_the_group_the_cause(tmp_path, capsys) -> None:
    # projection_spread: keeping one down projection per layer in float removes ~all of the error;
    # per-channel weights cannot help an activation outlier. Both measured; the group stays the cause.
    fx = models.projection_spread()
    fp, q, x = tmp_path / "fp32.onnx", tmp_path / "int8.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    quantize_dynamic(str(fp), str(q))
    np.savez(x, **fx.make_inputs(32, 1))
    code, out, _ = run_cli(["compare", fp, q, "--inputs", x, "--out", tmp_path / "o", "--quiet"], capsys)
    assert code in (0, 3)
    doc = json.loads((tmp_path / "o" / "diag.json").read_text())
    assert doc["verdict"]["headline"]["kind"] == "lever"
    assert doc["verdict"]["cause"].startswith("cause: mlp/down_proj quantized in every layer")
    group = doc["effects"]["groups"][0]["recovered"]
    settings = doc["recipe_settings"]
    assert settings["proved"] is True
    assert all(e["recovered"] < group for e in settings["effects"] if e["recovered"] is not None)
    assert "recipe settings, each changed alone and re-quantized, on the error of logits" in out


def test_a_spread_headline_lists_the_settings_with_their_measured_share() -> None:
    from diag.analysis.effects import EffectCheck, setting_headline
    from diag.analysis.headline import Headline, SpreadRemedies
    from diag.analysis.levers import RecipeChangeEffect

    spread = Headline("spread", ("no single root cause",), spread=SpreadRemedies("dynamic", {}, recipe_known=True))
    levers = RecipeLevers(
        "inferred",
        "the recipe rebuilds your INT8 model exactly (9 quantized nodes)",
        True,
        "logits",
        8,
        "all",
        (
            RecipeChangeEffect(RecipeChange("per_channel", False, True), 0.3),
            RecipeChangeEffect(RecipeChange("weight_type", "QInt8", "QUInt8"), -0.2),
            RecipeChangeEffect(RecipeChange("extra_options.ActivationSymmetric", False, True), 0.0, identical=True),
        ),
    )
    failing = RecipeChangeEffect(RecipeChange("reduce_range", True, False), None, error="onnxruntime said no")
    levers = dataclasses.replace(levers, effects=(*levers.effects, failing))
    headline = setting_headline([], EffectCheck("logits", [], 8, 0.0), levers, spread)
    assert headline.kind == "spread"
    assert headline.text().startswith(
        "no single root cause. What fits spread error: per_channel=True (removes 30% of the error of logits); "
        "measured, does not help: weight_type=QUInt8, ActivationSymmetric=True; could not be measured: "
        "reduce_range=False, measured by re-quantizing on 8 samples"
    )
    # above the confirmation share, the setting is the cause
    best = dataclasses.replace(levers, effects=(RecipeChangeEffect(RecipeChange("per_channel", False, True), 0.8),))
    spread = Headline("spread", ("no single root cause",), spread=SpreadRemedies("dynamic", {}, recipe_known=True))
    lever = Headline("lever", ("cause: a group",), fix_code='nodes_to_exclude=["a", "b", "c", "d", "e"]')
    named = setting_headline([], EffectCheck("logits", [], 8, 0.0), best, spread)
    assert named.kind == "setting" and named.spread is None
    # a group's long node list never stays under a headline whose fix is a setting
    assert setting_headline([], EffectCheck("logits", [], 8, 0.0), best, lever).fix_code == ""
    assert named.text().startswith(
        "cause: per_channel=False: the recipe read back from your model with per_channel=True"
    )


def test_a_recipe_onnxruntime_cannot_build_leaves_the_diagnosis_standing(spread, tmp_path, capsys) -> None:
    fp, q, x, _ = spread
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"mode": "dynamic", "op_types_to_quantize": ["NoSuchOp"]}))
    code, out, err = run_cli(
        ["compare", fp, q, "--inputs", x, "--recipe", recipe, "--out", tmp_path / "o", "--quiet"], capsys
    )
    assert code in (0, 3), err
    doc = json.loads((tmp_path / "o" / "diag.json").read_text())
    assert doc["recipe_settings"]["proved"] is False and "'NoSuchOp'" in doc["recipe_settings"]["proof"]
    assert "recipe settings not measured: the recipe could not be re-quantized: op_types_to_quantize" in out
