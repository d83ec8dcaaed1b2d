"""An AIMET export fixed in its encodings (issue 43: the fix verified on the model the user ships).

AIMET's standard export is the FP32 ``.onnx`` plus a ``.encodings`` file; the model the user
ships to QNN is what the pair describes. `diag exclude FP32 --int8 EXPORT.onnx` therefore makes
every trial the QDQ model of the user's encodings with the float nodes' encodings taken out, and
writes the answer as the user's encodings file, edited. Ground truth here: onnxruntime's own QDQ
model (the encodings are its quantization, written in AIMET's layout), with the Q/DQ of every
removed encoding bypassed by hand and run by plain onnxruntime: "before" and "after" must be its
figures, and the file written must hold exactly the user's entries minus the removed ones.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnx import helper

from diag.core.encodings import Encodings, document_without, read_encodings
from diag.fixtures import models, producers, quantize

VERSIONS = ("0.6.1", "1.0.0", "2.0.0")
TARGET = "cosine>=0.9999"


def _min_cosine(fp32: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray], first: int, level) -> float:
    """Min per-sample cosine of the outputs from sample ``first`` on, FP32 (exact) vs ``model`` at ``level``."""
    exact = ort.SessionOptions()
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    a = ort.InferenceSession(str(fp32), exact, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    held = {k: v[first:] for k, v in feeds.items()}
    worst = 1.0
    for x, y in zip(a.run(None, held), b.run(None, held), strict=True):
        x2, y2 = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
        worst = min(worst, float(((x2 * y2).sum(1) / np.sqrt((x2 * x2).sum(1) * (y2 * y2).sum(1))).min()))
    return worst


def _bypassed(qdq: onnx.ModelProto, fp: onnx.ModelProto, removed: set[str]) -> onnx.ModelProto:
    """onnxruntime's QDQ model with each ``removed`` encoding's quantization undone, by hand: an
    activation's Q -> DQ pair becomes an Identity of its float tensor (a Relu where onnxruntime fused
    one away), a weight's DequantizeLinear the FP32 weight (independent of diag's builder)."""
    model = onnx.ModelProto()
    model.CopyFrom(qdq)
    g = model.graph
    fp_weights = {t.name: t for t in fp.graph.initializer}
    inits = {t.name for t in g.initializer}
    quantizers = {n.output[0]: n for n in g.node if n.op_type == "QuantizeLinear"}
    fp_ops = {o: n.op_type for n in fp.graph.node for o in n.output}
    q_ops = {o: n.op_type for n in g.node for o in n.output}
    keep, extra = [], []
    for n in g.node:
        source = n.input[0]
        if n.op_type == "DequantizeLinear" and source in inits and source.removesuffix("_quantized") in removed:
            weight = source.removesuffix("_quantized")
            extra.append(fp_weights[weight])
            if n.output[0] != weight:  # a bias's DequantizeLinear writes the float name itself
                keep.append(helper.make_node("Identity", [weight], [n.output[0]]))
        elif n.op_type == "DequantizeLinear" and source in quantizers:
            x = quantizers[source].input[0]
            shown = x.removesuffix("_QuantizeLinear_Input")  # a graph output: its producer writes a new name
            # onnxruntime drops a Relu whose output it quantizes (the grid clips at zero): without the
            # quantization the Relu is back, as in the FP32 graph AIMET's encodings sit on
            fused = fp_ops.get(shown) == "Relu" and q_ops.get(x) != "Relu"
            keep.append(
                helper.make_node("Relu" if fused else "Identity", [x], [n.output[0]]) if shown in removed else n
            )
        elif not (n.op_type == "QuantizeLinear" and n.input[0].removesuffix("_QuantizeLinear_Input") in removed):
            keep.append(n)
    del g.node[:]
    g.node.extend(keep)
    g.initializer.extend(extra)
    return model


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The convnet fixture quantized static QDQ per tensor by onnxruntime, as AIMET's export:
    ``aimet.onnx`` (the FP32 graph) with ``aimet.encodings`` (1.0.0) beside it."""
    d = tmp_path_factory.mktemp("aimet-exclude")
    fx = models.build("convnet")
    fp32, qdq = d / "fp32.onnx", d / "qdq.onnx"
    onnx.save(fx.model, fp32)
    quantize.quantize(fp32, qdq, "qdq", fx.make_inputs(16, 3), per_channel=False, weight_type="QInt8")
    feeds = fx.make_inputs(64, 5)
    np.savez(d / "feeds.npz", **feeds)
    aimet = d / "aimet.onnx"
    aimet.write_bytes(fp32.read_bytes())
    doc = producers.aimet_encodings(onnx.load(str(qdq)), "1.0.0")
    doc["quantizer_args"] = {"activation_bitwidth": 8, "param_bitwidth": 8}  # kept as written in the fix
    (d / "aimet.encodings").write_text(json.dumps(doc, indent=1))
    return {"dir": d, "fp32": fp32, "qdq": qdq, "aimet": aimet, "feeds": feeds, "doc": doc}


