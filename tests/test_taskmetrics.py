"""Task metrics: F1 (macro and micro) against --labels, and --metric plugins in compare, check,
merge and exclude; every broken plugin is a one-line ``bad-metric`` error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnxruntime.quantization import quantize_dynamic

from diag.core.feeds import FeedSpec
from diag.core.recipe import Recipe
from diag.core.taskmetrics import F1Metric, TaskMetric
from diag.fix.exclude import ExcludeOptions, derive_exclusions
from diag.fixtures import models
from diag.foundations.errors import GATE_FAILED, OK, USER_ERROR
from diag.report.view import md_escape

PLUGIN = "taskmetric_plugins:rel_error"


@pytest.fixture(autouse=True)
def _plugins_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _f1_by_hand(truth: np.ndarray, pred: np.ndarray) -> tuple[float, float]:
    """Macro and micro F1 from a confusion matrix (rows truth, columns prediction), labelled classes only."""
    k = int(max(truth.max(), pred.max())) + 1
    cm = np.zeros((k, k), np.int64)
    np.add.at(cm, (truth, pred), 1)
    classes = np.unique(truth)
    tp = cm.diagonal()[classes]
    fp = cm.sum(0)[classes] - tp
    fn = cm.sum(1)[classes] - tp
    macro = float(np.mean(2 * tp / (2 * tp + fp + fn)))
    micro = float(2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()))
    return macro, micro


def test_f1_macro_and_micro_match_a_hand_computation():
    truth = np.array([0, 0, 1, 1, 2, 2])
    fp_pred = np.array([0, 0, 1, 1, 2, 2])
    q_pred = np.array([0, 1, 1, 1, 2, 0])
    # INT8 by hand: class 0 tp 1 fp 1 fn 1 -> 0.5; class 1 tp 2 fp 1 fn 0 -> 0.8; class 2 tp 1 fp 0 fn 1 -> 2/3
    macro_q = (0.5 + 0.8 + 2 / 3) / 3
    micro_q = 2 * 4 / (2 * 4 + 2 + 2)  # = accuracy 4/6 for single-label predictions
    m = F1Metric("logits")
    halves = [F1Metric("logits"), F1Metric("logits")]
    for part, rows in zip(halves, (slice(0, 3), slice(3, 6)), strict=True):
        part.update({"logits": np.eye(3)[fp_pred[rows]]}, {"logits": np.eye(3)[q_pred[rows]]}, truth[rows])
    m.update({"logits": np.eye(3)[fp_pred]}, {"logits": np.eye(3)[q_pred]}, truth)
    v = m.finalize()
    assert v["f1_macro_fp32"] == 1.0 and v["f1_micro_fp32"] == 1.0
    assert v["f1_macro_int8"] == pytest.approx(macro_q, abs=1e-12)
    assert v["f1_micro_int8"] == pytest.approx(micro_q, abs=1e-12) == pytest.approx(4 / 6)
    assert v["f1_macro_drop"] == pytest.approx(1 - macro_q) and v["f1_micro_drop"] == pytest.approx(1 - micro_q)
    assert _f1_by_hand(truth, q_pred) == pytest.approx((macro_q, micro_q))
    merged = halves[0].merge(F1Metric.from_state(json.loads(json.dumps(halves[1].to_state()))))
    assert merged.finalize() == v  # streaming + merge (through the JSON state) = one pass
    assert isinstance(m, TaskMetric)


@pytest.fixture(scope="module")
def labelled(built, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, np.ndarray]:
    """The transformer fixture's dynamic INT8 model with labels where the INT8 model errs on some rows."""
    b = built("transformer")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    fp = ort.InferenceSession(str(b.fp32), so, providers=["CPUExecutionProvider"]).run(None, b.inputs)[0]
    # Labels: FP32's argmax, with every 5th row relabelled, so both models make mistakes.
    labels = fp.argmax(axis=1).astype(np.int64)
    labels[::5] = (labels[::5] + 1) % fp.shape[1]
    path = tmp_path_factory.mktemp("labels") / "labels.npy"
    np.save(path, labels)
    return b, path, labels


