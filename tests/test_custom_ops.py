"""Models with custom ops (issue 43 item 5): ``--custom-op-library`` on every verb, other domains' Q/DQ read.

The library is a real one from PyPI: onnxruntime-extensions ships its custom ops (domain
``ai.onnx.contrib``) as a shared library onnxruntime registers with ``register_custom_ops_library``,
as AMD Quark ships ``com.amd.quark`` Extended(De)QuantizeLinear. Quark's own library does not
install here, so its Q/DQ are checked as read (inspect, format) on a Quark-shaped graph.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnx import TensorProto, helper
from onnxruntime.quantization import quantize_dynamic

from diag.fixtures import models, quantize


@pytest.fixture(scope="module")
def contrib(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An MLP with onnxruntime-extensions' NegPos between its MatMuls, and its quantize_dynamic model."""
    import onnxruntime_extensions

    d = tmp_path_factory.mktemp("contrib")
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [16, 32], rng.standard_normal((16, 32)).astype(np.float32).ravel())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [32, 4], rng.standard_normal((32, 4)).astype(np.float32).ravel())
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("NegPos", ["h"], ["neg", "pos"], name="negpos", domain="ai.onnx.contrib"),
        helper.make_node("MatMul", ["pos", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "contrib",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[w1, w2],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), d / "fp32.onnx")
    quantize_dynamic(str(d / "fp32.onnx"), str(d / "int8.onnx"))
    np.savez(d / "x.npz", x=rng.standard_normal((16, 16)).astype(np.float32))
    return {
        "dir": d,
        "fp32": d / "fp32.onnx",
        "int8": d / "int8.onnx",
        "x": d / "x.npz",
        "lib": Path(onnxruntime_extensions.get_library_path()),
    }


