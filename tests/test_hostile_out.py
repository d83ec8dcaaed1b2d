"""A read-only ``--out`` folder, seen by a real non-root user: ``error[bad-out]`` (exit 2) before any work.

Root writes into a mode-0555 folder anyway, so as root the command runs as ``nobody`` through
``setpriv`` (the permission check then sees what a user would); as a normal user the folder is
simply made read-only. Before the fix ``diag sweep`` / ``diag exclude`` died with
``diag: internal error: PermissionError ... .diag-sweep-...`` (exit 1) creating their work folder.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag.core.feeds import InputSpec, feeds_from_arrays
from diag.foundations.errors import DiagError

NOBODY = 65534
ROOT = os.geteuid() == 0


def _model(path: Path) -> None:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder under /tmp that ``nobody`` can enter (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="diag-ro-out-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        for p in d.rglob("*"):
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(d, ignore_errors=True)


def _run_as_user(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "diag", *args]
    env = {**os.environ, "HOME": str(cwd)}
    if ROOT:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a read-only folder cannot be made read-only to root")
        # CAP_DAC_READ_SEARCH (read and search only, never write): nobody must still read the
        # interpreter and its packages, which on a pyenv machine live under root's private /root.
        caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *caps, *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "verb",
    [
        ["sweep", "--grid", '{"mode": "dynamic"}', "--samples", "4"],
        ["exclude", "--target", "cosine>=0.9", "--samples", "4"],
        ["compare", "--samples", "4"],
    ],
    ids=["sweep", "exclude", "compare"],
)
def test_read_only_out_folder_is_bad_out_before_any_work(shared_dir: Path, verb: list[str]) -> None:
    model = shared_dir / "fp32.onnx"
    _model(model)
    model.chmod(0o644)
    out = shared_dir / "ro"
    out.mkdir()
    out.chmod(0o555)
    name, *flags = verb
    args = [name, str(model), *flags, "--random", "--out", str(out)]
    if name == "compare":
        args = [name, str(model), str(model), *flags, "--random", "--out", str(out)]
    p = _run_as_user(args, shared_dir)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "error[bad-out]" in p.stderr and f"'{out}" in p.stderr, p.stderr
    assert "internal error" not in p.stderr and "PermissionError" not in p.stderr
    if name != "compare":
        assert "cannot be written (permission denied)" in p.stderr, p.stderr
    assert os.listdir(out) == []  # no work folder, no partial output
    assert stat.S_IMODE(out.stat().st_mode) == 0o555


def test_problem_ending_in_a_question_mark_gets_no_second_mark() -> None:
    e = DiagError("swapped-models", "models", "the first is INT8: did you swap them?", "put FP32 first")
    assert e.message() == "models | the first is INT8: did you swap them? Hint: put FP32 first"
    assert "?." not in e.message()
    plain = DiagError("bad-inputs", "x", "has dtype int32", "cast it")
    assert plain.message() == "x | has dtype int32. Hint: cast it"


def test_bad_inputs_names_the_row_and_the_row_count() -> None:
    spec = InputSpec("x", np.dtype(np.float32), (8,))
    with pytest.raises(DiagError) as e:  # per-row arrays (one more axis than the input): batch of one
        feeds_from_arrays({"x": np.zeros((4, 8), np.int32)}, [spec], None, 2, "inputs 'x.npz'")
    assert "inputs 'x.npz' row 0 (of 4)" in str(e.value), str(e.value)
    assert "0..0" not in str(e.value)
    batched = InputSpec("x", np.dtype(np.float32), ("N", 8))
    with pytest.raises(DiagError) as e:
        feeds_from_arrays({"x": np.zeros((4, 8), np.int32)}, [batched], None, 2, "inputs 'x.npz'")
    assert "inputs 'x.npz' rows 0..1 (of 4)" in str(e.value), str(e.value)
