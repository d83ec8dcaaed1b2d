"""Fuzzing the CLI with mutated models and random feed dicts (issue 8), in-process and bounded.

Every example runs ``diag.cli.commands.main`` for real. The property: the exit code is 0 (ok) or 2 (a user
error with its one-line message) - never 1, which means an uncaught exception escaped as an
internal error. Hypothesis runs derandomized so CI sees the same examples on every run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from test_hostile import mlp

from diag.cli import commands as cli
from diag.fixtures import quantize
from diag.foundations.errors import OK, USER_ERROR

SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

EDITS = ["rewire", "drop_node", "op_type", "drop_init", "dim", "dtype", "rename_out", "name"] + ["values"] * 5
NAMES = ["", "<b>", "\x1b[0m", "n", "名"]
OPS = ["Relu", "MatMul", "Add", "Identity", "Log", "Reshape", "MatMulInteger", "DynamicQuantizeLinear", "If", "NoSuch"]


@pytest.fixture(scope="module")
def seed_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("fuzz")
    fp = d / "fp32.onnx"
    onnx.save(mlp(), str(fp))
    q = d / "int8.onnx"
    quantize.quantize(fp, q, "dynamic")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.savez(d / "x.npz", x=x)
    return fp, q, d / "x.npz"


@pytest.fixture(scope="module")
def int8_models(seed_pair: tuple[Path, Path, Path]) -> dict[str, Path]:
    """The seed model in all three formats onnxruntime writes (static ones calibrated on 16 rows)."""
    fp, q, _ = seed_pair
    calib = {"x": np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)}
    paths = {"dynamic": q}
    for fmt in ("qdq", "qoperator"):
        paths[fmt] = quantize.quantize(fp, fp.with_name(f"{fmt}.onnx"), fmt, calib)
    return paths


def _check(code: int, err: str, what: object) -> None:
    """0, or 2 with exactly one ``diag: error[slug]:`` line; 1 means an uncaught exception."""
    assert "internal error" not in err, (what, err)
    assert code in (OK, USER_ERROR), (what, code, err)
    if code == USER_ERROR:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("diag: error["), (what, err)
        event(lines[0].split("]")[0] + "]")  # pytest --hypothesis-show-statistics: which slugs the fuzz hit
    else:
        event("ok")


def _run(args: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main([str(a) for a in args])
    return code, capsys.readouterr().err


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """Flip, cut, insert, delete or duplicate byte ranges of a serialized model."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate"]))
        if op == "flip":
            b[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del b[i:]
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del b[i : i + draw(st.integers(1, 64))]
        else:
            j = draw(st.integers(0, len(b) - 1))
            b[i:i] = b[j : j + draw(st.integers(1, 64))]
    return bytes(b)


@st.composite
def mutated_graph(draw: st.DrawFn, model: onnx.ModelProto) -> bytes:
    """Structure-aware edits that keep the protobuf valid: rewire, drop, retype, reshape."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    names = sorted({t for n in g.node for t in (*n.input, *n.output)} | {i.name for i in g.input} | {"", "ghost"})
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(EDITS))
        if op == "rewire" and g.node:
            n = g.node[draw(st.integers(0, len(g.node) - 1))]
            if n.input:
                n.input[draw(st.integers(0, len(n.input) - 1))] = draw(st.sampled_from(names))
        elif op == "drop_node" and g.node:
            del g.node[draw(st.integers(0, len(g.node) - 1))]
        elif op == "op_type" and g.node:
            g.node[draw(st.integers(0, len(g.node) - 1))].op_type = draw(st.sampled_from(OPS))
        elif op == "drop_init" and g.initializer:
            del g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
        elif op == "dim" and g.input:
            dims = g.input[0].type.tensor_type.shape.dim
            if dims:
                dims[draw(st.integers(0, len(dims) - 1))].dim_value = draw(st.sampled_from([0, 1, 3, 7, 10**9]))
        elif op == "dtype" and g.input:
            g.input[0].type.tensor_type.elem_type = draw(st.sampled_from([1, 2, 3, 6, 7, 9, 10, 11, 16]))
        elif op == "rename_out" and g.output:
            g.output[0].name = draw(st.sampled_from(names))
        elif op == "values" and g.initializer:
            # Weights, scales and zero points set to extremes: zero scales, NaN, Inf, huge values.
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            a = numpy_helper.to_array(t).copy()
            if a.size:
                special = [0, 1, -1, 255, 1e30, -1e30, np.nan, np.inf] if a.dtype.kind == "f" else [0, 1, -1, 127]
                with np.errstate(all="ignore"):
                    a.flat[draw(st.integers(0, a.size - 1))] = np.array(draw(st.sampled_from(special))).astype(a.dtype)
                    if draw(st.booleans()):
                        a[...] = a.flat[0]
                t.CopyFrom(numpy_helper.from_array(a, t.name))
        elif op == "name" and g.node:
            g.node[draw(st.integers(0, len(g.node) - 1))].name = draw(st.sampled_from(NAMES))
    return m.SerializeToString()


def test_inspect_survives_mutated_model_bytes(seed_pair, tmp_path, capsys):
    _fp, q, _ = seed_pair
    data = q.read_bytes()
    path = tmp_path / "mutant.onnx"

    @settings(SETTINGS, max_examples=80)
    @given(mutated_bytes(data))
    def check(blob: bytes) -> None:
        path.write_bytes(blob)
        code, err = _run(["inspect", path], capsys)
        _check(code, err, hashlib.sha1(blob).hexdigest())

    check()


@pytest.mark.parametrize("fmt", ["dynamic", "qdq", "qoperator"])
def test_compare_survives_mutated_int8_models(fmt, seed_pair, int8_models, tmp_path, capsys):
    fp, _, x = seed_pair
    q = int8_models[fmt]
    before = (fp.read_bytes(), q.read_bytes())
    model = onnx.load(str(q))
    path = tmp_path / "mutant.int8.onnx"

    @settings(SETTINGS, max_examples=20)
    @given(st.one_of(mutated_bytes(q.read_bytes()), mutated_graph(model), mutated_graph(model)))
    def check(blob: bytes) -> None:
        path.write_bytes(blob)
        code, err = _run(["compare", fp, path, "--inputs", x, "--out", tmp_path / "o", "--quiet"], capsys)
        _check(code, err, hashlib.sha1(blob).hexdigest())

    check()
    assert (fp.read_bytes(), q.read_bytes()) == before


def test_compare_survives_mutated_fp32_graphs(seed_pair, tmp_path, capsys):
    fp, q, x = seed_pair
    model = onnx.load(str(fp))
    path = tmp_path / "mutant.fp32.onnx"

    @settings(SETTINGS, max_examples=30)
    @given(mutated_graph(model))
    def check(blob: bytes) -> None:
        path.write_bytes(blob)
        code, err = _run(["compare", path, q, "--inputs", x, "--out", tmp_path / "o", "--quiet"], capsys)
        _check(code, err, hashlib.sha1(blob).hexdigest())

    check()


DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_]


@st.composite
def feed_dicts(draw: st.DrawFn) -> dict[str, np.ndarray]:
    """Feed dicts that are sometimes right and mostly wrong: names, dtypes, shapes, NaN/Inf, empties."""
    if draw(st.booleans()):
        # Mostly right: the model's one input with a sample count and extreme magnitudes.
        scale = draw(st.sampled_from([1.0, 0.0, 1e-30, 1e30, 3e38]))
        rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        with np.errstate(all="ignore"):
            return {"x": (rng.standard_normal((draw(st.integers(0, 5)), 8)) * scale).astype(np.float32)}
    keys = draw(st.lists(st.sampled_from(["x", "x", "x", "y", "X", "x\x1b[2J", "输入", ""]), min_size=0, max_size=3))
    feeds: dict[str, np.ndarray] = {}
    for k in keys:
        dtype = draw(st.sampled_from(DTYPES[:1] * 4 + DTYPES))
        rank = draw(st.integers(0, 4))
        shape = [draw(st.sampled_from([0, 1, 2, 3, 8, 8, 8])) for _ in range(rank)]
        if draw(st.booleans()):
            shape = [draw(st.integers(0, 5)), 8]
        rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        arr = np.asarray(rng.standard_normal(shape) if np.dtype(dtype).kind == "f" else rng.integers(0, 2, shape))
        arr = arr.astype(dtype)
        if arr.size and np.dtype(dtype).kind == "f" and draw(st.booleans()):
            arr.flat[draw(st.integers(0, arr.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 6e4]))
        feeds[k] = arr
    return feeds


def test_compare_survives_random_feed_dicts(seed_pair, tmp_path, capsys):
    fp, q, _ = seed_pair
    path = tmp_path / "feeds.npz"

    @settings(SETTINGS, max_examples=50)
    @given(feed_dicts(), st.sampled_from(["1", "2", "64"]), st.sampled_from([None, "1", "3"]))
    def check(feeds: dict[str, np.ndarray], batch: str, samples: str | None) -> None:
        np.savez(path, **feeds)
        extra = ["--samples", samples] if samples else []
        args = ["compare", fp, q, "--inputs", path, "--batch", batch, *extra, "--out", tmp_path / "o", "--quiet"]
        code, err = _run(args, capsys)
        _check(code, err, {k: (v.dtype, v.shape) for k, v in feeds.items()})

    check()
