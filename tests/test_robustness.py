"""Failures that must not cost the user a report, a hang or a traceback."""

from __future__ import annotations

import errno
import json
import os
import time

import numpy as np
import pytest

from diag.cli.commands import main
from diag.core.distributions import Pow2Histogram
from diag.report.view import write_outputs


def _demo_doc(tmp_path, capsys) -> dict:
    assert main(["demo", "--out", str(tmp_path / "demo"), "--quiet", "--no-fix", "--samples", "8"]) == 0
    capsys.readouterr()
    return json.loads((tmp_path / "demo" / "diag.json").read_text())


def test_disk_full_on_the_last_file_leaves_every_old_file_of_the_report(tmp_path, capsys, monkeypatch):
    doc = _demo_doc(tmp_path, capsys)
    out = tmp_path / "demo"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    real_fsync, calls = os.fsync, []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 3:  # diag.json and report.html are staged, summary.md hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    doc["verdict"]["cause"] = "a new run"
    with pytest.raises(Exception, match="No space left"):
        write_outputs(doc, out)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # all three old files intact, no temp file left


def test_hand_edited_diag_json_is_a_bad_report_not_a_crash(tmp_path, capsys):
    doc = _demo_doc(tmp_path, capsys)
    del doc["nodes"][0]["accumulated"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    assert main(["report", str(broken), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diag: error[bad-report]: report '")
    assert "field 'nodes[0]' lacks the required key 'accumulated'" in err  # the field is named
    assert not (tmp_path / "r" / "report.html").exists()


def test_hostile_histogram_exponent_does_not_hang():
    h = Pow2Histogram()
    h.update(np.array([1.0, -2.0], np.float32))
    start = time.perf_counter()
    h._grow_to(10**12)
    assert time.perf_counter() - start < 1.0
    assert h.total == 2 and h.counts[h.counts > 0].size <= 2
