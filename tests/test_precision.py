"""FP16 models and 16-bit activations in QDQ: detection, matching, NaN origin and the block-list fix."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from diag.analysis.compare import CompareOptions, compare_models
from diag.analysis.fp16health import fp16_fix
from diag.core.feeds import FeedSpec
from diag.core.load import model_from_path
from diag.fixtures.models import transformer
from diag.fixtures.precision_models import fp16_overflow
from diag.fixtures.quantize import _ArrayReader


def _fp16(model: onnx.ModelProto, path: Path, node_block_list: list[str] | None = None) -> Path:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(model, keep_io_types=True, node_block_list=node_block_list), path)
    return path


@pytest.fixture(scope="module")
def overflow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fp16")
    fx = fp16_overflow()
    onnx.save(fx.model, d / "fp32.onnx")
    np.savez(d / "inputs.npz", **fx.make_inputs(8, 1))
    return {"fp32": d / "fp32.onnx", "fp16": _fp16(fx.model, d / "fp16.onnx"), "inputs": d / "inputs.npz", "dir": d}


def _nonfinite_tensors(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Plain onnxruntime: every tensor of the graph materialized, counts of NaN/Inf per tensor."""
    m = onnx.load(path)
    present = {o.name for o in m.graph.output}
    for n in m.graph.node:
        m.graph.output.extend(onnx.ValueInfoProto(name=o) for o in n.output if o and o not in present)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    values = sess.run(None, feeds)
    counts = {o.name: int((~np.isfinite(v)).sum()) for o, v in zip(sess.get_outputs(), values, strict=True)}
    return {k: c for k, c in counts.items() if c}


def test_fp16_model_is_detected_with_its_blocked_nodes(overflow: dict[str, Path]) -> None:
    plain = model_from_path(overflow["fp16"]).format
    assert (plain.kind, plain.family) == ("fp16", "fp16")
    blocked = _fp16(fp16_overflow().model, overflow["dir"] / "blocked.onnx", ["attn/Attention"])
    fmt = model_from_path(blocked).format
    assert (fmt.kind, fmt.family) == ("mixed", "fp16")
    assert fmt.precisions["fp32"] == ["attn/Attention"]


def test_fp16_model_with_float16_inputs_is_fed_cast_inputs(overflow: dict[str, Path]) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    path = overflow["dir"] / "noio.onnx"
    onnx.save(convert_float_to_float16(fp16_overflow().model, node_block_list=["attn/Attention"]), path)
    assert model_from_path(path).graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    r = compare_models(overflow["fp32"], path, FeedSpec(inputs=str(overflow["inputs"])), CompareOptions(effects=0))
    assert r.grade == "excellent" and r.matching.coverage == 1.0


def test_fp32_model_with_a_float16_island_stays_fp32() -> None:
    from onnx import TensorProto, helper

    from diag.core.load import detect_format

    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16, name="to16"),
        helper.make_node("Relu", ["h"], ["r"], name="relu16"),
        helper.make_node("Cast", ["r"], ["f"], to=TensorProto.FLOAT, name="to32"),
        helper.make_node("MatMul", ["f", "w"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "m"], ["y"], name="add"),
    ]
    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        nodes,
        "island",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert detect_format(model).kind == "fp32"  # one float16 node of three: still the float model


def test_overflowing_attention_is_named_and_its_block_list_derived(overflow: dict[str, Path]) -> None:
    r = compare_models(
        overflow["fp32"], overflow["fp16"], FeedSpec(inputs=str(overflow["inputs"])), CompareOptions(effects=0)
    )
    assert r.matching.coverage == 1.0
    assert r.matching.pairs["attn/Attention_out"].how == "fp16"
    from diag.analysis.analyze import nonfinite_origins

    assert nonfinite_origins(r.findings)["INT8"].group.label == "attn/Attention"
    fix = fp16_fix(r.findings, r.state.fp16_ranges)
    assert fix is not None and fix.node_block_list == ["attn/Attention"] and not fix.over_range


def test_derived_block_list_removes_nonfinite_values_in_plain_onnxruntime(overflow: dict[str, Path]) -> None:
    # Without diag code: onnxruntime's converter with node_block_list=["attn/Attention"].
    feeds = dict(np.load(overflow["inputs"]))
    before = _nonfinite_tensors(overflow["fp16"], feeds)
    assert before.get("attn/Attention_out", 0) > 0 and before.get("logits", 0) > 0
    fixed = _fp16(fp16_overflow().model, overflow["dir"] / "fixed.onnx", ["attn/Attention"])
    assert _nonfinite_tensors(fixed, feeds) == {}


