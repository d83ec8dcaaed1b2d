"""The layers are a contract: import-linter enforces ARCHITECTURE.md's table, and the contract is strict.

Each layer is a package (``diag/<layer>/``); ``pyproject.toml``'s ``[tool.importlinter]`` section
is generated (``python tools/import_map.py --contract``): the six packages, exhaustive, and no cycle
within or between them. ``tests/test_architecture.py`` checks that each module's folder is its row's
layer in ARCHITECTURE.md, so the document and the check cannot drift apart. The planted-import
tests show the contract can fail: an upward import, a cycle inside one layer, or a module outside
the layer packages, in a temporary copy of diag/, breaks it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "import_map.py"

#: Packages diag may import inside a function: heavy ones that would make ``diag --help`` slow
#: (onnxruntime, matplotlib), optional extras (Dask), the TOML reader that depends on the Python
#: version, and ``importlib`` for ``diag/__init__``'s lazy name table.
LAZY_ALLOWED = {"onnxruntime", "matplotlib", "distributed", "dask", "tomllib", "tomli", "importlib"}
#: ``diag.foundations.environment`` records numpy's and onnx's versions in a report; ``diag --version``
#: reads the same module and must not pay for them.
LAZY_ALLOWED_IN = {("environment", "numpy"), ("environment", "onnx")}


def _lint_imports(root: Path, config: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    env = {"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run(
        [*cmd, "--config", str(config), "--no-cache"], cwd=root, capture_output=True, text=True, env=env, check=False
    )


def _facts(root: Path = ROOT) -> dict:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_pyproject_contract_is_the_table_of_architecture_md():
    out = subprocess.run([sys.executable, str(SCRIPT), "--contract"], capture_output=True, text=True, check=True)
    wanted = tomllib.loads(out.stdout)["tool"]["importlinter"]
    held = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    assert held == wanted, "rerun `python tools/import_map.py --contract` and paste it into pyproject.toml"


def test_lint_imports_passes_on_diag():
    result = _lint_imports(ROOT, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "diag", tmp_path / "diag", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_lint_imports_fails_on_a_planted_upward_import(tmp_path):
    root = _copy(tmp_path)
    with (root / "diag" / "foundations" / "errors.py").open("a", encoding="utf-8") as f:
        f.write("\nimport diag.report.view  # planted: foundations importing the report layer\n")
    result = _lint_imports(root, root / "pyproject.toml")
    assert result.returncode != 0
    assert "diag.foundations is not allowed to import diag.report" in result.stdout
    assert "diag.foundations.errors -> diag.report.view" in result.stdout


def test_lint_imports_fails_on_a_planted_cycle_inside_one_layer(tmp_path):
    facts = _facts()
    layers = facts["layers"]
    edge = next(
        i
        for i in facts["imports"]
        if i["kind"] == "top" and layers.get(i["importer"]) == layers.get(i["imported"]) == "core"
    )
    root = _copy(tmp_path)
    with (root / "diag" / "core" / f"{edge['imported']}.py").open("a", encoding="utf-8") as f:
        f.write(f"\nimport diag.core.{edge['importer']}  # planted: closes a cycle inside the core layer\n")
    result = _lint_imports(root, root / "pyproject.toml")
    assert result.returncode != 0
    assert "No cycles are allowed in diag.core" in result.stdout


def test_lint_imports_fails_on_a_module_outside_the_layer_packages(tmp_path):
    """The layers contract is exhaustive: a new module at the top of diag/ must go into a layer package."""
    root = _copy(tmp_path)
    (root / "diag" / "stray.py").write_text("from diag.foundations import errors\n", encoding="utf-8")
    result = _lint_imports(root, root / "pyproject.toml")
    assert result.returncode != 0
    assert "diag.stray" in result.stdout + result.stderr


def test_no_import_cycle_and_no_upward_import_as_the_import_map_measures():
    facts = _facts()
    assert facts["unlisted"] == []
    assert facts["cycles"] == []
    assert facts["upward"] == []


def test_diag_modules_are_imported_at_module_top_except_by_the_cli():
    """cli/commands.py imports a verb's library when the verb runs (``diag --help`` stays instant); nobody else."""
    lazy = [f"{i['importer']}:{i['line']} -> {i['imported']}" for i in _facts()["imports"] if i["kind"] == "lazy"]
    assert [x for x in lazy if not x.startswith("commands:")] == []


