"""`diag exclude`: the derived list holds the culprit, meets the target on held-out inputs, is minimal,
costs O(log n + list) re-quantizations, and says "not reachable" instead of faking success."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from diag.cli.commands import EXCLUDE_TARGET_HELP, main
from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.fix.evaluate import TARGET_METRICS, parse_target, split_feeds
from diag.fix.exclude import ExcludeOptions, derive_exclusions
from diag.fix.exclude import summary_lines as summary
from diag.fix.quantize import quantize_model
from diag.fixtures import models
from diag.foundations.errors import DiagError
from diag.report.exclude_view import report_section
from diag.report.nodedata import OVERLAYS
from diag.report.plots_exclude import trajectory_plot

# NOTE: QUInt8 weights: onnxruntime's default QInt8 runs u8s8 integer kernels that saturate on x86
# CPUs without VNNI (AVX2 only), so which nodes a search keeps would depend on the CI machine's CPU.
DYNAMIC = Recipe(mode="dynamic", weight_type="QUInt8")
QDQ = Recipe(mode="static", quant_format="QDQ", activation_type="QUInt8", weight_type="QInt8")


def chain(n: int = 40, hidden: int = 16, defect: int | None = 20, seed: int = 0) -> onnx.ModelProto:
    """``n`` MatMuls with orthogonal weights; at ``defect`` one output column is x40 and the next
    MatMul's matching row /40 (FP32 unchanged): MatMuls ``defect`` and ``defect + 1`` break."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(n):
        w = np.linalg.qr(rng.standard_normal((hidden, hidden)))[0].astype(np.float32)
        if defect is not None and i == defect:
            w[:, 3] *= 40
        if defect is not None and i == defect + 1:
            w[3, :] /= 40
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        out = "y" if i == n - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [out], name=f"mm{i:02d}"))
        x = out
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", hidden])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_fixture(tmp: Path, name: str) -> tuple[Path, Path, dict[str, np.ndarray]]:
    fx = models.build(name)
    fp = tmp / f"{name}.fp32.onnx"
    onnx.save(fx.model, fp)
    arrays = fx.make_inputs(32, 12)
    np.savez(tmp / f"{name}.npz", **arrays)
    return fp, tmp / f"{name}.npz", arrays


def write_chain(tmp: Path, defect: int | None) -> tuple[Path, Path, dict[str, np.ndarray]]:
    fp = tmp / "chain.fp32.onnx"
    onnx.save(chain(defect=defect), fp)
    arrays = {"x": np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32)}
    np.savez(tmp / "chain.npz", **arrays)
    return fp, tmp / "chain.npz", arrays


