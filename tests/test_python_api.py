"""docs/python-api.md runs as it is and prints what it shows (issue 45: the Python API has a page)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from diag.cli import commands as cli

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), flags=re.S)


def _blur(line: str) -> str:
    return re.sub(r"\d+\.\d+|\d+%", "<n>", line)


def test_the_python_api_page_runs_and_prints_what_it_shows(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--no-fix", "--out", "demo", "--quiet"]) == 0
    capsys.readouterr()
    (code,), (expected,) = _blocks("python"), _blocks("text")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(PAGE), "exec"), {"__name__": "__main__"})
    # Figures from onnxruntime's int8 kernels differ between CPUs (VNNI or not: tests/kernel_path.py);
    # names, counts, grades, statuses and the structure are compared exactly.
    assert [_blur(x) for x in printed.getvalue().splitlines()] == [_blur(x) for x in expected.splitlines()]
    assert (tmp_path / "api-fix" / "by-hand.onnx").read_bytes() == (
        tmp_path / "api-fix" / "transformer.mixed.onnx"
    ).read_bytes()


@pytest.mark.parametrize("name", ["splice_to_file", "compare_models", "exclude_to_dir", "check_document"])
def test_the_page_uses_public_names_only(name: str) -> None:
    import diag

    assert name in diag.__all__ and f"    {name}," in _blocks("python")[0]