def _run_both(b) -> tuple[np.ndarray, np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    outs = []
    for model in (b.fp32, b.int8["dynamic"]):
        sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        x = b.inputs["input_ids"]
        outs.append(np.concatenate([sess.run(None, {"input_ids": x[i : i + 8]})[0] for i in range(0, len(x), 8)]))
    return outs[0], outs[1]


def test_compare_reports_f1_with_labels_and_check_gates_on_it(labelled, tmp_path, capsys):
    b, labels_path, labels = labelled
    out = tmp_path / "out"
    args = ["compare", b.fp32, b.int8["dynamic"], "--inputs", b.inputs_path, "--batch", "8", "--out", out, "--quiet"]
    code, stdout, err = run_cli([*args, "--labels", labels_path], capsys)
    assert code == OK, err
    fp, q = _run_both(b)
    macro_fp, micro_fp = _f1_by_hand(labels, fp.argmax(1))
    macro_q, micro_q = _f1_by_hand(labels, q.argmax(1))
    doc = json.loads((out / "diag.json").read_text())
    row = doc["verdict"]["outputs"][0]
    assert row["f1_macro_fp32"] == pytest.approx(macro_fp, abs=1e-6)
    assert row["f1_macro_int8"] == pytest.approx(macro_q, abs=1e-6)
    assert row["f1_micro_fp32"] == pytest.approx(micro_fp, abs=1e-6) == pytest.approx(row["accuracy_fp32"], abs=1e-6)
    assert row["f1_micro_drop"] == pytest.approx(micro_fp - micro_q, abs=1e-6)
    assert doc["task_metrics"]["f1"]["samples"] == 32
    drop = macro_fp - macro_q
    assert drop > 0.005, "the fixture's INT8 model must lose some F1 for the gate to mean anything"
    assert f"macro-F1 {macro_fp:.2%} -> {macro_q:.2%}, drop {drop:.2%}" in stdout
    f1_line = f"F1 of output logits against --labels (32 samples): macro {macro_fp:.2%} → {macro_q:.2%}"
    assert f1_line in stdout and f1_line in (out / "report.html").read_text()
    assert f1_line.replace("output logits", "output `logits`") in (out / "summary.md").read_text()  # a name: code
    code, stdout, _ = run_cli(["check", out / "diag.json", "--max-f1-drop", f"{drop + 0.001}"], capsys)
    assert code == OK and f"PASS max-f1-drop: output 'logits' f1_macro_drop {drop:.5f} <= " in stdout
    code, stdout, _ = run_cli(["check", out / "diag.json", "--max-f1-drop", f"{drop - 0.001}"], capsys)
    assert code == GATE_FAILED and "FAIL max-f1-drop" in stdout
    # Without --labels the gate cannot measure anything: it fails, never passes vacuously.
    code, _, err = run_cli([*args, "--out", tmp_path / "nolabels"], capsys)
    assert code == OK, err
    code, stdout, _ = run_cli(["check", tmp_path / "nolabels" / "diag.json", "--max-f1-drop", "0.5"], capsys)
    assert code == GATE_FAILED and "has no F1 drop" in stdout


def _rel_err(fp: np.ndarray, q: np.ndarray) -> float:
    x, e = fp.reshape(len(fp), -1).astype(np.float64), (q - fp).reshape(len(fp), -1).astype(np.float64)
    return float((np.sqrt((e * e).sum(1)) / np.sqrt((x * x).sum(1))).max())


def test_metric_plugin_is_reported_with_the_outputs_and_re_rendered(labelled, tmp_path, capsys):
    b, _, _ = labelled
    out = tmp_path / "out"
    args = ["compare", b.fp32, b.int8["dynamic"], "--inputs", b.inputs_path, "--batch", "8", "--out", out, "--quiet"]
    code, stdout, err = run_cli([*args, "--metric", PLUGIN], capsys)
    assert code == OK, err
    expected = _rel_err(*_run_both(b))
    doc = json.loads((out / "diag.json").read_text())
    plugin = doc["task_metrics"]["plugin"]
    assert plugin["spec"] == PLUGIN and plugin["better"] == {"rel_err": "lower"}
    assert plugin["values"]["rel_err"] == pytest.approx(expected, rel=1e-5)
    line = f"metric {PLUGIN}: rel_err {plugin['values']['rel_err']:.6g} (lower is better)"
    assert f"  {line}\n" in stdout
    assert md_escape(line) in (out / "summary.md").read_text() and line in (out / "report.html").read_text()
    code, _, err = run_cli(["report", out / "diag.json", "--out", tmp_path / "again"], capsys)
    assert code == OK, err
    assert md_escape(line) in (tmp_path / "again" / "summary.md").read_text()


def test_shards_merge_f1_counts_and_plugin_state_into_one_run(labelled, tmp_path, capsys):
    b, labels_path, _ = labelled
    base = ["compare", b.fp32, b.int8["dynamic"], "--inputs", b.inputs_path, "--batch", "8", "--quiet"]
    extra = ["--labels", labels_path, "--metric", PLUGIN, "--no-local", "--no-distributions"]
    code, _, err = run_cli([*base, *extra, "--out", tmp_path / "one"], capsys)
    assert code == OK, err
    for k in (0, 1):
        code, _, err = run_cli([*base, *extra, "--shard", f"{k}/2", "--out", tmp_path / f"s{k}"], capsys)
        assert code == OK, err
    code, stdout, err = run_cli(
        ["merge", tmp_path / "s0/diag.json", tmp_path / "s1/diag.json", "--out", tmp_path / "m"], capsys
    )
    assert code == OK, err
    one = json.loads((tmp_path / "one/diag.json").read_text())
    merged = json.loads((tmp_path / "m/diag.json").read_text())
    assert merged["task_metrics"] == one["task_metrics"]
    assert merged["verdict"]["outputs"][0]["f1_macro_drop"] == one["verdict"]["outputs"][0]["f1_macro_drop"]
    assert f"metric {PLUGIN}: rel_err" in stdout


def test_shard_with_a_plugin_that_cannot_be_serialized_is_refused_up_front(labelled, tmp_path, capsys):
    b, labels_path, _ = labelled
    out = tmp_path / "s0"
    code, _, err = run_cli(
        [
            *("compare", b.fp32, b.int8["dynamic"], "--inputs", b.inputs_path, "--labels", labels_path, "--out", out),
            *("--metric", "taskmetric_plugins:correct_count", "--shard", "0/2", "--quiet"),
        ],
        capsys,
    )
    assert code == USER_ERROR
    assert err.startswith("diag: error[bad-option]: --metric 'taskmetric_plugins:correct_count' with --shard | ")
    assert "no state() / from_state() pair" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("no_colon", "is not 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot be imported (ModuleNotFoundError"),
        ("taskmetric_plugins:missing", "cannot be imported (AttributeError"),
        ("taskmetric_plugins:NOT_CALLABLE", "is a int, not a function"),
        ("taskmetric_plugins:not_a_metric", "returned a int without update(), merge(), finalize()"),
        ("taskmetric_plugins:bad_better", "whose 'better' is {'rel_err': 'smaller'}"),
        ("taskmetric_plugins:raises", "raised RuntimeError: metric server unreachable"),
        ("taskmetric_plugins:update_fails", "raised ValueError in update(): expected boxes"),
    ],
)
def test_bad_plugin_is_a_one_line_bad_metric_error(labelled, tmp_path, capsys, spec, problem):
    b, _, _ = labelled
    out = tmp_path / "o"
    code, stdout, err = run_cli(
        [
            *("compare", b.fp32, b.int8["dynamic"], "--inputs", b.inputs_path, "--samples", "8", "--out", out),
            *("--metric", spec, "--quiet", "--no-local", "--no-distributions"),
        ],
        capsys,
    )
    assert code == USER_ERROR, (stdout, err)
    assert err.startswith(f"diag: error[bad-metric]: --metric '{spec}' | ") and problem in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.kernel_path
