"""diag's public API is what ``diag/__init__.py`` names, the ``diag`` command and ``python -m diag``.

Where a module lives is internal (issue 28 moved every module into its layer's package, in one
commit); these names are what users and plugins import, so they must not move with the modules.
The list below is written out, not read from the package: dropping or renaming a public name fails
here until the list (and the changelog) says so. The paths the manual documents must resolve too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import diag

ROOT = Path(__file__).resolve().parents[1]

#: Every name of ``from diag import ...``, as the public API was when the modules moved into layers.
PUBLIC = {
    "BenchOptions",
    "CompareOptions",
    "CompareResult",
    "DiagError",
    "DocumentDiff",
    "ExcludeOptions",
    "F1Metric",
    "FeedSpec",
    "GateResult",
    "Gates",
    "QuantizeOptions",
    "QuantizeReport",
    "Recipe",
    "SensitivityOptions",
    "Summary",
    "SweepOptions",
    "TaskMetric",
    "TierOptions",
    "__version__",
    "bench_models",
    "check_document",
    "compare_models",
    "compare_to_dir",
    "derive_exclusions",
    "derive_tier_plan",
    "diagnose",
    "diff_documents",
    "exclude_to_dir",
    "feed_source",
    "find_patterns",
    "infer_recipe",
    "splice_to_file",
    "load_pair",
    "load_recipe",
    "merge_shards",
    "merge_to_dir",
    "quantize_model",
    "save_recipe",
    "skip_one_sensitivity",
    "sweep_model",
    "sweep_to_dir",
    "tier_plan_to_dir",
    "weight_report",
}


def test_the_public_names_are_exactly_the_ones_users_had():
    assert sorted(set(diag.__all__) - PUBLIC) == [], "a new public name: add it to PUBLIC (and the docs)"
    assert sorted(PUBLIC - set(diag.__all__)) == [], "a public name was dropped from diag.__all__"
    assert sorted(PUBLIC - {"__version__"} - set(diag._LAZY)) == [], "a public name lost its lazy-table entry"


@pytest.mark.parametrize("name", sorted(PUBLIC - {"__version__"}))
def test_each_public_name_is_the_object_of_that_name_where_the_lazy_table_points(name):
    """``from diag import X`` gives the class or function named X, defined in the module the table names."""
    namespace: dict[str, object] = {}
    exec(f"from diag import {name}", namespace)
    value = namespace[name]
    module = importlib.import_module(diag._LAZY[name])
    assert value is getattr(module, name) is getattr(diag, name)
    assert inspect.isclass(value) or inspect.isfunction(value), f"diag.{name} is a {type(value).__name__}"
    assert value.__name__ == name
    assert value.__module__ == module.__name__, f"diag.{name} is defined in {value.__module__}"


def test_version_is_the_distribution_version():
    assert diag.__version__ == importlib.metadata.version("diag")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'compare'"):
        diag.compare  # noqa: B018  (a module, never a public name)


def _console_entry() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["scripts"]["diag"]


def _resolve(entry: str) -> object:
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_the_console_script_and_python_m_diag_run_the_same_main():
    main = _resolve(_console_entry())
    installed = importlib.metadata.entry_points(group="console_scripts", name="diag")
    assert [e.value for e in installed] == [_console_entry()], "reinstall: pip install -e . --no-deps"
    assert next(iter(installed)).load() is main
    source = (ROOT / "diag" / "__main__.py").read_text("utf-8")
    module = _console_entry().partition(":")[0]
    assert re.search(rf"^from {re.escape(module)} import main$", source, re.M), "python -m diag runs another main"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT, timeout=120)


def test_diag_help_and_python_m_diag_help_print_the_same_verbs():
    script = Path(sys.executable).with_name("diag")
    command = str(script) if script.exists() else shutil.which("diag")
    assert command, "the diag console script is not installed"
    by_script = _run([command, "--help"])
    by_module = _run([sys.executable, "-m", "diag", "--help"])
    assert by_script.returncode == by_module.returncode == 0, by_script.stderr + by_module.stderr
    assert by_script.stdout == by_module.stdout
    for verb in ("compare", "report", "check", "diff", "exclude", "sweep", "quantize", "bench", "merge", "demo"):
        assert re.search(rf"^\s+{verb}\s", by_module.stdout, re.M), f"diag --help lists no {verb}"


def _documented_paths() -> list[tuple[str, str]]:
    """``diag.<module>...`` names in README.md and docs/ (file names such as ``diag.json`` left out)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(r"`(diag(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", page.read_text("utf-8")):
            if name.split(".")[1] not in ("json", "schema", "py", "md", "html"):
                found.append((page.relative_to(ROOT).as_posix(), name))
    return found


def test_the_manual_documents_some_import_paths():
    names = {name for _, name in _documented_paths()}
    assert "diag.TaskMetric" in names, "docs/verbs/compare.md names the --metric Protocol's path"
    assert {"diag.load_recipe", "diag.quantize_model"} <= names, "docs/recipe.md's Python entry points"


@pytest.mark.parametrize(("page", "name"), _documented_paths())
def test_every_import_path_the_manual_names_resolves(page, name):
    """A path the manual names (``diag.TaskMetric``, ``diag.core.lazy_npz``) is importable as written."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            fields = getattr(value, "__dataclass_fields__", {})
            assert hasattr(value, attr) or attr in fields, f"{page}: `{name}` does not resolve ({attr!r} missing)"
            value = getattr(value, attr, None)
        return
    pytest.fail(f"{page}: `{name}` is not importable")


def test_the_metric_protocol_is_public_where_the_manual_says():
    """``--metric`` plugins are typed against ``diag.TaskMetric``: a Protocol, not a base class to import."""
    protocol = diag.TaskMetric
    assert getattr(protocol, "_is_protocol", False), "diag.TaskMetric is not a typing.Protocol"
    assert {"update", "merge", "finalize"} <= set(dir(protocol))
    assert "`diag.TaskMetric`" in (ROOT / "docs" / "verbs" / "compare.md").read_text("utf-8")
