"""Golden files: the HTML report and summary.md rendered from a fixed diag.json, volatile parts scrubbed.

The document (``tests/golden/convnet.qdq.diag.json``) comes from a real run of the convnet fixture
quantized to QDQ, with versions, dates, paths and timings scrubbed; rendering it must give exactly
the golden files, so any change to the report's wording or structure shows up in review.
Plots are matplotlib SVGs (their bytes change with matplotlib versions): each is reduced to a
placeholder before comparing, and checked to be present.

Regenerate after an intended change (and review the diff):
``DIAG_UPDATE_GOLDEN=1 pytest tests/test_golden.py``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from diag.report.view import SUMMARY_MAX_LINES, render_html, render_markdown, view_from_document

GOLDEN = Path(__file__).parent / "golden"
DOC = GOLDEN / "convnet.qdq.diag.json"
UPDATE = os.environ.get("DIAG_UPDATE_GOLDEN") == "1"


def _scrub_document(doc: dict) -> dict:
    doc["environment"] = {k: f"<{k}>" for k in doc["environment"]}
    doc["models"]["fp32"]["path"] = "convnet.fp32.onnx"
    doc["models"]["int8"]["path"] = "convnet.qdq.onnx"
    doc["run"]["seconds"] = 0.0
    return doc


def _scrub_svg(text: str) -> tuple[str, int]:
    return re.subn(r"<svg\b.*?</svg>", "<svg/>", text, flags=re.S)


def _document(built) -> dict:
    if UPDATE:
        from diag.analysis.compare import CompareOptions
        from diag.cli.verbs import diagnose
        from diag.core.feeds import FeedSpec
        from diag.report.document import document_from_result

        b = built("convnet")
        r = diagnose(
            b.fp32, b.int8["qdq"], FeedSpec(inputs=str(b.inputs_path), batch=8), CompareOptions(progress=False)
        )
        text = json.dumps(_scrub_document(document_from_result(r)), indent=1, ensure_ascii=False) + "\n"
        # Commands printed for the user name the models and inputs by their (machine's) paths.
        DOC.write_text(text.replace(f"{b.fp32.parent}/", ""))
    return json.loads(DOC.read_text())


def test_report_html_matches_the_golden_file(built):
    html, plots = _scrub_svg(render_html(view_from_document(_document(built))))
    assert plots >= 4  # error along the graph, neighbourhood, a histogram and a channel chart
    golden = GOLDEN / "convnet.qdq.report.html"
    if UPDATE:
        golden.write_text(html)
    assert html == golden.read_text()


def test_summary_md_matches_the_golden_file(built):
    md = render_markdown(view_from_document(_document(built), with_plots=False))
    golden = GOLDEN / "convnet.qdq.summary.md"
    if UPDATE:
        golden.write_text(md)
    assert md == golden.read_text()
    assert len(md.splitlines()) <= SUMMARY_MAX_LINES


def test_a_long_summary_is_cut_in_the_middle_never_the_verdict_or_the_fix(monkeypatch):
    """Issue 45: summary.md ("paste it in a PR") keeps its verdict and the fix to paste whole; the
    sections between them are shortened, then cut."""
    from diag.report import view as view_module

    doc = json.loads(DOC.read_text())
    full = render_markdown(view_from_document(doc, with_plots=False)).splitlines()
    fix_at = next(i for i, line in enumerate(full) if line.startswith("**Starting point**"))
    monkeypatch.setattr(view_module, "SUMMARY_MAX_LINES", 30)
    short = render_markdown(view_from_document(doc, with_plots=False)).splitlines()
    assert len(short) <= 30 and "_(truncated; see report.html)_" in short
    assert short[:3] == full[:3]  # the title and the verdict
    assert short[-(len(full) - fix_at) :] == full[fix_at:]  # the fix block, fence and verify command whole
    assert any("nodes_to_exclude=" in line for line in short)
