"""ARCHITECTURE.md stays true: every module is in its table once, and its measured imports are today's.

The counts come from ``tools/import_map.py`` (run as a script, as a developer runs it); the tests
compare them with what ARCHITECTURE.md states, so a new module, a new import cycle or a new upward
import fails here until it is removed or written down.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"
SCRIPT = ROOT / "tools" / "import_map.py"
LAYERS = ("foundations", "core", "analysis", "fix", "report", "cli")
ROW = re.compile(r"^\|\s*`(?P<module>[A-Za-z_][A-Za-z0-9_]*)`\s*\|\s*(?P<layer>[^|]*?)\s*\|(?P<job>[^|]*)\|\s*$")


def _script(*args: str, root: Path = ROOT) -> str:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _measured_block() -> list[str]:
    """The code block of ARCHITECTURE.md's "Dependencies as measured" section."""
    section = DOC.read_text(encoding="utf-8").split("## Dependencies as measured", 1)[1]
    block = section.split("```\n", 2)[1]
    return block.rstrip("\n").splitlines()


def _stated(label: str) -> int:
    """The number on the ``label: N`` line of the measured block."""
    found = [line for line in _measured_block() if line.startswith(f"{label}: ")]
    assert len(found) == 1, f"ARCHITECTURE.md states {label!r} {len(found)} times, not once"
    return int(found[0].split(": ", 1)[1])


def test_every_diag_module_is_in_the_module_table_exactly_once_with_a_layer_and_a_job():
    rows = [m for m in map(ROW.match, DOC.read_text(encoding="utf-8").splitlines()) if m]
    listed = collections.Counter(m["module"] for m in rows)
    package = ROOT / "diag"
    modules = {p.stem for p in package.rglob("*.py") if p.name != "__init__.py" or p.parent == package}
    assert sorted(modules - set(listed)) == [], "modules of diag/ missing from ARCHITECTURE.md's table"
    assert sorted(set(listed) - modules) == [], "ARCHITECTURE.md lists modules diag/ does not have"
    assert sorted(m for m, n in listed.items() if n > 1) == [], "modules listed more than once"
    for m in rows:
        assert m["layer"] in LAYERS, f"{m['module']}: layer {m['layer']!r} is none of {LAYERS}"
        assert len(m["job"].strip()) > 10, f"{m['module']}: no job"


def test_every_module_file_is_in_the_package_of_its_layer():
    """The table's layer column and the folder agree: ``core`` modules live in ``diag/core/``."""
    facts = json.loads(_script("--json"))
    assert facts["misplaced"] == [], "move the module into diag/<layer>/, or correct its row in ARCHITECTURE.md"
    assert facts["files"]["streaming"] == "core/streaming.py"
    assert facts["files"]["__main__"] == "__main__.py"


def test_stated_cycle_count_is_what_the_import_map_measures_today():
    facts = json.loads(_script("--json"))
    assert facts["unlisted"] == []
    assert facts["cycle_count"] == _stated("cycles"), (
        f"tools/import_map.py finds {facts['cycle_count']} import cycle(s), ARCHITECTURE.md states "
        f"{_stated('cycles')}: remove the new cycle, or rerun the script and update the document"
    )
    assert facts["cycle_modules"] == _stated("cycle modules")
    assert facts["upward_imports"] == _stated("upward imports")
    assert len(facts["upward_pairs"]) == _stated("upward module pairs")


def test_every_line_of_the_measured_block_is_printed_by_the_import_map_today():
    printed = set(_script().splitlines())
    stale = [line for line in _measured_block() if line not in printed]
    assert stale == [], "ARCHITECTURE.md's measured block is out of date: rerun tools/import_map.py and paste"


