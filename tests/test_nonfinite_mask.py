"""A causal mask writes -inf by design: no NaN/Inf finding unless a non-finite value reaches an output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from diag.analysis.analyze import nonfinite_origins
from diag.analysis.compare import CompareOptions, compare_models
from diag.cli.verbs import result_lines
from diag.core.feeds import FeedSpec
from diag.fixtures.quantize import quantize
from diag.report.document import document_from_result

SEQ, DIM = 4, 8


def _attention(nan_at_output: bool) -> onnx.ModelProto:
    """Where(mask, scores, -inf) -> Add -> Softmax -> MatMul; optionally a real NaN (Log of a negative) at the end."""
    rng = np.random.default_rng(0)
    mask = np.tril(np.ones((SEQ, SEQ), dtype=bool))
    inits = [
        numpy_helper.from_array(mask, "mask"),
        numpy_helper.from_array(np.array(-np.inf, dtype=np.float32), "neg_inf"),
        numpy_helper.from_array(rng.normal(size=(SEQ, SEQ)).astype(np.float32), "bias"),
        numpy_helper.from_array(rng.normal(size=(SEQ, SEQ)).astype(np.float32), "wq"),
        numpy_helper.from_array(rng.normal(size=(SEQ, DIM)).astype(np.float32), "wv"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["scores"], name="scores_mm"),
        helper.make_node("Where", ["mask", "scores", "neg_inf"], ["masked"], name="Where_2"),
        helper.make_node("Add", ["masked", "bias"], ["biased"], name="mask_add"),
        helper.make_node("Softmax", ["biased"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "wv"], ["ctx"], name="ctx_mm"),
    ]
    out = "ctx"
    if nan_at_output:
        inits.append(numpy_helper.from_array(np.array(-1.0, dtype=np.float32), "minus_one"))
        nodes += [
            helper.make_node("Mul", ["ctx", "minus_one"], ["neg"], name="negate"),
            helper.make_node("Abs", ["neg"], ["absneg"], name="abs"),
            helper.make_node("Mul", ["absneg", "minus_one"], ["neg2"], name="negate2"),
            helper.make_node("Log", ["neg2"], ["y"], name="the_log"),
        ]
        out = "y"
    graph = helper.make_graph(
        nodes,
        "causal_mask",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, SEQ])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, SEQ, DIM])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _diagnose(tmp_path: Path, nan_at_output: bool):
    fp32 = tmp_path / "fp32.onnx"
    int8 = tmp_path / "int8.onnx"
    onnx.save(_attention(nan_at_output), fp32)
    quantize(fp32, int8, "dynamic")
    inputs = tmp_path / "x.npz"
    np.savez(inputs, x=np.random.default_rng(1).normal(size=(4, SEQ, SEQ)).astype(np.float32))
    return compare_models(
        str(fp32), str(int8), FeedSpec(inputs=str(inputs), samples=4, batch=1), CompareOptions(progress=False)
    )


def test_causal_mask_where_writing_minus_inf_is_not_a_nonfinite_finding(tmp_path):
    r = _diagnose(tmp_path, nan_at_output=False)
    where = next(f for f in r.findings if "Where_2" in f.group.fp_nodes)
    assert where.accumulated is not None and where.accumulated.nonfinite_fp > 0  # the mask really is -inf
    assert nonfinite_origins(r.findings) == {}
    assert not [line for line in _finding_lines(r) if "NaN/Inf" in line]


def _finding_lines(r) -> list[str]:
    """What `diag compare` prints about ``r`` (the lines under the verdict, from its document)."""
    return result_lines(document_from_result(r), {})


def test_real_nan_reaching_an_output_is_still_reported(tmp_path):
    r = _diagnose(tmp_path, nan_at_output=True)
    origins = nonfinite_origins(r.findings)
    assert "FP32" in origins
    assert "the_log" in origins["FP32"].group.fp_nodes, origins["FP32"].group.label
    assert any("NaN/Inf" in line and "the_log" in line for line in _finding_lines(r))


def test_mask_model_quantizes_the_matmul_reading_softmax(tmp_path):
    """The rule looks at quantized inputs: the fixture must really have one after the Softmax."""
    r = _diagnose(tmp_path, nan_at_output=False)
    ctx = next(f for f in r.findings if "ctx_mm" in f.group.fp_nodes)
    assert ctx.group.quantized
