"""Hostile and broken inputs (issue 8), run through the real CLI.

One table row per broken input: the command, the expected slug, exit code and message fragment.
Every row also checks that the error is one line without a traceback, that ``--out`` holds no
half-written file and that no input file was modified (hashes before and after). Unusual but
valid models must succeed and say the right thing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_run import run_cli
from onnx import TensorProto, helper, numpy_helper

from diag.fixtures import models, quantize
from diag.foundations.errors import INTERRUPTED, OK, USER_ERROR
from diag.report.nodedata import OVERLAYS
from diag.report.view import md_code

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_hashes(folder: Path) -> dict[str, str]:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and os.access(p, os.R_OK)]  # skips locked.onnx
    return {str(p.relative_to(folder)): _sha(p) for p in files}


# ---------------------------------------------------------------- tiny models built in code


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _model(nodes: list[onnx.NodeProto], inputs: list, outputs: list, inits: list, opsets: dict | None = None):
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, initializer=inits)
    ops = [helper.make_opsetid(d, v) for d, v in (opsets or {"": 17}).items()]
    model = helper.make_model(graph, opset_imports=ops)
    model.ir_version = 8
    return model


def mlp(
    hidden: int = 8,
    names: tuple[str, str] = ("fc1", "fc2"),
    tensor: str = "h",
    outlier: bool = True,
    seed: int = 0,
) -> onnx.ModelProto:
    """x[batch,8] -> MatMul -> Relu -> MatMul -> y; with ``outlier`` fc2 is the injected root cause.

    Hidden unit 3 of fc1 is scaled x200 and fc2's row 3 /200 (FP32 function unchanged): the
    per-tensor activation scale of fc2's input then crushes every other unit.
    """
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, hidden)) / 3).astype(np.float32)
    w2 = (rng.standard_normal((hidden, 4)) / 3).astype(np.float32)
    if outlier:
        w1[:, 3] *= 200
        w2[3] /= 200
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], [tensor], name=names[0]),
        helper.make_node("Relu", [tensor], [tensor + "_relu"], name="relu"),
        helper.make_node("MatMul", [tensor + "_relu", "w2"], ["y"], name=names[1]),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )


def two_inputs() -> onnx.ModelProto:
    """y = MatMul(x, W) + b_in: two inputs sharing the symbolic batch dim."""
    w = (np.random.default_rng(1).standard_normal((8, 8)) / 3).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"),
        helper.make_node("Add", ["xw", "b_in"], ["y"], name="add"),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("b_in", TensorProto.FLOAT, ["batch", 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(w, "w")],
    )


def _w8(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
    return numpy_helper.from_array((np.random.default_rng(9).standard_normal(shape) / 3).astype(np.float32), name)


@dataclass
class Pair:
    fp32: Path
    int8: Path
    inputs: Path


def _pair(folder: Path, name: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> Pair:
    fp = _save(model, folder / f"{name}.fp32.onnx")
    q = folder / f"{name}.int8.onnx"
    # QUInt8: u8u8 kernels are exact on every CPU (QInt8's u8s8 saturate without VNNI, so which node
    # the outputs suffer from would depend on the CI machine).
    quantize.quantize(fp, q, "dynamic", weight_type="QUInt8")
    np.savez(folder / f"{name}.npz", **feeds)
    return Pair(fp, q, folder / f"{name}.npz")


def _x(n: int = 6, width: int = 8, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every hostile file of the table, built once per module (models quantized by real onnxruntime)."""
    d = tmp_path_factory.mktemp("zoo")
    z: dict[str, object] = {"dir": d}
    z["mlp"] = _pair(d, "mlp", mlp(), {"x": _x()})
    z["two"] = _pair(d, "two", two_inputs(), {"x": _x(), "b_in": _x(seed=4)})

    # FP32 that onnx.checker refuses: an op that does not exist in ai.onnx.
    bad = mlp()
    bad.graph.node[1].op_type = "NoSuchOp"
    z["checker_fail"] = _save(bad, d / "checker_fail.onnx")

    # FP32 that passes onnx.checker but onnxruntime refuses: Add of float and int64.
    m = mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.ones((4,), np.int64), "ints"))
    m.graph.node[2].output[0] = "y0"
    m.graph.node.append(helper.make_node("Add", ["y0", "ints"], ["y"], name="type_clash"))
    onnx.checker.check_model(m)
    z["ort_fail"] = _save(m, d / "ort_fail.fp32.onnx")

    # INT8 whose last op lives in a custom domain onnxruntime has no kernel for.
    q = onnx.load(str(z["mlp"].int8))  # type: ignore[attr-defined]
    last = next(n for n in q.graph.node if "y" in n.output)
    last.output[0] = "y_pre"
    q.graph.node.append(helper.make_node("Requant", ["y_pre"], ["y"], name="acme_requant", domain="com.acme"))
    q.opset_import.append(helper.make_opsetid("com.acme", 1))
    z["custom_int8"] = _save(q, d / "custom.int8.onnx")

    # INT8 whose output has another shape at run time (found by the fuzz test).
    q = onnx.load(str(z["mlp"].int8))  # type: ignore[attr-defined]
    last = next(n for n in q.graph.node if "y" in n.output)
    last.output[0] = "y_half"
    q.graph.node.append(helper.make_node("Concat", ["y_half", "y_half"], ["y"], name="twice", axis=1))
    z["wide_int8"] = _save(q, d / "wide.int8.onnx")

    # INT8 with an absurd weight scale: finite, but the error energy overflows (found by the fuzz test).
    q = onnx.load(str(z["mlp"].int8))  # type: ignore[attr-defined]
    scale = next(t for t in q.graph.initializer if t.name == "w1_scale")
    scale.CopyFrom(numpy_helper.from_array(np.array([-1e30], np.float32), "w1_scale"))
    z["absurd_scale"] = _save(q, d / "absurd_scale.int8.onnx")

    # "INT8" from an unknown quantizer: weight-only DequantizeLinear, no activation quantization.
    m = mlp()
    w1 = numpy_helper.to_array(m.graph.initializer[0])
    scale = np.float32(np.abs(w1).max() / 127)
    q8 = np.clip(np.round(w1 / scale), -127, 127).astype(np.int8)
    del m.graph.initializer[0]
    m.graph.initializer.extend(
        [
            numpy_helper.from_array(q8, "w1_q"),
            numpy_helper.from_array(scale, "w1_scale"),
            numpy_helper.from_array(np.int8(0), "w1_zp"),
        ]
    )
    m.graph.node.insert(0, helper.make_node("DequantizeLinear", ["w1_q", "w1_scale", "w1_zp"], ["w1"], name="dq_w1"))
    z["weight_only"] = _save(m, d / "weight_only.int8.onnx")

    # A Reshape that fails at run time (4 values into rows of 3), after a quantizable MatMul.
    m = mlp()
    m.graph.node[2].output[0] = "y0"
    m.graph.node.append(helper.make_node("Reshape", ["y0", "rows_of_3"], ["y"], name="bad_reshape"))
    m.graph.initializer.append(numpy_helper.from_array(np.array([3, -1], np.int64), "rows_of_3"))
    z["reshape"] = _pair(d, "reshape", m, {"x": _x()})

    # A different FP32 model with the same input and output names: x -> 4 x (MatMul, Relu) -> MatMul -> y.
    nodes, inits, t = [], [], "x"
    for i in range(5):
        width = 4 if i == 4 else 8
        inits.append(_w8(f"deep{i}", (8, width)))
        nodes.append(helper.make_node("MatMul", [t, f"deep{i}"], [f"d{i}" if i < 4 else "y"], name=f"deep{i}"))
        t = f"d{i}"
        if i < 4:
            nodes.append(helper.make_node("Relu", [t], [f"r{i}"], name=f"relu{i}"))
            t = f"r{i}"
    deep = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    z["deep"] = _save(deep, d / "deep.fp32.onnx")

    # FP32 with one more output than its INT8 version.
    m = mlp()
    m.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 8]))
    z["extra_output"] = _save(m, d / "extra_output.fp32.onnx")

    # External data: missing, pointing outside the folder, and a symlink escaping it.
    for case in ("missing", "outside", "absolute", "symlink"):
        sub = d / f"ext_{case}"
        sub.mkdir()
        path = sub / "model.onnx"
        onnx.save(mlp(), str(path), save_as_external_data=True, location="weights.data", size_threshold=0)
        if case == "missing":
            (sub / "weights.data").unlink()
        elif case in ("outside", "absolute"):
            (sub / "weights.data").rename(d / f"secret_{case}.data")
            m = onnx.load(str(path), load_external_data=False)
            for t in m.graph.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = f"../secret_{case}.data" if case == "outside" else str(d / f"secret_{case}.data")
            onnx.save(m, str(path))
        else:
            (sub / "weights.data").rename(d / "elsewhere.data")
            (sub / "weights.data").symlink_to(d / "elsewhere.data")
        z[f"ext_{case}"] = path

    # Resource abuse: a declared 10^6 x 10^6 intermediate (Expand to a constant shape).
    nodes = [
        helper.make_node("Expand", ["x", "big_shape"], ["huge"], name="blow_up"),
        helper.make_node("ReduceSum", ["huge"], ["s"], name="sum", keepdims=0),
        helper.make_node("MatMul", ["x", "w"], ["y0"], name="mm"),
        helper.make_node("Add", ["y0", "s"], ["y"], name="add"),
    ]
    huge = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [
            numpy_helper.from_array(np.array([10**6, 10**6], np.int64), "big_shape"),
            numpy_helper.from_array(np.ones((1, 1), np.float32), "w"),
        ],
    )
    z["huge"] = _pair(d, "huge", huge, {"x": np.ones((2, 1, 1), np.float32)})
    big_in = mlp()
    big_in.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 10**12
    z["big_input"] = _save(big_in, d / "big_input.onnx")

    # Files that are not models.
    (d / "empty.onnx").write_bytes(b"")
    (d / "notes.onnx").write_text("this is not a model\n" * 20)
    data = z["mlp"].fp32.read_bytes()  # type: ignore[attr-defined]
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (d / "a_folder.onnx").mkdir()
    (d / "locked.onnx").write_bytes(data)
    (d / "locked.onnx").chmod(0)
    (d / "a_file").write_text("not a folder\n")

    # Input files that do not fit the models.
    x = _x()
    np.savez(d / "wrong_name.npz", pixels=x)
    np.savez(d / "wrong_dtype.npz", x=x.astype(np.float64))
    np.savez(d / "wrong_shape.npz", x=x[:, :5])
    np.savez(d / "wrong_rank.npz", x=x[:, :, None, None])
    np.savez(d / "extra.npz", x=x, mask=x)
    nan, inf = x.copy(), x.copy()
    nan[1, 2] = np.nan
    inf[0, 0] = np.inf
    np.savez(d / "nan.npz", x=nan)
    np.savez(d / "inf.npz", x=inf)
    np.savez(d / "zero.npz", x=x[:0])
    np.save(d / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(d / "ints.npz", x=np.arange(48).reshape(6, 8))
    np.savez(d / "uneven.npz", x=x, b_in=x[:4])
    batches = d / "batches"
    batches.mkdir()
    np.savez(batches / "000.npz", x=x[:2], b_in=x[:3])
    np.savez(d / "escape_name.npz", **{"\x1b[31mred\x1b[0m": x})

    # --reader factories: one raises, one yields lists, one is not iterable.
    (d / "hostile_readers.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def raises():
                raise RuntimeError("database offline")

            def lists():
                return [[np.zeros((1, 8), np.float32)]]

            def number():
                return 42

            def wrong_dtype():
                return [{"x": np.zeros((1, 8), np.int32)}]
            """
        )
    )
    return z


@dataclass(frozen=True)
class Row:
    """One broken input: CLI args, expected slug, message fragment, exit code."""

    label: str
    args: list[object]
    slug: str
    fragment: str
    code: int = USER_ERROR


def _rows(z: dict[str, object], out: Path) -> list[Row]:
    d: Path = z["dir"]  # type: ignore[assignment]
    p: Pair = z["mlp"]  # type: ignore[assignment]
    two: Pair = z["two"]  # type: ignore[assignment]
    huge: Pair = z["huge"]  # type: ignore[assignment]
    rs: Pair = z["reshape"]  # type: ignore[assignment]

    def cmp(fp: object, q: object, *flags: object) -> list[object]:
        return ["compare", fp, q, *flags, "--out", out, "--quiet"]

    def feed(name: str) -> list[object]:
        return cmp(p.fp32, p.int8, "--inputs", d / name)

    good = ("--inputs", p.inputs)
    return [
        # 1. not a model
        Row("missing path", ["inspect", d / "nope.onnx"], "missing-file", "does not exist"),
        Row("directory", ["inspect", d / "a_folder.onnx"], "not-a-file", "is a directory"),
        Row("empty file", ["inspect", d / "empty.onnx"], "empty-file", "is empty (0 bytes)"),
        Row("text file", ["inspect", d / "notes.onnx"], "not-onnx", "not a readable ONNX model"),
        Row("truncated model", ["inspect", d / "truncated.onnx"], "not-onnx", "not a readable ONNX model"),
        Row("unreadable file", ["inspect", d / "locked.onnx"], "unreadable", "permission denied"),
        Row("special file", ["inspect", "/dev/null"], "not-a-file", "is not a regular file"),
        Row(
            "escape codes in a path",
            ["inspect", d / "\x1b[2Jevil\x07.onnx"],
            "missing-file",
            "/ [2Jevil .onnx' | does not exist",
        ),
        # 2. valid ONNX that fails the checker or onnxruntime (and says which)
        Row("fails onnx.checker", ["inspect", z["checker_fail"]], "invalid-model", "fails onnx.checker"),
        Row(
            "fails in onnxruntime",
            cmp(z["ort_fail"], p.int8, *good),
            "invalid-model",
            "FP32 model '",
        ),
        Row(
            "fails at run time",
            cmp(rs.fp32, rs.int8, "--inputs", rs.inputs),
            "runtime-failure",
            "FP32 model 'reshape.fp32.onnx' | onnxruntime failed at node 'bad_reshape'",
        ),
        # 3. not a pair
        Row("swapped", cmp(p.int8, p.fp32, *good), "swapped-models", "did you swap them?"),
        Row("both fp32", cmp(p.fp32, p.fp32, *good), "not-quantized", "contains no quantized operators"),
        Row("both int8", cmp(p.int8, p.int8, *good), "fp32-is-quantized", "already contains quantized"),
        Row("different inputs", cmp(p.fp32, two.int8, *good), "model-mismatch", "have different inputs"),
        Row(
            "a different model altogether",
            cmp(z["deep"], p.int8, *good),
            "model-mismatch",
            "only 20% of FP32 tensors exist in the INT8 model",
        ),
        Row("different outputs", cmp(z["extra_output"], p.int8, *good), "model-mismatch", "have different outputs"),
        Row(
            "output shape differs at run time",
            cmp(p.fp32, z["wide_int8"], *good),
            "model-mismatch",
            "output 'y' | has shape (1, 4) in the FP32 model but (1, 8) in the INT8 model",
        ),
        # 4. unknown quantizer / custom ops
        Row("weight-only quantizer", cmp(p.fp32, z["weight_only"], *good), "not-quantized", "no quantized"),
        Row("custom-domain op", cmp(p.fp32, z["custom_int8"], *good), "invalid-model", "INT8 model '"),
        # 5. inputs
        Row("missing input name", feed("wrong_name.npz"), "bad-inputs", "has no array for model input 'x'"),
        Row("extra input name", feed("extra.npz"), "bad-inputs", "'mask', which is not a model input"),
        Row("wrong dtype", feed("wrong_dtype.npz"), "bad-inputs", "has dtype float64, model wants float32"),
        Row("integers for floats", feed("ints.npz"), "bad-inputs", "has dtype int64, model wants float32"),
        Row("wrong shape", feed("wrong_shape.npz"), "bad-inputs", "axis 1 must be 8"),
        Row("wrong rank", feed("wrong_rank.npz"), "bad-inputs", "(rank 4), model wants float32[batch,8] (rank 2)"),
        Row(
            "uneven sample counts",
            cmp(two.fp32, two.int8, "--inputs", d / "uneven.npz"),
            "bad-inputs",
            "different sample counts (x: 6, b_in: 4)",
        ),
        Row(
            "batch mismatch between inputs",
            cmp(two.fp32, two.int8, "--inputs", d / "batches"),
            "bad-inputs",
            "has batch=3 but input 'x' has batch=2",
        ),
        Row("zero samples", feed("zero.npz"), "bad-inputs", "zero samples"),
        Row("NaN input", feed("nan.npz"), "bad-inputs", "contains 1 NaN/Inf value(s)"),
        Row("Inf input", feed("inf.npz"), "bad-inputs", "contains 1 NaN/Inf value(s)"),
        Row("pickled npy", feed("pickled.npy"), "bad-inputs", "pickled Python objects"),
        Row("terminal escapes in a name", feed("escape_name.npz"), "bad-inputs", "has no array for model input"),
        Row("missing inputs file", feed("nope.npz"), "missing-file", "does not exist"),
        Row("reader not importable", cmp(p.fp32, p.int8, "--reader", "no_such_mod_xyz:make"), "bad-reader", "import"),
        Row("reader raises", cmp(p.fp32, p.int8, "--reader", "hostile_readers:raises"), "bad-reader", "database off"),
        Row(
            "reader yields lists",
            cmp(p.fp32, p.int8, "--reader", "hostile_readers:lists"),
            "bad-reader",
            "yielded a list, not a dict",
        ),
        Row(
            "reader returns a number",
            cmp(p.fp32, p.int8, "--reader", "hostile_readers:number"),
            "bad-reader",
            "returned a int, not an iterable",
        ),
        Row(
            "reader yields wrong dtype",
            cmp(p.fp32, p.int8, "--reader", "hostile_readers:wrong_dtype"),
            "bad-inputs",
            "has dtype int32, model wants float32",
        ),
        Row("no input source", cmp(p.fp32, p.int8), "bad-option", "exactly one of"),
        Row("zero batch", cmp(p.fp32, p.int8, "--random", "--batch", "0"), "bad-option", "--batch"),
        Row("negative samples", cmp(p.fp32, p.int8, "--random", "--samples", "-3"), "bad-option", "--samples"),
        Row("bad --shape", cmp(p.fp32, p.int8, "--random", "--shape", "x:1x3"), "bad-option", "name=d0,d1"),
        Row("bad --int-range", cmp(p.fp32, p.int8, "--random", "--int-range", "9,1"), "bad-option", "LO < HI"),
        # 8. external data
        Row("missing .data", ["inspect", z["ext_missing"]], "missing-external-data", "which is missing"),
        Row("data outside folder", ["inspect", z["ext_outside"]], "unsafe-external-data", "outside the model's"),
        Row("absolute data path", ["inspect", z["ext_absolute"]], "unsafe-external-data", "outside the model's"),
        Row("symlink escaping", ["inspect", z["ext_symlink"]], "unsafe-external-data", "outside the model's"),
        # 9. output
        Row(
            "--out under a file",
            ["compare", p.fp32, p.int8, *good, "--samples", "2", "--out", d / "a_file" / "sub", "--quiet"],
            "bad-out",
            "cannot be created",
        ),
        Row("bad report json", ["report", d / "notes.onnx", "--out", out], "bad-report", "not readable JSON"),
        # 11. resource abuse
        Row(
            "10^12-element intermediate",
            cmp(huge.fp32, huge.int8, "--inputs", huge.inputs),
            "too-large",
            "'huge' [1000000x1000000]",
        ),
        Row(
            "10^12-element input",
            cmp(z["big_input"], p.int8, "--random"),
            "too-large",
            "FP32 model tensor 'x' | one batch of 1 sample(s) needs at least 3.6 TiB",
        ),
        Row(
            "absurd --samples",
            cmp(p.fp32, p.int8, "--random", "--samples", str(10**11)),
            "too-large",
            "would draw 2,980.2 GiB of random inputs in 100,000,000,000 runs",
        ),
        Row("absurd --batch", cmp(p.fp32, p.int8, "--random", "--batch", str(10**12)), "too-large", "GiB"),
    ]


def test_every_broken_input_gives_one_line_error_with_slug_and_exit_code(zoo, tmp_path, capsys, monkeypatch):
    d: Path = zoo["dir"]  # type: ignore[assignment]
    monkeypatch.syspath_prepend(str(d))
    if ROOT:
        # root reads a chmod-000 file anyway; make the permission check see what a user would.
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda p, m, **kw: False if Path(p).name == "locked.onnx" else real_access(p, m)
        )
    before = _tree_hashes(d)
    out = tmp_path / "o"
    rows = _rows(zoo, out)
    assert len(rows) >= 30
    assert len({r.label for r in rows}) == len(rows)
    failures = []
    for row in rows:
        code, _stdout, err = run_cli(row.args, capsys)
        lines = err.strip().splitlines()
        problems = []
        if code != row.code:
            problems.append(f"exit {code} != {row.code}")
        if len(lines) != 1:
            problems.append(f"{len(lines)} stderr lines")
        elif not lines[0].startswith(f"diag: error[{row.slug}]: "):
            problems.append("wrong slug")
        elif row.fragment not in lines[0] or "Hint: " not in lines[0] or " | " not in lines[0]:
            problems.append("fragment/hint missing")
        if "Traceback" in err or "\x1b" in err:
            problems.append("traceback or escape code in stderr")
        if out.exists() and any(out.iterdir()):
            problems.append(f"--out not empty: {sorted(p.name for p in out.iterdir())}")
        if problems:
            failures.append(f"{row.label}: {'; '.join(problems)}: {err.strip()!r}")
    assert not failures, "\n".join(failures)
    after = _tree_hashes(d)
    changed = {k for k in before if before.get(k) != after.get(k)}
    assert not changed, f"inputs modified: {changed}"


def test_onnxruntime_failure_is_one_line_on_the_real_stderr(zoo, tmp_path):
    """onnxruntime logs kernel failures to the process's stderr itself; diag silences that log."""
    rs: Pair = zoo["reshape"]
    cmd = [sys.executable, "-m", "diag", "compare", rs.fp32, rs.int8, "--inputs", rs.inputs, "--out", tmp_path / "o"]
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)
    assert out.returncode == USER_ERROR
    assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("diag: error[runtime-failure]: FP32 model 'reshape.fp32.onnx' | onnxruntime failed")
    assert not (tmp_path / "o").exists()


def test_debug_flag_shows_the_traceback(tmp_path):
    cmd = [sys.executable, "-m", "diag", "inspect", str(tmp_path / "missing.onnx"), "--debug"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != OK
    assert "Traceback (most recent call last)" in out.stderr
    assert "diag.foundations.errors.DiagError: model '" in out.stderr and "does not exist" in out.stderr


# ---------------------------------------------------------------- unusual but valid models


def _vi(name: str, dtype: int, dims: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, dims)


def _w(name: str, shape: tuple[int, ...], seed: int = 5) -> onnx.TensorProto:
    return numpy_helper.from_array((np.random.default_rng(seed).standard_normal(shape) / 3).astype(np.float32), name)


def _int_model() -> onnx.ModelProto:
    """An integer-only path (int64 Add, output as is) next to a float MatMul."""
    nodes = [
        helper.make_node("Add", ["ids", "ids"], ["ids2"], name="int_add"),
        helper.make_node("Cast", ["ids2"], ["idsf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"),
        helper.make_node("Add", ["xw", "idsf"], ["y"], name="add"),
    ]
    ins = [_vi("x", TensorProto.FLOAT, ["batch", 8]), _vi("ids", TensorProto.INT64, ["batch", 8])]
    outs = [_vi("y", TensorProto.FLOAT, ["batch", 8]), _vi("ids2", TensorProto.INT64, ["batch", 8])]
    return _model(nodes, ins, outs, [_w("w", (8, 8))])


def _zero_size_model() -> onnx.ModelProto:
    """A Slice that yields a [batch, 0] tensor, concatenated back and also a model output."""
    nodes = [
        helper.make_node("Slice", ["x", "zero", "zero", "one"], ["empty"], name="slice_empty"),
        helper.make_node("Concat", ["x", "empty"], ["xc"], name="concat", axis=1),
        helper.make_node("MatMul", ["xc", "w"], ["y"], name="mm"),
    ]
    inits = [
        _w("w", (8, 8)),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    outs = [_vi("y", TensorProto.FLOAT, ["batch", 8]), _vi("empty", TensorProto.FLOAT, ["batch", 0])]
    return _model(nodes, [_vi("x", TensorProto.FLOAT, ["batch", 8])], outs, inits)


def _scalar_output_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("ReduceSum", ["y"], ["total"], name="total_sum", keepdims=0),
    ]
    outs = [_vi("y", TensorProto.FLOAT, [1, 8]), _vi("total", TensorProto.FLOAT, [])]
    return _model(nodes, [_vi("x", TensorProto.FLOAT, [1, 8])], outs, [_w("w", (8, 8))])


def _passthrough_model() -> onnx.ModelProto:
    """Input ``x`` is also a graph output."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    outs = [_vi("y", TensorProto.FLOAT, ["batch", 8]), _vi("x", TensorProto.FLOAT, ["batch", 8])]
    return _model(nodes, [_vi("x", TensorProto.FLOAT, ["batch", 8])], outs, [_w("w", (8, 8))])


def _loop_model() -> onnx.ModelProto:
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["acc_in", "lw"], ["acc_mm"], name="loop/MatMul"),
            helper.make_node("Tanh", ["acc_mm"], ["acc_out"], name="loop/Tanh"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="loop/cond"),
        ],
        "body",
        [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []), _vi("acc_in", TensorProto.FLOAT, None)],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("acc_out", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="pre/MatMul"),
        helper.make_node("Loop", ["trip", "", "xw"], ["looped"], name="the_loop", body=body),
        helper.make_node("MatMul", ["looped", "w2"], ["y"], name="post/MatMul"),
    ]
    inits = [
        _w("w", (8, 8)),
        _w("w2", (8, 8), 6),
        _w("lw", (8, 8), 7),
        numpy_helper.from_array(np.array(3, np.int64), "trip"),
    ]
    return _model(
        nodes, [_vi("x", TensorProto.FLOAT, ["batch", 8])], [_vi("y", TensorProto.FLOAT, ["batch", 8])], inits
    )


def _log_model() -> onnx.ModelProto:
    """MatMul then Log: NaN wherever the MatMul is negative (FP32 and INT8 alike), then MatMul."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"),
        helper.make_node("Log", ["xw"], ["lg"], name="the_log"),
        helper.make_node("MatMul", ["lg", "w2"], ["y"], name="mm2"),
    ]
    ins, outs = [_vi("x", TensorProto.FLOAT, ["batch", 8])], [_vi("y", TensorProto.FLOAT, ["batch", 8])]
    return _model(nodes, ins, outs, [_w("w", (8, 8)), _w("w2", (8, 8), 6)])


def _int8_log_model() -> tuple[onnx.ModelProto, np.ndarray]:
    """Log of a MatMul that is > 0 in FP32 but exactly 0 in INT8: -inf only in the INT8 model.

    Feature 0 is 100 (weight 0) and the others are ~0.05 (weight 1): dynamic quantization's step
    of 100/255 rounds every small feature to 0, so the INT8 MatMul is 0 and its Log is -inf.
    """
    w = np.ones((8, 8), np.float32)
    w[0] = 0
    x = np.full((6, 8), 0.05, np.float32) + np.arange(6, dtype=np.float32)[:, None] * 0.01
    x[:, 0] = 100
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"),
        helper.make_node("Log", ["xw"], ["y"], name="the_log"),
    ]
    ins, outs = [_vi("x", TensorProto.FLOAT, ["batch", 8])], [_vi("y", TensorProto.FLOAT, ["batch", 8])]
    return _model(nodes, ins, outs, [numpy_helper.from_array(w, "w")]), x


