"""Hostile and broken inputs (issue 8), run through the real CLI.

One table row per broken input: the command, the expected slug, exit code and message fragment.
Every row also checks that the error is one line without a traceback, that ``--out`` holds no
half-written file and that no input file was modified (hashes before and after). Unusual but
valid models must succeed and say the right thing.
"""

from __future__ import annotations

import hashlib
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag import cli
from diag.errors import USER_ERROR
from diag.fixtures import quantize

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def run_cli(args: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


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

    Hidden unit 3 of fc1 is scaled x40 and fc2's row 3 /40 (FP32 function unchanged): the
    per-tensor activation scale of fc2's input then crushes every other unit.
    """
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, hidden)) / 3).astype(np.float32)
    w2 = (rng.standard_normal((hidden, 4)) / 3).astype(np.float32)
    if outlier:
        w1[:, 3] *= 40
        w2[3] /= 40
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


@dataclass
class Pair:
    fp32: Path
    int8: Path
    inputs: Path


def _pair(folder: Path, name: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> Pair:
    fp = _save(model, folder / f"{name}.fp32.onnx")
    q = folder / f"{name}.int8.onnx"
    quantize.quantize(fp, q, "dynamic")
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

    # FP32 with one more output than its INT8 version.
    m = mlp()
    m.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 8]))
    z["extra_output"] = _save(m, d / "extra_output.fp32.onnx")

    # External data: missing, pointing outside the folder, and a symlink escaping it.
    for case in ("missing", "outside", "symlink"):
        sub = d / f"ext_{case}"
        sub.mkdir()
        path = sub / "model.onnx"
        onnx.save(mlp(), str(path), save_as_external_data=True, location="weights.data", size_threshold=0)
        if case == "missing":
            (sub / "weights.data").unlink()
        elif case == "outside":
            (sub / "weights.data").rename(d / "secret.data")
            m = onnx.load(str(path), load_external_data=False)
            for t in m.graph.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = "../secret.data"
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
        # 2. valid ONNX that fails the checker or onnxruntime (and says which)
        Row("fails onnx.checker", ["inspect", z["checker_fail"]], "invalid-model", "fails onnx.checker"),
        Row(
            "fails in onnxruntime",
            cmp(z["ort_fail"], p.int8, *good),
            "invalid-model",
            "FP32 model '",
        ),
        # 3. not a pair
        Row("swapped", cmp(p.int8, p.fp32, *good), "swapped-models", "did you swap them?"),
        Row("both fp32", cmp(p.fp32, p.fp32, *good), "not-quantized", "contains no quantized operators"),
        Row("both int8", cmp(p.int8, p.int8, *good), "fp32-is-quantized", "already contains quantized"),
        Row("different inputs", cmp(p.fp32, two.int8, *good), "model-mismatch", "have different inputs"),
        Row("different outputs", cmp(z["extra_output"], p.int8, *good), "model-mismatch", "have different outputs"),
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
