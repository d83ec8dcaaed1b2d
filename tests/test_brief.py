"""The lines under the verdict are worded once and rendered three times (issue 42 item 6).

`diag compare` prints them, summary.md lists them under its headline and report.html in its
``#brief`` list, all from the same diag.json (:mod:`diag.report.brief`); `diag report` re-renders
them from the file alone. Before, the terminal worded its lines from the in-memory result and the
summary from the document, and they disagreed (the error path shortened at 2 + 2 steps against
3 + 3, a root cause with and without its input's outlier channel, SmoothQuant's Muls printed but
missing from diag.json). Every fixture's lines are also compared in
``tests/test_headline_subject.py::test_lines_under_the_headline_agree_with_it``.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from brief_text import report_brief, summary_brief, terminal_brief
from cli_run import run_cli

from diag.cli.verbs import result_lines
from diag.fixtures import models, producers
from diag.report.brief import brief
from diag.report.view import output_texts

GOLDEN = Path(__file__).parent / "golden" / "convnet.qdq.diag.json"


def _three(out, stdout: str) -> tuple[list, list, list]:
    summary = (out / "summary.md").read_text()
    html = (out / "report.html").read_text()
    return terminal_brief(stdout), summary_brief(summary), report_brief(html)


def test_compare_prints_what_summary_md_and_report_html_list(built, tmp_path, capsys):
    b = built("transformer")
    out = tmp_path / "o"
    code, stdout, _ = run_cli(
        ["compare", b.fp32, b.int8["dynamic"], "--inputs", b.inputs_path, "--batch", 8, "--out", out], capsys
    )
    assert code == 0
    terminal, summary, report = _three(out, stdout)
    assert terminal == summary == report, (terminal, summary, report)
    texts = [t for _, t in terminal]
    fc1, norm = "layer1/ffn/fc1/MatMul", "layer1/ffn_norm/LayerNormalization_out"
    # The planted outlier (channel 7 of layer 1's FFN LayerNorm) read the same way in all three.
    assert any(
        t.startswith(f"root cause: {fc1} (MatMul): local SQNR ") and f"input '{norm}' has outlier channel 7" in t
        for t in texts
    ), texts
    assert f"outlier: channel 7 of {norm} is " in "\n".join(texts)
    assert any(t.startswith(f"error path to logits: {fc1} [root-cause, ") for t in texts), texts
    assert texts[-1].startswith("matched 75/75 FP32 float tensors")
    # diag report re-renders the same lines from diag.json alone.
    again = tmp_path / "again"
    code, reprinted, _ = run_cli(["report", out / "diag.json", "--out", again], capsys)
    assert code == 0 and terminal_brief(reprinted) == terminal  # without the models
    assert summary_brief((again / "summary.md").read_text()) == summary


def test_smoothquant_muls_are_in_diag_json_and_said_alike_everywhere(built, tmp_path, capsys):
    """The terminal named NNCF's SmoothQuant Muls but diag.json did not keep them, so summary.md and
    report.html could not: now the document holds them and all three print the same line."""
    b = built("transformer")
    fp32, q = producers.smoothquant_style(onnx.load(b.fp32), onnx.load(b.int8["qdq"]), b.calib)
    onnx.save(fp32, tmp_path / "sq.fp32.onnx")
    onnx.save(q, tmp_path / "sq.int8.onnx")
    out = tmp_path / "o"
    args = ["compare", tmp_path / "sq.fp32.onnx", tmp_path / "sq.int8.onnx", "--inputs", b.inputs_path]
    code, stdout, _ = run_cli([*args, "--effects", 0, "--out", out], capsys)
    assert code == 0
    doc = json.loads((out / "diag.json").read_text())
    smoothing = doc["weights"]["smoothing"]
    assert smoothing[0]["tensor"] == "layer1/ffn_norm/LayerNormalization_out"
    assert smoothing[0]["strongest_channel"] == models.transformer().expected.outlier_channel
    terminal, summary, report = _three(out, stdout)
    assert terminal == summary == report
    line = next(t for _, t in terminal if t.startswith("SmoothQuant's "))
    assert f"divides channel {smoothing[0]['strongest_channel']} of layer1/ffn_norm/LayerNormalization_out" in line
    assert f"(+{len(smoothing) - 1} more SmoothQuant Muls in diag.json)" in line


def test_rarer_sections_are_worded_from_the_document_too():
    """FP16 ranges, the cluster, accuracy_level and a --scheduler run: sections a fixture run seldom
    has, added to a real document; each becomes one line, in the terminal and summary.md alike."""
    doc = json.loads(GOLDEN.read_text())
    doc["fp16"] = {
        "ranges": {"attn/scores": {"count": 1000, "overflow": 12, "subnormal": 3, "flushed": 40, "peak": 91234.5}},
        "fix": {"node_block_list": ["attn/MatMul"], "op_block_list": [], "over_range": [], "why": []},
    }
    doc["run"]["cluster"] = {"workers": 2, "scheduler": "local", "tasks": 8, "retries": 0, "shards": 4}
    doc["accuracy_level"] = {"level": 4, "samples": 8, "nodes": {"fc/MatMulNBits": 31.25}, "outputs": {"logits": 35.5}}
    texts = [line.text for line in brief(doc)]
    assert "FP16 fix: convert_float_to_float16(..., node_block_list=['attn/MatMul'])" in texts
    assert "FP16 range: 'attn/scores' reaches 9.12e+04 in FP32: 12 of 1000 values overflow to inf" in texts
    assert "FP16 range: 'attn/scores': 40 of 1000 values (4.0%) flush to zero, 3 are subnormal" in texts
    assert "cluster: 2 worker(s) at local, 4 shards, 8 tasks, 0 retried after a worker died" in texts
    assert (
        "accuracy_level 4 vs 0 (MatMulNBits inputs quantized inside the kernel): SQNR logits 35.5 dB; "
        "worst node fc/MatMulNBits 31.2 dB (8 samples)"
    ) in texts
    summary = output_texts(doc)["summary.md"]
    assert summary_brief(summary) == terminal_brief("\n".join(result_lines(doc, {})))


def test_document_edge_cases_are_worded_not_crashed_on():
    """Found in review: a transposed Gather table's block is a row, not a column (the document's own
    ``where``); an "inf" outlier ratio or an all-zero bias is worded, not a TypeError; names inside
    a line (persistent tensors, the effect target) are names, so summary.md shows them as code."""
    doc = json.loads(GOLDEN.read_text())
    doc["weights"]["blocks"] = [
        {"weight": "emb", "channel": 3, "block": 1, "rows": [32, 64], "rmse": 0.1, "rel_rmse": 0.5, "max_abs": 0.2,
         "levels": 2, "peak_ratio": 40.0, "where": "row 3 columns 32-63"},
    ]  # fmt: skip
    doc["weights"]["bias_corrections"] = [{"name": "fc.bias", "fp_nodes": ["fc"], "max_change": 0.5, "relative": "inf"}]
    tensors = doc["distributions"]["tensors"]
    name = next(k for k, h in tensors.items() if h.get("outliers"))
    tensors[name]["outliers"][0]["times_median"] = "inf"
    doc["distributions"]["persistent_outliers"] = [
        {"index": 5, "channels": 8, "tensors": ["a_b", "c"], "of_tensors": 3}
    ]
    texts = [line.text for line in brief(doc)]
    assert (
        "worst weight block: emb row 3 columns 32-63: error 0.5x the weight's rms, 2 levels used, "
        "max |w| 40x the median" in texts
    )
    assert any(
        t.startswith("bias correction: 1 float bias(es)") and t.endswith("by 0.5 (the FP32 bias is all zero)")
        for t in texts
    )
    assert f"outlier: channel {tensors[name]['outliers'][0]['index']} of {name} is infx the median channel" in texts
    summary = output_texts(doc)["summary.md"]
    assert "- persistent outlier: channel 5 is an outlier in 2 of the 3 tensors with 8 channels: `a_b`, `c`" in summary
    assert "- effect on `logits` of keeping one node in float: " in summary
    assert summary_brief(summary) == terminal_brief("\n".join(result_lines(doc, {})))


@pytest.mark.parametrize("name", ["<script>alert(1)</script>", "a`b*c_d"])
def test_hostile_names_stay_text_in_every_rendering(name):
    """Node names are untrusted: a name becomes a code span in summary.md and escaped ``<code>`` in
    report.html, and reads back as the same text the terminal prints."""
    doc = json.loads(GOLDEN.read_text())
    doc["models"]["fp32"]["warnings"] = [f"node {name} has no shape"]
    doc["verdict"]["outputs"][0]["name"] = name
    texts = output_texts(doc)
    assert "<script>alert" not in texts["report.html"].split('id="brief"')[1].split("</details>")[0]
    terminal = terminal_brief("\n".join(result_lines(doc, {})))
    assert (0, f"warning: node {name} has no shape") in terminal
    assert summary_brief(texts["summary.md"]) == terminal == report_brief(texts["report.html"])
