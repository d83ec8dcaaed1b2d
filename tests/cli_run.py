"""Running the ``diag`` CLI in-process from a test: exit code, stdout and stderr of one command."""

from __future__ import annotations

import pytest

from diag.cli import commands as cli


def run_cli(args: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``diag ARGS`` (each argument passed through ``str``): its exit code, stdout and stderr."""
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err
