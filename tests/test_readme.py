"""The README's examples run, and print what the README says they print (timings scrubbed)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[tuple[str, list[str]]]:
    examples: list[tuple[str, list[str]]] = []
    current: tuple[str, list[str]] | None = None
    for line in README.read_text().splitlines():
        if line.startswith("$ diag "):
            current = (line[2:], [])
            examples.append(current)
        elif current is not None and line and not line.startswith("```"):
            current[1].append(line)
        else:
            current = None
    return examples


def _scrub(line: str) -> str:
    return re.sub(r"in \d+(\.\d+)? s$", "in <t> s", line.rstrip())


def _scrub_numbers(line: str) -> str:
    """diag bench and diag sweep print timings: compare their layout, names and units, not their numbers."""
    return " ".join(re.sub(r"\d+(\.\d+)?", "#", line).split())


def test_readme_examples_run_and_print_what_the_readme_shows(tmp_path):
    examples = _examples()
    from diag.cli import VERBS

    verbs = [cmd.split()[1] for cmd, _ in examples]
    assert verbs[0] == "demo", "the first example builds the files the others use"
    assert set(verbs) == set(VERBS), "every CLI verb has a README example with its real output"
    for cmd, expected in examples:
        argv = shlex.split(cmd)
        out = subprocess.run([sys.executable, "-m", "diag", *argv[1:]], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 0, (cmd, out.stderr)
        scrub = _scrub_numbers if argv[1] in ("bench", "sweep") else _scrub
        got = [scrub(x) for x in out.stdout.splitlines()]
        assert got == [scrub(x) for x in expected], cmd


def test_readme_starts_with_install_and_test_commands_that_ci_runs():
    text = README.read_text()
    head = text[: text.index("## What it does")]
    assert "pip install . && diag demo --out demo" in head
    assert 'pip install ".[test]" && pytest' in head
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install ".[test]"' in ci and ci.strip().endswith("pytest")
