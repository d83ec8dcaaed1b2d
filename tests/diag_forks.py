"""``python -m diag ARGS`` many times, each in its own process, without importing diag each time.

A fresh ``python -m diag`` spends ~1.5 s importing onnx, onnxruntime, numpy and matplotlib before it
does anything (onnx's ml_dtypes alone ~0.7 s): most of the time of a short command, paid again by
every example of the docs. :class:`DiagForks` starts one interpreter (on the CPU of
:func:`kernel_path.python_command`, emulated or real) that imports diag's CLI once, then forks it
for every command: each command still runs in a new process of its own, from ``diag/__main__.py``,
with its own folder, environment, ``sys.path`` (the folder first, then ``PYTHONPATH``, as
``python -m`` sets it up), stdout and stderr, and ends as that process would (exit code, atexit).
Nothing a command does is seen by the next one; only the imports are shared.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kernel_path import python_command

#: The forking interpreter: imports what every ``diag`` verb imports (and pyplot, as the reports
#: do), then one line of JSON in per command, its exit code out once the child has ended.
_SERVER = r"""
import json, os, runpy, sys
import diag.cli.commands, diag.cli.verbs
from diag.report.plots import pyplot
pyplot()
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [job["cwd"], *[os.path.abspath(p) for p in extra]]
        for fd, opened in ((0, os.open(os.devnull, os.O_RDONLY)),
                           (1, os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)),
                           (2, os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))):
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = ["diag", *job["argv"]]
        runpy.run_module("diag", run_name="__main__", alter_sys=True)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@dataclass
class Ran:
    """What one command did, as :func:`subprocess.run` would say it."""

    returncode: int
    stdout: str
    stderr: str


class DiagForks:
    """``with DiagForks(folder) as diag: diag.run(["demo", "--out", "d"], cwd=..., env=...)``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.count = 0
        self.server = subprocess.Popen(
            [*python_command(), "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=folder
        )

    def run(self, argv: list[str], cwd: Path, env: dict[str, str]) -> Ran:
        """``python -m diag *argv`` in ``cwd`` with exactly the environment ``env``."""
        assert self.server.stdin is not None and self.server.stdout is not None
        self.count += 1
        out, err = self.folder / f"fork{self.count}.out", self.folder / f"fork{self.count}.err"
        job = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        self.server.stdin.write(json.dumps(job) + "\n")
        self.server.stdin.flush()
        code = self.server.stdout.readline()
        assert code, f"the forking interpreter ended (exit code {self.server.poll()})"
        return Ran(int(code), out.read_text(), err.read_text())

    def __enter__(self) -> DiagForks:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(timeout=60)
