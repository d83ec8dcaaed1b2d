"""The model's graph in report.html (issue 44 item 1), in a real headless Chromium.

The drawing is made by the page (dagre, inlined): these tests load the report offline and check
what a reviewer sees: no console error, no request, the root cause's figures on click equal to
diag.json's, the error path highlighted, a collapsed block that expands, a search that finds a
node inside one, and a ``data-node`` element for nearly every FP32 node.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from browser import chromium

from diag.cli import commands as cli
from diag.fixtures import models, quantize


def _report(folder: Path, fx: models.Fixture, fmt: str) -> Path:
    onnx.save(fx.model, folder / "fp32.onnx")
    quantize.quantize(folder / "fp32.onnx", folder / "int8.onnx", fmt, fx.make_inputs(16, 1))
    np.savez(folder / "in.npz", **fx.make_inputs(16, 2))
    args = [
        "compare",
        folder / "fp32.onnx",
        folder / "int8.onnx",
        "--inputs",
        folder / "in.npz",
        "--out",
        folder / "out",
    ]
    assert cli.main([str(a) for a in [*args, "--quiet"]]) in (0, 3)
    return folder / "out"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        yield b
        b.close()


class Page:
    """One report opened offline, with its console errors and requests recorded."""

    def __init__(self, browser: Any, out: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = (out / "report.html").resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_load_state("load")
        self.doc = json.loads((out / "diag.json").read_text())

    def data_nodes(self) -> set[str]:
        return set(
            self.page.eval_on_selector_all("#graph-svg [data-node]", "es => es.map(e => e.getAttribute('data-node'))")
        )

    def close(self) -> None:
        assert self.errors == [] and self.requests == [self.url]
        self.page.close()


def _fp32_nodes(out: Path) -> set[str]:
    doc = json.loads((out / "diag.json").read_text())
    model = onnx.load(doc["models"]["fp32"]["path"], load_external_data=False)
    return {n.name for n in model.graph.node if n.op_type != "Constant"}


def test_root_cause_figures_and_error_path_on_the_graph(browser, tmp_path) -> None:
    out = _report(tmp_path, models.transformer(), "dynamic")
    page = Page(browser, out)
    root = next(n for n in page.doc["nodes"] if n["role"] == "root-cause")
    box = page.page.locator("#graph-svg g.gn.root")
    assert box.count() == 1 and box.get_attribute("data-node") == root["fp_nodes"][0]
    box.click()
    shown = page.page.locator("#graph-detail").inner_text()
    assert f"local SQNR: {root['local']['sqnr_db']:.2f} dB" in shown
    assert f"accumulated SQNR: {root['accumulated']['sqnr_db']:.2f} dB" in shown
    # The error path of the output, box by box, and nothing else.
    path = page.doc["verdict"]["outputs"][0]["error_path"]
    first = {n["name"]: n["fp_nodes"][0] for n in page.doc["nodes"]}
    highlighted = page.page.eval_on_selector_all(
        "#graph-svg g.gn.onpath", "es => es.map(e => e.getAttribute('data-node'))"
    )
    assert sorted(highlighted) == sorted(first[p] for p in path) and len(path) >= 2
    # The output's health on its grid, as diag.json has it, for a box whose output is quantized.
    health = page.doc["distributions"]["tensors"]
    first_by_tensor = {n["tensor"]: n["fp_nodes"][0] for n in page.doc["nodes"] if n["tensor"] in health}
    graded = next(t for t, h in health.items() if h["grid"] != "none" and t in first_by_tensor)
    page.page.fill("#graph-search", first_by_tensor[graded])
    page.page.press("#graph-search", "Enter")
    bits = health[graded]["effective_bits"]
    assert f"output on the grid: {bits:.1f} of " in page.page.locator("#graph-detail").inner_text()
    # Colour by effect: the root cause, which removes most of the error, is the reddest box.
    page.page.select_option("#graph-metric", "effect")
    fill = page.page.locator("#graph-svg g.gn.root rect").get_attribute("fill")
    assert fill is not None and fill.startswith("hsl(") and int(fill[4:].split(",")[0]) < 30
    assert len(page.data_nodes() & _fp32_nodes(out)) >= 0.9 * len(_fp32_nodes(out))
    page.close()


def test_every_convnet_node_is_addressable(browser, tmp_path) -> None:
    out = _report(tmp_path, models.convnet(), "qdq")
    page = Page(browser, out)
    nodes = _fp32_nodes(out)
    assert len(page.data_nodes() & nodes) >= 0.9 * len(nodes)
    page.close()


def test_collapsed_blocks_expand_and_search_opens_the_block_it_finds(browser, tmp_path) -> None:
    out = _report(tmp_path, models.projection_spread(layers=30), "dynamic")
    page = Page(browser, out)
    collapsed = "#graph-svg g.gn[data-block-collapsed]"
    assert page.page.locator(collapsed).count() == 30
    # A collapsed block still names every node it holds.
    assert "/model/layers.3/mlp/down_proj/MatMul" in page.data_nodes()
    page.page.click('#graph-svg g.gn[data-block-collapsed="layer 3"]')
    assert page.page.locator(collapsed).count() == 29
    down = page.page.locator('#graph-svg g.gn[data-node="/model/layers.3/mlp/down_proj/MatMul"]')
    assert down.count() == 1
    page.page.fill("#graph-search", "layers.7/mlp/up_proj")
    page.page.press("#graph-search", "Enter")
    found = page.page.locator("#graph-svg g.gn.found")
    assert found.get_attribute("data-node") == "/model/layers.7/mlp/up_proj/MatMul"
    assert page.page.locator(collapsed).count() == 28
    assert "/model/layers.7/mlp/up_proj/MatMul" in page.page.locator("#graph-detail").inner_text()
    page.page.click("#graph-expand")
    assert page.page.locator(collapsed).count() == 0
    assert len(page.data_nodes() & _fp32_nodes(out)) >= 0.9 * len(_fp32_nodes(out))
    page.close()


def test_layers_come_from_torchs_module_paths_when_node_names_carry_none() -> None:
    """torch's dynamo exporter names nodes ``node_linear_3``: the layer is read from the module path
    diag.json records for the node (``pkg.torch.onnx.name_scopes``), as the per-layer view reads it."""
    from diag.report.graphview import graph_data

    def node(i: int, layer: int) -> dict[str, Any]:
        name = f"node_linear_{i}"
        module = f"model.layers.{layer}.mlp.down_proj/linear_{i}"
        return {"name": name, "fp_nodes": [name], "tensor": f"t{i}", "inputs": [], "module": module, "local": None}

    g = graph_data({"nodes": [node(i, i // 2) for i in range(6)]})
    assert g is not None and [u["block"] for u in g["units"]] == [
        "layer 0",
        "layer 0",
        "layer 1",
        "layer 1",
        "layer 2",
        "layer 2",
    ]


def test_a_clicked_node_shows_its_output_histogram_over_the_grid(browser, tmp_path) -> None:
    """Issue 44 item 1: the detail panel draws the output's FP32 and INT8 values (diag.json's small
    histogram, bar for bar) and the INT8 grid's range, for the conv whose output channel 5 is 40x."""
    out = _report(tmp_path, models.convnet(), "qdq")
    page = Page(browser, out)
    health = page.doc["distributions"]["tensors"]
    node = next(n for n in page.doc["nodes"] if n["fp_nodes"] and n["fp_nodes"][0] == "conv2")
    hist, grid = health[node["tensor"]]["histogram"], health[node["tensor"]]["grid_range"]
    assert len(hist["fp32"]) == len(hist["int8"]) <= 32 and sum(hist["fp32"]) > 0 and sum(hist["int8"]) > 0
    page.page.fill("#graph-search", "conv2")
    page.page.press("#graph-search", "Enter")
    bars = page.page.eval_on_selector_all(
        "#graph-hist rect", "es => es.map(e => [e.getAttribute('data-series'), +e.getAttribute('data-count')])"
    )
    assert [c for s, c in bars if s == "fp"] == [c for c in hist["fp32"] if c]
    assert [c for s, c in bars if s == "q"] == [c for c in hist["int8"] if c]
    lines = page.page.eval_on_selector_all("#graph-hist line", "es => es.map(e => +e.getAttribute('data-grid'))")
    assert lines == pytest.approx(grid)
    assert "dashed: the INT8 grid's range" in page.page.locator("#graph-detail").inner_text()
    page.close()
