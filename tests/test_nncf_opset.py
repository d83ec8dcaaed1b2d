"""NNCF below opset 13 quantizes weights per tensor: the advice is NNCF's, and it is true (issue 43).

NNCF has no per-channel switch: it quantizes weights per channel from opset 13 and falls back to one
scale per tensor below it. A model exported at opset 11 whose weights have a few loud output
channels is ruined by that fallback, and the remedy onnxruntime's users get (``per_channel=True``)
is not a line an NNCF user can write. The advice must be the FP32 model's opset, and following it
with a real NNCF run must give per-channel weights and a smaller error.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli

from diag.fixtures import models, thirdparty

#: NNCF's fix for per-tensor weights below opset 13: the FP32 model's opset.
UPGRADE = "model = onnx.version_converter.convert_version(model, 13)  # then nncf.quantize(model, ...)"


def _min_cosine(fp32: onnx.ModelProto, q: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> float:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a, b = (ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]) for m in (fp32, q))
    x, y = a.run(None, feeds)[0].astype(np.float64), b.run(None, feeds)[0].astype(np.float64)
    return float(((x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1))).min())


@pytest.fixture(scope="module")
def at_opset(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """``per_channel_spread`` (6 MatMuls whose weight columns span 100x) declared at opset 11 (its
    ops mean the same there) and at 13, each quantized by NNCF itself."""
    d = tmp_path_factory.mktemp("nncf-opset")
    fx = models.per_channel_spread()
    calibration = thirdparty.one_sample_batches(fx.make_inputs(16, 3))
    out: dict[Any, Any] = {"dir": d, "feeds": fx.make_inputs(32, 5)}
    np.savez(d / "x.npz", **out["feeds"])
    for opset in (11, 13):
        fp = onnx.ModelProto()
        fp.CopyFrom(fx.model)
        fp.opset_import[0].version, fp.ir_version = opset, 7
        onnx.save(fp, d / f"fp32.{opset}.onnx")
        q = thirdparty.nncf_quantized(fp, calibration)
        onnx.save(q, d / f"nncf.{opset}.onnx")
        out[opset] = (fp, q)
    return out


def test_nncf_below_opset_13_is_told_to_upgrade_the_model_and_that_advice_holds(at_opset, capsys) -> None:
    d = at_opset["dir"]
    args = ["compare", d / "fp32.11.onnx", d / "nncf.11.onnx", "--inputs", d / "x.npz", "--no-local"]
    code, _, _ = run_cli([*args, "--out", d / "c", "--quiet"], capsys)
    assert code in (0, 3)
    doc = json.loads((d / "c" / "diag.json").read_text())
    assert doc["models"]["int8"]["producer"] == "NNCF"
    advice = next(s for s in doc["suggestions"] if s["remedy"] == "per-channel-weights")
    assert advice["python"] == UPGRADE
    assert advice["applies_to"] == "NNCF" and "(your FP32 model: opset 11)" in advice["note"]
    assert "per_channel=True" not in json.dumps(doc["suggestions"])  # not a line an NNCF user can write
    # The advice holds: NNCF at opset 13 gives per-channel weights (an axis on the weight
    # DequantizeLinears) and a smaller error than at opset 11, by plain onnxruntime.
    (fp11, q11), (fp13, q13) = at_opset[11], at_opset[13]
    inits = {t.name for t in q13.graph.initializer}
    weights = [n for n in q13.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weights and all(any(a.name == "axis" for a in n.attribute) for n in weights)
    feeds: dict[str, np.ndarray] = at_opset["feeds"]
    assert _min_cosine(fp13, q13, feeds) > _min_cosine(fp11, q11, feeds)


def test_onnxruntimes_own_per_tensor_model_keeps_onnxruntimes_switch(at_opset, tmp_path, capsys) -> None:
    from diag.fixtures import quantize

    d = at_opset["dir"]
    ort_model = tmp_path / "ort.onnx"
    quantize.quantize(d / "fp32.13.onnx", ort_model, "qdq", models.per_channel_spread().make_inputs(16, 3))
    args = ["compare", d / "fp32.13.onnx", ort_model, "--inputs", d / "x.npz", "--no-local", "--out", tmp_path / "c"]
    code, _, _ = run_cli([*args, "--quiet"], capsys)
    assert code in (0, 3)
    doc = json.loads((tmp_path / "c" / "diag.json").read_text())
    advice = next(s for s in doc["suggestions"] if s["remedy"] == "per-channel-weights")
    assert advice["python"] == "per_channel=True" and advice["applies_to"] == "quantize_static"