def test_exclude_fixes_an_aimet_export_in_its_encodings_and_measures_the_model_they_describe(export, capsys) -> None:
    d, fp32, aimet = Path(str(export["dir"])), Path(str(export["fp32"])), Path(str(export["aimet"]))
    feeds: dict[str, np.ndarray] = export["feeds"]  # type: ignore[assignment]
    user_files = {p: p.read_bytes() for p in (aimet, d / "aimet.encodings")}
    args = ["exclude", fp32, "--int8", aimet, "--inputs", d / "feeds.npz", "--target", TARGET, "--bench-runs", "0"]
    code, out, _ = run_cli([*args, "--out", d / "ex", "--quiet"], capsys)
    assert code == 0, out
    assert all(p.read_bytes() == b for p, b in user_files.items())  # the user's files are never touched
    ex = json.loads((d / "ex" / "exclusion.json").read_text())
    assert ex["verdict"] == "met" and ex["method"] == "encodings" and ex["int8"] == str(aimet)
    assert ex["producer"]["key"] == "aimet" and "sim.get_op_quantizers(op)" in ex["producer"]["fix_call"]
    removed = set(ex["encodings"]["removed"])
    assert removed and ex["encodings"]["file"] == str(d / "ex" / "aimet.encodings")

    # The file written is the user's, minus exactly the removed encodings: every other key and entry as written.
    written = json.loads((d / "ex" / "aimet.encodings").read_text())
    doc: dict[str, list[dict[str, object]]] = export["doc"]  # type: ignore[assignment]
    assert written["quantizer_args"] == doc["quantizer_args"] and written["version"] == "1.0.0"
    for section in ("activation_encodings", "param_encodings"):
        assert written[section] == [e for e in doc[section] if e["name"] not in removed]
    # Each float node's own quantizers go: its weight's and bias's encodings, and its output's.
    params, acts = {e["name"] for e in doc["param_encodings"]}, {e["name"] for e in doc["activation_encodings"]}
    for node in ex["nodes_to_exclude"]:
        fp_node = next(n for n in onnx.load(str(fp32)).graph.node if n.name == node)
        assert (set(fp_node.input[1:]) & params) | (set(fp_node.output) & acts) <= removed

    # Before: the model the user's encodings describe (onnxruntime's own QDQ model); after: that model
    # with the removed encodings' quantization undone by hand. Both by plain onnxruntime.
    held = len(next(iter(feeds.values()))) // 2
    exact, deployed = ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    qdq = onnx.load(str(export["qdq"]))
    fixed = _bypassed(qdq, onnx.load(str(fp32)), removed)
    assert ex["metrics"]["before"]["cosine"] == pytest.approx(_min_cosine(fp32, qdq, feeds, held, exact), abs=1e-6)
    assert ex["metrics"]["before"]["cosine"] < 0.9999
    after = _min_cosine(fp32, fixed, feeds, held, exact)
    assert ex["metrics"]["after"]["cosine"] == pytest.approx(after, abs=1e-6) and after >= 0.9999
    assert ex["metrics"]["after_deployed"]["cosine"] == pytest.approx(
        _min_cosine(fp32, fixed, feeds, held, deployed), abs=1e-6
    )

    # The terminal says where the fix is; reproduce.py (plain Python, no diag) writes the same file.
    assert "in your AIMET encodings:" in out and f"wrote encodings: {d / 'ex' / 'aimet.encodings'}" in out
    assert "built from your AIMET encodings, edited (no re-quantization)" in out
    assert "nodes_to_exclude=" not in out.split("\n  also met")[0]  # AIMET's list, not onnxruntime's argument
    script = (d / "ex" / "reproduce.py").read_text()
    assert "import diag" not in script
    runpy.run_path(str(d / "ex" / "reproduce.py"))
    assert json.loads((d / "ex" / "aimet.reproduced.encodings").read_text()) == written


@pytest.mark.parametrize("version", VERSIONS)
def test_taking_encodings_out_keeps_every_other_entry_in_each_layout(export, version) -> None:
    qdq = onnx.load(str(export["qdq"]))
    doc = producers.aimet_encodings(qdq, version)
    full = read_encodings_doc(doc, Path(str(export["dir"])) / f"{version}.encodings")
    gone = {"relu2_out", "conv3.weight"}
    assert gone <= set(full.activations) | set(full.params)
    cut = read_encodings_doc(document_without(doc, gone), Path(str(export["dir"])) / f"{version}.cut.encodings")
    for kind in ("activations", "params"):
        before, after = getattr(full, kind), getattr(cut, kind)
        assert set(after) == set(before) - gone
        assert all(np.array_equal(after[k].scale, before[k].scale) for k in after)


