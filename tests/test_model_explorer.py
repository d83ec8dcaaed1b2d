"""diag's node-data files in Google's Model Explorer itself (issue 44 item 2), in a real headless Chromium.

Model Explorer (``ai-edge-model-explorer``, with the ``model-explorer-onnx`` adapter; both on PyPI,
in the test extras) is started as a user starts it, with the command summary.md prints (the FP32
model, the ONNX adapter, the three overlays of compare), in summary.md's folder. The page draws the
graph on a canvas, but its "Node data" side table lists every node (its op type and the overlay's
value) in graph order: the values shown must be diag.json's local SQNR of the same nodes, so the
file is read, keyed the way the adapter names nodes, and nothing is dropped or misplaced.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from browser import chromium

from diag.cli import commands as cli
from diag.fixtures import models, quantize

pytest.importorskip("model_explorer", reason="the test extras install ai-edge-model-explorer")
pytest.importorskip("model_explorer_onnx", reason="the test extras install model-explorer-onnx")

#: Seconds Model Explorer gets to start and the page to list the node data.
STARTUP = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def compared(tmp_path: Path) -> Path:
    fx = models.convnet()
    onnx.save(fx.model, tmp_path / "fp32.onnx")
    quantize.quantize(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", "qdq", fx.make_inputs(16, 1))
    np.savez(tmp_path / "in.npz", **fx.make_inputs(16, 2))
    args = ["compare", tmp_path / "fp32.onnx", tmp_path / "int8.onnx", "--inputs", tmp_path / "in.npz"]
    assert cli.main([str(a) for a in [*args, "--out", tmp_path / "out", "--quiet"]]) in (0, 3)
    return tmp_path


@pytest.fixture
def explorer(compared: Path) -> Iterator[str]:
    """Model Explorer started with the command summary.md prints, run in its folder (the overlays are
    named relative to it); yields the URL it prints."""
    summary = (compared / "out" / "summary.md").read_text()
    printed = re.search(r"`(model-explorer [^`]+)`", summary)
    assert printed is not None, "summary.md says how to open the node data"
    words = shlex.split(printed.group(1))
    # the console script, run by this interpreter; not opening a browser, on a free port
    command = [sys.executable, "-c", "from model_explorer.cmdline import main; main()", *words[1:]]
    command += ["--no_open_in_browser", f"--port={_free_port()}"]
    log = compared / "explorer.log"
    with log.open("w") as sink:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=compared / "out")
        try:
            url = None
            deadline = time.monotonic() + STARTUP
            while url is None and time.monotonic() < deadline and server.poll() is None:
                found = re.search(r"http://localhost:\d+/\S*", log.read_text())
                url = found.group(0) if found else None
                time.sleep(0.2)
            assert url is not None, f"Model Explorer did not start: {log.read_text()[-2000:]}"
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_model_explorer_shows_diags_local_sqnr_on_the_models_nodes(compared, explorer) -> None:
    from playwright.sync_api import sync_playwright

    doc = json.loads((compared / "out" / "diag.json").read_text())
    local = {n["fp_nodes"][0]: n["local"]["sqnr_db"] for n in doc["nodes"] if n.get("local") and n["fp_nodes"]}
    members = {m: n["fp_nodes"][0] for n in doc["nodes"] for m in n["fp_nodes"]}
    graph = [n for n in onnx.load(compared / "fp32.onnx").graph.node if n.op_type != "Constant"]
    # every FP32 node, in graph order, with the value of the finding it belongs to (a fused group's)
    expected = [(n.op_type, round(float(local[members[n.name]]), 2)) for n in graph if members.get(n.name) in local]
    assert len(expected) == len(graph) >= 9
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(explorer)
        page.wait_for_selector("td.node-label", timeout=STARTUP * 1000)
        page.wait_for_function("document.querySelectorAll('td.value-col').length >= 9", timeout=STARTUP * 1000)
        # the side panel's tables of nodes: root-level stats (one row per layer) and "Node data"
        # (one row per node), the longer one
        tables = page.eval_on_selector_all(
            "table:has(td.node-label)",
            "ts => ts.map(t => [...t.querySelectorAll('tr:has(td.node-label)')].map(r =>"
            " [r.querySelector('td.node-label').textContent.trim(),"
            " (r.querySelector('td.value-col') || {textContent: ''}).textContent.trim()]))",
        )
        rows = max(tables, key=len)
        browser.close()
    shown = [(label, float(value)) for label, value in rows if re.fullmatch(r"-?\d+(\.\d+)?", value)]
    assert shown == expected
    assert any(label == "Conv" and value == round(float(local["conv3"]), 2) for label, value in shown)