HOSTILE_NODE = "<script>alert(1)</script>"
HOSTILE_ROOT = "**bold** | `x` [l](http://e) \x1b[31mred\x1b[0m"
HOSTILE_TENSOR = "<img src=x onerror=alert(2)>"


@dataclass
class Valid:
    """An unusual but valid model: compare must succeed and print / write the right things."""

    label: str
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    stdout: list[str]
    files: Callable[[dict[str, str]], list[str]] = field(default=lambda f: [])


def _doc(files: dict[str, str]) -> dict:
    return json.loads(files["diag.json"])


def _valid_cases() -> list[Valid]:
    log8, x8 = _int8_log_model()
    unnamed = mlp()
    for n in unnamed.graph.node:
        n.name = ""
    if_fx = models.build("if_model")

    def subgraph_listed(node: str, holder: str) -> Callable[[dict[str, str]], list[str]]:
        def check(f: dict[str, str]) -> list[str]:
            m = _doc(f)["matching"]
            reasons = {**m["unmatched_tensors"], **m["unmatched_nodes"], **m["skipped_tensors"]}
            hits = [k for k, why in reasons.items() if node in k and f"inside a subgraph of {holder}" in why]
            return [] if hits else [f"{node} not listed as inside {holder}"]

        return check

    def hostile_files(f: dict[str, str]) -> list[str]:
        html, md = f["report.html"], f["summary.md"]
        bad = []
        for raw in ("<script>alert", "<img src=x", "\x1b"):
            if raw in html:
                bad.append(f"raw {raw!r} in report.html")
        if "&lt;script&gt;alert(1)&lt;/script&gt;" not in html:
            bad.append("escaped <script> node missing from report.html")
        # a name is a code span in summary.md (copied as the model's own name; nothing in it renders)
        if "\x1b" in md or md_code(HOSTILE_ROOT) not in md:
            bad.append("summary.md does not show the root-cause name as a code span")
        if _doc(f)["recommendation"]["nodes_to_exclude"] != [HOSTILE_ROOT]:
            bad.append("diag.json must keep the exact node name for nodes_to_exclude")
        return bad

    def unnamed_files(f: dict[str, str]) -> list[str]:
        rec = _doc(f)["recommendation"]
        bad = (
            [] if rec["nodes_to_exclude"] == [] and rec["unnamed_nodes"] == ["MatMul#0"] else [f"recommendation {rec}"]
        )
        hint = "have no name, so `nodes_to_exclude` cannot refer to them: give every node a name"
        if hint not in f["summary.md"]:
            bad.append("summary.md does not say what to do about the unnamed node")
        if "give every node a name before quantizing" not in f["report.html"]:
            bad.append("report.html does not say what to do about the unnamed node")
        return bad

    return [
        Valid(
            "integer-only tensors",
            _int_model(),
            {"x": _x(), "ids": np.arange(48).reshape(6, 8)},
            # Integer ids are not class scores: graded by cosine, never by an argmax over them.
            ["output ids2: excellent (min per-sample cosine"],
        ),
        Valid("zero-size tensor", _zero_size_model(), {"x": _x()}, ["output empty: excellent", "output y: "]),
        Valid("scalar output", _scalar_output_model(), {"x": _x()[:, None, :]}, ["output total: excellent"]),
        Valid("input is also an output", _passthrough_model(), {"x": _x()}, ["output x: excellent"]),
        Valid(
            "unicode and duplicate-looking names",
            mlp(names=("层1/矩阵乘 ", "层1/矩阵乘"), tensor="h_quantized"),
            {"x": _x(32)},
            # The x200 column of the first MatMul's weights is what the output suffers from: keeping
            # "层1/矩阵乘 " (trailing space) in float removes most of the error, the other one little.
            ["root cause: 层1/矩阵乘  (MatMul)"],
            lambda f: [] if _doc(f)["recommendation"]["nodes_to_exclude"] == ["层1/矩阵乘 "] else ["wrong exclusion"],
        ),
        # The first MatMul's x200 weight column is what the output suffers from (measured effect).
        Valid("unnamed nodes", unnamed, {"x": _x(32)}, ["root cause: MatMul#0 (MatMul)"], unnamed_files),
        Valid("If subgraphs", if_fx.model, if_fx.make_inputs(6), ["output y: "], subgraph_listed("then/MatMul", "If")),
        Valid("Loop subgraph", _loop_model(), {"x": _x()}, ["output y: "], subgraph_listed("loop/MatMul", "Loop")),
        Valid(
            "NaN produced in FP32",
            _log_model(),
            {"x": _x()},
            ["NaN/Inf first produced in the FP32 model by the_log (Log): "],
            lambda f: (
                []
                if "NaN/Inf first produced in the FP32 model by the_log (Log)" in f["report.html"]
                and "NaN/Inf first produced in the FP32 model by `the_log` (Log)" in f["summary.md"]
                else ["the report and summary do not say where NaN first appears"]
            ),
        ),
        Valid(
            "-inf produced only in INT8",
            log8,
            {"x": x8},
            [
                "6 of 6 samples have NaN/Inf in the INT8 output",
                "NaN/Inf first produced in the INT8 model by the_log (Log): 48 value(s) in 'y'",
            ],
        ),
        Valid(
            "hostile names",
            mlp(names=(HOSTILE_ROOT, HOSTILE_NODE), tensor=HOSTILE_TENSOR),
            {"x": _x(32)},
            ["root cause: **bold** | `x` [l](http://e) ?[31mred?[0m (MatMul)"],
            hostile_files,
        ),
    ]


