"""One fix-code generator: the report's suggested fix and reproduce.py spell a recipe the same way, and both compile."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from diag.fix.fixcode import fix_snippet, reproduce_snippet

STATIC = {
    "mode": "static",
    "quant_format": "QDQ",
    "activation_type": "QUInt8",
    "weight_type": "QInt8",
    "per_channel": True,
    "reduce_range": False,
    "calibrate_method": "Percentile",
    "nodes_to_exclude": ["head"],
}


def _result(recipe: dict[str, Any], steps: list[str] | None = None) -> SimpleNamespace:
    """What reproduce.py reads of an exclusion result."""
    return SimpleNamespace(
        recipe=recipe,
        steps=steps or [],
        target="cosine>=0.999",
        verdict="met",
        nodes_to_exclude=["head", "fc1"],
        fp32="m.onnx",
    )


def test_the_report_fix_and_reproduce_py_pass_a_static_recipes_enums_as_the_same_keywords():
    fix = fix_snippet("qdq", ["fc1"], {"source": "given", "settings": STATIC, "unknown": {}}, "m.onnx", "m.int8.onnx")
    script = reproduce_snippet(_result(STATIC), "m.reproduced.onnx", "calib.npz", 8, 2)
    for line in (
        "    quant_format=QuantFormat.QDQ,",
        "    activation_type=QuantType.QUInt8,",
        "    weight_type=QuantType.QInt8,",
        "    calibrate_method=CalibrationMethod.Percentile,",
    ):
        assert line in fix.splitlines(), line
        assert line in script.splitlines(), line
    assert 'nodes_to_exclude=["head", "fc1"],' in fix  # the recipe's own exclusions stay, the fix adds its node
    assert "nodes_to_exclude=['head', 'fc1']," in script


@pytest.mark.parametrize(
    "recipe",
    [
        {"mode": "dynamic", "weight_type": "QUInt8", "per_channel": False},
        STATIC,
        {**STATIC, "extra_options": {"TensorQuantOverrides": {"h": [{"quant_type": "QInt16", "scale": 0.5}]}}},
        {"mode": "fp16", "keep_io_types": True},
        {"mode": "weight_only", "quant_format": "QOperator", "bits": 4, "block_size": 32},
    ],
    ids=["dynamic", "static", "static-overrides", "fp16", "weight-only"],
)
def test_both_texts_are_valid_python_for_every_mode(recipe: dict[str, Any]):
    fix = fix_snippet("qdq", ["fc1"], {"source": "inferred", "settings": recipe, "unknown": {}})
    script = reproduce_snippet(_result(recipe, ["lift_constants", "quant_pre_process"]), "out.onnx")
    compile(fix, "fix.py", "exec")
    compile(script, "reproduce.py", "exec")
    if recipe["mode"] in ("dynamic", "static"):
        fn = "quantize_static(" if recipe["mode"] == "static" else "quantize_dynamic("
        assert fn in fix and fn in script


def test_every_step_the_quantizer_records_is_replayed_by_reproduce_py():
    """A step name quantize records but fixcode does not know would be skipped by reproduce.py, silently."""
    from diag.fix.fixcode import _file_steps, _model_steps
    from diag.fix.modelprep import STEP_EXTERNAL_DATA, STEPS

    baseline = _model_steps([], "static") + _file_steps([], external=False)
    for step in STEPS:
        if step == STEP_EXTERNAL_DATA:  # changes how the model is saved, not a step of its own
            assert _file_steps([], external=True) != _file_steps([], external=False)
            continue
        assert _model_steps([step], "static") + _file_steps([step], external=False) != baseline, step