def test_import_map_finds_a_planted_cycle_and_upward_import(tmp_path):
    """The script can fail: on a three-module package it reports exactly the cycle and the upward import."""
    pkg = tmp_path / "diag"
    for layer in ("foundations", "core", "report"):
        (pkg / layer).mkdir(parents=True)
        (pkg / layer / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "foundations" / "errors.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diag.report import view\n"
    )
    (pkg / "core" / "load.py").write_text(
        "from diag.foundations.errors import DiagError\n\ndef f():\n    from diag.report import view\n"
    )
    (pkg / "report" / "view.py").write_text("from ..core import load\nfrom diag.core.load import _private\n")
    (tmp_path / "ARCHITECTURE.md").write_text(
        "| `__init__` | cli | x |\n| `errors` | foundations | x |\n| `load` | core | x |\n| `view` | report | x |\n"
    )
    facts = json.loads(_script("--json", root=tmp_path))
    assert facts["cycles"] == [["load", "view"]]
    assert [(i["importer"], i["imported"], i["kind"]) for i in facts["upward"]] == [("load", "view", "lazy")]
    assert facts["counts"] == {"top": 3, "lazy": 1, "dynamic": 0, "typing": 1}
    assert facts["layer_cycles"] == []
    assert [i["private"] for i in facts["imports"] if i["private"]] == [["_private"]]
    assert facts["misplaced"] == []


def test_import_map_finds_a_module_outside_its_layer_package(tmp_path):
    """A ``core`` row whose file sits in ``diag/foundations/`` is misplaced: the script can fail."""
    pkg = tmp_path / "diag"
    (pkg / "foundations").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "foundations" / "load.py").write_text("")
    (tmp_path / "ARCHITECTURE.md").write_text("| `__init__` | cli | x |\n| `load` | core | x |\n")
    assert json.loads(_script("--json", root=tmp_path))["misplaced"] == ["load"]


#: The feature walks of issue 28 in ARCHITECTURE.md's "Where does X go", and the most files each may name.
WALKS = {"**A new metric**": 5, "**A new CLI verb**": 5, "**A new quantization format**": 5}
NUMBERS = {"Five": 5}


def _walk(heading: str) -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text[text.index("## Where does X go") : text.index("## Outside `diag/`")]
    start = section.index(heading)
    end = section.find("\n**A new", start + 1)
    return section[start : end if end != -1 else None]


def test_each_feature_walk_is_a_numbered_file_list_as_long_as_it_says():
    for heading, most in WALKS.items():
        walk = _walk(heading)
        steps = re.findall(r"^(\d+)\. `([^`]+)`", walk, flags=re.M)
        assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1)), f"{heading}: steps not numbered 1..n"
        assert len(steps) <= most, f"{heading} names {len(steps)} files; issue 28 wants at most {most}"
        stated = re.search(r"\b(" + "|".join(NUMBERS) + r") files", walk)
        assert stated and NUMBERS[stated[1]] == len(steps), (
            f"{heading}: says {stated and stated[1]}, lists {len(steps)}"
        )
        files = [f for _, f in steps if "<" not in f]
        assert len(set(files)) == len(files), f"{heading}: a file in two steps"


def test_every_file_and_name_the_feature_walks_cite_exists():
    """A walk that names a file that moved, or a table or function that was renamed, fails here."""
    import importlib

    for heading in WALKS:
        walk = _walk(heading)
        for token in re.findall(r"`([^`\s]+)`", walk):
            if re.fullmatch(r"[\w./-]+\.(py|md|json|yml)", token) and "/" in token:
                assert (ROOT / token).exists(), f"{heading} cites {token}, which does not exist"
            dotted = re.fullmatch(r"([a-z_]+)\.([A-Za-z_]+)", token)
            found = sorted((ROOT / "diag").glob(f"*/{dotted[1]}.py")) if dotted else []
            if dotted and dotted[2] not in ("py", "md", "json") and found:
                module = importlib.import_module(f"diag.{found[0].parent.name}.{dotted[1]}")
                assert hasattr(module, dotted[2]), f"{heading} cites {token}, which {module.__name__} lacks"
