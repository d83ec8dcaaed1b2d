"""Grades as deployed (issue 42 item 3): the outputs are graded as onnxruntime runs the INT8 model by
default (optimization level "all", fused integer kernels), against the exact FP32 outputs, with the
exact-mode grades beside them; ``diag check`` gates what the user deploys.

The fixture: the transformer quantized static QDQ per channel with its culprit excluded, the way a
user applies a fix. Around the float node, onnxruntime's optimizer fuses the remaining Q/DQ pairs,
so what runs at level "all" differs from exact mode. Every figure is re-computed with plain
onnxruntime sessions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import QuantFormat, quantize_static
from plain_ort import Rows

from diag.cli import commands as cli
from diag.fix.evaluate import macro_f1
from diag.fixtures import models
from diag.foundations.errors import GATE_FAILED


def _max_abs(fp32: Path, model: Path, feeds: dict[str, np.ndarray], level: ort.GraphOptimizationLevel) -> float:
    """Largest |FP32 (exact) - INT8 (at ``level``)| over every sample, by plain onnxruntime."""
    exact = ort.SessionOptions()
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    deployed = ort.SessionOptions()
    deployed.graph_optimization_level = level
    a = ort.InferenceSession(str(fp32), exact, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = ort.InferenceSession(str(model), deployed, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return float(np.abs(a.astype(np.float64) - b).max())


#: compare's flags for a run that grades the outputs and measures nothing else.
GRADES_ONLY = ("--effects", "0", "--no-local", "--settings", "off")


@pytest.fixture(scope="module")
def excluded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("deploy")
    fx = models.build("transformer")
    fp, q, x = d / "t.fp32.onnx", d / "t.qdq.onnx", d / "x.npz"
    onnx.save(fx.model, fp)
    quantize_static(
        str(fp),
        str(q),
        Rows(fx.make_inputs(16, 5), 16),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        nodes_to_exclude=[fx.expected.culprit_node],
    )
    feeds = fx.make_inputs(32, 3)
    np.savez(x, **feeds)
    return fp, q, x, feeds


def test_outputs_are_graded_as_deployed_with_exact_mode_beside(excluded, tmp_path, capsys) -> None:
    fp, q, x, feeds = excluded
    out = tmp_path / "out"
    cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--effects", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    verdict = json.loads((out / "diag.json").read_text())["verdict"]
    assert verdict["graded_at"] == "all"
    graded, exact = verdict["outputs"][0], verdict["exact_outputs"][0]
    deployed_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    exact_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert graded["max_abs"] == pytest.approx(deployed_abs, rel=1e-5)
    assert exact["max_abs"] == pytest.approx(exact_abs, rel=1e-5)
    assert abs(deployed_abs - exact_abs) > 0.05 * exact_abs, "the fixture must run differently as deployed"
    assert "outputs graded as deployed (level all)" in printed
    assert "Graded as onnxruntime runs the INT8 model at optimization level all" in (out / "summary.md").read_text()
    # --deploy-level disabled grades exact mode, and says so.
    cli.main([*["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--effects", "0"],
              "--deploy-level", "disabled", "--out", str(tmp_path / "exact")])  # fmt: skip
    printed = capsys.readouterr().out
    exact_doc = json.loads((tmp_path / "exact" / "diag.json").read_text())["verdict"]
    assert exact_doc["graded_at"] == "disabled" and exact_doc["exact_outputs"] == []
    assert exact_doc["outputs"][0]["max_abs"] == pytest.approx(exact_abs, rel=1e-5)
    assert "outputs graded in exact mode" in printed


def test_check_gates_the_model_as_deployed(excluded, tmp_path, capsys) -> None:
    """A max-abs gate between the exact and deployed figures: the deployed one decides."""
    fp, q, x, feeds = excluded
    out = tmp_path / "out"
    cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--effects", "0", "--out", str(out)])
    capsys.readouterr()
    deployed_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    exact_abs = _max_abs(fp, q, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    between = (deployed_abs + exact_abs) / 2
    code = cli.main(["check", str(out / "diag.json"), "--max-abs", f"{between:.6f}"])
    printed = capsys.readouterr().out
    if deployed_abs > exact_abs:
        assert code == GATE_FAILED and "FAIL max-abs" in printed, printed  # passes exact, fails as deployed
    else:
        assert code == 0, printed  # fails exact, passes as deployed: deployment is what counts


def test_the_f1_gate_reads_the_f1_drop_as_deployed_with_exact_mode_beside(excluded, tmp_path, capsys) -> None:
    """Issue 42 item 3: compare's macro-F1 drop is the deployed model's (plain onnxruntime at its
    default level agrees), the exact-mode drop is kept beside it, and a ``--max-f1-drop`` between
    the two fails the model: it passes in exact mode, and fails as the user runs it."""
    fp, q, _, _ = excluded
    feeds = models.build("transformer").make_inputs(512, 3)
    exact_opts = ort.SessionOptions()
    exact_opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def argmax(path: Path, opts: ort.SessionOptions | None) -> np.ndarray:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0].argmax(-1)

    reference = argmax(fp, exact_opts)
    rng = np.random.default_rng(0)
    labels = reference.copy()  # the FP32 predictions with 10 % of them wrong: an F1 below 1 to lose
    flip = rng.random(len(labels)) < 0.1
    labels[flip] = rng.integers(0, 4, int(flip.sum()))
    np.savez(tmp_path / "x.npz", **feeds)
    np.save(tmp_path / "y.npy", labels)

    def drop(pred: np.ndarray) -> float:
        return macro_f1(labels, reference) - macro_f1(labels, pred)

    deployed, exact = drop(argmax(q, None)), drop(argmax(q, exact_opts))
    assert deployed > exact + 0.003, "the fixture must lose more F1 as deployed"
    out = tmp_path / "out"
    # grades only: no local error, no effect check, no recipe settings (each costs runs this test needs not)
    args = ["compare", fp, q, "--inputs", tmp_path / "x.npz", "--labels", tmp_path / "y.npy", *GRADES_ONLY]
    cli.main([str(a) for a in [*args, "--batch", "512", "--out", out, "--quiet"]])
    capsys.readouterr()
    doc = json.loads((out / "diag.json").read_text())
    assert doc["verdict"]["outputs"][0]["f1_macro_drop"] == pytest.approx(deployed, abs=1e-6)
    assert doc["verdict"]["exact_outputs"][0]["f1_macro_drop"] == pytest.approx(exact, abs=1e-6)
    assert doc["task_metrics"]["f1"]["exact"]["f1_macro_drop"] == pytest.approx(exact, abs=1e-6)
    between = f"{(deployed + exact) / 2:.6f}"
    code = cli.main(["check", str(out / "diag.json"), "--max-f1-drop", between])
    assert code == GATE_FAILED and "FAIL" in capsys.readouterr().out


def test_a_model_whose_f1_passes_in_exact_mode_fails_as_deployed(excluded, tmp_path, capsys) -> None:
    """Issue 42, "done means": inputs built so that exact mode agrees with FP32 on every sample and
    the deployed model does not on a few (chosen from 2048 candidates with plain onnxruntime): exact
    F1 drop 0, deployed drop above the 2 % band. compare grades the output failing and ``diag check
    --max-f1-drop 0.015`` exits 3."""
    fp, q, _, _ = excluded
    candidates = models.build("transformer").make_inputs(2048, 11)
    exact_opts = ort.SessionOptions()
    exact_opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def argmax(path: Path, opts: ort.SessionOptions | None) -> np.ndarray:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return sess.run(None, candidates)[0].argmax(-1)

    reference, exact, deployed = argmax(fp, exact_opts), argmax(q, exact_opts), argmax(q, None)
    only_deployed = np.flatnonzero((deployed != reference) & (exact == reference))
    agree = np.flatnonzero((deployed == reference) & (exact == reference))
    assert len(only_deployed) >= 5, "the fixture must have samples only the deployed model gets wrong"
    chosen = np.sort(np.concatenate([agree[: 20 * len(only_deployed)], only_deployed]))
    np.savez(tmp_path / "x.npz", **{k: v[chosen] for k, v in candidates.items()})
    np.save(tmp_path / "y.npy", reference[chosen])  # the FP32 predictions: FP32's F1 is 1
    out = tmp_path / "out"
    # grades only: no local error, no effect check, no recipe settings (each costs runs this test needs not)
    args = ["compare", fp, q, "--inputs", tmp_path / "x.npz", "--labels", tmp_path / "y.npy", *GRADES_ONLY]
    cli.main([str(a) for a in [*args, "--out", out, "--quiet"]])
    capsys.readouterr()
    verdict = json.loads((out / "diag.json").read_text())["verdict"]
    graded, exact_graded = verdict["outputs"][0], verdict["exact_outputs"][0]
    assert exact_graded["f1_macro_drop"] == 0.0 and graded["f1_macro_drop"] > 0.02
    assert graded["grade"] == "reject" and any("drop" in r and "(reject)" in r for r in graded["reasons"])
    assert cli.main(["check", str(out / "diag.json"), "--max-f1-drop", "0.015"]) == GATE_FAILED
    assert "FAIL" in capsys.readouterr().out
