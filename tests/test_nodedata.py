"""Model Explorer node data (issue 44 item 2): diag's per-node figures as overlays on the graph.

The overlay files are written beside every diag.json, in the shape Model Explorer's
``node_data_builder.GraphNodeData`` writes, keyed by FP32 node names (the node ids of its ONNX
adapter), with the same figures as diag.json.
"""

from __future__ import annotations

import json

import onnx
import pytest

from diag.cli import commands as cli
from diag.report.nodedata import OVERLAYS


@pytest.mark.parametrize(("fixture", "fmt"), [("convnet", "qdq"), ("transformer", "dynamic")])
def test_overlays_name_the_fp32_nodes_with_diag_json_figures(built, tmp_path, capsys, fixture, fmt) -> None:
    b = built(fixture)
    out = tmp_path / "o"
    args = ["compare", str(b.fp32), str(b.int8[fmt]), "--inputs", str(b.inputs_path), "--quiet", "--out", str(out)]
    assert cli.main(args) in (0, 3)
    printed = capsys.readouterr().out
    doc = json.loads((out / "diag.json").read_text())
    names = {n.name for n in onnx.load(str(b.fp32)).graph.node if n.op_type != "Constant"}
    overlays = {name: json.loads((out / name).read_text()) for name in OVERLAYS}
    for name in OVERLAYS:
        assert f"wrote {name}: " in printed
    local, acc = overlays["modelexplorer.local.json"], overlays["modelexplorer.accumulated.json"]
    assert set(acc["results"]) <= names and set(local["results"]) <= names
    assert len(acc["results"]) >= 0.9 * len(names), (len(acc["results"]), len(names))
    for n in doc["nodes"]:
        for node in n["fp_nodes"]:
            if isinstance((n["accumulated"] or {}).get("sqnr_db"), float):
                assert acc["results"][node]["value"] == pytest.approx(n["accumulated"]["sqnr_db"], abs=0.006)
            if n["local"] and isinstance(n["local"].get("sqnr_db"), float):
                assert local["results"][node]["value"] == pytest.approx(n["local"]["sqnr_db"], abs=0.006)
    effects = overlays["modelexplorer.effect.json"]["results"]
    for e in (doc["effects"] or {}).get("effects") or []:
        assert effects[e["fp_nodes"][0]]["value"] == pytest.approx(100 * max(e["recovered"], 0.0), abs=0.06)
    # Model Explorer's thresholds: a value at or below one takes its colour; diag's bad band is < 20 dB.
    assert [t["value"] for t in local["thresholds"]][:2] == [10, 20]
    summary = (out / "summary.md").read_text()
    opened = f"`model-explorer {b.fp32} --extensions=model_explorer_onnx --node_data_paths=modelexplorer.local.json,"
    assert opened in summary


def test_an_exclusion_report_adds_the_nodes_its_fix_keeps_in_float(tmp_path, capsys) -> None:
    """`diag exclude --int8`: a fourth overlay marks the nodes the verified fix keeps in float, and
    summary.md's command opens it with the others."""
    import numpy as np

    from diag.fixtures import models
    from diag.fixtures.quantize import quantize
    from diag.report.nodedata import KEPT_IN_FLOAT

    fx = models.build("transformer")
    fp, q, x = tmp_path / "t.fp32.onnx", tmp_path / "t.int8.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    quantize(fp, q, "dynamic")
    np.savez(x, **fx.make_inputs(32, 12))
    out = tmp_path / "ex"
    args = ["exclude", str(fp), "--int8", str(q), "--inputs", str(x), "--batch", "8", "--target", "cosine>=0.999"]
    assert cli.main([*args, "--bench-runs", "0", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    kept = json.loads((out / "exclusion.json").read_text())["nodes_to_exclude"]
    overlay = json.loads((out / KEPT_IN_FLOAT).read_text())
    assert kept and sorted(overlay["results"]) == sorted(kept) and f"wrote {KEPT_IN_FLOAT}: " in printed
    assert f",{KEPT_IN_FLOAT}`" in (out / "summary.md").read_text()


def test_summary_md_links_a_picture_of_the_error_path_beside_it(built, tmp_path, capsys) -> None:
    """Issue 44 item 3: reviews read summary.md first. It links ``error_path.svg`` (a file beside it:
    GitHub and GitLab render a linked SVG, not an inline one): the worst output's path, node by
    node, each with its accumulated SQNR as diag.json has it."""
    b = built("convnet")
    out = tmp_path / "o"
    args = [
        "compare",
        str(b.fp32),
        str(b.int8["dynamic"]),
        "--inputs",
        str(b.inputs_path),
        "--quiet",
        "--out",
        str(out),
    ]
    assert cli.main(args) in (0, 3)
    assert "wrote error_path.svg: " in capsys.readouterr().out
    doc = json.loads((out / "diag.json").read_text())
    summary = (out / "summary.md").read_text()
    assert "](error_path.svg)" in summary
    svg = (out / "error_path.svg").read_text()
    assert svg.startswith("<svg") and 'xmlns="http://www.w3.org/2000/svg"' in svg
    path = next(o for o in doc["verdict"]["outputs"] if o["error_path"])["error_path"]
    first = next(n for n in doc["nodes"] if n["name"] == path[0])
    assert f">{path[0]}</text>" in svg and f">{first['accumulated']['sqnr_db']:.1f} dB</text>" in svg


def test_a_node_name_that_looks_like_a_formula_stays_text_in_every_picture(tmp_path, capsys) -> None:
    """Names come from untrusted models: matplotlib parsed ``$...$`` in one as mathtext, and an
    invalid formula made it raise, so the whole report failed. The name is drawn as text."""
    import numpy as np

    from diag.fixtures import models
    from diag.fixtures.quantize import quantize

    fx = models.build("convnet")
    evil = "conv$\\frac{3}{$<b>&"
    for node in fx.model.graph.node:
        if node.name == "conv3":  # the head of the error path
            node.name = evil
    fp, q, x = tmp_path / "m.fp32.onnx", tmp_path / "m.int8.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    quantize(fp, q, "dynamic")
    np.savez(x, **fx.make_inputs(16, 12))
    out = tmp_path / "o"
    code = cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--quiet", "--out", str(out)])
    assert code in (0, 3), capsys.readouterr().err
    svg = (out / "error_path.svg").read_text()
    assert "<b>" not in svg and ">conv$\\frac{3}{$&lt;b&gt;&amp;</text>" in svg
    assert "<b>&" not in (out / "report.html").read_text()