def test_unusual_but_valid_models_are_compared_and_reported(tmp_path, capsys):
    cases = _valid_cases()
    failures = []
    for i, case in enumerate(cases):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        onnx.checker.check_model(case.model)
        pair = _pair(folder, "m", case.model, case.feeds)
        before = _tree_hashes(folder)
        out = folder / "out"
        code, stdout, err = run_cli(
            ["compare", pair.fp32, pair.int8, "--inputs", pair.inputs, "--out", out, "--quiet"], capsys
        )
        problems = [] if code == OK else [f"exit {code}: {err.strip()}"]
        problems += [f"stdout lacks {frag!r}" for frag in case.stdout if frag not in stdout]
        if "\x1b" in stdout:
            problems.append("terminal escape in stdout")
        if code == OK:
            names = sorted(p.name for p in out.iterdir())
            report = {"diag.json", "report.html", "summary.md", *OVERLAYS}  # and error_path.svg when a path is
            if not report <= set(names) <= report | {"error_path.svg"}:
                problems.append(f"--out holds {names}")
            files = {n: (out / n).read_text() for n in ("diag.json", "report.html", "summary.md")}
            problems += case.files(files)
        changed = [k for k, v in before.items() if _tree_hashes(folder).get(k) != v]
        if changed:
            problems.append(f"inputs modified: {changed}")
        if problems:
            failures.append(f"{case.label}: {problems}\n{stdout}")
    assert not failures, "\n".join(failures)


