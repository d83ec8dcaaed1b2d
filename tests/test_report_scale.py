"""The HTML report of a 1,000-node model stays small (<= 5 MB) and renders in headless Chromium fast.

The model is a deep residual stack of tiny MatMul -> Relu -> Add blocks (8 wide), quantized with real
onnxruntime (dynamic), compared through the library on a few samples. Needs Debian's ``chromium`` and
the ``playwright`` package, as ``tests/test_report_browser.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from browser import chromium
from onnx import TensorProto, helper, numpy_helper

from diag.analysis.compare import CompareOptions
from diag.cli.verbs import compare_to_dir
from diag.core.feeds import FeedSpec
from diag.fixtures import quantize
from diag.report.view import load_document

NODES = 1000
HIDDEN = 8
MAX_HTML_BYTES = 5 * 1024 * 1024
MAX_RENDER_SECONDS = 10.0  # generous: CI machines vary; the measured figure is printed


def deep_stack(blocks: int, hidden: int = HIDDEN, seed: int = 0) -> onnx.ModelProto:
    """``x -> [x + Relu(x @ W_i)] * blocks -> Identity``: 3 nodes per block plus one, all named.

    Small residual weights keep activations finite over hundreds of blocks.
    """
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "x"
    for i in range(blocks):
        w = rng.standard_normal((hidden, hidden)) * 0.3 / np.sqrt(hidden)
        inits.append(numpy_helper.from_array(w.astype(np.float32), f"block{i}.weight"))
        nodes.append(helper.make_node("MatMul", [x, f"block{i}.weight"], [f"block{i}/mm"], name=f"block{i}/MatMul"))
        nodes.append(helper.make_node("Relu", [f"block{i}/mm"], [f"block{i}/relu"], name=f"block{i}/Relu"))
        nodes.append(helper.make_node("Add", [x, f"block{i}/relu"], [f"block{i}/out"], name=f"block{i}/Add"))
        x = f"block{i}/out"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="output/Identity"))
    graph = helper.make_graph(
        nodes,
        "deep_stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


#: Height budget of a compare report with its long sections collapsed (issue 25: 1400 px wide).
MAX_COLLAPSED_PX = 8000


@pytest.fixture(scope="module")
def big_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("scale")
    model = deep_stack((NODES - 1) // 3)
    assert len(model.graph.node) == NODES
    onnx.save(model, folder / "fp32.onnx")
    quantize.quantize(folder / "fp32.onnx", folder / "int8.onnx", "dynamic")
    np.savez(folder / "in.npz", x=np.random.default_rng(1).standard_normal((8, HIDDEN)).astype(np.float32))
    feeds = FeedSpec(inputs=str(folder / "in.npz"), batch=4)
    compare_to_dir(folder / "fp32.onnx", folder / "int8.onnx", feeds, folder / "out", CompareOptions(progress=False))
    return folder / "out"


def test_report_of_a_1000_node_model_is_at_most_5_mb(big_report):
    doc = load_document(big_report / "diag.json")
    assert len(doc["nodes"]) == NODES  # every node is its own row: nothing fused away or dropped
    size = (big_report / "report.html").stat().st_size
    json_size = (big_report / "diag.json").stat().st_size
    print(f"report.html for {NODES} nodes: {size / 1e6:.2f} MB; diag.json {json_size / 1e6:.2f} MB")
    assert size <= MAX_HTML_BYTES


def test_report_of_a_1000_node_model_renders_and_sorts_in_chromium_in_seconds(big_report):
    from playwright.sync_api import sync_playwright

    rows = len(load_document(big_report / "diag.json")["nodes"])
    url = (big_report / "report.html").resolve().as_uri()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        start = time.perf_counter()
        page.goto(url)
        page.wait_for_load_state("load")
        collapsed_px = page.evaluate("document.documentElement.scrollHeight")
        page.click("#section-nodes summary")  # the node table is collapsed on the first screen
        rendered = page.locator("#nodes tbody tr").count()
        render_s = time.perf_counter() - start
        assert page.locator("#verdict").inner_text().startswith("Verdict:")
        start = time.perf_counter()
        page.click("#nodes thead th:nth-child(8)")  # sort all rows by local SQNR
        keys = page.eval_on_selector_all(
            "#nodes tbody tr td:nth-child(8)", "els => els.map(e => parseFloat(e.getAttribute('data-sort')))"
        )
        sort_s = time.perf_counter() - start
        browser.close()
    print(f"{rows}-row report: rendered in {render_s:.2f} s, sorted in {sort_s:.2f} s")
    assert errors == []
    assert collapsed_px <= MAX_COLLAPSED_PX, f"{NODES}-node report is {collapsed_px} px tall with sections collapsed"
    assert rendered == rows == NODES
    finite = [k for k in keys if k == k]
    assert len(keys) == rows and finite == sorted(finite) and len(finite) > rows // 4
    assert render_s < MAX_RENDER_SECONDS
    assert sort_s < MAX_RENDER_SECONDS
