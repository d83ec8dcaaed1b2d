"""4-bit / 8-bit block-wise weights: detection, unpacking, weight error per block, weight_only recipes.

Models are quantized by onnxruntime's own ``MatMulNBitsQuantizer`` (QOperator -> ``MatMulNBits``,
QDQ -> block-wise int4 ``DequantizeLinear``); unpacking is checked against what onnxruntime computes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag.analysis.weights import weight_report
from diag.cli.commands import main
from diag.core.load import detect_format, model_summary
from diag.core.nbits import blocked_weights, unpack_bits
from diag.core.recipe import Recipe
from diag.fix.infer import infer_recipe
from diag.fix.quantize import quantize_model
from diag.fix.weightonly import weight_only_calls
from diag.fixtures.nbits_models import BLOCK, stray_block_mlp
from diag.foundations.errors import DiagError


def nbits_quantize(model: onnx.ModelProto, out: Path, bits: int = 4, fmt: str = "QOperator", **kw: object) -> Path:
    """Plain onnxruntime: MatMulNBitsQuantizer with its default (RTN) config."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.disable(logging.INFO)
    try:
        q = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), bits=bits,
                                 quant_format=QuantFormat[fmt], **kw)  # fmt: skip
        q.process()
        onnx.save(q.model.model, str(out))
    finally:
        logging.disable(logging.NOTSET)
    return out


@pytest.fixture(scope="module")
def stray(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("nbits")
    fx = stray_block_mlp()
    paths = {"fp32": folder / "fp32.onnx", "inputs": folder / "x.npz"}
    onnx.save(fx.model, paths["fp32"])
    np.savez(paths["inputs"], **fx.make_inputs(32, 1))
    paths["q4"] = nbits_quantize(fx.model, folder / "q4.onnx", block_size=BLOCK)
    paths["qdq4"] = nbits_quantize(fx.model, folder / "qdq4.onnx", fmt="QDQ", block_size=BLOCK)
    return paths


def test_unpack_bits_reads_the_low_nibble_first() -> None:
    assert unpack_bits(np.array([[0x21, 0x43]], dtype=np.uint8), 4, 4).tolist() == [[1, 2, 3, 4]]
    assert unpack_bits(np.array([[0xE4]], dtype=np.uint8), 2, 4).tolist() == [[0, 1, 2, 3]]


def test_matmulnbits_and_blocked_int4_models_are_detected_with_their_precision(stray: dict[str, Path]) -> None:
    q4 = onnx.load(str(stray["q4"]))
    assert detect_format(q4).kind == "matmulnbits"
    assert detect_format(q4).evidence == {"MatMulNBits": 3}
    assert detect_format(onnx.load(str(stray["qdq4"]))).kind == "qdq-int4-blocked"
    assert model_summary(stray["q4"]).precision == {"int4 weights (MatMulNBits)": 3}
    inferred = infer_recipe(stray["q4"]).recipe
    assert inferred == {
        "mode": "weight_only",
        "quant_format": "QOperator",
        "bits": 4,
        "block_size": 32,
        "is_symmetric": False,
    }
    assert infer_recipe(stray["qdq4"]).recipe["quant_format"] == "QDQ"


@pytest.mark.parametrize(
    ("bits", "fmt", "symmetric"), [(4, "QOperator", False), (8, "QOperator", True), (4, "QDQ", False)]
)
def test_unpacked_weight_times_input_is_what_onnxruntime_computes(
    tmp_path: Path, bits: int, fmt: str, symmetric: bool
) -> None:
    # K = 40 is not a multiple of the block (32): the last block is padded.
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 6)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21 if fmt == "QDQ" else 17)])
    path = nbits_quantize(model, tmp_path / "q.onnx", bits=bits, fmt=fmt, block_size=32, is_symmetric=symmetric)
    q = onnx.load(str(path))
    arrays = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    [(unpacked, _, _)] = blocked_weights(q, arrays.get)
    assert unpacked is not None and unpacked.levels.shape == (40, 6) and unpacked.bits == bits
    x = rng.standard_normal((3, 40)).astype(np.float32)
    # NOTE: optimizations off: onnxruntime's optimizer fuses DequantizeLinear + MatMul into MatMulNBits,
    # whose kernel may quantize the input to int8 (accuracy_level): not the weight being checked here.
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x.astype(np.float64) @ unpacked.dequantized(), atol=1e-4)


