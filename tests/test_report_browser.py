"""The HTML report in a real headless Chromium: no console errors, no network, sortable, XSS-proof.

Needs Debian's ``chromium`` (``.ci/run`` installs it) and the ``playwright`` Python package,
which drives that browser (no browser download).
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from browser import chromium

from diag.cli import commands as cli
from diag.fixtures import models, quantize
from diag.report.view import md_code

HOSTILE = "<img src=x onerror=alert(1)>"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory) -> Path:
    """A convnet whose culprit node and tensor carry HTML/JS in their names, compared via the CLI."""
    folder = tmp_path_factory.mktemp("hostile")
    fx = models.convnet()
    model = fx.model
    for node in model.graph.node:
        if node.name == "conv3":
            node.name = HOSTILE
    onnx.save(model, folder / "fp32.onnx")
    calib = fx.make_inputs(16, 1)
    quantize.quantize(folder / "fp32.onnx", folder / "int8.onnx", "qdq", calib)
    import numpy as np

    np.savez(folder / "in.npz", **fx.make_inputs(8, 2))
    code = cli.main(
        [
            "compare",
            str(folder / "fp32.onnx"),
            str(folder / "int8.onnx"),
            "--inputs",
            str(folder / "in.npz"),
            "--out",
            str(folder / "out"),
            "--quiet",
        ]
    )
    assert code == 0
    return folder / "out"


def test_hostile_node_name_is_text_in_html_and_markdown(hostile_report):
    html = (hostile_report / "report.html").read_text()
    assert HOSTILE not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    md = (hostile_report / "summary.md").read_text()
    prose = re.sub(r"```.*?```", "", md, flags=re.S)  # inside a code fence HTML is not interpreted
    prose = re.sub(r"(`+) .*? \1|`[^`]*`", "", prose)  # nor inside an inline code span
    assert not re.search(r"(?<!\\)<img", prose)
    assert md_code(HOSTILE) in md  # the node's name: a code span, where HTML is text


def test_report_in_headless_chromium_sorts_runs_no_script_and_makes_no_request(hostile_report):
    from playwright.sync_api import sync_playwright

    exe = chromium()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=exe,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page()
        errors: list[str] = []
        requests: list[str] = []
        dialogs: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        url = (hostile_report / "report.html").resolve().as_uri()
        page.goto(url)
        page.wait_for_load_state("load")
        page.click("#section-nodes summary")  # the node table is collapsed on the first screen
        assert page.locator("#verdict").inner_text().startswith("Verdict:")
        # The hostile name is rendered as text, and the <img onerror> never ran.
        assert HOSTILE in page.locator("#nodes").inner_text()
        assert page.locator("#nodes img").count() == 0
        # Sort by local SQNR (8th column), ascending: values must come out in order.
        page.click("#nodes thead th:nth-child(8)")
        keys = page.eval_on_selector_all(
            "#nodes tbody tr td:nth-child(8)", "els => els.map(e => parseFloat(e.getAttribute('data-sort')))"
        )
        finite = [k for k in keys if k == k]
        assert finite == sorted(finite) and len(finite) >= 5
        assert HOSTILE in page.locator("#nodes tbody tr").first.inner_text()
        # Filter narrows the table.
        page.fill("#filter", "relu1")
        visible = page.eval_on_selector_all(
            "#nodes tbody tr", "rs => rs.filter(r => r.style.display !== 'none').length"
        )
        assert visible == 1
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert errors == []
    assert dialogs == []
    assert requests == [url]