def read_encodings_doc(doc: dict[str, object], path: Path) -> Encodings:
    path.write_text(json.dumps(doc))
    return read_encodings(path)


def test_an_aimet_export_is_not_re_quantized_or_tier_planned(export, capsys) -> None:
    d, fp32, aimet = Path(str(export["dir"])), export["fp32"], export["aimet"]
    common = ["exclude", fp32, "--int8", aimet, "--inputs", d / "feeds.npz", "--target", TARGET]
    for extra, says in (
        (["--requantize"], "is AIMET's export (encodings aimet.encodings): an onnxruntime recipe cannot rebuild it"),
        (["--tiers", "int8,fp32"], "is AIMET's export (encodings aimet.encodings): a tier plan re-blocks"),
    ):
        code, _, err = run_cli([*common, *extra, "--out", d / "refused"], capsys)
        assert code == 2 and "error[bad-option]" in err and says in err, err
        assert len(err.strip().splitlines()) == 1 and not (d / "refused").exists()
    code, _, err = run_cli(
        ["exclude", fp32, "--encodings", d / "aimet.encodings", "--inputs", d / "feeds.npz", "--target", TARGET],
        capsys,
    )
    assert code == 2 and "error[bad-option]: --encodings | needs --int8" in err


def test_compare_on_an_aimet_export_suggests_the_exclude_command_that_fixes_it(export, capsys) -> None:
    d, fp32, aimet = Path(str(export["dir"])), export["fp32"], export["aimet"]
    code, _, _ = run_cli(["compare", fp32, aimet, "--inputs", d / "feeds.npz", "--out", d / "cmp", "--quiet"], capsys)
    assert code == 0
    summary = (d / "cmp" / "summary.md").read_text()
    assert f"`diag exclude {fp32} --int8 {aimet} --inputs {d / 'feeds.npz'} --target" in summary
    # A node exclusion remedy is AIMET's own switch, not onnxruntime's nodes_to_exclude argument.
    doc = json.loads((d / "cmp" / "diag.json").read_text())
    exclusions = [s for s in doc["suggestions"] if s["remedy"] == "exclude-consumers"]
    assert exclusions and all(
        s["python"].startswith("the quantizers of [") and s["applies_to"] == "Qualcomm AIMET (aimet-onnx)"
        for s in exclusions
    )
    # Per-tensor weights: per-channel weights as AIMET's quantsim config says it, not per_channel=True.
    per_channel = next(s for s in doc["suggestions"] if s["remedy"] == "per-channel-weights")
    assert per_channel["python"].startswith('"per_channel_quantization": "True" in the defaults of your quantsim')


def test_the_demo_writes_an_aimet_export_and_its_fixed_encodings(tmp_path, capsys) -> None:
    code, out, _ = run_cli(["demo", "--fixture", "convnet", "--format", "aimet", "--out", tmp_path / "d"], capsys)
    assert code == 0
    models_dir, fix = tmp_path / "d" / "models", tmp_path / "d" / "fix"
    assert "INT8 model convnet.aimet.onnx built by diag from AIMET encodings 'convnet.aimet.encodings'" in out
    assert f"wrote the fixed encodings: {fix / 'convnet.aimet.encodings'}" in out
    ex = json.loads((fix / "exclusion.json").read_text())
    assert ex["method"] == "encodings" and ex["verdict"] == "met"
    mine = json.loads((models_dir / "convnet.aimet.encodings").read_text())
    fixed = json.loads((fix / "convnet.aimet.encodings").read_text())
    assert fixed == document_without(mine, ex["encodings"]["removed"]) != mine


def test_an_aimet_export_that_no_list_fixes_is_told_aimets_own_alternatives(export, capsys) -> None:
    d, fp32, aimet = Path(str(export["dir"])), export["fp32"], export["aimet"]
    args = ["exclude", fp32, "--int8", aimet, "--inputs", d / "feeds.npz", "--target", "cosine>=0.9999999"]
    code, out, _ = run_cli([*args, "--bench-runs", "0", "--out", d / "nr", "--quiet"], capsys)
    assert code == 3 and "NOT REACHABLE" in out
    ex = json.loads((d / "nr" / "exclusion.json").read_text())
    assert not (d / "nr" / "aimet.encodings").exists()  # no fix, no edited file
    changes = [a["change"] for a in ex["alternatives"]]
    assert changes[0].startswith('"per_channel_quantization": "True" in the defaults of your quantsim config')
    assert "per_channel=True" not in changes
    assert all(
        "(onnxruntime's recipe; Qualcomm AIMET (aimet-onnx) has its own setting" in a["why"]
        for a in ex["alternatives"][1:]
    )
