"""The suggested-fix snippet carries the recipe: the INT8 model's own settings, not onnxruntime's defaults."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_run import run_cli

from diag.fix.infer import infer_recipe
from diag.fixtures import models
from diag.foundations.errors import OK


class _Reader:
    """A CalibrationDataReader over stacked arrays, one sample per get_next."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        n = len(next(iter(arrays.values())))
        self.rows = iter([{k: v[i : i + 1] for k, v in arrays.items()} for i in range(n)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.rows, None)


@pytest.fixture(scope="module")
def per_channel_qdq(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    """convnet quantized QDQ with per_channel=True, QUInt8 activations (neither is the default)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    logging.getLogger().setLevel(logging.ERROR)
    d = tmp_path_factory.mktemp("fix")
    fx = models.build("convnet")
    fp32, int8 = d / "convnet.fp32.onnx", d / "convnet.int8.onnx"
    onnx.save(fx.model, fp32)
    calib = fx.make_inputs(16, 11)
    quantize_static(
        fp32,
        int8,
        _Reader(calib),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )
    inputs = d / "inputs.npz"
    np.savez(inputs, **fx.make_inputs(16, 12))
    return fp32, int8, inputs, calib


def _snippet(summary: str) -> str:
    return re.search(r"```python\n(.*?)\n```", summary, re.S).group(1)  # type: ignore[union-attr]


def _weight_scales(path: Path) -> dict[str, tuple[int, ...]]:
    """Shape of every weight scale feeding a Conv's DequantizeLinear, by weight name."""
    m = onnx.load(str(path))
    inits = {t.name: t for t in m.graph.initializer}
    return {
        n.input[0]: tuple(inits[n.input[1]].dims)
        for n in m.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in inits and n.input[0].endswith("_quantized")
    }


def test_fix_snippet_uses_the_settings_inferred_from_the_int8_model(per_channel_qdq, tmp_path, capsys):
    fp32, int8, inputs, calib = per_channel_qdq
    out = tmp_path / "out"
    code, _, err = run_cli(["compare", fp32, int8, "--inputs", inputs, "--batch", "8", "--out", out, "--quiet"], capsys)
    assert code == OK, err
    doc = json.loads((out / "diag.json").read_text())
    rec = doc["recommendation"]
    assert rec["nodes_to_exclude"] == ["conv3", "relu3"]
    assert rec["recipe"]["source"] == "inferred"
    assert rec["recipe"]["settings"]["per_channel"] is True
    assert "calibrate_method" in rec["recipe"]["unknown"]
    snippet = _snippet((out / "summary.md").read_text())
    assert "per_channel=True," in snippet
    assert "activation_type=QuantType.QUInt8," in snippet
    assert "quant_format=QuantFormat.QDQ," in snippet
    assert 'nodes_to_exclude=["conv3", "relu3"],' in snippet
    assert snippet.startswith("# Settings inferred by diag from the INT8 model")
    assert "not inferable: calibrate_method, preprocess." in snippet
    assert "calibration_reader is yours" in snippet
    assert snippet in (out / "report.html").read_text().replace("&#34;", '"')

    # Run as-is with a calibration reader substituted: the same format as the INT8 model.
    fixed = Path(str(int8).removesuffix(".onnx") + ".fixed.onnx")
    fixed.unlink(missing_ok=True)
    exec(compile(snippet, "fix.py", "exec"), {"calibration_reader": _Reader(calib)})
    assert fixed.is_file()
    again, original = infer_recipe(fixed).recipe, infer_recipe(int8).recipe
    assert again["nodes_to_exclude"] == ["conv3"]  # the weighted node of the pair, in float
    del again["nodes_to_exclude"], original["nodes_to_exclude"]
    assert again == original
    scales, fixed_scales = _weight_scales(int8), _weight_scales(fixed)
    assert scales["conv1.weight_quantized"] == fixed_scales["conv1.weight_quantized"] == (8,)  # per channel
    assert "conv3.weight_quantized" not in fixed_scales


def test_report_re_renders_the_same_snippet_without_the_models(per_channel_qdq, tmp_path, capsys):
    fp32, int8, inputs, _ = per_channel_qdq
    folder = tmp_path / "models"
    folder.mkdir()
    a, b = shutil.copy(fp32, folder), shutil.copy(int8, folder)
    out = tmp_path / "out"
    code, _, err = run_cli(["compare", a, b, "--inputs", inputs, "--batch", "8", "--out", out, "--quiet"], capsys)
    assert code == OK, err
    shutil.rmtree(folder)
    code, _, err = run_cli(["report", out / "diag.json", "--out", tmp_path / "again"], capsys)
    assert code == OK, err
    assert _snippet((tmp_path / "again" / "summary.md").read_text()) == _snippet((out / "summary.md").read_text())


def test_a_given_recipe_wins_over_inference(per_channel_qdq, tmp_path, capsys):
    fp32, int8, inputs, _ = per_channel_qdq
    recipe = {
        "mode": "static",
        "quant_format": "QDQ",
        "activation_type": "QUInt8",
        "per_channel": True,
        "calibrate_method": "Entropy",
    }
    out = tmp_path / "out"
    args = ["compare", fp32, int8, "--inputs", inputs, "--batch", "8", "--out", out, "--quiet"]
    code, _, err = run_cli([*args, "--recipe", json.dumps(recipe)], capsys)
    assert code == OK, err
    snippet = _snippet((out / "summary.md").read_text())
    assert snippet.startswith("# Settings as given with --recipe.")
    assert "calibrate_method=CalibrationMethod.Entropy," in snippet
    assert "from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static" in snippet


def test_dynamic_fix_snippet_keeps_weight_type_and_per_channel(built, tmp_path, capsys):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    b = built("transformer")
    int8 = tmp_path / "t.u8pc.onnx"
    quantize_dynamic(b.fp32, int8, per_channel=True, weight_type=QuantType.QUInt8)
    out = tmp_path / "out"
    code, _, err = run_cli(
        [
            "compare",
            b.fp32,
            int8,
            "--inputs",
            b.inputs_path,
            "--samples",
            "16",
            "--batch",
            "8",
            "--out",
            out,
            "--quiet",
        ],
        capsys,
    )
    assert code == OK, err
    snippet = _snippet((out / "summary.md").read_text())
    assert "weight_type=QuantType.QUInt8," in snippet and "per_channel=True," in snippet
    assert "activation_type" not in snippet and "calibration_reader" not in snippet
    assert snippet.startswith(
        "# Settings inferred by diag from the INT8 model (diag inspect INT8 --recipe); not inferable: preprocess."
    )


def test_recipe_is_inferred_from_a_model_with_external_weights(per_channel_qdq, tmp_path):
    _, int8, _, _ = per_channel_qdq
    m = onnx.load(str(int8))
    ext = tmp_path / "ext.onnx"
    onnx.save(m, ext, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data", size_threshold=0)
    assert infer_recipe(ext).recipe == infer_recipe(int8).recipe


def test_snippet_says_so_when_the_settings_cannot_be_inferred(tmp_path):
    from diag.fix.infer import fix_recipe
    from diag.report.view import fix_snippet

    recipe = fix_recipe(tmp_path / "gone.int8.onnx")
    assert recipe is not None and recipe["source"] == "unknown" and recipe["settings"] is None
    assert "does not exist" in recipe["why"]
    snippet = fix_snippet("dynamic", ["fc1"], recipe)
    assert snippet.startswith("# The INT8 model's settings could not be inferred (does not exist)")
    assert snippet.endswith('quantize_dynamic("fp32.onnx", "int8.onnx", nodes_to_exclude=["fc1"])')
