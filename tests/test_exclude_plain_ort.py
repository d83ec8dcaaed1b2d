"""`exclusion.json` re-applied with plain onnxruntime calls reproduces the verified held-out metric.

Only the exclusion itself comes from `diag`; quantizing, running and measuring here use
``onnxruntime.quantization``, ``onnxruntime.InferenceSession`` and numpy, nothing from `diag`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import (
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from plain_ort import Rows, min_cosine

from diag.cli.commands import main
from diag.fixtures import models


def plain_quantize(fp32: Path, out: Path, doc: dict, arrays: dict[str, np.ndarray]) -> None:
    r = doc["recipe"]
    common = {
        "weight_type": QuantType[r["weight_type"]],
        "per_channel": r["per_channel"],
        "reduce_range": r["reduce_range"],
        "op_types_to_quantize": doc["op_types_to_quantize"],
        "nodes_to_exclude": doc["nodes_to_exclude"],
        "extra_options": r["extra_options"],
    }
    if r["mode"] == "dynamic":
        quantize_dynamic(fp32, out, **common)
    else:
        quantize_static(
            fp32,
            out,
            Rows(arrays, doc["split"]["ranking_samples"]),
            quant_format=QuantFormat[r["quant_format"]],
            activation_type=QuantType[r["activation_type"]],
            calibrate_method=CalibrationMethod[r["calibrate_method"]],
            **common,
        )


@pytest.mark.parametrize(
    ("fixture", "recipe", "target"),
    [
        ("transformer", {"mode": "dynamic"}, "cosine>=0.999"),
        ("convnet", {"mode": "static", "quant_format": "QDQ", "activation_type": "QUInt8"}, "cosine>=0.9999"),
    ],
)
def test_plain_onnxruntime_reproduces_the_verified_metric(tmp_path, fixture, recipe, target):
    fx = models.build(fixture)
    fp32 = tmp_path / f"{fixture}.fp32.onnx"
    onnx.save(fx.model, fp32)
    arrays = fx.make_inputs(32, 12)
    np.savez(tmp_path / "inputs.npz", **arrays)
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    out = tmp_path / "ex"
    argv = ["exclude", str(fp32), "--recipe", str(tmp_path / "recipe.json"), "--inputs", str(tmp_path / "inputs.npz")]
    assert main([*argv, "--batch", "8", "--target", target, "--bench-runs", "0", "--quiet", "--out", str(out)]) == 0
    doc = json.loads((out / "exclusion.json").read_text())
    assert doc["verdict"] == "met" and fx.expected.culprit_node in doc["nodes_to_exclude"]
    split = doc["split"]
    verified = doc["metrics"]["after"]["cosine"]

    plain = tmp_path / "plain.onnx"
    plain_quantize(fp32, plain, doc, arrays)
    got = min_cosine(fp32, plain, arrays, split["held_out_first"], split["batch"])
    assert got == pytest.approx(verified, abs=1e-4)
    assert got >= float(target.split(">=")[1])
    # and without the list the same calls give the "before" figure, which misses the target
    base = tmp_path / "base.onnx"
    plain_quantize(fp32, base, {**doc, "nodes_to_exclude": []}, arrays)
    before = min_cosine(fp32, base, arrays, split["held_out_first"], split["batch"])
    assert before == pytest.approx(doc["metrics"]["before"]["cosine"], abs=1e-4)
    assert before < float(target.split(">=")[1])

    # reproduce.py is the same recipe as runnable code: run it as its own process. It writes a new
    # file next to the verified model (never over it) and rebuilds the very same model.
    code = (out / "reproduce.py").read_text()
    if recipe["mode"] == "static":
        assert "Reader(" in code and str(tmp_path / "inputs.npz") in code
    subprocess.run([sys.executable, str(out / "reproduce.py")], check=True, capture_output=True, cwd=tmp_path)
    again = out / f"{fixture}.reproduced.onnx"
    assert again.read_bytes() == (out / f"{fixture}.mixed.onnx").read_bytes()
    got = min_cosine(fp32, again, arrays, split["held_out_first"], split["batch"])
    assert got == pytest.approx(verified, abs=1e-6)