def held_out_min_cosine(fp32: Path, model: Path, arrays: dict[str, np.ndarray], first: int, batch: int = 8) -> float:
    """Independent of diag's evaluator: plain onnxruntime + numpy, ``batch`` rows per run (dynamic
    quantization picks its scale per run, so the batching is part of the measurement)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a = ort.InferenceSession(str(fp32), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    worst = math.inf
    n = len(next(iter(arrays.values())))
    for i in range(first, n, batch):
        feed = {k: v[i : i + batch] for k, v in arrays.items()}
        for x, y in zip(a.run(None, feed), b.run(None, feed), strict=True):
            x, y = x.astype(np.float64).reshape(len(x), -1), y.astype(np.float64).reshape(len(y), -1)
            cos = (x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1))
            worst = min(worst, float(cos.min()))
    return worst


def assert_minimal(fp32: Path, recipe: Recipe, result, arrays, tmp: Path, calib: FeedSpec | None = None) -> None:
    """Re-including any excluded group (all its nodes) breaks the target on the held-out samples."""
    first = result.split["held_out_first"]
    for c in result.excluded:
        rest = [n for n in result.nodes_to_exclude if n not in c.fp_nodes]
        out = tmp / f"without-{c.rank}.onnx"
        quantize_model(fp32, recipe.with_excluded(rest), out, calibration=calib)
        cos = held_out_min_cosine(fp32, out, arrays, first)
        assert not result.target.met(cos), (c.label, cos)


def test_transformer_culprit_is_kept_in_float_and_the_target_met_on_held_out_samples(tmp_path):
    fp, npz, arrays = write_fixture(tmp_path, "transformer")
    feeds = FeedSpec(inputs=str(npz), batch=8)
    r = derive_exclusions(fp, DYNAMIC, feeds, ExcludeOptions("cosine>=0.999", bench_runs=0, progress=False), tmp_path)
    assert r.reachable and not r.already_met
    assert models.transformer().expected.culprit_node in r.nodes_to_exclude
    assert r.split["held_out_first"] == 16 and r.split["held_out_samples"] == 16
    assert r.before.cosine < 0.999 <= r.after.cosine
    # the verified figure is the held-out one, measured independently
    assert held_out_min_cosine(fp, Path(r.model), arrays, 16) == pytest.approx(r.after.cosine, abs=1e-5)
    assert held_out_min_cosine(fp, Path(r.model), arrays, 16) != pytest.approx(
        held_out_min_cosine(fp, Path(r.model), {k: v[:16] for k, v in arrays.items()}, 0), abs=1e-9
    ), "the ranking samples are not part of the verdict"
    real = [s for s in r.trajectory if not s.phase.startswith("estimate")]
    assert r.quantizations == len(real) and r.evaluations == r.quantizations
    # the search ran on estimates; only the baseline and the estimated answer were re-quantized
    assert [s.phase for s in real] == ["baseline", "verify"] and r.estimates == 1
    assert_minimal(fp, DYNAMIC, r, arrays, tmp_path)


def test_convnet_qdq_list_holds_conv3_and_pruning_leaves_only_needed_groups(tmp_path):
    fp, npz, arrays = write_fixture(tmp_path, "convnet")
    feeds = FeedSpec(inputs=str(npz), batch=8)
    r = derive_exclusions(fp, QDQ, feeds, ExcludeOptions("cosine>=0.9999", bench_runs=0, progress=False))
    assert r.reachable
    assert models.convnet().expected.culprit_node in r.nodes_to_exclude
    assert r.candidates[0].label.startswith("conv3"), "the culprit is ranked first"
    assert r.after.cosine >= 0.9999
    assert r.calibration and "ranking split" in r.calibration
    [sug] = r.op_type_suggestions  # conv2 and conv3 of 3 Convs: the op-type complement is offered, verified
    assert sug["op_type"] == "Conv" and sug["excluded"] == 2 and sug["of"] == 3
    assert "Conv" not in sug["op_types_to_quantize"] and "Gemm" in sug["op_types_to_quantize"]
    assert sug["met"] == r.target.met(sug["metric"])
    doc = r.to_dict()
    json.dumps(doc, allow_nan=False)
    svg = trajectory_plot(doc)
    assert svg.startswith("<svg") and "cosine&gt;=0.9999" in svg
    calib = FeedSpec(inputs=str(npz), batch=8, samples=r.split["ranking_samples"])
    assert_minimal(fp, QDQ, r, arrays, tmp_path, calib)


def test_many_candidates_need_logarithmic_requantizations(tmp_path):
    fp, npz, _ = write_chain(tmp_path, defect=20)
    r = derive_exclusions(
        fp,
        DYNAMIC,
        FeedSpec(inputs=str(npz), batch=8),
        ExcludeOptions("cosine>=0.995", bench_runs=0, progress=False, estimates=False),
    )
    n = len(r.candidates)
    assert n == 40
    assert r.reachable and set(r.nodes_to_exclude) == {"mm20", "mm21"}
    prefix = max(s.excluded_groups for s in r.trajectory if s.phase == "search" and s.met)
    bound = 1 + 2 * math.ceil(math.log2(n)) + prefix
    assert r.quantizations <= bound, (r.quantizations, bound)
    assert r.quantizations < n / 4, "far fewer re-quantizations than one per candidate"
    assert r.evaluations == r.quantizations


def test_unreachable_target_is_reported_as_such_not_as_a_list(tmp_path):
    fp, npz, _ = write_chain(tmp_path, defect=None)
    r = derive_exclusions(
        fp,
        DYNAMIC,
        FeedSpec(inputs=str(npz), batch=8),
        ExcludeOptions("cosine>=0.999999", bench_runs=0, progress=False),
    )
    assert not r.reachable and r.verdict == "not reachable"
    assert r.nodes_to_exclude == [] and r.after is None and r.model is None
    assert max(s.excluded_groups for s in r.trajectory) == len(r.candidates) - 1, "all-but-one was tried"
    changes = [a["change"] for a in r.alternatives]
    assert "per_channel=True" in changes and "static QDQ instead of dynamic" in changes
    assert any("QInt16" in c for c in changes)
    assert r.quantizations <= 2 + math.ceil(math.log2(len(r.candidates)))


def test_cli_writes_exclusion_json_model_and_snippet_and_exits_3_when_unreachable(tmp_path, capsys):
    fp, npz, _ = write_fixture(tmp_path, "transformer")
    out = tmp_path / "ex"
    argv = ["exclude", str(fp), "--inputs", str(npz), "--batch", "8", "--target", "cosine>=0.999", "--quiet"]
    argv += ["--recipe", '{"mode": "dynamic", "weight_type": "QUInt8"}']  # u8u8: the same list on every CPU
    assert main([*argv, "--bench-runs", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "target cosine>=0.999 met on 16 held-out samples" in text and "layer1/ffn/fc1/MatMul" in text
    assert "latency p50" in text
    doc = json.loads((out / "exclusion.json").read_text())
    assert doc["nodes_to_exclude"] == ["layer1/ffn/fc1/MatMul"]
    assert doc["recipe"]["nodes_to_exclude"] == ["layer1/ffn/fc1/MatMul"]
    assert [x["model"] for x in doc["latency"]] == ["fp32", "int8", "mixed"]
    real = [s for s in doc["search"]["trajectory"] if not s["phase"].startswith("estimate")]
    assert doc["search"]["quantizations"] == len(real) and doc["search"]["estimates"] == 1
    assert (out / "transformer.mixed.onnx").is_file() and "quantize_dynamic(" in (out / "reproduce.py").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temp files left"
    view = report_section(doc)
    assert view["nodes"] == ["layer1/ffn/fc1/MatMul"] and view["verdict"] == "met"
    assert [r["name"] for r in view["metrics"]][:3] == ["cosine", "cosine_mean", "max_abs"]
    assert view["metrics"][0]["after"] == f"{doc['metrics']['after']['cosine']:.6f}"
    assert view["latency"][0]["speedup"] == "ref" and "quantize_dynamic(" in view["snippet"]
    # One report: the verified fix first (with its trajectory and snippet), then the baseline's diagnosis.
    html = (out / "report.html").read_text()
    assert (
        html.index('id="verdict"')
        < html.index('id="exclusion"')
        < html.index('id="root-causes"')
        < html.index('id="nodes"')
    )
    assert 'id="plot-exclusion"><svg' in html and "quantize_dynamic(" in html
    assert json.loads((out / "diag.json").read_text())["exclusion"]["nodes_to_exclude"] == doc["nodes_to_exclude"]
    assert "keep in float: `layer1/ffn/fc1/MatMul`" in (out / "summary.md").read_text()

    fp2, npz2, _ = write_chain(tmp_path, defect=None)
    out2 = tmp_path / "ex2"
    out2.mkdir()
    (out2 / "chain.mixed.onnx").write_text("left by an earlier run")
    rc = main(
        [
            "exclude",
            str(fp2),
            "--inputs",
            str(npz2),
            "--target",
            "cosine>=0.999999",
            "--bench-runs",
            "0",
            "--quiet",
            "--batch",
            "8",
            "--out",
            str(out2),
        ]
    )
    assert rc == 3
    assert "NOT REACHABLE" in capsys.readouterr().out
    # No model and no snippet: only the verdict, and the diagnosis report that explains it.
    report = ["diag.json", "report.html", "summary.md", *OVERLAYS]
    written = {p.name for p in out2.iterdir()} - {"error_path.svg"}  # (written when an output has a path)
    assert written == {"exclusion.json", *report}
    assert json.loads((out2 / "exclusion.json").read_text())["verdict"] == "not reachable"
    html = (out2 / "report.html").read_text()
    assert "Verified fix" in html and "not reachable" in html and "Cheaper alternatives" in html
    assert "Verified fix**: not reachable" in (out2 / "summary.md").read_text()


def test_target_already_met_costs_one_quantization(tmp_path):
    fp, npz, _ = write_fixture(tmp_path, "transformer")
    r = derive_exclusions(
        fp, DYNAMIC, FeedSpec(inputs=str(npz), batch=8), ExcludeOptions("cosine>=0.99", bench_runs=0, progress=False)
    )
    assert r.already_met and r.reachable and r.nodes_to_exclude == []
    assert r.quantizations == 1 and r.ranking_passes == 0


def test_accuracy_and_f1_targets_use_labels_of_the_held_out_rows(tmp_path):
    fp, npz, arrays = write_fixture(tmp_path, "convnet")
    sess = ort.InferenceSession(str(fp), providers=["CPUExecutionProvider"])
    labels = sess.run(None, arrays)[0].argmax(axis=1)
    labels[16:20] = (labels[16:20] + 1) % 10  # FP32 is wrong on 4 of the 16 held-out rows
    np.save(tmp_path / "labels.npy", labels)
    feeds = FeedSpec(inputs=str(npz), batch=8)
    r = derive_exclusions(
        fp,
        QDQ,
        feeds,
        ExcludeOptions("f1_drop<=0.2", labels=str(tmp_path / "labels.npy"), bench_runs=0, progress=False),
    )
    assert r.before.accuracy_fp32 == pytest.approx(12 / 16)
    assert r.before.f1_drop is not None
    with pytest.raises(DiagError, match="needs --labels"):
        derive_exclusions(fp, QDQ, feeds, ExcludeOptions("accuracy_drop<=0.01", bench_runs=0, progress=False))


def test_split_keeps_ranking_and_held_out_disjoint(tmp_path):
    _, npz, arrays = write_chain(tmp_path, defect=None)
    fp = tmp_path / "chain.fp32.onnx"
    src = FeedSpec(inputs=str(npz), batch=4).source(onnx.load(fp))
    s = split_feeds(src, 0.25)
    rank = np.concatenate([b.feeds["x"] for b in s.ranking])
    held = np.concatenate([b.feeds["x"] for b in s.held_out])
    assert len(rank) == 24 and len(held) == 8
    np.testing.assert_array_equal(held, arrays["x"][24:])
    assert s.to_dict()["held_out"] == "samples 24..31"


@pytest.mark.parametrize(
    ("text", "problem"),
    [("cosine<=0.9", "higher is better"), ("loss>=1", "unknown metric"), ("cosine 0.9", "is not metric")],
)
def test_bad_targets_are_user_errors(text, problem):
    with pytest.raises(DiagError, match=problem) as e:
        parse_target(text)
    assert e.value.slug == "bad-option"


def test_help_explains_every_target_metric():
    for metric, (direction, _) in TARGET_METRICS.items():
        assert f"{metric}{direction}V" in EXCLUDE_TARGET_HELP


def test_cli_flags_reach_the_library(tmp_path, capsys):
    fp, npz, _ = write_chain(tmp_path, defect=20)
    (tmp_path / "r.json").write_text(json.dumps({"mode": "dynamic", "per_channel": True}))
    out = tmp_path / "flags"
    argv = ["exclude", str(fp), "--inputs", str(npz), "--batch", "4", "--holdout", "0.25", "--target", "max_abs<=5"]
    argv += ["--max-trials", "99", "--time-budget", "600"]
    assert main([*argv, "--recipe", str(tmp_path / "r.json"), "--bench-runs", "0", "--quiet", "--out", str(out)]) == 0
    doc = json.loads((out / "exclusion.json").read_text())
    assert doc["search"]["budget"] == {"max_trials": 99, "time_budget": 600.0, "exhausted": False}
    assert doc["target"] == "max_abs<=5"
    assert doc["split"]["held_out"] == "samples 24..31" and doc["split"]["batch"] == 4
    assert doc["recipe"]["per_channel"] is True and doc["recipe"]["mode"] == "dynamic"
    assert "samples 24..31" in capsys.readouterr().out


def test_a_list_whose_mixed_model_outputs_nan_fails_the_target_and_is_not_picked(tmp_path, capsys):
    fx = models.build("nan_on_exclusion")
    fp = tmp_path / "nan.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp_path / "nan.npz", **fx.make_inputs(32, 12))
    out = tmp_path / "ex"
    argv = ["exclude", str(fp), "--inputs", str(tmp_path / "nan.npz"), "--batch", "8", "--target", "cosine>=0.99"]
    assert main([*argv, "--bench-runs", "0", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(
        r"cosine -1\.0000 \(16 of 16 held-out samples NaN/Inf\) -> 1\.0000 \(level all: [-\d.]+\) by keeping 2 nodes",
        text,
    ), text
    doc = json.loads((out / "exclusion.json").read_text())
    # Keeping only the worst-ranked node fixes output 'a' but leaves 'logb' = log(0) = -inf on
    # every held-out sample: that list is tried, fails, and is not the answer.
    steps = {tuple(s["excluded_nodes"]): s for s in doc["search"]["trajectory"]}
    only_a = steps[("a/MatMul",)]
    assert only_a["nonfinite_samples"] == 16 and only_a["metric"] == -1.0 and not only_a["met"]
    assert doc["nodes_to_exclude"] == ["a/MatMul", fx.expected.culprit_node]
    assert doc["metrics"]["before"]["nonfinite_samples"] == 16 and doc["metrics"]["before"]["max_abs"] == "inf"
    assert doc["metrics"]["after"]["nonfinite_samples"] == 0 and doc["metrics"]["after"]["samples"] == 16
    assert held_out_min_cosine(fp, out / "nan.mixed.onnx", dict(np.load(tmp_path / "nan.npz")), 16) >= 0.99
    assert "- NaN/Inf samples: 16 of 16 → 0 of 16" in (out / "summary.md").read_text()
    # op_types_to_quantize=[] would mean "every default type" to onnxruntime: never suggested
    assert all(s["op_types_to_quantize"] for s in doc["op_type_suggestions"])


def test_nan_samples_fail_any_target_and_count_as_the_worst_value(tmp_path):
    fx = models.build("nan_on_exclusion")
    fp = tmp_path / "nan.fp32.onnx"
    onnx.save(fx.model, fp)
    arrays = fx.make_inputs(32, 12)
    np.savez(tmp_path / "nan.npz", **arrays)
    from diag.core.load import model_from_path
    from diag.fix.evaluate import HeldOutEvaluator

    q = tmp_path / "only_a.onnx"
    quantize_model(fp, DYNAMIC.with_excluded(["a/MatMul"]), q)
    source = FeedSpec(inputs=str(tmp_path / "nan.npz"), batch=8).source(fx.model)
    m = HeldOutEvaluator(model_from_path(fp, "FP32"), source, 0, None, None).evaluate(q)
    assert m.samples == 32 and m.nonfinite_samples == 32
    assert (m.cosine, m.max_abs) == (-1.0, math.inf)
    # Agreement is measured on class outputs only ('a', intact): 'logb' is Log values, not classes.
    # Its -inf samples still fail every target, agreement included.
    assert m.agreement == 1.0
    for target in ("cosine>=-1", "max_abs<=1e30", "agreement>=0"):
        t = parse_target(target)
        assert not m.meets(t), target


def test_compare_grades_an_output_with_nan_samples_reject_without_an_excellent_max_abs(tmp_path):
    from diag.analysis.compare import CompareOptions, compare_models

    fx = models.build("nan_on_exclusion")
    fp = tmp_path / "nan.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp_path / "nan.npz", **fx.make_inputs(8, 12))
    q = tmp_path / "nan.int8.onnx"
    quantize_model(fp, DYNAMIC, q)
    r = compare_models(fp, q, FeedSpec(inputs=str(tmp_path / "nan.npz")), CompareOptions(progress=False))
    [v] = [v for v in r.verdicts if v.name == "logb"]
    assert v.grade == "reject"
    assert v.reasons[0] == "8 of 8 samples have NaN/Inf in the INT8 output"
    assert not any("max abs" in x for x in v.reasons)
    assert v.per_sample.nonfinite_samples == 8 and v.per_sample.max_abs == math.inf
    assert math.isnan(v.per_sample.cosine_min), "no cosine stands for a NaN sample"


def test_progress_bar_shows_trials_total_and_eta_on_a_terminal(monkeypatch, capsys):
    import sys

    from diag.foundations.progress import Progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = Progress(None, "exclude", unit="trials")
    bar.start -= 20.0  # two trials in 20 s: 10 s each
    bar.total = 8
    bar.advance(2)
    bar.note("exclude: search      1 group(s) in float -> cosine 0.5 (missed)")
    bar.finish()
    err = capsys.readouterr().err
    assert "2/8 trials, 10.0 s each, eta 1m00s" in err
    assert "exclude: search      1 group(s) in float" in err
    assert err.rstrip().endswith("2/2 trials, 10.0 s each, eta 0s"), "an estimated total ends at 100 %"


def _nan_fixture(tmp: Path) -> tuple[Path, Path]:
    fx = models.build("nan_on_exclusion")
    fp = tmp / "nan.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp / "nan.npz", **fx.make_inputs(32, 12))
    return fp, tmp / "nan.npz"


def test_max_trials_returns_the_best_verified_list_so_far_and_says_budget_exhausted(tmp_path, capsys):
    fp, npz = _nan_fixture(tmp_path)
    feeds = FeedSpec(inputs=str(npz), batch=8)
    # baseline, {a} (NaN), {a, b} (met): the cap stops the pruning, the met list is the answer
    r = derive_exclusions(
        fp, DYNAMIC, feeds, ExcludeOptions("cosine>=0.99", bench_runs=0, progress=False, max_trials=3, estimates=False)
    )
    assert r.quantizations == 3 and r.verdict == "met" and r.nodes_to_exclude == ["a/MatMul", "b/MatMul"]
    assert r.budget == {"max_trials": 3, "time_budget": None, "exhausted": True, "reason": "--max-trials 3 reached"}
    assert any("budget exhausted (--max-trials 3 reached)" in x and "not proven minimal" in x for x in summary(r))
    # one trial fewer: nothing met yet, which is not "not reachable"
    out = tmp_path / "ex"
    argv = ["exclude", str(fp), "--inputs", str(npz), "--batch", "8", "--target", "cosine>=0.99", "--max-trials", "2"]
    assert main([*argv, "--no-estimates", "--bench-runs", "0", "--quiet", "--out", str(out)]) == 3
    text = capsys.readouterr().out
    assert "NOT MET: budget exhausted (--max-trials 2 reached) before any list met it" in text
    assert "NOT REACHABLE" not in text and not (out / "nan.mixed.onnx").exists()
    doc = json.loads((out / "exclusion.json").read_text())
    assert (
        doc["verdict"] == "budget exhausted" and doc["nodes_to_exclude"] == [] and doc["search"]["quantizations"] == 2
    )


def test_time_budget_stops_the_search_after_the_baseline(tmp_path):
    fp, npz = _nan_fixture(tmp_path)
    r = derive_exclusions(
        fp,
        DYNAMIC,
        FeedSpec(inputs=str(npz), batch=8),
        ExcludeOptions("cosine>=0.99", bench_runs=0, progress=False, time_budget=1e-6),
    )
    assert r.quantizations == 1 and r.verdict == "budget exhausted"
    assert r.budget["reason"] == "--time-budget reached"
    with pytest.raises(DiagError, match="must be at least 1"):
        derive_exclusions(fp, DYNAMIC, FeedSpec(inputs=str(npz)), ExcludeOptions("cosine>=0.99", max_trials=0))


def test_a_mixed_model_slower_than_fp32_is_warned_about():
    from diag.fix.exclude import _slower_warning

    lat = [{"model": "fp32", "p50_ms": 20.0}, {"model": "int8", "p50_ms": 30.0}, {"model": "mixed", "p50_ms": 24.6}]
    [w] = _slower_warning(lat)
    assert w.startswith("warning: the mixed model is slower than FP32 (p50 24.60 ms vs 20.00 ms)")
    assert _slower_warning([{**lat[0]}, {"model": "mixed", "p50_ms": 12.0}]) == []
    assert _slower_warning(lat[:2]) == [], "nothing to say without a mixed model"


def test_a_candidate_model_with_external_weights_is_evaluated_like_the_same_model_in_one_file(tmp_path):
    """Quantizers write external data for > 2 GB models; the evaluator must read those weights."""
    from diag.core.load import model_from_path
    from diag.fix.evaluate import HeldOutEvaluator

    fx = models.build("nan_on_exclusion")
    fp = tmp_path / "m.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp_path / "m.npz", **fx.make_inputs(16, 3))
    q = tmp_path / "one.onnx"
    quantize_model(fp, DYNAMIC, q)
    split = tmp_path / "split" / "split.onnx"
    split.parent.mkdir()
    onnx.save(onnx.load(q), split, save_as_external_data=True, location="split.onnx.data", size_threshold=0)
    assert (split.parent / "split.onnx.data").stat().st_size > 0
    source = FeedSpec(inputs=str(tmp_path / "m.npz"), batch=8).source(fx.model)
    ev = HeldOutEvaluator(model_from_path(fp, "FP32"), source, 0, None, None)
    one, external = ev.evaluate(q), ev.evaluate(split)
    assert external.samples == one.samples == 16
    assert external.to_dict() == one.to_dict()