def test_plugin_value_is_an_exclusion_target_met_by_real_requantization(tmp_path):
    fx = models.build("transformer")
    fp = tmp_path / "t.fp32.onnx"
    onnx.save(fx.model, fp)
    arrays = fx.make_inputs(32, 12)
    np.savez(tmp_path / "t.npz", **arrays)
    feeds = FeedSpec(inputs=str(tmp_path / "t.npz"), batch=8)
    # Independently: plain onnxruntime on the held-out rows, batched as diag batched them.
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def held_out_logits(model: Path) -> np.ndarray:
        sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        x = arrays["input_ids"]
        return np.concatenate([sess.run(None, {"input_ids": x[i : i + 8]})[0] for i in range(16, 32, 8)])

    # NOTE: the INT8 baseline depends on the CPU's u8s8 kernels (AVX2 saturates, VNNI does not), so
    # the target is set from this machine's own plain-onnxruntime baseline, not written as a number.
    plain = tmp_path / "t.plain.onnx"
    quantize_dynamic(fp, plain)
    baseline = _rel_err(held_out_logits(fp), held_out_logits(plain))
    target = f"rel_err<={0.6 * baseline:.4f}"
    r = derive_exclusions(
        fp,
        Recipe(mode="dynamic"),
        feeds,
        ExcludeOptions(target, bench_runs=0, progress=False, metric=PLUGIN),
        work_dir=tmp_path,
    )
    assert str(r.target) == target
    assert r.before.task["rel_err"] == pytest.approx(baseline, rel=1e-6)
    assert r.reachable and not r.already_met
    assert fx.expected.culprit_node in r.nodes_to_exclude
    assert r.before.task["rel_err"] > r.target.value >= r.after.task["rel_err"]
    assert _rel_err(held_out_logits(fp), held_out_logits(Path(r.model))) == pytest.approx(
        r.after.task["rel_err"], rel=1e-6
    )
    doc = r.to_dict()
    assert doc["metrics"]["after"]["task"] == {"rel_err": r.after.task["rel_err"]}
    from diag.report.exclude_view import report_section

    row = next(x for x in report_section(doc)["metrics"] if x["name"] == "rel_err")
    assert row == {
        "name": "rel_err",
        "before": f"{r.before.task['rel_err']:.6f}",
        "after": f"{r.after.task['rel_err']:.6f}",
    }


