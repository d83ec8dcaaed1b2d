"""One list per workflow (issue 25, item 4): an unverified list is a starting point with its measured
estimate; once a run has a verified list, its remedies do not read as a competing fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

import diag.analysis.effects
from diag.analysis.compare import CompareOptions, compare_models
from diag.analysis.effects import EffectBudget, check_effects, estimate_list
from diag.cli.commands import main
from diag.core.feeds import FeedSpec, feed_source
from diag.core.outputs import output_specs
from diag.fixtures.quantize import quantize
from diag.report.view import view_from_document


def _compare(built, tmp_path, name: str, fmt: str, *extra: str) -> dict:
    b = built(name)
    out = tmp_path / f"{name}-{fmt}"
    args = ["compare", str(b.fp32), str(b.int8[fmt]), "--inputs", str(b.inputs_path), "--batch", "8", *extra]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "diag.json").read_text()) | {"_out": str(out)}


def _sqnr(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    return float(10 * np.log10((x * x).sum() / ((y - x) ** 2).sum()))


def test_the_starting_point_carries_its_measured_estimate_everywhere(built, tmp_path):
    doc = _compare(built, tmp_path, "ctc", "dynamic")
    rec = doc["recommendation"]
    assert rec["nodes_to_exclude"] == ["head/MatMul"] and rec["verified"] is False
    est = rec["estimate"]
    assert est["nodes"] == rec["nodes_to_exclude"] and est["target"] == "probs" and est["samples"] == 8
    assert est["recovered"] > 0.9 and est["sqnr_after_db"] > est["sqnr_before_db"] + 10
    # The "before" figure is the INT8 model as onnxruntime runs it by default, on the first 8 samples.
    b = built("ctc")
    x = b.inputs["x"][:8]
    fp = ort.InferenceSession(str(b.fp32), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    q = ort.InferenceSession(str(b.int8["dynamic"]), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert abs(est["sqnr_before_db"] - _sqnr(fp, q)) < 0.01
    summary = Path(doc["_out"], "summary.md").read_text()
    assert "**Starting point** (not verified): keep 1 node(s) in float; estimated on 8 samples" in summary
    assert "Suggested fix" not in summary
    assert "Verify and prune it on held-out samples: `diag exclude " in summary and "--batch 8" in summary
    html = Path(doc["_out"], "report.html").read_text()
    assert "<h2>Starting point (not verified)</h2>" in html and "99% of its error removed" in html


def test_the_estimate_of_a_single_cause_is_the_effect_check_figure(built, tmp_path):
    """A one-group list is what the effect check measured already: the same number, no second run."""
    doc = _compare(built, tmp_path, "ctc", "dynamic")
    effect = next(e for e in doc["effects"]["effects"] if e["fp_nodes"] == ["head/MatMul"])
    assert doc["recommendation"]["estimate"]["recovered"] == effect["recovered"]


def test_without_the_effect_check_the_starting_point_says_it_is_unmeasured(built, tmp_path):
    doc = _compare(built, tmp_path, "ctc", "dynamic", "--effects", "0")
    assert doc["recommendation"]["estimate"] is None
    summary = Path(doc["_out"], "summary.md").read_text()
    assert "**Starting point** (not verified): keep 1 node(s) in float; not measured" in summary


def test_a_remedy_naming_nodes_outside_the_verified_fix_says_so(built, tmp_path):
    """convnet, dynamic: the remedy for relu2_out keeps its reader conv3 in float, the verified fix
    keeps conv2 (the node that writes the outlier channel). The fix's report must not offer conv3 as
    a second fix without saying the verified one does without it. QUInt8 weights (u8u8): exact on
    every CPU, so the verified list does not depend on VNNI."""
    b = built("convnet")
    int8 = quantize(b.fp32, tmp_path / "u8.onnx", "dynamic", weight_type="QUInt8")
    out = tmp_path / "fix"
    args = ["exclude", str(b.fp32), "--int8", str(int8), "--inputs", str(b.inputs_path), "--batch", "8"]
    assert main([*args, "--target", "cosine>=0.999", "--bench-runs", "0", "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "diag.json").read_text())
    verified = doc["exclusion"]["nodes_to_exclude"]
    remedies = [s["python"] for s in doc["suggestions"] if s["python"].startswith("nodes_to_exclude=")]
    off = [p for p in remedies if any(n not in verified for n in json.loads(p.split("=", 1)[1]))]
    assert off, (verified, remedies)  # the case this test is about exists
    notes = [r.note for g in view_from_document(doc, with_plots=False).remedy_groups for r in g.remedies]
    assert any(f"not needed by the verified fix (nodes_to_exclude={json.dumps(verified)})" in n for n in notes), notes
    summary = (out / "summary.md").read_text()
    assert "not needed by the verified fix" in summary


def test_a_remedy_naming_nodes_a_tier_plan_keeps_out_of_float_says_so(built, tmp_path):
    """The same model fixed by a tier plan (diag exclude --tiers): its report shows the plan, not
    the starting point, so a remedy's extra nodes are measured against the plan's fp32 tier."""
    b = built("convnet")
    int8 = quantize(b.fp32, tmp_path / "u8.onnx", "dynamic", weight_type="QUInt8")
    out = tmp_path / "tiers"
    args = ["exclude", str(b.fp32), "--int8", str(int8), "--inputs", str(b.inputs_path), "--batch", "8"]
    flags = ["--target", "cosine>=0.999", "--tiers", "int8,fp32", "--bench-runs", "0", "--out", str(out), "--quiet"]
    assert main([*args, *flags]) == 0
    doc = json.loads((out / "diag.json").read_text())
    floated = doc["tiers"]["recipe"]["nodes_to_exclude"]
    remedies = [s["python"] for s in doc["suggestions"] if s["python"].startswith("nodes_to_exclude=")]
    off = [p for p in remedies if any(n not in floated for n in json.loads(p.split("=", 1)[1]))]
    assert floated and off, (floated, remedies)  # the case this test is about exists
    notes = [r.note for g in view_from_document(doc, with_plots=False).remedy_groups for r in g.remedies]
    assert any("not kept in float by the verified tier plan" in n for n in notes), notes
    assert not any("starting point" in n for n in notes), notes
    assert "not kept in float by the verified tier plan" in (out / "summary.md").read_text()


def test_a_list_estimate_reuses_the_effect_checks_fp32_outputs(built, monkeypatch):
    """The list estimate measures against the FP32 outputs the effect check computed (the FP32
    model is not loaded again) and gets the figure a fresh FP32 run gives."""
    b = built("convnet")
    result = compare_models(
        b.fp32, b.int8["qdq"], FeedSpec(inputs=str(b.inputs_path), batch=8), CompareOptions(progress=False, effects=0)
    )
    fp, q, matching = result.fp32, result.int8, result.matching
    feeds = feed_source(fp.proto, FeedSpec(inputs=str(b.inputs_path), batch=8))
    specs = output_specs(fp.proto)
    check = check_effects(fp, q, matching, feeds, result.findings, result.paths, specs, EffectBudget(progress=False))
    assert check is not None and check.reference is not None and len(check.effects) >= 2
    nodes = [n for e in check.effects[:2] for n in e.finding.group.fp_nodes]
    loads: list[str] = []
    real = diag.analysis.effects.session_from_model

    def counting(model, role, *args, **kwargs):
        loads.append(role)
        return real(model, role, *args, **kwargs)

    monkeypatch.setattr(diag.analysis.effects, "session_from_model", counting)
    reused = estimate_list(fp, q, matching, feeds, nodes, check, specs)
    assert loads == ["INT8 model with the suggested list in float"]
    check.reference = None
    fresh = estimate_list(fp, q, matching, feeds, nodes, check, specs)
    assert loads.count("FP32 model") == 1
    assert reused is not None and reused == fresh