def test_gather_block_quantized_table_is_unpacked_paired_and_inferred(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    table[7, 40] = 30.0  # a stray value in row 7, block of columns 32-63
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed")],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3, 64])],
        [numpy_helper.from_array(table, "emb")],
    )
    fp = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = nbits_quantize(fp, tmp_path / "q.onnx", block_size=32, op_types_to_quantize=("Gather",))
    q = onnx.load(str(path))
    assert detect_format(q).kind == "matmulnbits"
    assert infer_recipe(path).recipe["op_types_to_quantize"] == ["Gather"]
    arrays = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    [(unpacked, _, _)] = blocked_weights(q, arrays.get)
    ids = np.array([[0, 7, 49], [3, 3, 1]])
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    np.testing.assert_allclose(got, unpacked.dequantized().T[ids], atol=1e-6)
    report = weight_report(fp, q)
    assert [(f.fp_name, f.shape) for f in report.findings] == [("emb", (50, 64))]
    assert report.worst_blocks()[0].where() == "row 7 columns 32-63"


@pytest.mark.parametrize("which", ["q4", "qdq4"])
def test_stray_weight_block_is_ranked_first_in_the_weight_table(stray: dict[str, Path], which: str) -> None:
    report = weight_report(onnx.load(str(stray["fp32"])), onnx.load(str(stray[which])))
    assert not report.unmatched
    assert sorted(f.fp_name for f in report.findings) == ["fc0.weight", "fc1.weight", "fc2.weight"]
    worst = report.worst_blocks()
    expected = stray_block_mlp().expected
    assert (worst[0].weight, worst[0].channel, worst[0].block) == ("fc2.weight", expected.outlier_channel, 1)
    assert worst[0].rows == (32, 64)
    assert worst[0].rel_rmse > 2 * worst[1].rel_rmse, "the stray block stands out"
    assert worst[0].levels <= 4, "the other 31 values of the block share a few levels"


def test_static_qint4_per_channel_weights_are_measured(stray: dict[str, Path], tmp_path: Path) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from plain_ort import Rows

    fp = onnx.version_converter.convert_version(onnx.load(str(stray["fp32"])), 21)  # int4 needs opset 21
    onnx.save(fp, tmp_path / "fp32.onnx")
    arrays = dict(np.load(stray["inputs"]))
    out = tmp_path / "q.onnx"
    quantize_static(str(tmp_path / "fp32.onnx"), str(out), Rows(arrays, 8), quant_format=QuantFormat.QDQ,
                    weight_type=QuantType.QInt4, per_channel=True)  # fmt: skip
    report = weight_report(fp, onnx.load(str(out)))
    assert not report.unmatched and len(report.findings) == 3
    assert {(f.dtype, f.symmetric, f.axis) for f in report.findings} == {("int4", True, 1)}


@pytest.mark.parametrize(("which", "fmt"), [("q4", "matmulnbits"), ("qdq4", "qdq-int4-blocked")])
def test_compare_names_the_stray_head_lists_its_worst_block_and_fixes_it_with_matmulnbitsquantizer(
    stray: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str, fmt: str
) -> None:
    import json

    argv = ["compare", str(stray["fp32"]), str(stray[which]), "--inputs", str(stray["inputs"]), "--out", str(tmp_path)]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "root cause: fc2 (MatMul)" in out
    assert "matched 6/6 FP32 float tensors" in out
    assert "worst weight block: fc2.weight column 3 rows 32-63" in out
    doc = json.loads((tmp_path / "diag.json").read_text())
    assert doc["models"]["int8"]["format"] == fmt
    assert doc["recommendation"]["nodes_to_exclude"] == ["fc2"]
    assert doc["weights"]["blocks"][0]["weight"] == "fc2.weight"
    assert 'id="weight-blocks"' in (tmp_path / "report.html").read_text()
    summary = (tmp_path / "summary.md").read_text()
    assert "MatMulNBitsQuantizer(model, bits=4, block_size=32" in summary and "nodes_to_exclude=['fc2']" in summary


