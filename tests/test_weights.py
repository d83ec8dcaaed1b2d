"""Weight error on models quantized by the real onnxruntime: QDQ, QOperator, dynamic, folds, 0-d weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from diag.analysis.weights import ChannelError, WeightFinding, weight_errors, weight_report
from diag.fixtures.models import convnet
from diag.fixtures.quantize import FORMATS  # every 8-bit kind of diag.foundations.ortfacts.FORMATS
from diag.fixtures.weight_models import DEFECT_CHANNEL, quantize_variant, weightnet


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[onnx.ModelProto, onnx.ModelProto]]:
    """weightnet quantized every way the tests need: key -> (FP32 model, INT8 model)."""
    folder = tmp_path_factory.mktemp("weights")
    fx = weightnet()
    fp = folder / "weightnet.fp32.onnx"
    onnx.save(fx.model, fp)
    calib = fx.make_inputs(8)
    variants: dict[str, dict[str, object]] = {}
    for fmt in FORMATS:
        variants[f"{fmt}"] = {}
        variants[f"{fmt}.pc"] = {"per_channel": True}
        variants[f"{fmt}.pre"] = {"preprocess": True}
    variants["qdq.pre.pc"] = {"preprocess": True, "per_channel": True}
    variants["dynamic.u8.rr"] = {"weight_type": "QUInt8", "reduce_range": True}
    out: dict[str, tuple[onnx.ModelProto, onnx.ModelProto]] = {}
    for key, kw in variants.items():
        fmt = key.split(".")[0]
        q = quantize_variant(fp, folder / f"weightnet.{key}.onnx", fmt, calib, **kw)  # type: ignore[arg-type]
        out[key] = (fx.model, onnx.load(q))
    return out


def _by_int8(findings: list[WeightFinding], name: str) -> WeightFinding:
    hits = [f for f in findings if f.int8_name == name]
    assert len(hits) == 1, [f.int8_name for f in findings]
    return hits[0]


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _sqnr(x: np.ndarray, y: np.ndarray) -> float:
    x = x.astype(np.float64)
    e = y.astype(np.float64) - x
    return 10 * math.log10(float(np.sum(x * x)) / float(np.sum(e * e)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_injected_outlier_channel_weight_is_ranked_first(made, fmt):
    fp, q = made[fmt]
    report = weight_report(fp, q)
    assert report.unmatched == {}
    top = report.findings[0]
    assert (top.fp_name, top.int8_name, top.fp_nodes, top.op_type) == (
        "conv2.weight",
        "conv2.weight_quantized",
        ["conv2"],
        "Conv",
    )
    assert top.shape == (8, 8, 3, 3) and top.dtype == "int8" and top.axis is None and top.symmetric
    # The tensor SQNR hides the damage (the huge channel carries the energy); the channels do not.
    assert top.sqnr_db > 25
    assert top.worst_sqnr_db < 10
    assert [c.channel for c in top.channels] == list(range(8))


def test_per_tensor_ruins_the_small_channels_and_per_channel_keeps_them(made):
    per_tensor = _by_int8(weight_errors(*made["qdq"]), "conv2.weight_quantized")
    per_channel = _by_int8(weight_errors(*made["qdq.pc"]), "conv2.weight_quantized")
    assert per_tensor.axis is None and per_channel.axis == 0
    small = [c for c in per_tensor.channels if c.channel != DEFECT_CHANNEL]
    assert max(c.sqnr_db for c in small) < 12, [round(c.sqnr_db, 1) for c in small]
    assert per_tensor.channels[DEFECT_CHANNEL].sqnr_db > 35
    assert min(c.sqnr_db for c in per_channel.channels) > 30
    # Per-channel: each channel has its own scale, so the error is plain rounding noise (1/sqrt(12)).
    assert 0.2 < per_channel.rmse_over_scale < 0.35
    # Per-tensor the small channels' values are a fraction of one step: max error below half a step.
    scale = float(_init(made["qdq"][1], "conv2.weight_scale"))
    assert max(c.max_abs for c in small) <= scale / 2 + 1e-7


def test_numbers_are_the_dequantized_initializers_against_fp32(made):
    fp, q = made["qdq.pc"]
    f = _by_int8(weight_errors(fp, q), "conv1.weight_quantized")
    deq = (_init(q, "conv1.weight_quantized").astype(np.float64) - 0) * _init(q, "conv1.weight_scale").reshape(
        8, 1, 1, 1
    )
    w = _init(fp, "conv1.weight")
    assert f.sqnr_db == pytest.approx(_sqnr(w, deq), abs=1e-6)
    assert f.max_abs == pytest.approx(float(np.max(np.abs(deq - w))), rel=1e-6)
    assert f.channels[2].sqnr_db == pytest.approx(_sqnr(w[2], deq[2]), abs=1e-6)


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_zero_d_and_one_d_constants_are_weights_without_channels(made, fmt):
    fp, q = made[fmt]
    findings = weight_errors(fp, q)
    scalar = _by_int8(findings, "scale_mul.value_quantized")
    assert (scalar.fp_name, scalar.shape, scalar.op_type, scalar.channels) == ("scale_mul.value", (), "Mul", [])
    expected = (float(_init(q, "scale_mul.value_quantized")) - float(_init(q, "scale_mul.value_zero_point"))) * float(
        _init(q, "scale_mul.value_scale")
    )
    assert scalar.max_abs == pytest.approx(abs(expected - 0.75), abs=1e-9)
    shift = _by_int8(findings, "shift_add.value_quantized")
    assert shift.shape == (8, 1, 1) and shift.channels == [] and shift.dtype == "uint8"
    assert math.isfinite(shift.sqnr_db) and shift.sqnr_db > 30


@pytest.mark.parametrize("key", ["qdq.pre", "qoperator.pre", "dynamic.pre", "qdq.pre.pc"])
def test_batchnorm_fold_is_compared_with_the_folded_fp32_weight(made, key):
    fp, q = made[key]
    report = weight_report(fp, q)
    assert report.unmatched == {}
    f = _by_int8(report.findings, "ConvBnFusion_W_conv1.weight_quantized")
    assert (f.fp_name, f.folded, f.fp_nodes, f.op_type) == (
        "conv1.weight folded with bn1",
        "bn1",
        ["conv1", "bn1"],
        "Conv",
    )
    assert f.sqnr_db > 30
    # Control: the raw (unfolded) FP32 weight against the same dequantized values is garbage, so a
    # high SQNR above proves the fold was replayed, not that any weight would do.
    scale = _init(q, "ConvBnFusion_W_conv1.weight_scale")
    scale = scale.reshape(-1, 1, 1, 1) if scale.size > 1 else scale
    deq = _init(q, "ConvBnFusion_W_conv1.weight_quantized").astype(np.float64) * scale
    assert _sqnr(_init(fp, "conv1.weight"), deq) < 10


def test_folded_bias_and_constant_mul_fold_match_the_unfolded_quantization(made):
    folded = weight_errors(*made["qdq.pre.pc"])
    plain = weight_errors(*made["qdq.pc"])
    bias = _by_int8(folded, "ConvBnFusion_BN_B_bn1.bias_quantized")
    assert bias.is_bias and bias.dtype == "int32" and bias.fp_name == "bias of conv1 folded with bn1"
    assert bias.sqnr_db > 30
    # conv2.weight * 0.75 (scale_mul folded in): per-channel quantization scales with the weight,
    # so the folded weight's SQNR equals the unfolded one's.
    w = _by_int8(folded, "ConvMulFusion_W_conv2.weight_quantized")
    assert w.fp_name == "conv2.weight folded with scale_mul" and w.fp_nodes == ["conv2", "scale_mul", "shift_add"]
    assert w.sqnr_db == pytest.approx(_by_int8(plain, "conv2.weight_quantized").sqnr_db, abs=0.5)


@pytest.mark.parametrize("weight", ["conv1.weight_quantized", "conv2.weight_quantized", "fc.weight_quantized"])
def test_dynamic_qdq_and_qoperator_agree_on_the_same_weight(made, weight):
    found = [_by_int8(weight_errors(*made[fmt]), weight) for fmt in FORMATS]
    assert {f.fp_name for f in found} == {weight.removesuffix("_quantized")}
    for f in found[1:]:
        assert f.sqnr_db == pytest.approx(found[0].sqnr_db, abs=1e-6)
        assert f.max_abs == pytest.approx(found[0].max_abs, rel=1e-6)
        assert [c.sqnr_db for c in f.channels] == pytest.approx([c.sqnr_db for c in found[0].channels], abs=1e-6)


def test_qdq_and_qoperator_biases_are_included_and_flagged(made):
    for fmt in ("qdq", "qoperator"):
        b = _by_int8(weight_errors(*made[fmt]), "conv2.bias_quantized")
        assert b.is_bias and b.dtype == "int32" and b.fp_nodes == ["conv2"] and b.channels == []
    # The bias scale is input scale x weight scale: the x100 channel inflates the weight scale,
    # so per tensor the bias is coarsely quantized too, and per channel it is not.
    coarse = _by_int8(weight_errors(*made["qdq"]), "conv2.bias_quantized")
    fine = _by_int8(weight_errors(*made["qdq.pc"]), "conv2.bias_quantized")
    assert coarse.sqnr_db < fine.sqnr_db - 10


def test_uint8_reduce_range_weights_are_asymmetric_7_bit(made):
    f = _by_int8(weight_errors(*made["dynamic.u8.rr"]), "conv1.weight_quantized")
    q = _init(made["dynamic.u8.rr"][1], "conv1.weight_quantized")
    assert f.dtype == "uint8" and not f.symmetric
    assert int(q.max()) - int(q.min()) <= 127  # reduce_range: 7 bits
    assert 0.2 < f.rmse_over_scale < 0.35


def test_gemm_weight_transposed_by_dynamic_quantization_is_compared_transposed(tmp_path):
    fx = convnet()
    fp = tmp_path / "convnet.fp32.onnx"
    onnx.save(fx.model, fp)
    dyn = weight_errors(fx.model, onnx.load(quantize_variant(fp, tmp_path / "d.onnx", "dynamic")))
    qdq = weight_errors(fx.model, onnx.load(quantize_variant(fp, tmp_path / "q.onnx", "qdq", fx.make_inputs(4))))
    t = _by_int8(dyn, "fc.weight_Transposed_quantized")
    assert (t.fp_name, t.op_type, t.shape, t.fp_nodes) == ("fc.weight transposed", "Gemm", (16, 10), ["fc"])
    assert len(t.channels) == 10  # the 10 output classes, not the 16 inputs
    assert t.sqnr_db == pytest.approx(_by_int8(qdq, "fc.weight_quantized").sqnr_db, abs=1e-6)


def test_unpaired_weight_is_listed_not_guessed(made):
    fp, q = made["qdq"]
    q2 = onnx.ModelProto()
    q2.CopyFrom(q)
    for t in q2.graph.initializer:
        if t.name == "fc.weight_quantized":
            t.name = "mystery_quantized"
    for n in q2.graph.node:
        n.input[:] = ["mystery_quantized" if x == "fc.weight_quantized" else x for x in n.input]
    fp2 = onnx.ModelProto()
    fp2.CopyFrom(fp)  # the FP32 MatMul now reads its weight through an Identity: nothing to fold
    fc = next(n for n in fp2.graph.node if n.name == "fc")
    fc.input[1] = "fc.weight_id"
    fp2.graph.node.append(onnx.helper.make_node("Identity", ["fc.weight"], ["fc.weight_id"], name="fc_id"))
    report = weight_report(fp2, q2)
    assert list(report.unmatched) == ["mystery_quantized"]
    assert "MatMul 'fc' has no initializer weight" in report.unmatched["mystery_quantized"]
    assert "mystery_quantized" not in {f.int8_name for f in report.findings}
    assert len(report.findings) == len(weight_errors(fp, q)) - 1


def test_findings_serialize_to_json_with_non_finite_numbers_as_strings():
    f = WeightFinding(
        fp_name="w",
        int8_name="w_quantized",
        fp_nodes=["n"],
        op_type="Conv",
        shape=(2, 1),
        dtype="int8",
        axis=0,
        symmetric=True,
        folded=None,
        sqnr_db=math.inf,
        max_abs=0.0,
        rmse_over_scale=math.nan,
        cosine=1.0,
        channels=[ChannelError(0, math.inf, 0.0, None), ChannelError(1, -math.inf, 1.0, 0.5)],
    )
    d = json.loads(json.dumps(f.to_dict(), allow_nan=False))
    assert d["sqnr_db"] == "inf" and d["rmse_over_scale"] == "nan" and d["worst_sqnr_db"] == "-inf"
    assert d["channels"][1] == {"channel": 1, "sqnr_db": "-inf", "max_abs": 1.0, "rmse_over_scale": 0.5}
    assert d["shape"] == [2, 1]


@pytest.mark.slow
def test_real_ppocr_det_qdq_every_quantized_weight_is_found(tmp_path: Path):
    from diag.fixtures import quantize, thirdparty

    src = onnx.load(str(thirdparty.rapidocr_model("det")))
    fp = tmp_path / "det.fp32.onnx"
    onnx.save(quantize.lift_constants(src), fp)
    name = src.graph.input[0].name
    q = onnx.load(quantize.quantize(fp, tmp_path / "det.qdq.onnx", "qdq", {name: thirdparty.text_images(2, 64, 64)}))
    fp_model = onnx.load(fp)
    report = weight_report(fp_model, q)
    inits = {t.name: t for t in q.graph.initializer}
    dequantized = {n.input[0] for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    assert report.unmatched == {}
    assert {f.int8_name for f in report.findings} == dequantized
    zero_d = [f for f in report.findings if f.shape == ()]
    assert len(zero_d) == sum(1 for n in dequantized if len(inits[n].dims) == 0) > 0
    assert all(f.channels == [] for f in zero_d)
    convs = [f for f in report.findings if f.op_type == "Conv" and not f.is_bias]
    assert convs and all(len(f.channels) == f.shape[0] for f in convs)
    # Measured on onnxruntime 1.32: QDQ quantizes a BatchNormalization's bias like a conv bias
    # (scale = input scale x gamma scale), which rounds every value to 0: SQNR exactly 0 dB.
    bn_bias = [f for f in report.findings if f.op_type == "BatchNormalization" and f.is_bias]
    assert bn_bias and min(f.sqnr_db for f in bn_bias) < 1.0


def test_dynamic_graph_fused_by_onnxruntime_keeps_every_weight(tmp_path):
    import onnxruntime as ort

    from diag.fixtures.models import transformer

    fx = transformer()
    fp = tmp_path / "t.fp32.onnx"
    onnx.save(fx.model, fp)
    dyn = quantize_variant(fp, tmp_path / "t.dynamic.onnx", "dynamic")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "t.fused.onnx")
    ort.InferenceSession(str(dyn), so, providers=["CPUExecutionProvider"])
    fused = onnx.load(tmp_path / "t.fused.onnx")
    ops = {n.op_type for n in fused.graph.node}
    assert {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"} <= ops and "MatMulInteger" not in ops
    plain = {f.int8_name: f.sqnr_db for f in weight_errors(fx.model, onnx.load(dyn))}
    after = {f.int8_name: f.sqnr_db for f in weight_errors(fx.model, fused)}
    assert after.keys() == plain.keys() and len(plain) == 14  # 13 MatMul weights + the embedding table
    assert after == pytest.approx(plain, abs=1e-9)


def test_weights_not_loaded_is_a_user_error(made, tmp_path):
    from diag.foundations.errors import DiagError

    fp, q = made["qdq"]
    path = tmp_path / "ext.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(q)  # onnx.save(save_as_external_data=True) rewrites the proto it is given
    onnx.save(
        copy, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data", size_threshold=0
    )
    lazy = onnx.load(path, load_external_data=False)
    with pytest.raises(DiagError) as err:
        weight_errors(fp, lazy)
    assert err.value.slug == "missing-external-data"
    assert len(weight_errors(fp, onnx.load(path))) == len(weight_errors(fp, q))


@pytest.mark.slow
def test_real_ppocr_det_batchnorm_folds_match_the_replayed_fold(tmp_path: Path):
    from diag.fixtures import quantize, thirdparty

    src = onnx.load(str(thirdparty.rapidocr_model("det")))
    fp = tmp_path / "det.fp32.onnx"
    onnx.save(quantize.lift_constants(src), fp)
    name = src.graph.input[0].name
    calib = {name: thirdparty.text_images(2, 64, 64)}
    q = onnx.load(quantize_variant(fp, tmp_path / "det.qdq.onnx", "qdq", calib, preprocess=True))
    report = weight_report(onnx.load(fp), q)
    assert report.unmatched == {}
    folds = [f for f in report.findings if f.folded]
    renamed = {
        t.name for t in q.graph.initializer if t.name.startswith("ConvBnFusion_W_") and t.name.endswith("_quantized")
    }
    assert {f.int8_name for f in folds if not f.is_bias} == renamed and renamed
    # A wrong fold (or the unfolded weight) would be near 0 dB; per-tensor int8 rounding is ~30-45 dB.
    assert min(f.sqnr_db for f in folds) > 25
    assert all("BatchNormalization" in (f.folded or "") for f in folds)