def test_exclude_cli_takes_the_metric_and_refuses_an_undeclared_name(tmp_path, capsys):
    fx = models.build("transformer")
    fp = tmp_path / "t.fp32.onnx"
    onnx.save(fx.model, fp)
    np.savez(tmp_path / "t.npz", **fx.make_inputs(16, 12))
    base = ["exclude", fp, "--inputs", tmp_path / "t.npz", "--batch", "8", "--out", tmp_path / "x", "--quiet"]
    code, _, err = run_cli([*base, "--target", "map50>=0.5", "--metric", PLUGIN], capsys)
    assert code == USER_ERROR
    assert "has unknown metric 'map50'" in err and "rel_err<=" in err
    code, _, err = run_cli([*base, "--target", "rel_err>=0.5", "--metric", PLUGIN], capsys)
    assert code == USER_ERROR and "rel_err: lower is better" in err
    code, stdout, err = run_cli([*base, "--target", "rel_err<=10", "--metric", PLUGIN, "--bench-runs", "0"], capsys)
    assert code == OK, err
    first, verdict = stdout.splitlines()[:2]
    assert first.startswith('recipe: onnxruntime\'s quantize_dynamic defaults {"mode": "dynamic"}'), first
    assert verdict.startswith("target rel_err<=10 already met on 8 held-out samples: rel_err "), verdict