def test_exclude_with_a_weight_only_recipe_writes_a_reproduce_py_that_runs_without_diag(
    stray: dict[str, Path], tmp_path: Path
) -> None:
    import json
    import subprocess
    import sys

    recipe = json.dumps({"mode": "weight_only", "bits": 4, "block_size": BLOCK})
    argv = ["exclude", str(stray["fp32"]), "--recipe", recipe, "--inputs", str(stray["inputs"])]
    assert main([*argv, "--target", "cosine>=0.94", "--bench-runs", "0", "--out", str(tmp_path), "--quiet"]) == 0
    assert json.loads((tmp_path / "exclusion.json").read_text())["nodes_to_exclude"] == ["fc2"]
    script = (tmp_path / "reproduce.py").read_text()
    assert "import diag" not in script and "MatMulNBitsQuantizer(model, bits=4" in script
    subprocess.run([sys.executable, str(tmp_path / "reproduce.py")], cwd=Path.cwd(), check=True, capture_output=True)
    again = onnx.load(str(tmp_path / "fp32.reproduced.onnx"))
    assert [n.op_type for n in again.graph.node] == ["MatMulNBits", "Relu", "MatMulNBits", "Relu", "MatMul"]


def test_weight_only_recipe_quantizes_named_nodes_at_8_bits(stray: dict[str, Path], tmp_path: Path) -> None:
    recipe = Recipe(mode="weight_only", bits=4, block_size=32, node_bits={"fc2": 8}, nodes_to_exclude=["fc0"])
    assert [(c["bits"], c["nodes_to_exclude"]) for c in weight_only_calls(recipe)] == [
        (4, ["fc0", "fc2"]),
        (8, ["fc0"]),
    ]
    report = quantize_model(stray["fp32"], recipe, tmp_path / "mixed.onnx")
    assert report.format == "matmulnbits"
    q = onnx.load(str(tmp_path / "mixed.onnx"))
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits") for n in q.graph.node if n.op_type == "MatMulNBits"
    }
    assert bits == {"fc1_Q4": 4, "fc2_Q8": 8}
    assert [n.name for n in q.graph.node if n.op_type == "MatMul"] == ["fc0"]
    assert infer_recipe(tmp_path / "mixed.onnx").recipe["node_bits"] == {"fc2": 8}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"mode": "weight_only", "per_channel": True}, "is not a MatMulNBitsQuantizer argument"),
        ({"mode": "dynamic", "bits": 4}, "only applies to MatMulNBitsQuantizer"),
        ({"mode": "weight_only", "bits": 3}, "is 3"),
        ({"mode": "weight_only", "block_size": 48}, "not a power of 2"),
        ({"mode": "weight_only", "quant_format": "QDQ", "bits": 8}, "4-bit only"),
    ],
)
def test_weight_only_recipe_mistakes_are_bad_recipe(data: dict[str, object], says: str) -> None:
    with pytest.raises(DiagError) as e:
        Recipe.from_dict(data)
    assert e.value.slug == "bad-recipe" and says in str(e.value)


def test_lint_reports_weight_only_settings_onnxruntime_cannot_honour_together() -> None:
    from diag.fix.lint import lint_recipe

    assert lint_recipe({"mode": "weight_only", "bits": 4, "block_size": 32}) == []
    [finding] = lint_recipe({"mode": "weight_only", "quant_format": "QDQ", "bits": 8})
    assert (finding.code, finding.where) == ("contradiction", "quant_format")
    [finding] = lint_recipe({"mode": "weight_only", "per_channel": True})
    assert finding.where == "per_channel" and "MatMulNBitsQuantizer" in finding.message