def test_absurd_int8_scale_is_graded_not_crashed(zoo, tmp_path, capsys):
    p: Pair = zoo["mlp"]
    code, stdout, err = run_cli(_compare_args(Pair(p.fp32, zoo["absurd_scale"], p.inputs), tmp_path / "o"), capsys)
    assert code == OK, err
    assert "verdict: REJECT" in stdout and "output y: reject" in stdout
    doc = json.loads((tmp_path / "o" / "diag.json").read_text())
    # The error's squares overflow float32; summed in float64 it is a number, not -inf (issue 42 item 5).
    assert float(doc["verdict"]["outputs"][0]["sqnr_db"]) < -300


def test_inspect_prints_hostile_names_without_terminal_escapes(tmp_path, capsys):
    path = _save(mlp(names=(HOSTILE_ROOT, HOSTILE_NODE)), tmp_path / "m.onnx")
    m = onnx.load(str(path))
    m.graph.output[0].name = "y\x1b]0;pwned\x07"
    m.graph.node[2].output[0] = m.graph.output[0].name
    m.graph.node[1].op_type = "Evil\x1b[2J<b>"
    m.graph.node[1].domain = "com.evil"
    m.opset_import.append(helper.make_opsetid("com.evil", 1))
    _save(m, path)
    code, stdout, _ = run_cli(["inspect", path], capsys)
    assert code == OK
    assert "outputs:    y?]0;pwned?" in stdout
    assert "Evil?[2J<b> 1" in stdout and "custom op domains ['com.evil']" in stdout
    assert "\x1b" not in stdout and "\x07" not in stdout