@pytest.fixture(scope="module")
def a16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    logging.getLogger().setLevel(logging.ERROR)
    d = tmp_path_factory.mktemp("a16")
    fx = transformer()
    fp = d / "fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(d / "inputs.npz", **fx.make_inputs(16, 1))
    cal = fx.make_inputs(16, 0)
    out = {"fp32": fp, "inputs": d / "inputs.npz"}
    for name, act, extra in [
        ("a8", QuantType.QUInt8, {}),
        ("a16", QuantType.QUInt16, {}),
        ("q16", QuantType.QInt16, {}),
        (
            "mix",
            QuantType.QUInt8,
            {"TensorQuantOverrides": {fx.expected.outlier_tensor: [{"quant_type": QuantType.QUInt16}]}},
        ),
    ]:
        out[name] = d / f"{name}.onnx"
        quantize_static(
            fp,
            out[name],
            _ArrayReader(cal),
            quant_format=QuantFormat.QDQ,
            activation_type=act,
            weight_type=QuantType.QInt16 if name == "q16" else QuantType.QInt8,
            extra_options=extra,
        )
    return out


def test_sixteen_bit_activations_are_detected(a16: dict[str, Path]) -> None:
    assert model_from_path(a16["a8"]).format.kind == "qdq"
    assert model_from_path(a16["a16"]).format.kind == "qdq-a16w8"
    assert model_from_path(a16["q16"]).format.kind == "qdq16"
    mix = model_from_path(a16["mix"]).format
    assert (mix.kind, mix.family) == ("mixed", "qdq")
    assert mix.precisions["a16w8"] == [transformer().expected.culprit_node]


def test_eight_bit_outlier_is_ranked_first_and_remedied_with_16_bit_override(a16: dict[str, Path]) -> None:
    feeds = FeedSpec(inputs=str(a16["inputs"]))
    r8 = compare_models(a16["fp32"], a16["a8"], feeds, CompareOptions(effects=0))
    culprit = transformer().expected
    ranked = sorted((f for f in r8.findings if f.local is not None), key=lambda f: f.local.sqnr_db)
    assert ranked[0].group.label == culprit.culprit_node
    text = [s.python for s in r8.suggestions if s.tensor == culprit.outlier_tensor]
    assert any('"TensorQuantOverrides"' in t and "QInt16" in t for t in text)
    # The same model with that tensor promoted to 16 bits: matched, and its local error gone.
    r16 = compare_models(a16["fp32"], a16["mix"], feeds, CompareOptions(effects=0))
    assert r16.matching.coverage > 0.95
    mm = next(f for f in r16.findings if f.group.label == culprit.culprit_node)
    assert mm.local.sqnr_db > ranked[0].local.sqnr_db + 10
    # Grid statistics read the 16-bit grid: 16 bits, most of them used.
    health = r16.health[culprit.outlier_tensor]
    assert health.grid_bits == 16 and health.effective_bits > 14
    assert r8.health[culprit.outlier_tensor].grid_bits == 8
    assert not [s for s in r16.suggestions if s.tensor == culprit.outlier_tensor]  # 16 bits suffice


def test_fp16_range_counts_overflow_subnormal_and_flushed_values() -> None:
    from diag.core.fp16 import Fp16Range

    r = Fp16Range()
    r.update(np.array([65519.0, 65520.0, -7e4, 1e-5, 1e-8, 0.0, 1.0], np.float32))
    other = Fp16Range()
    other.update(np.array([np.inf, 2e5], np.float32))
    r.merge(other)
    assert (r.overflow, r.subnormal, r.flushed, r.count) == (3, 2, 1, 8)
    assert r.peak == 2e5


def test_fp16_recipe_converts_and_is_read_back_and_linted(overflow: dict[str, Path]) -> None:
    from diag.core.recipe import Recipe
    from diag.fix.infer import infer_recipe
    from diag.fix.lint import lint_recipe
    from diag.fix.quantize import quantize_model

    recipe = Recipe(mode="fp16", keep_io_types=True, node_block_list=["attn/Attention"])
    out = overflow["dir"] / "recipe.fp16.onnx"
    report = quantize_model(overflow["fp32"], recipe, out)
    assert report.format == "mixed"
    assert infer_recipe(out).recipe == {"mode": "fp16", "keep_io_types": True, "node_block_list": ["attn/Attention"]}
    assert _nonfinite_tensors(out, dict(np.load(overflow["inputs"]))) == {}
    model = onnx.load(overflow["fp32"])
    codes = [
        (f.code, f.where)
        for f in lint_recipe({"mode": "fp16", "node_block_list": ["attn/Atention"], "per_channel": True}, model)
    ]
    assert ("unknown-node", "node_block_list 'attn/Atention'") in codes
    assert ("contradiction", "per_channel") in codes


def test_fp16_fix_snippet_run_as_is_removes_nonfinite_values(overflow: dict[str, Path], tmp_path: Path) -> None:
    from diag.cli.verbs import diagnose
    from diag.report.view import fix_snippet

    r = diagnose(
        overflow["fp32"], overflow["fp16"], FeedSpec(inputs=str(overflow["inputs"])), CompareOptions(effects=0)
    )
    assert r.single_cause and "attn/Attention" in r.cause_sentence
    code = fix_snippet("fp16", ["attn/Attention"], r.fix_recipe, str(overflow["fp32"]), str(tmp_path / "m.onnx"))
    exec(compile(code, "snippet", "exec"), {})  # plain onnxruntime, as a user would paste it
    assert _nonfinite_tensors(tmp_path / "m.fixed.onnx", dict(np.load(overflow["inputs"]))) == {}


