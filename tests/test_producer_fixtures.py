"""The other-producer fixtures (``fixtures/producers.py``) run, keep the INT8 function, and carry the marks.

Each rewrite of an onnxruntime static QDQ model into ModelOpt's, NNCF's or NNCF SmoothQuant's graph
shape is exact by construction (weights dequantized and quantized back, power-of-two smoothing
factors), so the outputs are compared for equality: the measured difference is 0.0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from diag.fixtures import models, producers, quantize

#: Largest |difference| allowed between a rewritten model's outputs and the original QDQ model's.
#: The rewrites are exact, so none is allowed (measured: 0.0 on every fixture).
TOLERANCE = 0.0
#: The transformer's MatMuls with a constant weight, grouped by the activation they read: q/k/v
#: share one, then attn/out, ffn/fc1, ffn/fc2 per layer, and the classifier.
SMOOTHED_ACTIVATIONS = 9


class Quantized:
    """One fixture: its FP32 model, its onnxruntime QDQ model, calibration and test feeds."""

    def __init__(self, folder: Path, name: str) -> None:
        fx = models.build(name)
        self.fp32 = fx.model
        self.calibration = fx.make_inputs(4, 3)
        self.feed = fx.make_inputs(8, 5)
        fp32_path = folder / f"{name}.fp32.onnx"
        onnx.save(fx.model, fp32_path)
        self.q = onnx.load(quantize.quantize(fp32_path, folder / f"{name}.qdq.onnx", "qdq", self.calibration))


@pytest.fixture(scope="module")
def qdq(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Quantized]:
    folder = tmp_path_factory.mktemp("producer_fixtures")
    return {name: Quantized(folder, name) for name in ("convnet", "transformer")}


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _max_difference(a: onnx.ModelProto, b: onnx.ModelProto, feed: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(_run(a, feed), _run(b, feed), strict=True))


def _producer_of(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def _weight_path(model: onnx.ModelProto, consumer: onnx.NodeProto) -> list[str]:
    """The op types from a node's second input back through DequantizeLinear / QuantizeLinear, then
    the element type of the initializer reached ("activation" when none is)."""
    producer, inits = _producer_of(model), {t.name: t for t in model.graph.initializer}
    path, name = [], consumer.input[1]
    while name in producer and producer[name].op_type in ("DequantizeLinear", "QuantizeLinear"):
        path.append(producer[name].op_type)
        name = producer[name].input[0]
    return [*path, TensorProto.DataType.Name(inits[name].data_type) if name in inits else "activation"]


#: The Conv / MatMul / Gemm nodes with a constant weight: convnet's 3 Conv and 1 Gemm; the
#: transformer's q, k, v, out, fc1, fc2 in two layers and the classifier.
WEIGHTED = {"convnet": 4, "transformer": 13}


@pytest.mark.parametrize("name", ["convnet", "transformer"])
def test_modelopt_style_keeps_weights_in_float_quantized_in_the_graph_and_the_outputs(qdq, name):
    fx = qdq[name]
    before = fx.q.SerializeToString()
    m = producers.modelopt_style(fx.q)
    onnx.checker.check_model(m)
    weighted = [n for n in m.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")]
    paths = {n.name: _weight_path(m, n) for n in weighted}
    weights = {k: p for k, p in paths.items() if p[-1] != "activation"}
    assert len(weights) == WEIGHTED[name]
    assert all(p == ["DequantizeLinear", "QuantizeLinear", "FLOAT"] for p in weights.values()), weights
    inits = {t.name for t in m.graph.initializer}
    integer_dq = [n.name for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert integer_dq == []
    assert (m.producer_name, m.ir_version) == ("onnx.quantize", producers.MODELOPT_IR_VERSION)
    assert _max_difference(fx.q, m, fx.feed) <= TOLERANCE
    assert fx.q.SerializeToString() == before


@pytest.mark.parametrize("name", ["convnet", "transformer"])
def test_nncf_style_names_every_quantizer_as_nncf_and_keeps_the_outputs(qdq, name):
    fx = qdq[name]
    before = fx.q.SerializeToString()
    m = producers.nncf_style(fx.q)
    onnx.checker.check_model(m)
    outputs = {o.name for o in m.graph.output}
    inits = {t.name: t for t in m.graph.initializer}
    dqs = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    for dq in dqs:
        tag = dq.name.removeprefix("DequantizeLinear_")
        assert dq.name.startswith("DequantizeLinear_") and tag.endswith("_1"), dq.name
        assert dq.output[0] in outputs or dq.output[0] == f"dq_output_{tag}"
        assert dq.input[0] == f"q_output_{tag}" and dq.input[1:] == [f"scale_{tag}", f"zero_point_{tag}"]
        if dq.input[0] in inits:  # a weight: folded to an integer initializer, as NNCF compresses it
            assert inits[dq.input[0]].data_type in (TensorProto.INT8, TensorProto.UINT8)
    quants = [n for n in m.graph.node if n.op_type == "QuantizeLinear"]
    assert quants and all(q.name == f"QuantizeLinear_{q.output[0].removeprefix('q_output_')}" for q in quants)
    assert not [t for n in m.graph.node for t in n.output if t.endswith("_DequantizeLinear_Output")]
    assert (m.producer_name, m.producer_version) == producers.EXPORTER
    assert _max_difference(fx.q, m, fx.feed) <= TOLERANCE
    assert fx.q.SerializeToString() == before


def test_smoothquant_style_inserts_nncf_smooth_quant_muls_before_the_matmuls_quantizers(qdq):
    fx = qdq["transformer"]
    fp32_before, q_before = fx.fp32.SerializeToString(), fx.q.SerializeToString()
    fp32, m = producers.smoothquant_style(fx.fp32, fx.q, fx.calibration)
    onnx.checker.check_model(m)
    assert fp32.SerializeToString() == fp32_before and fp32 is not fx.fp32
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in m.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    muls = [n for n in m.graph.node if n.name.endswith("/nncf_smooth_quant")]
    assert len(muls) == SMOOTHED_ACTIVATIONS and all(n.op_type == "Mul" for n in muls)
    for mul in muls:
        assert mul.input[1] == f"{mul.name}_scale" and mul.output[0] == f"{mul.name}_output"
        (quant,) = consumers[mul.output[0]]
        (dq,) = consumers[quant.output[0]]
        assert (quant.op_type, dq.op_type) == ("QuantizeLinear", "DequantizeLinear")
        assert {n.op_type for n in consumers[dq.output[0]]} == {"MatMul"}
    # The outlier dimension of layer1's FFN LayerNorm (x40) is scaled down hardest.
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    outlier = inits["layer1/ffn_norm/LayerNormalization_0_0/nncf_smooth_quant_scale"]
    assert outlier.argmin() == models.transformer().expected.outlier_channel and outlier.min() <= 1 / 16
    assert _max_difference(fx.q, m, fx.feed) <= TOLERANCE
    assert (fx.fp32.SerializeToString(), fx.q.SerializeToString()) == (fp32_before, q_before)


def test_smoothquant_style_without_inputs_still_runs_and_keeps_the_outputs(qdq):
    fx = qdq["transformer"]
    _, m = producers.smoothquant_style(fx.fp32, fx.q)
    assert sum(n.name.endswith("/nncf_smooth_quant") for n in m.graph.node) == SMOOTHED_ACTIVATIONS
    assert _max_difference(fx.q, m, fx.feed) <= TOLERANCE


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("name", ["convnet", "transformer"])
def test_float_weights_before_a_quantizelinear_are_read_as_quantized_weights(tmp_path, name, per_channel):
    """Issue 43 item 1: ModelOpt / AIMET / NNCF-on-Constants store each weight in float and quantize it at
    run time. The weight table, the recipe and the advice must see the same quantized weights as in the
    onnxruntime model they were rewritten from: same figures, same weight_type and per_channel."""
    from diag.analysis.weights import weight_errors
    from diag.fix.infer import infer_recipe

    fx = models.build(name)
    fp32_path = tmp_path / f"{name}.fp32.onnx"
    onnx.save(fx.model, fp32_path)
    q_path = quantize.quantize(fp32_path, tmp_path / "q.onnx", "qdq", fx.make_inputs(4, 3), per_channel=per_channel)
    ort_model = onnx.load(q_path)
    float_weights = producers.modelopt_style(ort_model)
    onnx.save(float_weights, tmp_path / "mo.onnx")
    assert not [t for t in float_weights.graph.initializer if t.data_type == TensorProto.INT8 and len(t.dims) > 1]
    ref = {w.fp_name: w for w in weight_errors(fx.model, ort_model) if not w.is_bias}
    got = {w.fp_name: w for w in weight_errors(fx.model, float_weights)}
    assert got.keys() == ref.keys() and len(got) >= 3, (sorted(got), sorted(ref))
    assert any(w.axis is not None for w in got.values()) == per_channel
    for k, w in got.items():
        assert w.sqnr_db == pytest.approx(ref[k].sqnr_db, abs=1e-6), k
        assert w.axis == ref[k].axis and w.dtype == ref[k].dtype, k
        assert [c.sqnr_db for c in w.channels] == pytest.approx([c.sqnr_db for c in ref[k].channels], abs=1e-6)
    # The recipe read back: the weights' type and per-channel grid, as from the onnxruntime model.
    mine, theirs = infer_recipe(tmp_path / "mo.onnx").recipe, infer_recipe(q_path).recipe
    assert (
        (mine["weight_type"], mine["per_channel"])
        == (theirs["weight_type"], theirs["per_channel"])
        == (
            "QInt8",
            per_channel,
        )
    )


def test_smoothquant_weights_are_compared_with_the_fp32_weight_as_smoothquant_rescaled_it(qdq):
    """Issue 43 item 2: a SmoothQuant weight's figure is its error against ``W / v`` (the weight NNCF
    quantized), recomputed here with numpy from the model file; against ``W`` it would be noise."""
    from diag.analysis.weights import weight_errors

    fx = qdq["transformer"]
    fp32, m = producers.smoothquant_style(fx.fp32, fx.q, fx.calibration)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    fp_inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in fp32.graph.initializer}
    producer, consumers = _producer_of(m), {}
    for node in m.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    found = {w.fp_name: w for w in weight_errors(fp32, m)}
    checked = 0
    for mul in (n for n in m.graph.node if n.name.endswith("/nncf_smooth_quant")):
        v = inits[mul.input[1]].astype(np.float64)
        dq = consumers[consumers[mul.output[0]][0].output[0]][0]
        for matmul in consumers[dq.output[0]]:
            wdq = producer[matmul.input[1]]
            q, scale, zp = (inits[x] for x in wdq.input)
            deq = (q.astype(np.float64) - zp.reshape(-1, 1)) * scale.astype(np.float64).reshape(-1, 1)
            name = wdq.input[0].removesuffix("_quantized").removeprefix("q_output_").removesuffix("_1")
            truth = fp_inits[name] / v[:, None]
            want = 10 * np.log10((truth**2).sum() / ((deq - truth) ** 2).sum())
            assert found[name].sqnr_db == pytest.approx(want, abs=0.1), name
            assert "SmoothQuant's" in (found[name].folded or "")
            against_original = 10 * np.log10((fp_inits[name] ** 2).sum() / ((deq - fp_inits[name]) ** 2).sum())
            assert found[name].sqnr_db > 25 and (against_original < found[name].sqnr_db - 3 or v.max() / v.min() < 2)
            checked += 1
    assert checked >= 8
    # The outlier SmoothQuant moved into the weights is a finding: layer1's FFN LayerNorm dimension.
    from diag.analysis.weights import weight_report

    strongest = weight_report(fp32, m).smoothing[0]
    assert strongest.strongest_channel == models.transformer().expected.outlier_channel
    assert strongest.tensor == "layer1/ffn_norm/LayerNormalization_out" and strongest.divided_by >= 16
    assert strongest.weights == ("layer1/ffn/fc1.weight",)