def test_without_the_library_compare_names_the_op_and_the_flag(contrib, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DIAG_CUSTOM_OP_LIBRARIES", "")
    code, _, err = run_cli(
        ["compare", contrib["fp32"], contrib["int8"], "--inputs", contrib["x"], "--out", contrib["dir"] / "no"], capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "error[invalid-model]" in err and "uses the custom op ai.onnx.contrib:NegPos" in err
    assert "diag --custom-op-library PATH" in err and not (contrib["dir"] / "no").exists()


@pytest.mark.parametrize("where", ["verb", "global"])
def test_the_library_registered_on_the_command_line_runs_every_session(contrib, capsys, monkeypatch, where) -> None:
    monkeypatch.setenv("DIAG_CUSTOM_OP_LIBRARIES", "")  # none; restored after the test (the CLI sets it)
    out = contrib["dir"] / where
    args = ["compare", contrib["fp32"], contrib["int8"], "--inputs", contrib["x"], "--out", out, "--quiet"]
    flag = ["--custom-op-library", contrib["lib"]]
    code, _, err = run_cli([*args, *flag] if where == "verb" else [*flag, *args], capsys)
    assert code in (0, 3), err
    doc = json.loads((out / "diag.json").read_text())
    # The output's figure is plain onnxruntime's, with the same library registered.
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(contrib["lib"]))
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # per-tensor figures: exact mode
    x = np.load(contrib["x"])["x"]
    ref, got = (
        np.concatenate(  # one sample at a time, as diag ran them (dynamic quantization scales each run)
            [
                ort.InferenceSession(str(contrib[k]), so, providers=["CPUExecutionProvider"]).run(None, {"x": r[None]})[
                    0
                ]
                for r in x
            ]
        ).astype(np.float64)
        for k in ("fp32", "int8")
    )
    sqnr = 10 * np.log10((ref**2).sum() / ((got - ref) ** 2).sum())
    assert doc["tensors"]["y"]["accumulated"]["sqnr_db"] == pytest.approx(sqnr, abs=1e-3)
    assert {"fc1", "fc2"} <= {n for node in doc["nodes"] for n in node["fp_nodes"]}


def test_a_library_that_is_not_a_file_is_a_one_line_error(contrib, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DIAG_CUSTOM_OP_LIBRARIES", "")
    code, _, err = run_cli(["inspect", contrib["fp32"], "--custom-op-library", contrib["dir"] / "nope.so"], capsys)
    assert code == 2 and "error[missing-file]: --custom-op-library" in err and len(err.strip().splitlines()) == 1


def _quark_shaped(tmp_path: Path, per_channel: bool = False) -> tuple[models.Fixture, onnx.ModelProto, onnx.ModelProto]:
    """The convnet quantized QDQ by onnxruntime, and the same model as Quark writes it: every Q/DQ
    a com.amd.quark Extended(De)QuantizeLinear (the FP32 model is saved as ``fp32.onnx``)."""
    fx = models.convnet()
    onnx.save(fx.model, tmp_path / "fp32.onnx")
    calibration = fx.make_inputs(8, 1)
    quantize.quantize(tmp_path / "fp32.onnx", tmp_path / "qdq.onnx", "qdq", calibration, per_channel=per_channel)
    ort_model = onnx.load(str(tmp_path / "qdq.onnx"))
    quark = onnx.load(str(tmp_path / "qdq.onnx"))
    for n in quark.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            n.op_type, n.domain = f"Extended{n.op_type}", "com.amd.quark"
    quark.opset_import.append(helper.make_opsetid("com.amd.quark", 1))
    return fx, ort_model, quark


def test_quarks_extended_qdq_is_read_as_qdq_and_the_missing_library_is_named(tmp_path, capsys, monkeypatch) -> None:
    """A Quark-shaped model: onnxruntime's QDQ convnet with Quark's com.amd.quark Extended(De)QuantizeLinear."""
    monkeypatch.setenv("DIAG_CUSTOM_OP_LIBRARIES", "")  # none; restored after the test (the CLI sets it)
    _, _, m = _quark_shaped(tmp_path)
    count = sum(n.domain == "com.amd.quark" for n in m.graph.node)
    onnx.save(m, tmp_path / "quark.onnx")
    code, out, _ = run_cli(["inspect", tmp_path / "quark.onnx"], capsys)
    assert code == 0
    assert "format:     qdq  (com.amd.quark:ExtendedDequantizeLinear x" in out
    assert f"({count} quantization ops" in out
    assert (
        "problem:    custom op domains ['com.amd.quark']" in out
        and "(0 registered; pass it with diag --custom-op-library" in out
    )
    code, _, err = run_cli(
        ["compare", tmp_path / "fp32.onnx", tmp_path / "quark.onnx", "--random", "--out", tmp_path / "o"], capsys
    )
    assert code == 2 and "uses the custom op com.amd.quark:Extended" in err and "libcustom_ops.so" in err


def test_quarks_extended_qdq_pairs_as_onnxruntimes_qdq_without_the_library(tmp_path) -> None:
    """Pairing reads Quark's Extended Q/DQ as Q/DQ: the same FP32 tensors pair with the same INT8
    tensors as in the onnxruntime model the Quark-shaped one was made from (no library needed to read)."""
    from diag.core.match import match_models

    fx, ort_model, quark = _quark_shaped(tmp_path)
    theirs, ours = match_models(fx.model, ort_model), match_models(fx.model, quark)
    assert {k: (p.how, p.int8_name) for k, p in ours.pairs.items()} == {
        k: (p.how, p.int8_name) for k, p in theirs.pairs.items()
    }
    assert sum(p.how == "qdq" for p in ours.pairs.values()) >= 5


def test_quarks_extended_qdq_weights_are_in_the_weight_table(tmp_path) -> None:
    """Issue 43 item 2: Quark's Extended DequantizeLinear of an integer weight is a quantized weight,
    read without the library (numpy only): the same table, figure for figure, as the onnxruntime QDQ
    model the Quark-shaped one was made from, with per-channel weights (an axis) too."""
    from diag.analysis.weights import weight_report

    fx, ort_model, quark = _quark_shaped(tmp_path, per_channel=True)
    theirs, ours = weight_report(fx.model, ort_model), weight_report(fx.model, quark)
    rows = [(f.fp_name, f.int8_name, f.axis, f.sqnr_db, f.is_bias) for f in ours.findings]
    assert rows == [(f.fp_name, f.int8_name, f.axis, f.sqnr_db, f.is_bias) for f in theirs.findings]
    assert sum(1 for f in ours.findings if not f.is_bias and f.axis is not None) >= 3  # every Conv, per channel
    assert ours.unmatched == theirs.unmatched


def test_the_library_does_not_outlive_the_test_that_registered_it() -> None:
    """The CLI sets DIAG_CUSTOM_OP_LIBRARIES for its process; the tests above restore it, so every
    later test's sessions run without the extensions library (as a user's would)."""
    import os

    assert not os.environ.get("DIAG_CUSTOM_OP_LIBRARIES")