def test_other_packages_are_imported_inside_functions_only_when_heavy_or_optional():
    found = _facts()["lazy_external"]
    assert found, "the measurement sees no lazy import at all: onnxruntime is imported lazily somewhere"
    unexpected = [
        f"{i['importer']}:{i['line']} {i['package']}"
        for i in found
        if i["package"] not in LAZY_ALLOWED and (i["importer"], i["package"]) not in LAZY_ALLOWED_IN
    ]
    assert unexpected == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["compare", "--help"],
        ["exclude", "--help"],
        # the document verbs a CI job runs read JSON only: no model library (seconds to import)
        ["check", "missing.json", "--min-cosine", "0.9"],
        ["diff", "a.json", "b.json"],
    ],
)
def test_diag_help_and_the_document_verbs_import_neither_onnx_nor_onnxruntime_nor_numpy(argv):
    code = (
        "import sys\nfrom diag.cli import commands as cli\n"
        f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('onnx', 'onnxruntime', 'numpy', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_public_name_resolves_to_where_the_lazy_table_says_it_is_defined():
    """``from diag import X`` works for every name of ``diag.__all__``, from the module that defines it."""
    import importlib

    import diag

    table = diag._LAZY  # the lazy name table itself: what ``diag.__getattr__`` reads
    assert set(diag.__all__) == {*table, "__version__"}
    for name, module in table.items():
        value = getattr(diag, name)
        defined_in = getattr(value, "__module__", module)
        assert defined_in == module, f"diag.{name} is defined in {defined_in}, the table says {module}"
        assert getattr(importlib.import_module(module), name) is value


#: The issue's limits: no function longer than this many lines or with more parameters (self and
#: cls not counted), unless a ``NOTE:`` comment in the function's first lines says why.
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8


def _oversized(source: str) -> list[str]:
    import ast

    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = [
            *a.posonlyargs,
            *a.args,
            *a.kwonlyargs,
            *([a.vararg] if a.vararg else []),
            *([a.kwarg] if a.kwarg else []),
        ]
        count = len([p for p in params if p.arg not in ("self", "cls")])
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        noted = any("NOTE:" in line for line in lines[node.lineno - 1 : node.lineno + 5])
        if (length > MAX_FUNCTION_LINES or count > MAX_PARAMETERS) and not noted:
            found.append(f"{node.name} ({length} lines, {count} parameters)")
    return found


def test_no_function_over_80_lines_or_8_parameters_without_a_note():
    found = [f"{p.name}: {f}" for p in sorted((ROOT / "diag").rglob("*.py")) for f in _oversized(p.read_text("utf-8"))]
    assert found == []


def test_the_size_check_finds_a_long_function_and_a_wide_one():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    wide = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS + 1))
    source = f"def long():\n{long_body}\n\n\ndef wide(self, {wide}):\n    pass\n\n\ndef fine(self, a, b):\n    pass\n"
    assert _oversized(source) == [
        f"long ({MAX_FUNCTION_LINES + 1} lines, 0 parameters)",
        f"wide (2 lines, {MAX_PARAMETERS + 1} parameters)",
    ]


def test_ci_runs_the_layer_contract_and_the_type_checks_before_the_tests():
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text("utf-8").splitlines()]
    for step in ("ruff check diag tests fixtures tools", "lint-imports", "mypy diag", "tools/test-setup.sh && pytest"):
        assert step in steps, f".ci/run does not run {step!r}"
    assert any(s.startswith("mypy --strict") and "--files foundations core" in s for s in steps)
    assert steps.index("lint-imports") < steps.index("tools/test-setup.sh && pytest")
