"""Round-trip proof: a model quantized by onnxruntime, its recipe read back by diag, rebuilt exactly.

Real onnxruntime throughout: the user's model is made with ``quantize_dynamic`` / ``quantize_static``
as a user calls them, the recipe is inferred from the INT8 file alone, and ``prove_roundtrip``
re-quantizes with it through diag's guarded quantizer.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.fix.infer import infer_recipe, two_activation_matmuls
from diag.fix.roundtrip import (
    MATMUL_OP_TYPES,
    InitializerDifference,
    OpCountDifference,
    prove_roundtrip,
    roundtrip_difference,
    roundtrip_line,
)
from diag.fixtures import models
from diag.fixtures.quantize import _ArrayReader

NO_CONST_B = {"MatMulConstBOnly": False}

#: (fixture, recipe as a user writes it): onnxruntime's defaults apart from the keys set.
DYNAMIC: dict[str, tuple[str, dict[str, Any]]] = {
    "transformer-defaults": ("transformer", {}),
    "transformer-u8": ("transformer", {"weight_type": "QUInt8"}),
    "transformer-per-channel": ("transformer", {"per_channel": True}),
    "transformer-reduced": ("transformer", {"reduce_range": True}),
    "transformer-u8-per-channel-reduced": (
        "transformer",
        {"weight_type": "QUInt8", "per_channel": True, "reduce_range": True},
    ),
    "transformer-matmul-activations": ("transformer", {"extra_options": NO_CONST_B}),
    "transformer-matmul-activations-u8-per-channel": (
        "transformer",
        {"weight_type": "QUInt8", "per_channel": True, "extra_options": NO_CONST_B},
    ),
    "transformer-matmul-activations-one-excluded": (
        "transformer",
        {"extra_options": NO_CONST_B, "nodes_to_exclude": ["layer1/attn/MatMul_1", "layer0/ffn/fc2/MatMul"]},
    ),
    "transformer-activation-symmetric": ("transformer", {"extra_options": {"ActivationSymmetric": True}}),
    "transformer-u8-weight-symmetric": (
        "transformer",
        {"weight_type": "QUInt8", "extra_options": {"WeightSymmetric": True}},
    ),
    "convnet-defaults": ("convnet", {}),
    "convnet-u8-per-channel": ("convnet", {"weight_type": "QUInt8", "per_channel": True}),
    "convnet-reduced-excluded": ("convnet", {"reduce_range": True, "nodes_to_exclude": ["conv2"]}),
}

#: static recipes: calibrated with MinMax (min and max over every sample, whatever the batching), so
#: the same calibration samples rebuild the same activation scales.
STATIC: dict[str, tuple[str, dict[str, Any]]] = {
    "convnet-qdq-per-channel-excluded": (
        "convnet",
        {"quant_format": "QDQ", "activation_type": "QUInt8", "per_channel": True, "nodes_to_exclude": ["conv3"]},
    ),
    "convnet-qoperator-symmetric-reduced": (
        "convnet",
        {"quant_format": "QOperator", "reduce_range": True, "extra_options": {"ActivationSymmetric": True}},
    ),
    "transformer-qdq": ("transformer", {"quant_format": "QDQ", "activation_type": "QUInt8"}),
    "transformer-qoperator": ("transformer", {"quant_format": "QOperator", "activation_type": "QUInt8"}),
}


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, np.ndarray]]]:
    """fixture name -> (FP32 model, calibration .npz, calibration arrays)."""
    folder = tmp_path_factory.mktemp("roundtrip")
    out = {}
    for name in ("transformer", "convnet"):
        fx = models.build(name)
        path = folder / f"{name}.fp32.onnx"
        onnx.save(fx.model, path)
        calib = fx.make_inputs(8, 11)
        npz = folder / f"{name}.calib.npz"
        np.savez(npz, **calib)
        out[name] = (path, npz, calib)
    return out


def _users_model(fp32: Path, out: Path, recipe: Recipe, calib: dict[str, np.ndarray] | None = None) -> Path:
    """The INT8 model as a user makes it: onnxruntime's own call, not diag's."""
    from onnxruntime.quantization import quantize_dynamic, quantize_static

    logging.getLogger().setLevel(logging.ERROR)
    if recipe.mode == "dynamic":
        quantize_dynamic(fp32, out, **recipe.ort_kwargs())
    else:
        assert calib is not None
        quantize_static(fp32, out, _ArrayReader(calib), **recipe.ort_kwargs())
    return out


def _op_counts(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.mark.parametrize("case", list(DYNAMIC))
def test_the_inferred_recipe_rebuilds_a_dynamic_model_exactly(case, fp32, tmp_path):
    fixture, used = DYNAMIC[case]
    fp32_path, _, _ = fp32[fixture]
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe.from_dict({"mode": "dynamic", **used}))

    inferred = infer_recipe(user)
    rt = prove_roundtrip(fp32_path, user, Recipe.from_dict(inferred.recipe), tmp_path / "work")

    assert rt.identical, roundtrip_line(rt)
    assert rt.differences == () and rt.lever is None
    assert roundtrip_line(rt) == f"the recipe rebuilds your INT8 model exactly ({rt.quantized_nodes} quantized nodes)"
    counts = _op_counts(user)
    assert rt.quantized_nodes == sum(
        counts[op] for op in ("DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DequantizeLinear")
    )


@pytest.mark.parametrize("case", list(STATIC))
def test_the_inferred_recipe_rebuilds_a_static_model_calibrated_on_the_same_samples(case, fp32, tmp_path):
    fixture, used = STATIC[case]
    fp32_path, npz, calib = fp32[fixture]
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe.from_dict({"mode": "static", **used}), calib)

    inferred = infer_recipe(user)
    rt = prove_roundtrip(
        fp32_path, user, Recipe.from_dict(inferred.recipe), tmp_path / "work", FeedSpec(inputs=str(npz))
    )

    # the calibration data is not in the model: diag says so, and the caller supplied the same samples
    assert "calibration" in inferred.unknown and "calibrate_method" in inferred.unknown
    assert rt.identical, roundtrip_line(rt)


def test_a_static_model_calibrated_on_other_samples_differs_in_its_activation_scales(fp32, tmp_path):
    fixture, used = STATIC["convnet-qdq-per-channel-excluded"]
    fp32_path, _, calib = fp32[fixture]
    recipe = Recipe.from_dict({"mode": "static", **used})
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", recipe, calib)
    other = tmp_path / "other.npz"
    np.savez(other, **models.build(fixture).make_inputs(8, 99))

    rt = prove_roundtrip(fp32_path, user, recipe, tmp_path / "work", FeedSpec(inputs=str(other)))

    assert not rt.identical and rt.lever is None
    changed = {d.name for d in rt.differences if isinstance(d, InitializerDifference)}
    assert changed and all(d.reason == "bytes" for d in rt.differences if isinstance(d, InitializerDifference))
    assert not any(name.endswith("weight_quantized") for name in changed)  # weights do not depend on calibration


def test_qoperator_attention_left_float_is_excluded_and_the_lever_is_said_not_told(fp32, tmp_path):
    fp32_path, npz, calib = fp32["transformer"]
    used = Recipe(
        mode="static", quant_format="QOperator", activation_type="QUInt8", extra_options={"MatMulConstBOnly": True}
    )
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", used, calib)
    attention = [f"layer{i}/attn/{m}" for i in (0, 1) for m in ("MatMul", "MatMul_1")]

    inferred = infer_recipe(user)

    assert set(attention) <= set(inferred.recipe["nodes_to_exclude"])  # the same graph, by node names
    assert any(e.startswith("MatMulConstBOnly: not told") for e in inferred.evidence)
    rt = prove_roundtrip(
        fp32_path, user, Recipe.from_dict(inferred.recipe), tmp_path / "work", FeedSpec(inputs=str(npz))
    )
    assert rt.identical, roundtrip_line(rt)


def test_a_dynamic_model_with_quantized_attention_matmuls_is_not_rebuilt_by_the_defaults(fp32, tmp_path):
    fp32_path, _, _ = fp32["transformer"]
    default = _users_model(fp32_path, tmp_path / "default.int8.onnx", Recipe(mode="dynamic"))
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe(mode="dynamic", extra_options=dict(NO_CONST_B)))
    user_matmuls = sum(_op_counts(user)[op] for op in MATMUL_OP_TYPES)
    default_matmuls = sum(_op_counts(default)[op] for op in MATMUL_OP_TYPES)
    pairs = two_activation_matmuls(onnx.load(str(user)).graph)
    assert user_matmuls > default_matmuls  # the lever really quantizes more MatMuls
    assert len(pairs) == user_matmuls - default_matmuls == 4  # layer{0,1}/attn/MatMul and MatMul_1

    rt = prove_roundtrip(fp32_path, user, Recipe(mode="dynamic"), tmp_path / "work")

    assert rt.identical is False
    assert rt.lever is not None and rt.lever.option == "MatMulConstBOnly" and rt.lever.value is False
    assert (rt.lever.user_matmuls, rt.lever.rebuilt_matmuls) == (user_matmuls, default_matmuls)
    assert sorted(rt.lever.nodes) == sorted(pairs)
    assert OpCountDifference("MatMulInteger", user_matmuls, default_matmuls) in rt.differences
    assert roundtrip_line(rt) == (
        f"your model quantizes {user_matmuls} MatMuls, the recipe {default_matmuls}: "
        f"the {len(pairs)} with two activation inputs — set MatMulConstBOnly=False"
    )


def test_the_recipe_read_back_from_quantized_attention_sets_matmul_const_b_only_false_and_round_trips(fp32, tmp_path):
    fp32_path, _, _ = fp32["transformer"]
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe(mode="dynamic", extra_options=dict(NO_CONST_B)))

    inferred = infer_recipe(user)

    assert inferred.recipe["extra_options"]["MatMulConstBOnly"] is False
    assert inferred.recipe["nodes_to_exclude"] == []  # quantized, so not excluded
    line = next(e for e in inferred.evidence if e.startswith("MatMulConstBOnly"))
    assert line == (
        "MatMulConstBOnly: False — 4 MatMulInteger read two activations (B from DynamicQuantizeLinear): "
        "e.g. 'layer0/attn/MatMul_quant'"
    )
    assert prove_roundtrip(fp32_path, user, Recipe.from_dict(inferred.recipe), tmp_path / "work").identical


def test_attention_matmuls_left_float_by_the_default_lever_are_not_exclusions(fp32, tmp_path):
    fp32_path, _, _ = fp32["transformer"]
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe(mode="dynamic"))
    assert _op_counts(user)["MatMul"] == 4  # the four attention MatMuls stayed float

    inferred = infer_recipe(user)

    assert inferred.recipe["nodes_to_exclude"] == []
    assert "MatMulConstBOnly" not in inferred.recipe.get("extra_options", {})


def test_a_recipe_that_quantizes_more_attention_than_the_users_model_says_set_it_true(fp32, tmp_path):
    fp32_path, _, _ = fp32["transformer"]
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe(mode="dynamic"))

    rt = prove_roundtrip(fp32_path, user, Recipe(mode="dynamic", extra_options=dict(NO_CONST_B)), tmp_path / "work")

    assert rt.lever is not None and rt.lever.value is True
    assert roundtrip_line(rt).endswith(
        "the recipe also quantizes the 4 with two activation inputs — set MatMulConstBOnly=True"
    )


def test_another_weight_granularity_is_named_as_the_weight_that_differs(fp32, tmp_path):
    fp32_path, _, _ = fp32["convnet"]
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe(mode="dynamic", per_channel=True))

    rt = prove_roundtrip(fp32_path, user, Recipe(mode="dynamic"), tmp_path / "work")

    first = next(d for d in rt.differences if isinstance(d, InitializerDifference))
    assert rt.lever is None and first.reason == "shape" and first.name.endswith("_scale")
    assert roundtrip_line(rt).startswith(
        f"the recipe does not rebuild your INT8 model: weight '{first.name}' differs (shape)"
    )


def test_graph_level_noise_is_not_a_difference(fp32, tmp_path):
    fp32_path, _, _ = fp32["convnet"]
    user = onnx.load(str(_users_model(fp32_path, tmp_path / "user.int8.onnx", Recipe(mode="dynamic"))))
    noisy = onnx.ModelProto()
    noisy.CopyFrom(user)
    noisy.producer_name, noisy.producer_version, noisy.doc_string = "someone", "9.9", "exported on Monday"
    nodes = list(noisy.graph.node)
    del noisy.graph.node[:]
    noisy.graph.node.extend(reversed(nodes))
    w = noisy.graph.initializer[0]
    values = onnx.numpy_helper.to_array(w)
    w.CopyFrom(onnx.helper.make_tensor(w.name, w.data_type, w.dims, values.ravel().tolist()))  # typed fields, not raw

    assert roundtrip_difference(user, noisy).identical
    noisy.graph.initializer[0].CopyFrom(
        onnx.numpy_helper.from_array(values + 1 if values.dtype.kind == "f" else values ^ 1, w.name)
    )
    changed = roundtrip_difference(user, noisy)
    assert changed.differences == (InitializerDifference(w.name, "bytes"),)
    assert roundtrip_line(changed) == f"the recipe does not rebuild your INT8 model: weight '{w.name}' differs (bytes)"


# ---------------------------------------------------------------- the grid (issue 41 item 3)

#: What each grid case pulls, in a user's terms; ``_grid_recipe`` spells it per format. The first 16
#: cross weight_type x per_channel x reduce_range x WeightSymmetric, the last 8 the other levers.
GRID: list[dict[str, Any]] = [
    {"weight_type": w, "per_channel": pc, "reduce_range": rr, "WeightSymmetric": sym}
    for w in ("QInt8", "QUInt8")
    for pc in (False, True)
    for rr in (False, True)
    for sym in (False, True)
] + [
    {"MatMulConstBOnly": "not the default"},
    {"exclude": True},
    {"op_types": True},
    {"exclude": True, "per_channel": True},
    {"ActivationSymmetric": True},
    {"activation_type": "QInt8"},
    {"MatMulConstBOnly": "not the default", "weight_type": "QUInt8"},
    {"ActivationSymmetric": True, "per_channel": True},
]
#: One node each fixture's grid cases exclude, and the op type their op_types_to_quantize keeps.
GRID_EXCLUDED = {"transformer": ["layer0/ffn/fc2/MatMul"], "convnet": ["conv2"]}
GRID_OP_TYPES = {"transformer": ["MatMul"], "convnet": ["Conv"]}


def _grid_recipe(case: dict[str, Any], fmt: str, fixture: str) -> dict[str, Any]:
    """The recipe file a user writes for ``case`` in ``fmt`` (dynamic / qdq / qoperator)."""
    recipe: dict[str, Any] = (
        {"mode": "dynamic"} if fmt == "dynamic" else {"mode": "static", "activation_type": "QUInt8"}
    )
    if fmt != "dynamic":
        recipe["quant_format"] = "QDQ" if fmt == "qdq" else "QOperator"
    extra: dict[str, Any] = {}
    for key, value in case.items():
        if key in ("weight_type", "per_channel", "reduce_range") or (key == "activation_type" and fmt != "dynamic"):
            recipe[key] = value
        elif key == "WeightSymmetric" and value:
            extra[key] = True
        elif key == "ActivationSymmetric" and fmt != "dynamic":
            extra[key] = value
        elif key == "MatMulConstBOnly":
            extra[key] = fmt != "dynamic"  # the opposite of the format's default
        elif key == "exclude":
            recipe["nodes_to_exclude"] = GRID_EXCLUDED[fixture]
        elif key == "op_types":
            recipe["op_types_to_quantize"] = GRID_OP_TYPES[fixture]
    if extra:
        recipe["extra_options"] = extra
    return recipe


@pytest.mark.parametrize("fmt", ["dynamic", "qdq", "qoperator"])
@pytest.mark.parametrize("index", range(len(GRID)))
def test_every_recipe_of_the_grid_round_trips_in_every_format(index, fmt, fp32, tmp_path):
    """24 recipes x {dynamic, QDQ, QOperator} on a BERT-shaped model (real activation x activation
    attention MatMuls) and a convnet, alternately: quantized by onnxruntime as the user would, the
    recipe read back from the INT8 file alone rebuilds it byte for byte (same quantized nodes, op
    types, weight bytes and scales). What this grid found and diag now reads right: QDQ makes
    per-channel weights symmetric whatever WeightSymmetric says; QOperator's per-channel QLinearConv
    weights are int8 whatever weight_type says; a float embedding Gather is an exclusion; a QDQ
    model quantizing only some op types has op_types_to_quantize."""
    fixture = "transformer" if index % 2 == 0 else "convnet"
    fp32_path, npz, calib = fp32[fixture]
    recipe = Recipe.from_dict(_grid_recipe(GRID[index], fmt, fixture))
    user = _users_model(fp32_path, tmp_path / "user.int8.onnx", recipe, calib)

    inferred = infer_recipe(user)
    spec = FeedSpec(inputs=str(npz)) if recipe.mode == "static" else None
    rt = prove_roundtrip(fp32_path, user, Recipe.from_dict(inferred.recipe), tmp_path / "work", spec)

    assert rt.identical, f"{recipe.to_dict()} -> inferred {inferred.recipe}: {roundtrip_line(rt)}"
