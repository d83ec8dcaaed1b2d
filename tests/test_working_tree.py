"""The tests test the working tree: a run against an installed copy of diag stops at once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, installed_outside

import diag


def test_this_run_imports_diag_from_the_checkout():
    assert not installed_outside(diag.__file__, ROOT)
    assert Path(diag.__file__).resolve().parent == ROOT / "diag"


def test_a_diag_outside_the_checkout_is_told_apart_by_path_not_by_prefix(tmp_path):
    root = tmp_path / "diag"
    assert not installed_outside(str(root / "diag" / "__init__.py"), root)
    assert installed_outside(str(tmp_path / "diag-old" / "diag" / "__init__.py"), root)
    assert installed_outside("/usr/lib/python3/site-packages/diag/__init__.py", root)
    assert installed_outside(None, root)


def test_a_run_whose_diag_is_not_its_checkouts_stops_with_one_line_and_the_hint(tmp_path):
    """The same conftest in another checkout: the diag this interpreter imports is not that one's."""
    other = tmp_path / "other_checkout"
    (other / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "conftest.py", other / "tests" / "conftest.py")
    (other / "tests" / "test_anything.py").write_text("def test_anything():\n    pass\n")
    (other / "pytest.ini").write_text("[pytest]\n")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=other,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 4, out.stdout + out.stderr  # pytest's USAGE_ERROR: nothing was collected
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert lines == [
        f"ERROR: the tests import diag from {ROOT / 'diag'}, not from this checkout ({other.resolve()}). "
        'Hint: pip install -e ".[test]" in the checkout'
    ]