# ---------------------------------------------------------------- output folder: replace, disk full, Ctrl-C


def _compare_args(p: Pair, out: Path) -> list[object]:
    return ["compare", p.fp32, p.int8, "--inputs", p.inputs, "--out", out, "--quiet"]


def test_existing_report_is_replaced_whole_and_survives_disk_full(zoo, tmp_path, capsys, monkeypatch):
    p: Pair = zoo["mlp"]
    out = tmp_path / "out"
    code, _, err = run_cli(_compare_args(p, out), capsys)
    assert code == OK, err
    old = _tree_hashes(out)
    assert set(old) - {"error_path.svg"} == {"diag.json", "report.html", "summary.md", *OVERLAYS}

    # Disk full while the new report is written: the write fails with a bad-out line and the
    # previous report stays byte-identical, with no temp file left next to it.
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    code, _, err = run_cli(_compare_args(p, out), capsys)
    monkeypatch.undo()
    assert code == USER_ERROR
    assert err.startswith("diag: error[bad-out]: output '") and "No space left on device" in err, err
    assert len(err.strip().splitlines()) == 1
    assert _tree_hashes(out) == old

    # A successful run over an existing report replaces every file and leaves no temp file.
    two: Pair = zoo["two"]
    code, _, _ = run_cli(["compare", two.fp32, two.int8, "--inputs", two.inputs, "--out", out, "--quiet"], capsys)
    assert code == OK
    new = _tree_hashes(out)
    assert sorted(new) == sorted(old) and all(new[k] != old[k] for k in old)
    assert json.loads((out / "diag.json").read_text())["models"]["fp32"]["path"].endswith("two.fp32.onnx")