def test_weight_only_recipe_round_trips_with_only_its_own_keys() -> None:
    r = Recipe.from_dict({"mode": "weight_only", "block_size": 32, "node_bits": {"lm_head": 8}})
    assert r.quant_format == "QOperator", "MatMulNBitsQuantizer's default format"
    assert r.to_dict() == {
        "mode": "weight_only",
        "quant_format": "QOperator",
        "nodes_to_exclude": [],
        "block_size": 32,
        "node_bits": {"lm_head": 8},
    }
    assert Recipe.from_dict(r.to_dict()) == r


def test_accuracy_level_check_names_the_node_fed_by_the_outlier_and_matches_plain_onnxruntime(tmp_path, capsys):
    """accuracy_level 4 quantizes each MatMulNBits input to int8 inside the kernel: the node reading the
    transformer fixture's outlier hidden dimension loses most; the output figure is what two plain
    onnxruntime sessions (accuracy_level 0 and 4) give."""
    import json

    from diag.fixtures.models import build
    from diag.report.documents import validate_document

    fx = build("transformer")
    onnx.save(fx.model, tmp_path / "fp32.onnx")
    x = fx.make_inputs(16, 1)
    np.savez(tmp_path / "x.npz", **x)
    q4 = nbits_quantize(fx.model, tmp_path / "q4.onnx", block_size=32)
    argv = ["compare", str(tmp_path / "fp32.onnx"), str(q4), "--inputs", str(tmp_path / "x.npz"), "--batch", "8"]
    assert main([*argv, "--accuracy-level-check", "4", "--out", str(tmp_path / "out"), "--quiet"]) in (0, 3)
    line = next(x for x in capsys.readouterr().out.splitlines() if "accuracy_level 4 vs 0" in x)
    doc = json.loads((tmp_path / "out" / "diag.json").read_text())
    validate_document(doc, "diag.json")
    check = doc["accuracy_level"]
    assert check["level"] == 4 and check["samples"] == 8
    assert next(iter(check["nodes"])) == fx.expected.culprit_node  # worst first, named as in the FP32 graph
    assert f"worst node {fx.expected.culprit_node}" in line

    def logits(level: int) -> np.ndarray:
        m = onnx.load(str(q4))
        for n in m.graph.node:
            if n.op_type == "MatMulNBits":
                kept = [a for a in n.attribute if a.name != "accuracy_level"]
                del n.attribute[:]
                n.attribute.extend([*kept, helper.make_attribute("accuracy_level", level)])
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {k: v[:8] for k, v in x.items()})[0].astype(np.float64)  # the first 8 samples

    a, b = logits(0), logits(4)
    expected = 10 * np.log10((a * a).sum() / ((b - a) ** 2).sum())
    assert check["outputs"]["logits"] == pytest.approx(expected, abs=1e-3)
    assert 10 < expected < 60, "the int8 inputs cost something, and not everything"
    # a model without MatMulNBits: one line, before any work
    dyn = tmp_path / "dyn.onnx"
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(tmp_path / "fp32.onnx", dyn, weight_type=QuantType.QUInt8)
    argv[2] = str(dyn)
    assert main([*argv, "--accuracy-level-check", "4", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("diag: error[bad-option]: --accuracy-level-check | needs MatMulNBits nodes") and "\n" not in err
    )
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("short", [0, 3])
def test_unpack_bits_matches_a_value_by_value_reading_of_the_bytes(bits, short):
    """The 4-bit fast path (uint8 nibble planes) and the general path read bytes as MatMulNBits
    stores them: value j of a row is bits ``(j % per_byte) * bits`` of byte ``j // per_byte``."""

    packed = np.random.default_rng(bits).integers(0, 256, (7, 5, 16), dtype=np.uint8)
    per_byte = 8 // bits
    count = 16 * per_byte - short
    want = np.zeros((7, 5, count), np.int64)
    for j in range(count):
        want[..., j] = (packed[..., j // per_byte] >> ((j % per_byte) * bits)) & ((1 << bits) - 1)
    got = unpack_bits(packed, bits, count)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert np.array_equal(unpack_bits(packed, bits, count, np.int16), want)
