"""Unmatched tensors summarised in one sentence per cause, in the producer's name (issue 43 item 7).

AMD Quark folds each BatchNormalization into the Conv before it and drops Reshapes a graph does not
need; diag listed one reason per tensor. Now each unmatched tensor carries a typed cause
(:class:`diag.core.match.UnmatchedCause`: fused, folded, renamed, identity, missing, shape), diag.json groups
them (``matching.unmatched_causes``) and the terminal, summary.md and report.html say one sentence
per group. Ground truth: a Conv → BatchNormalization → Reshape → Reshape → MatMul model, and its
Quark-shaped INT8 version built here: BN folded into the Conv (which then writes the BN's output,
as Quark's folding leaves it), the first Reshape removed, quantized with onnxruntime (static QDQ),
producer name ``quark.onnx``. Its outputs equal the FP32 model's before quantization (checked).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from brief_text import summary_brief, terminal_brief
from cli_run import run_cli
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from diag.core.match import UnmatchedCause, match_models


class _Reader(CalibrationDataReader):
    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows = iter([{"x": r} for r in rows])

    def get_next(self) -> dict | None:
        return next(self.rows, None)


def _model(nodes: list, **weights: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _quark_pair(folder: Path) -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    s, b = rng.uniform(0.5, 2, 4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    mean, var = rng.standard_normal(4).astype(np.float32) * 0.1, rng.uniform(0.5, 2, 4).astype(np.float32)
    fc = rng.standard_normal((256, 10)).astype(np.float32) * 0.1
    shape_a, shape_b = np.array([1, 16, 16], np.int64), np.array([1, 256], np.int64)
    fp32 = _model(
        [
            helper.make_node("Conv", ["x", "w"], ["conv_out"], "conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["conv_out", "s", "b", "m", "v"], ["bn_out"], "bn"),
            helper.make_node("Reshape", ["bn_out", "shape_a"], ["r1_out"], "r1"),
            helper.make_node("Reshape", ["r1_out", "shape_b"], ["r2_out"], "r2"),
            helper.make_node("MatMul", ["r2_out", "fc"], ["y"], "fc"),
        ],
        w=w, s=s, b=b, m=mean, v=var, shape_a=shape_a, shape_b=shape_b, fc=fc,
    )  # fmt: skip
    k = s / np.sqrt(var + 1e-5)
    folded = _model(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["bn_out"], "conv", pads=[1, 1, 1, 1]),
            helper.make_node("Reshape", ["bn_out", "shape_b"], ["r2_out"], "r2"),
            helper.make_node("MatMul", ["r2_out", "fc"], ["y"], "fc"),
        ],
        w=w * k[:, None, None, None], b=b - mean * k, shape_b=shape_b, fc=fc,
    )  # fmt: skip
    x = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    paths = folder / "fp32.onnx", folder / "folded.onnx", folder / "quark.onnx", folder / "x.npz"
    onnx.save(fp32, paths[0])
    onnx.save(folded, paths[1])
    run = [ort.InferenceSession(str(p)).run(None, {"x": x[:1]})[0] for p in paths[:2]]
    assert np.abs(run[0] - run[1]).max() < 1e-4  # the folding keeps the function
    quantize_static(
        str(paths[1]), str(paths[2]), _Reader([x[i : i + 1] for i in range(8)]), quant_format=QuantFormat.QDQ
    )
    q = onnx.load(str(paths[2]))
    q.producer_name = "quark.onnx"
    onnx.save(q, paths[2])
    np.savez(paths[3], x=x)
    return paths[0], paths[2], paths[3]


def test_quark_folding_and_a_removed_reshape_are_one_sentence_each_in_quarks_name(tmp_path, capsys):
    fp32, int8, inputs = _quark_pair(tmp_path)
    causes = match_models(onnx.load(str(fp32)), onnx.load(str(int8))).unmatched_causes
    assert causes == {
        "conv_out": UnmatchedCause("folded", "Conv", "BatchNormalization"),
        "r1_out": UnmatchedCause("missing", "Reshape"),
    }
    out = tmp_path / "o"
    code, stdout, _ = run_cli(["compare", fp32, int8, "--inputs", inputs, "--effects", 0, "--out", out], capsys)
    assert code in (0, 3)
    doc = json.loads((out / "diag.json").read_text())
    assert doc["models"]["int8"]["producer"] == "AMD Quark"
    assert doc["matching"]["unmatched_causes"] == [
        {"kind": "folded", "op_type": "Conv", "merged_with": "BatchNormalization", "tensors": ["conv_out"]},
        {"kind": "missing", "op_type": "Reshape", "merged_with": "", "tensors": ["r1_out"]},
    ]
    terminal = terminal_brief(stdout)
    assert (0, "unmatched: 1 Conv output folded with the BatchNormalization after it into one INT8 node by AMD "
               "Quark; compared after the BatchNormalization: conv_out") in terminal  # fmt: skip
    assert (0, "unmatched: 1 Reshape output without an INT8 tensor of the same name: AMD Quark removed or "
               "renamed it: r1_out") in terminal  # fmt: skip
    assert summary_brief((out / "summary.md").read_text()) == terminal


def test_onnxruntime_fusions_group_into_one_sentence_and_name_the_tensors(built, capsys, tmp_path):
    """onnxruntime's QDQ convnet: its three Conv+Relu fusions are one sentence, not three reasons."""
    b = built("convnet")
    out = tmp_path / "o"
    code, stdout, _ = run_cli(
        ["compare", b.fp32, b.int8["qdq"], "--inputs", b.inputs_path, "--effects", 0, "--out", out], capsys
    )
    assert code == 0
    m = match_models(onnx.load(str(b.fp32)), onnx.load(str(b.int8["qdq"])))
    assert set(m.unmatched_causes.values()) == {UnmatchedCause("fused", "Conv", "Relu")}
    assert sorted(m.fused_away) == sorted(m.unmatched_tensors) == ["conv1_out", "conv2_out", "conv3_out"]
    lines = [t for _, t in terminal_brief(stdout) if t.startswith("unmatched: ")]
    assert lines == [
        "unmatched: 3 Conv outputs fused with the Relu after them into one INT8 node by onnxruntime; compared "
        "after the Relu: conv1_out, conv2_out, conv3_out"
    ]