SLOW_READER = """
import time
from pathlib import Path

import numpy as np

def make():
    # Three batches, then wait for the test's Ctrl-C: the run cannot finish before the signal arrives
    # (however loaded the machine), and the signal lands mid-run, at a known point.
    for i in range(200):
        if i == 3:
            Path(__file__).with_name("reader_waiting").touch()
            time.sleep(120)
        yield {"x": np.full((1, 8), 0.1 * (i % 7), np.float32)}
"""


def test_ctrl_c_mid_run_exits_130_and_leaves_the_old_report(zoo, tmp_path, capsys):
    p: Pair = zoo["mlp"]
    out = tmp_path / "out"
    code, _, err = run_cli(_compare_args(p, out), capsys)
    assert code == OK, err
    old = _tree_hashes(out)
    (tmp_path / "slow_reader.py").write_text(SLOW_READER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "diag", "compare", p.fp32, p.int8, "--reader", "slow_reader:make", "--out", out]
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    burners: list[subprocess.Popen[bytes]] = []
    try:
        # NOTE: the handshake decides when the signal goes (the reader's file, three batches in),
        # not a clock: the limit only ends a run that hangs, and is generous for a loaded machine.
        deadline = time.monotonic() + 900
        while not (tmp_path / "reader_waiting").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached its third batch"
            time.sleep(0.05)
        # Ctrl-C must act at once on a busy machine too: every core is kept busy while it lands.
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)  # three batches into the run, the reader waiting for it
        stdout, stderr = proc.communicate(timeout=600)
        acted = time.monotonic() - sent
    finally:
        for b in burners:
            b.kill()
            b.wait()
        if proc.poll() is None:
            proc.kill()
    assert acted < 20, f"Ctrl-C took {acted:.1f} s to end the run on a busy machine"
    assert proc.returncode == INTERRUPTED, stderr
    assert stderr.strip().splitlines()[-1] == "diag: interrupted; no output was written"
    assert "Traceback" not in stderr
    assert stdout == ""
    assert _tree_hashes(out) == old


