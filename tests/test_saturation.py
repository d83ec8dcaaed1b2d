"""The AVX2-without-VNNI prediction (diag.core.saturation) against u8s8 arithmetic computed independently.

The fixture is a MatMulInteger model built in code whose weight columns have a known defect: column 0
holds full-range pairs (127, 127) that saturate int16 when the activations are large, column 1 holds
7-bit weights that never do. The simulation is checked against explicit Python loops (written
without numpy's vector tricks), and on a CPU without VNNI against onnxruntime itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from kernel_path import emulated_cpu
from onnx import TensorProto, helper, numpy_helper

from diag.core.saturation import NodePrediction, predict_avx2, u8s8_avx2, u8s8_exact
from diag.foundations import cpu

K = 6


def _loops_avx2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """u8s8 on AVX2, one output at a time: int16-saturated sums of products (k, k+1), k even."""
    m, k = a.shape
    n = b.shape[1]
    out = np.zeros((m, n), np.int64)
    for i in range(m):
        for j in range(n):
            total = 0
            for p in range(0, k, 2):
                s = int(a[i, p]) * int(b[p, j])
                if p + 1 < k:
                    s += int(a[i, p + 1]) * int(b[p + 1, j])
                total += max(-32768, min(32767, s))
            out[i, j] = total
    return out


def _weight() -> np.ndarray:
    b = np.zeros((K, 3), np.int8)
    b[:, 0] = 127  # every pair saturates when a >= 129 on both k of the pair
    b[:, 1] = [63, -64, 63, 63, -64, 10]  # 7-bit: 255 * 64 * 2 < 32768, never saturates
    b[:, 2] = [-128, -128, 5, 7, 0, 1]  # pair (0, 1) saturates downwards
    return b


def _model(path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "a_zp"], ["y"], name="mmi")],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["M", 3])],
        [numpy_helper.from_array(_weight(), "b"), numpy_helper.from_array(np.array(3, np.uint8), "a_zp")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, K)).astype(np.uint8)
    a[0] = 255  # a row that saturates both signed columns
    a[1] = 10  # a row that saturates nothing
    return a


def test_simulated_avx2_matches_explicit_loops_and_saturates_where_injected() -> None:
    a, b = _inputs(), _weight()
    sim = u8s8_avx2(a, b)
    assert np.array_equal(sim, _loops_avx2(a, b))
    exact = u8s8_exact(a, b)
    assert np.array_equal(exact, a.astype(np.int64) @ b.astype(np.int64))
    assert sim[0, 0] == 3 * 32767 and exact[0, 0] == 6 * 255 * 127  # the injected saturation
    assert sim[0, 2] == -32768 + 255 * 12 + 255  # pair (0, 1) clipped, the rest exact
    assert np.array_equal(sim[:, 1], exact[:, 1])  # 7-bit column: exact on AVX2 too
    assert np.array_equal(sim[1], exact[1])
    odd = _inputs()[:, :5]
    assert np.array_equal(u8s8_avx2(odd, b[:5]), _loops_avx2(odd, b[:5]))  # odd K: zero-padded last pair


def test_node_prediction_from_the_models_captured_inputs(tmp_path: Path) -> None:
    path = tmp_path / "mmi.onnx"
    _model(path)
    a = _inputs()
    preds = predict_avx2(str(path), [{"a": a[:8]}, {"a": a[8:]}])  # streamed in two batches
    assert [p.node for p in preds] == ["mmi"] and preds[0].op_type == "MatMulInteger"
    p = preds[0]
    b = _weight().astype(np.int64)
    y = (a.astype(np.int64) - 3) @ b  # the node's exact output, zero point applied
    err = _loops_avx2(a, _weight()) - a.astype(np.int64) @ b
    want = 10 * math.log10(float((y.astype(float) ** 2).sum()) / float((err.astype(float) ** 2).sum()))
    assert p.rows == 16
    assert p.saturation_sqnr_db == pytest.approx(want, rel=1e-9)
    pairs = [
        int(a[i, q]) * int(b[q, j]) + int(a[i, q + 1]) * int(b[q + 1, j])
        for i in range(16)
        for j in range(3)
        for q in range(0, K, 2)
    ]
    assert p.saturated_pairs == sum(1 for s in pairs if not -32768 <= s <= 32767) > 0
    assert p.pairs == len(pairs)
    p.measured_sqnr_db = 40.0
    predicted = p.predicted_sqnr_db()
    assert predicted is not None and predicted < min(40.0, p.saturation_sqnr_db)
    text = p.sentence()
    assert text.startswith("mmi: on AVX2 without VNNI this node's output SQNR drops from 40.0 to ")
    assert f"{predicted:.1f} dB" in text
    assert p.to_dict()["predicted_sqnr_db"] == round(predicted, 2)


def test_seven_bit_weights_are_predicted_exact() -> None:
    p = NodePrediction("n", "MatMulInteger", measured_sqnr_db=30.0)
    assert p.saturation_sqnr_db == math.inf and p.predicted_sqnr_db() == 30.0
    assert p.to_dict()["saturation_sqnr_db"] == "inf"


def _ort_matmulinteger(tmp_path: Path) -> np.ndarray:
    path = tmp_path / "mmi.onnx"
    _model(path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"a": _inputs()})[0], np.int64)


def _needs_avx2_without_vnni() -> None:
    # qemu-user shows the host's /proc/cpuinfo: CI's emulated leg says which CPU onnxruntime really sees
    avx2_only = emulated_cpu() == "Haswell" or (cpu.has_vnni() is False and "AVX2" in cpu.kernel_path().isa)
    if not avx2_only:
        pytest.skip(
            "needs an x86 CPU with AVX2 and without VNNI: only there does onnxruntime run the saturating "
            f"u8s8 kernel being predicted (this CPU: {cpu.kernel_path().describe()})"
        )


def _needs_vnni() -> None:
    if cpu.has_vnni() is not True or emulated_cpu() is not None:
        pytest.skip(f"needs a VNNI CPU, where u8s8 kernels are exact (this CPU: {cpu.kernel_path().describe()})")


@pytest.mark.kernel_path
def test_prediction_matches_onnxruntime_on_a_cpu_without_vnni(tmp_path: Path) -> None:
    _needs_avx2_without_vnni()
    a = _inputs()
    want = u8s8_avx2(a, _weight()) - 3 * _weight().astype(np.int64).sum(axis=0)[None, :]
    assert np.array_equal(_ort_matmulinteger(tmp_path), want)


def test_onnxruntime_is_exact_on_a_vnni_cpu(tmp_path: Path) -> None:
    _needs_vnni()
    a = _inputs()
    assert np.array_equal(_ort_matmulinteger(tmp_path), (a.astype(np.int64) - 3) @ _weight().astype(np.int64))


def _qdq_model(path: Path) -> None:
    """x (float) -> Q/DQ (u8, scale 1) -> MatMul with DQ(s8 weight, scale 1): what a QDQ model holds.
    At onnxruntime's default level the pair fuses into a u8s8 kernel (MatMulIntegerToFloat)."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "one", "zp_u8"], ["x_q"], name="q"),
        helper.make_node("DequantizeLinear", ["x_q", "one", "zp_u8"], ["x_dq"], name="dq"),
        helper.make_node("DequantizeLinear", ["w_q", "one", "zp_s8"], ["w_dq"], name="w_dq"),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 3])],
        [
            one,
            numpy_helper.from_array(np.array(0, np.uint8), "zp_u8"),
            numpy_helper.from_array(np.array(0, np.int8), "zp_s8"),
            numpy_helper.from_array(_weight(), "w_q"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_a_qdq_matmul_is_predicted_as_the_u8s8_kernel_it_fuses_into(tmp_path: Path) -> None:
    """QDQ models hold no integer op: the u8s8 kernel exists only after onnxruntime's fusion. A QDQ
    MatMul over DQ(u8) and DQ(s8 weight) is predicted like the MatMulInteger it becomes."""
    path = tmp_path / "qdq.onnx"
    _qdq_model(path)
    a = _inputs()
    (p,) = predict_avx2(str(path), [{"x": a.astype(np.float32)}])
    assert p.node == "fc" and p.op_type == "MatMul (QDQ)" and not p.note
    want = sum(
        1
        for i in range(16)
        for j in range(3)
        for q in range(0, K, 2)
        if not -32768 <= int(a[i, q]) * int(_weight()[q, j]) + int(a[i, q + 1]) * int(_weight()[q + 1, j]) <= 32767
    )
    assert p.saturated_pairs == want > 0


def _ort_qdq(tmp_path: Path) -> np.ndarray:
    path = tmp_path / "qdq.onnx"
    _qdq_model(path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # as deployed: fused
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": _inputs().astype(np.float32)})[0], np.int64)


@pytest.mark.kernel_path
def test_the_fused_qdq_matmul_saturates_as_predicted_on_a_cpu_without_vnni(tmp_path: Path) -> None:
    _needs_avx2_without_vnni()
    assert np.array_equal(_ort_qdq(tmp_path), u8s8_avx2(_inputs(), _weight()))


def test_the_fused_qdq_matmul_is_exact_on_a_vnni_cpu(tmp_path: Path) -> None:
    _needs_vnni()
    assert np.array_equal(_ort_qdq(tmp_path), u8s8_exact(_inputs(), _weight()))
