"""Models onnxruntime runs are diagnosed: onnx.checker's stricter findings become warnings.

And `diag inspect` reports only real problems: an imported but unused domain needs no library,
an unnamed Constant needs no name; an unnamed *quantizable* node does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_run import run_cli
from onnx import helper

from diag.fixtures import models
from diag.foundations.errors import OK, USER_ERROR


@pytest.fixture(scope="module")
def subgraph_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """An If-with-LSTMs model and its quantize_dynamic(EnableSubgraph=True) version, plus inputs."""
    from onnxruntime.quantization import quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)
    d = tmp_path_factory.mktemp("subgraph")
    fx = models.if_lstm_model()
    fp32, int8 = d / "if_lstm.fp32.onnx", d / "if_lstm.int8.onnx"
    onnx.save(fx.model, fp32)
    quantize_dynamic(fp32, int8, extra_options={"EnableSubgraph": True})
    x = fx.make_inputs(6)["x"]  # [steps, batch, hidden]: the sample axis is 1, so one feed file each
    inputs = d / "inputs"
    inputs.mkdir()
    for i in range(x.shape[1]):
        np.savez(inputs / f"{i}.npz", x=x[:, i : i + 1])
    return fp32, int8, inputs


def test_enable_subgraph_int8_model_fails_onnx_checker_but_runs_in_onnxruntime(subgraph_pair):
    import onnxruntime as ort

    _, int8, _ = subgraph_pair
    with pytest.raises(onnx.checker.ValidationError, match=r"No opset import for domain 'com\.microsoft'"):
        onnx.checker.check_model(onnx.load(str(int8)))
    sess = ort.InferenceSession(str(int8), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.ones((4, 1, 8), np.float32)})[0].shape == (4, 1, 1, 8)


def test_enable_subgraph_dynamic_model_with_if_is_compared_not_refused(subgraph_pair, tmp_path, capsys):
    fp32, int8, inputs = subgraph_pair
    out = tmp_path / "out"
    code, stdout, err = run_cli(["compare", fp32, int8, "--inputs", inputs, "--out", out, "--quiet"], capsys)
    assert code == OK, err
    assert (
        stdout.startswith("verdict: ")
        and (
            "\n  warning: onnx.checker rejects INT8 model 'if_lstm.int8.onnx' "
            "(No opset import for domain 'com.microsoft'); onnxruntime loads it, so diag goes on\n"
        )
        in stdout
    )
    assert "output y: " in stdout and "6 samples" in stdout  # graded (by cosine: an LSTM output is no class scores)
    doc = json.loads((out / "diag.json").read_text())
    assert doc["models"]["fp32"]["warnings"] == []
    assert "No opset import for domain 'com.microsoft'" in doc["models"]["int8"]["warnings"][0]
    assert "warning: onnx.checker rejects INT8 model" in (out / "summary.md").read_text()
    assert 'id="model-warning"' in (out / "report.html").read_text()
    # `diag report` re-renders the warning from diag.json alone.
    code, _, err = run_cli(["report", out / "diag.json", "--out", tmp_path / "again"], capsys)
    assert code == OK, err
    assert "warning: onnx.checker rejects INT8 model" in (tmp_path / "again" / "summary.md").read_text()


def test_inspect_shows_the_checker_finding_as_a_warning(subgraph_pair, capsys):
    _, int8, _ = subgraph_pair
    code, stdout, _ = run_cli(["inspect", int8], capsys)
    assert code == OK
    assert "warning:    onnx.checker rejects model 'if_lstm.int8.onnx'" in stdout
    assert "problems:   none found" in stdout


def test_model_neither_onnx_checker_nor_onnxruntime_loads_is_refused(subgraph_pair, tmp_path, capsys):
    fp32, int8, inputs = subgraph_pair
    m = onnx.load(str(int8))
    branch = next(a.g for n in m.graph.node if n.op_type == "If" for a in n.attribute)
    branch.node[0].op_type = "NoSuchLSTM"
    bad = tmp_path / "bad.int8.onnx"
    onnx.save(m, bad)
    code, _, err = run_cli(["compare", fp32, bad, "--inputs", inputs, "--out", tmp_path / "o"], capsys)
    assert code == USER_ERROR
    assert err.startswith("diag: error[invalid-model]: INT8 model '")
    assert "fails onnx.checker (No opset import for domain 'com.microsoft')" in err
    assert "onnxruntime cannot load it" in err
    assert not (tmp_path / "o").exists()


def _mlp(tmp_path: Path, name: str, mutate) -> Path:
    fx = models.spread_mlp(layers=2, width=8)
    m = fx.model
    mutate(m)
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, path)
    return path


def test_inspect_ignores_an_imported_domain_no_node_uses(tmp_path, capsys):
    path = _mlp(tmp_path, "unused", lambda m: m.opset_import.append(helper.make_opsetid("com.unused", 1)))
    code, stdout, _ = run_cli(["inspect", path], capsys)
    assert code == OK
    assert "com.unused 1" in stdout  # listed among the opsets ...
    assert "custom op domains" not in stdout  # ... but not a problem


def test_inspect_flags_a_domain_a_node_uses_that_onnxruntime_lacks(tmp_path, capsys):
    def mutate(m: onnx.ModelProto) -> None:
        m.opset_import.append(helper.make_opsetid("com.vendor", 1))
        m.graph.node[1].op_type, m.graph.node[1].domain = "FancyRelu", "com.vendor"

    code, stdout, _ = run_cli(["inspect", _mlp(tmp_path, "custom", mutate)], capsys)
    assert code == OK
    assert "problem:    custom op domains ['com.vendor'] (ops FancyRelu): onnxruntime needs their library" in stdout


def test_inspect_ignores_unnamed_constants_but_flags_an_unnamed_matmul(tmp_path, capsys):
    def constant(m: onnx.ModelProto) -> None:
        c = helper.make_node("Constant", [], ["unused_c"], value=onnx.numpy_helper.from_array(np.float32(1)))
        m.graph.node.insert(0, c)  # no name, like many exporters write them

    code, stdout, _ = run_cli(["inspect", _mlp(tmp_path, "const", constant)], capsys)
    assert code == OK
    assert "without a name" not in stdout

    def matmul(m: onnx.ModelProto) -> None:
        m.graph.node[0].name = ""

    code, stdout, _ = run_cli(["inspect", _mlp(tmp_path, "unnamed", matmul)], capsys)
    assert "problem:    1 quantizable node(s) without a name (MatMul): nodes_to_exclude cannot refer to them" in stdout


def test_enable_subgraph_if_model_with_matmul_branches_is_compared(tmp_path, capsys):
    """The brief's case: If branches holding MatMuls. With onnx 1.23 / onnxruntime 1.32 this model passes
    onnx.checker (no com.microsoft op lands in the branches); it must be compared like any other."""
    from onnxruntime.quantization import quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)
    fx = models.build("if_model")
    fp32, int8 = tmp_path / "if.fp32.onnx", tmp_path / "if.int8.onnx"
    onnx.save(fx.model, fp32)
    quantize_dynamic(fp32, int8, extra_options={"EnableSubgraph": True})
    if_node = next(n for n in onnx.load(str(int8)).graph.node if n.op_type == "If")
    branch_ops = {n.op_type for a in if_node.attribute for n in a.g.node}
    assert "MatMulInteger" in branch_ops  # the branches really were quantized
    np.savez(tmp_path / "x.npz", **fx.make_inputs(8))
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        ["compare", fp32, int8, "--inputs", tmp_path / "x.npz", "--out", out, "--quiet"], capsys
    )
    assert code == OK, err
    assert "verdict: " in stdout and "8 samples" in stdout  # after any warning line (CPU-dependent)