def test_a_signal_landing_on_another_thread_mid_commit_still_leaves_the_whole_set(tmp_path, monkeypatch) -> None:
    """Issue 45: with other threads alive (onnxruntime's, the reduction pool's), a Ctrl-C right after
    the first file of a set is replaced must not cut the set: every file is the new one, the
    interrupt comes after, and the interrupt message lists the set as written."""
    import threading

    from diag.foundations import files

    out = tmp_path / "out"
    out.mkdir()
    names = ["exclusion.json", "reproduce.py", "m.mixed.onnx"]
    for n in names:
        (out / n).write_text("old\n")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # started before the mask: it does not block SIGINT
    other.start()
    real_replace = os.replace
    sent = []

    def replace_then_ctrl_c(src, dst):  # type: ignore[no-untyped-def]
        real_replace(src, dst)
        if Path(dst).parent == out and not sent:
            sent.append(dst)
            signal.pthread_kill(other.ident, signal.SIGINT)  # delivered on the other thread
            time.sleep(0.2)  # let Python's handler run: it used to raise in the main thread here

    monkeypatch.setattr(files.os, "replace", replace_then_ctrl_c)
    files.reset()
    try:
        with pytest.raises(KeyboardInterrupt):
            files.write_set({out / n: "new\n" for n in names})
    finally:
        stop.set()
        other.join()
    assert sent, "the test never interrupted the commit"
    assert {n: (out / n).read_text() for n in names} == {n: "new\n" for n in names}
    assert files.written_sets() == [[out / n for n in names]]
    assert "no output was written" not in files.interrupt_state()
