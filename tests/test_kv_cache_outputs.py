"""A KV cache's ``present`` outputs are graded on the positions they add, not on the copied past.

``present = Concat(past, new, axis=2)``: the first ``past`` positions are the fed input, bit for
bit the same in both models, so figures over the whole tensor read better than the computed part
(about 10 log10(total / new) dB better than the computed part). Ground truth here: plain onnxruntime
runs of both models, sliced by hand.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag.analysis.analyze import FAILING_GRADES
from diag.analysis.compare import CompareOptions, compare_models
from diag.cli.verbs import result_lines
from diag.core.feeds import FeedSpec
from diag.core.outputs import output_specs
from diag.fixtures import quantize
from diag.report.document import document_from_result
from diag.report.view import write_outputs

HEADS, DIM, HIDDEN, PAST, SEQ = 2, 8, 16, 48, 4


def _decoder_step(seed: int = 0, values: bool = False, outlier: float = 30) -> onnx.ModelProto:
    """x [1, SEQ, HIDDEN] -> a key projection appended to ``past_key`` (and logits), as a decoder step.

    ``values``: a value projection appended to ``past_value`` too, and logits computed from the
    new keys and values (so they inherit k_proj's error, as a decoder's logits inherit its caches').
    """
    rng = np.random.default_rng(seed)
    w_k = rng.standard_normal((HIDDEN, HEADS * DIM)).astype(np.float32) / 4
    w_k[3] *= outlier  # one hidden input channel the per-tensor activation scale cannot serve
    w_v = rng.standard_normal((HIDDEN, HEADS * DIM)).astype(np.float32) * 2
    w_o = rng.standard_normal((HEADS * DIM if values else HIDDEN, 32)).astype(np.float32) / 4
    nodes = [
        helper.make_node("MatMul", ["x", "w_k"], ["k_flat"], name="k_proj"),
        helper.make_node("Reshape", ["k_flat", "k_shape"], ["k_heads"], name="k_reshape"),
        helper.make_node("Transpose", ["k_heads"], ["k_new"], perm=[0, 2, 1, 3], name="k_transpose"),
        helper.make_node("Concat", ["past_key", "k_new"], ["present_key"], axis=2, name="cache_concat"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", HIDDEN]),
        helper.make_tensor_value_info("past_key", TensorProto.FLOAT, [1, HEADS, "past", DIM]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", 32]),
        helper.make_tensor_value_info("present_key", TensorProto.FLOAT, [1, HEADS, "total", DIM]),
    ]
    if values:
        nodes += [
            helper.make_node("MatMul", ["x", "w_v"], ["v_flat"], name="v_proj"),
            helper.make_node("Reshape", ["v_flat", "k_shape"], ["v_heads"], name="v_reshape"),
            helper.make_node("Transpose", ["v_heads"], ["v_new"], perm=[0, 2, 1, 3], name="v_transpose"),
            helper.make_node("Concat", ["past_value", "v_new"], ["present_value"], axis=2, name="value_concat"),
            helper.make_node("Add", ["k_flat", "v_flat"], ["kv_sum"], name="mix"),
            helper.make_node("MatMul", ["kv_sum", "w_o"], ["logits"], name="lm_head"),
        ]
        inputs.append(helper.make_tensor_value_info("past_value", TensorProto.FLOAT, [1, HEADS, "past", DIM]))
        outputs.append(helper.make_tensor_value_info("present_value", TensorProto.FLOAT, [1, HEADS, "total", DIM]))
    else:
        nodes.append(helper.make_node("MatMul", ["x", "w_o"], ["logits"], name="lm_head"))
    weights = {"w_k": w_k, "w_o": w_o, "k_shape": np.array([1, -1, HEADS, DIM], np.int64)}
    if values:
        weights["w_v"] = w_v
    graph = helper.make_graph(
        nodes, "kv_step", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in weights.items()]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inputs(count: int, seed: int, values: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, SEQ, HIDDEN)).astype(np.float32)
    x[:, :, 3] *= 0.1
    feeds = {"x": x, "past_key": rng.standard_normal((count, HEADS, PAST, DIM)).astype(np.float32)}
    if values:
        feeds["past_value"] = rng.standard_normal((count, HEADS, PAST, DIM)).astype(np.float32)
    return feeds


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    fp = folder / "kv.fp32.onnx"
    onnx.save(_decoder_step(), fp)
    q = folder / "kv.dynamic.onnx"
    quantize.quantize(fp, q, "dynamic", _inputs(8, 1))
    np.savez(folder / "kv.npz", **_inputs(8, 2))
    return fp, q, folder / "kv.npz"


def _plain_sqnr(fp, q, inputs, sl):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a, b = (ort.InferenceSession(str(m), so, providers=["CPUExecutionProvider"]) for m in (fp, q))
    xs, es = 0.0, 0.0
    for i in range(len(inputs["x"])):
        feed = {k: v[i : i + 1] for k, v in inputs.items()}
        x = a.run(["present_key"], feed)[0][sl].astype(np.float64)
        y = b.run(["present_key"], feed)[0][sl].astype(np.float64)
        xs, es = xs + float((x * x).sum()), es + float(((y - x) ** 2).sum())
    return 10 * math.log10(xs / es)


def test_present_is_recognised_as_appended_to_its_past_input(models):
    spec = output_specs(onnx.load(models[0]))["present_key"]
    assert (spec.appended_to, spec.appended_axis, spec.appended_input_axis) == ("past_key", 2, 2)
    assert "KV cache" in spec.evidence and "cache_concat" in spec.evidence
    assert output_specs(onnx.load(models[0]))["logits"].appended_to is None


def test_present_is_graded_on_its_new_positions_as_plain_onnxruntime_measures_them(models):
    fp, q, npz = models
    r = compare_models(fp, q, FeedSpec(inputs=str(npz), samples=8, batch=1), CompareOptions(progress=False))
    present = next(v for v in r.verdicts if v.name == "present_key")
    inputs = dict(np.load(npz))
    new = _plain_sqnr(fp, q, inputs, (slice(None), slice(None), slice(PAST, None)))
    whole = _plain_sqnr(fp, q, inputs, (slice(None),))
    assert present.stats.sqnr_db == pytest.approx(new, abs=0.01)
    # graded over the whole tensor, the copied past (48 of 52 positions, exact) would add ~9 dB
    assert whole - new > 6.0
    assert present.per_sample.samples == 8


@pytest.fixture(scope="module")
def two_caches(tmp_path_factory):
    """Keys and values cached; logits read both projections, keys carry the outlier channel."""
    folder = tmp_path_factory.mktemp("kv2")
    fp = folder / "kv2.fp32.onnx"
    onnx.save(_decoder_step(values=True, outlier=60), fp)
    q = folder / "kv2.dynamic.onnx"
    quantize.quantize(fp, q, "dynamic", _inputs(8, 1, values=True))
    np.savez(folder / "kv2.npz", **_inputs(8, 2, values=True))
    spec = FeedSpec(inputs=str(folder / "kv2.npz"), samples=8, batch=1)
    return compare_models(fp, q, spec, CompareOptions(progress=False)), folder


def test_effect_check_scores_nodes_on_the_logits_not_on_the_worse_cache(two_caches):
    r, _ = two_caches
    grades = {v.name: (v.grade, v.stats.sqnr_db) for v in r.verdicts}
    assert grades["logits"][0] in FAILING_GRADES and grades["present_key"][0] in FAILING_GRADES
    # the lowest SQNR is the cache's: the old rule (lowest SQNR among the failing) scored on it
    assert grades["present_key"][1] < grades["logits"][1] - 3
    assert r.effects is not None and r.effects.target == "logits"
    assert "of the error of logits" in r.cause_sentence and "k_proj" in r.cause_sentence


def test_caches_get_one_line_named_by_the_worst(two_caches, tmp_path):
    r, _ = two_caches
    lines = result_lines(document_from_result(r), {})
    assert [line for line in lines if line.startswith("  output ")] == [
        line for line in lines if line.startswith("  output logits:")
    ]
    cache = [line for line in lines if "KV-cache outputs:" in line]
    assert len(cache) == 1 and cache[0].startswith("  2 KV-cache outputs: 1 marginal, 1 excellent; worst present_key: ")
    paths = [line for line in lines if line.startswith("  error path to ")]
    assert [p.split(":")[0] for p in paths] == [
        "  error path to logits",
        "  error path to present_key (the worst of 2 KV-cache outputs)",
    ]
    files = {p.name: p for p in write_outputs(document_from_result(r), tmp_path).values()}
    summary = files["summary.md"].read_text()
    assert summary.count("- error path to ") == 2 and "error path to `present_value`" not in summary
    doc = json.loads(files["diag.json"].read_text())
    assert {o["name"]: o["cache_of"] for o in doc["verdict"]["outputs"]} == {
        "logits": None,
        "present_key": "past_key",
        "present_value": "past_value",
    }
