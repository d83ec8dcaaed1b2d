"""Sequence outputs ``[N, T, classes]`` (CTC/OCR heads) are graded per position, samples counted as
samples, and a decoder plugin gives the sequence-level figure (issue 25, item 7)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import onnxruntime as ort
import pytest
from test_readme import _python_files

from diag.analysis.compare import CompareOptions, compare_models
from diag.cli.commands import main
from diag.core.feeds import FeedSpec
from diag.core.metrics import OutputAccumulator, OutputSpec

FORMATS = ("dynamic", "qdq", "qoperator")
BATCH = 8


def _plain_argmax(fp32, int8, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Argmax of both models' ``probs`` with plain onnxruntime (exact mode, batches of 8 as diag runs
    them: dynamic quantization's activation scale is per batch)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a, b = (ort.InferenceSession(str(m), so, providers=["CPUExecutionProvider"]) for m in (fp32, int8))
    n = len(inputs["x"])
    fp = [a.run(["probs"], {"x": inputs["x"][i : i + BATCH]})[0] for i in range(0, n, BATCH)]
    q = [b.run(["probs"], {"x": inputs["x"][i : i + BATCH]})[0] for i in range(0, n, BATCH)]
    return np.concatenate(fp).argmax(-1), np.concatenate(q).argmax(-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_position_agreement_equals_plain_onnxruntime(built, fmt):
    b = built("ctc")
    spec = FeedSpec(inputs=str(b.inputs_path), samples=32, batch=BATCH)
    r = compare_models(b.fp32, b.int8[fmt], spec, CompareOptions(progress=False))
    fp, q = _plain_argmax(b.fp32, b.int8[fmt], b.inputs)
    same = fp == q
    v = next(v for v in r.verdicts if v.name == "probs")
    assert v.per_sample.samples == 32 and v.per_sample.positions == 32 * 24
    assert v.per_sample.top1_agreement == pytest.approx(same.mean(), abs=1e-12)
    assert v.per_sample.sequence_agreement == pytest.approx(same.all(axis=1).mean(), abs=1e-12)
    # The defect must show, or this proves nothing: some positions and most whole lines disagree.
    assert 0.80 < same.mean() < 0.99 and same.all(axis=1).sum() < 16, (same.mean(), same.all(axis=1).sum())
    reason = f"per-position top-1 agreement {same.mean():.2%} over 768 positions of 32 samples"
    assert any(x.startswith(reason) for x in v.reasons), v.reasons
    assert f"{int(same.all(axis=1).sum())} of 32 samples agree at every position" in v.reasons


def test_the_ctc_culprit_is_the_head_whose_input_scale_the_outlier_wrecks(built):
    b = built("ctc")
    spec = FeedSpec(inputs=str(b.inputs_path), samples=32, batch=BATCH)
    r = compare_models(b.fp32, b.int8["dynamic"], spec, CompareOptions(progress=False))
    assert r.cause_sentence.startswith("single root cause: head/MatMul"), r.cause_sentence
    health = r.health["enc/Relu_out"]
    assert health.axis == 2 and [o.index for o in health.outliers] == [7]


def test_diag_json_records_positions_and_the_whole_sequence_share(built, tmp_path):
    b = built("ctc")
    out = tmp_path / "o"
    args = ["compare", str(b.fp32), str(b.int8["dynamic"]), "--inputs", str(b.inputs_path), "--batch", "8"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "diag.json").read_text())
    probs = doc["verdict"]["outputs"][0]
    fp, q = _plain_argmax(b.fp32, b.int8["dynamic"], b.inputs)
    assert probs["samples"] == 32 and probs["positions"] == 768
    assert probs["sequence_agreement"] == pytest.approx((fp == q).all(axis=1).mean(), abs=1e-12)
    summary = (out / "summary.md").read_text()
    whole = int((fp == q).all(axis=1).sum())
    differ = ~(fp == q).all(axis=1)
    first = int(np.argmin(fp == q, axis=1)[differ].min())
    cell = f"{(fp == q).mean():.2%} per position (768); {whole}/32 samples at every position"
    cell += f"; first differ at position {first}"
    assert cell in summary
    assert (
        probs["first_divergence"]["earliest"] == first and probs["first_divergence"]["diverged_samples"] == 32 - whole
    )


def _greedy(argmax: np.ndarray) -> list[tuple[int, ...]]:
    """CTC greedy decoding written here again, independently of the README's plugin."""
    texts = []
    for row in argmax:
        text, prev = [], -1
        for c in row.tolist():
            if c != prev and c != 0:
                text.append(c)
            prev = c
        texts.append(tuple(text))
    return texts


def test_the_readme_decoder_plugin_gives_the_share_of_decoded_texts_that_match(built, tmp_path, monkeypatch):
    b = built("ctc")
    (tmp_path / "ctc_metrics.py").write_text(_python_files()["ctc_metrics.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ctc_metrics", raising=False)
    out = tmp_path / "o"
    args = ["compare", str(b.fp32), str(b.int8["dynamic"]), "--inputs", str(b.inputs_path), "--batch", "8"]
    assert main([*args, "--metric", "ctc_metrics:text_agreement", "--out", str(out), "--quiet"]) == 0
    plugin = json.loads((out / "diag.json").read_text())["task_metrics"]["plugin"]
    fp, q = _plain_argmax(b.fp32, b.int8["dynamic"], b.inputs)
    texts = sum(x == y for x, y in zip(_greedy(fp), _greedy(q), strict=True)) / 32
    assert plugin["values"]["text_agreement"] == pytest.approx(texts, abs=1e-12)
    # Texts are the user's figure: they differ from both agreement shares diag grades on its own.
    assert texts < (fp == q).mean()
    assert re.search(r"text_agreement 0\.\d+", (out / "summary.md").read_text())  # markdown-escaped


def test_sequence_counts_merge_and_survive_the_shard_state():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5, 4)).astype(np.float32)
    y = x.copy()
    y[1, 2] = y[1, 2][::-1]  # sample 1 changes its argmax at one position (unless the row is symmetric)
    changed = int(x[1, 2].argmax() != y[1, 2].argmax())
    halves = [OutputAccumulator(OutputSpec(kind="probabilities", class_axis=-1)) for _ in range(2)]
    halves[0].update(x[:3], y[:3])
    halves[1].update(x[3:], y[3:])
    first, second = (OutputAccumulator.from_state(h.to_state()) for h in halves)
    merged = first.merge(second)
    s = merged.finalize()
    assert s.samples == 6 and s.positions == 30
    assert s.top1_agreement == pytest.approx(1 - changed / 30)
    assert s.sequence_agreement == pytest.approx(1 - changed / 6)
    assert changed == 1


def test_one_prediction_per_sample_has_no_positions():
    acc = OutputAccumulator(OutputSpec(kind="logits", class_axis=1))
    x = np.eye(4, dtype=np.float32)
    acc.update(x, x)
    s = acc.finalize()
    assert s.positions is None and s.sequence_agreement is None and s.top1_agreement == 1.0