def test_a_tensor_whose_shape_differs_at_run_time_is_called_a_tensor_not_a_graph_input():
    """A run-time shape mismatch has no op type recorded: it is worded as tensors (review finding)."""
    from diag.analysis.headline import plain
    from diag.report.brief import unmatched_lines

    shape = {"kind": "shape", "op_type": "", "merged_with": "", "tensors": ["a", "b"]}
    missing = {"kind": "missing", "op_type": "", "merged_with": "", "tensors": ["ids"]}
    assert [plain(s) for s in unmatched_lines([shape, missing], None)] == [
        "unmatched: 2 tensor(s) whose shape differs in the INT8 model at run time: a, b",
        "unmatched: 1 graph input(s) without an INT8 tensor of the same name: the quantizer removed or renamed it: ids",
    ]


def test_identities_quark_removes_are_said_as_identities_not_as_missing(tmp_path):
    """Quark drops ``x * 1`` and ``x + 0`` (a LayerNorm whose gamma is 1 and beta 0; seen on a real
    Quark 0.13 run): the Div before them then writes the Add's output. The Mul's output is an
    identity's, the Div's is passed on by identities and compared after them; a Mul by 2 stays."""
    rng = np.random.default_rng(1)
    fc = rng.standard_normal((8, 10)).astype(np.float32)
    one, zero, two = np.ones(8, np.float32), np.zeros(8, np.float32), np.full(8, 2.0, np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])
    fp32 = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Div", ["x", "two"], ["div_out"], "div"),
                helper.make_node("Mul", ["div_out", "one"], ["mul_out"], "mul"),
                helper.make_node("Add", ["mul_out", "zero"], ["add_out"], "add"),
                helper.make_node("Mul", ["add_out", "two"], ["scaled"], "scale"),
                helper.make_node("MatMul", ["scaled", "fc"], ["y"], "fc"),
            ],
            "g", [x], [y],
            [numpy_helper.from_array(v, k) for k, v in {"one": one, "zero": zero, "two": two, "fc": fc}.items()],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    quark = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Div", ["x", "two"], ["add_out"], "div"),
                helper.make_node("MatMul", ["add_out", "fc"], ["y"], "fc"),
            ],
            "g", [x], [y],
            [numpy_helper.from_array(two, "two"), numpy_helper.from_array(fc * 2, "fc")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    causes = match_models(fp32, quark).unmatched_causes
    assert causes == {
        "div_out": UnmatchedCause("identity", "Div", "Mul"),
        "mul_out": UnmatchedCause("identity", "Mul"),
        "scaled": UnmatchedCause("missing", "Mul"),  # a Mul by 2 is not an identity
    }
    from diag.analysis.headline import plain
    from diag.report.brief import unmatched_lines

    grouped = [
        {"kind": c.kind, "op_type": c.op_type, "merged_with": c.merged_with, "tensors": [t]} for t, c in causes.items()
    ]
    assert [plain(s) for s in unmatched_lines(grouped, "AMD Quark")][:2] == [
        "unmatched: 1 Div output passed on by an identity Mul (x * 1, x + 0) removed by AMD Quark; compared after "
        "it: div_out",
        "unmatched: 1 Mul output of an identity (x * 1, x + 0), removed by AMD Quark: mul_out",
    ]