def test_mixed_qdq_recipe_is_read_back_with_its_16_bit_override(a16: dict[str, Path], tmp_path: Path) -> None:
    from diag.core.recipe import Recipe
    from diag.fix.infer import infer_recipe
    from diag.fix.quantize import quantize_model

    inferred = infer_recipe(a16["mix"]).recipe
    tensor = transformer().expected.outlier_tensor
    assert inferred["activation_type"] == "QUInt8"
    assert inferred["extra_options"]["TensorQuantOverrides"] == {tensor: [{"quant_type": "QUInt16"}]}
    out = tmp_path / "again.onnx"
    quantize_model(a16["fp32"], Recipe.from_dict(inferred), out, FeedSpec(inputs=str(a16["inputs"])))
    assert model_from_path(out).format.precisions == model_from_path(a16["mix"]).format.precisions


def test_fp8_qdq_model_is_detected_compared_and_its_recipe_read_back(tmp_path: Path) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from diag.fix.infer import infer_recipe
    from diag.fix.lint import lint_recipe
    from diag.fixtures.precision_models import fp8_mlp

    logging.getLogger().setLevel(logging.ERROR)
    fx = fp8_mlp()
    fp, q8 = tmp_path / "fp32.onnx", tmp_path / "fp8.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp_path / "inputs.npz", **fx.make_inputs(8, 1))
    quantize_static(
        fp,
        q8,
        _ArrayReader(fx.make_inputs(16, 0)),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QFLOAT8E4M3FN,
        weight_type=QuantType.QFLOAT8E4M3FN,
        calibrate_method=CalibrationMethod.Distribution,
    )
    fmt = model_from_path(q8).format
    assert (fmt.kind, fmt.family) == ("qdq-fp8", "qdq")
    assert fmt.precisions["af8wf8"] == ["fc1/MatMul", "head/MatMul"]
    r = compare_models(fp, q8, FeedSpec(inputs=str(tmp_path / "inputs.npz")), CompareOptions(effects=0))
    m = r.matching
    assert len(m.pairs) + len(m.fused_away) == len(m.fp_float_tensors)  # MatMul+Relu: one QDQ output
    assert r.health["fc1/Relu_out"].grid == "none"  # no integer grid to count levels of
    assert {w.dtype for w in r.weights.findings} == {"float8_e4m3fn"}
    recipe = infer_recipe(q8).recipe
    assert (recipe["activation_type"], recipe["calibrate_method"]) == ("QFLOAT8E4M3FN", "Distribution")
    bad = lint_recipe({"activation_type": "QFLOAT8E4M3FN", "weight_type": "QFLOAT8E4M3FN"})
    assert [(f.code, f.where) for f in bad] == [("contradiction", "activation_type")]


def test_exclude_with_an_fp16_recipe_writes_a_reproduce_script_that_rebuilds_the_model(
    overflow: dict[str, Path], tmp_path: Path
) -> None:
    import subprocess
    import sys

    from diag.cli.verbs import exclude_to_dir
    from diag.core.recipe import Recipe
    from diag.fix.exclude import ExcludeOptions

    recipe = Recipe(mode="fp16", keep_io_types=True, node_block_list=["attn/Attention"])
    assert recipe.with_excluded(["o/MatMul"]).node_block_list == ["attn/Attention", "o/MatMul"]
    feeds = FeedSpec(inputs=str(overflow["inputs"]))
    exclude_to_dir(
        overflow["fp32"], recipe, feeds, ExcludeOptions("cosine>=0.999", bench_runs=1, progress=False), tmp_path
    )
    script = (tmp_path / "reproduce.py").read_text()
    assert "convert_float_to_float16" in script and "import diag" not in script and "from diag" not in script
    subprocess.run([sys.executable, str(tmp_path / "reproduce.py")], check=True, cwd=Path.cwd())
    built = {p.name: onnx.load(p).graph for p in tmp_path.glob("*.onnx")}
    assert built["fp32.mixed.onnx"] == built["fp32.reproduced.onnx"]


def test_fp16_diag_json_follows_the_shipped_schema(overflow: dict[str, Path], tmp_path: Path) -> None:
    import json

    from diag.cli.verbs import compare_to_dir
    from diag.report.documents import validate_document

    feeds = FeedSpec(inputs=str(overflow["inputs"]))
    compare_to_dir(overflow["fp32"], overflow["fp16"], feeds, tmp_path, CompareOptions(effects=0, progress=False))
    doc = json.loads((tmp_path / "diag.json").read_text())
    validate_document(doc, "diag.json")  # the shipped schema, as diag check / report / merge read it
    assert doc["models"]["int8"]["format"] == "fp16"
    assert doc["fp16"]["fix"]["node_block_list"] == ["attn/Attention"]
    assert doc["fp16"]["ranges"]["q/MatMul_out"]["overflow"] == 0
