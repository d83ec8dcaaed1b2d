"""`diag compare --deploy-isa avx2` (issue 26, item 3): what an AVX2 server without VNNI computes,
predicted on this CPU, in the printed verdict, diag.json, the report and the summary.

The arithmetic itself is checked in tests/test_saturation.py (against explicit loops, and against
onnxruntime on an AVX2 CPU without VNNI, CI's emulated leg); here the wiring: every u8s8 node of
a real quantized model is predicted on the run's own inputs, next to its measured local SQNR.
"""

from __future__ import annotations

import json

import pytest

from diag.cli.commands import main
from diag.core.saturation import predict_avx2, u8s8_nodes
from diag.fixtures.quantize import quantize


def _compare(fp32, int8, inputs, out, capsys) -> tuple[dict, str]:
    args = ["compare", str(fp32), str(int8), "--inputs", str(inputs), "--batch", "8", "--deploy-isa", "avx2"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "diag.json").read_text()), capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["dynamic", "qdq"])
def test_every_u8s8_node_is_predicted_next_to_its_measured_sqnr(built, tmp_path, capsys, fmt):
    b = built("transformer")  # QInt8 weights, u8 activations: u8s8 kernels
    doc, printed = _compare(b.fp32, b.int8[fmt], b.inputs_path, tmp_path / "o", capsys)
    isa = doc["deploy_isa"]
    nodes = {e["node"]: e for e in isa["nodes"]}
    assert isa["u8s8_nodes"] == len(nodes) >= 10
    if fmt == "dynamic":
        import onnx

        assert set(nodes) == set(u8s8_nodes(onnx.load(b.int8[fmt])))
    # The same prediction as diag.core.saturation on the same batches, node by node.
    batches = [{k: v[i : i + 8] for k, v in b.inputs.items()} for i in range(0, 32, 8)]
    direct = {p.node: p for p in predict_avx2(str(b.int8[fmt]), batches)}
    assert {n: e["saturated_pairs"] for n, e in nodes.items()} == {n: p.saturated_pairs for n, p in direct.items()}
    assert isa["saturating_nodes"] == sum(1 for p in direct.values() if p.saturated_pairs) > 0
    # Measured = this run's local SQNR of the FP32 node the INT8 node was made from.
    local = {n["name"]: n["local"]["sqnr_db"] for n in doc["nodes"] if n["local"]}
    for e in isa["nodes"]:
        if e["fp32_node"] in local and isinstance(local[e["fp32_node"]], float):
            assert e["measured_sqnr_db"] == pytest.approx(local[e["fp32_node"]], abs=0.01)
            if e["saturated_pairs"]:
                assert e["predicted_sqnr_db"] < e["measured_sqnr_db"]
    worst = isa["nodes"][0]
    assert f"{isa['saturating_nodes']} of {isa['u8s8_nodes']} u8s8 node(s) saturate" in printed
    assert worst["sentence"] in printed and "on AVX2 without VNNI this node's output SQNR drops from" in printed
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert "\n- on AVX2 without VNNI (predicted" in summary and f"  - {worst['sentence']}" in summary, summary
    html = (tmp_path / "o" / "report.html").read_text()
    assert "<h2>On AVX2 without VNNI (predicted)</h2>" in html and 'id="deploy-isa"' in html


def test_u8u8_weights_have_nothing_to_saturate(built, tmp_path, capsys):
    b = built("transformer")
    int8 = quantize(b.fp32, tmp_path / "u8.onnx", "dynamic", weight_type="QUInt8")
    doc, printed = _compare(b.fp32, int8, b.inputs_path, tmp_path / "o", capsys)
    assert doc["deploy_isa"]["u8s8_nodes"] == 0 and doc["deploy_isa"]["nodes"] == []
    line = next(x.strip() for x in printed.splitlines() if "on AVX2 without VNNI" in x)
    assert line.startswith("on AVX2 without VNNI: no u8s8 node") and line.endswith("nothing saturates on any x86 CPU")
    # One sentence, worded once: the terminal and summary.md print the same words (issue 42 item 6:
    # they said "nothing to saturate" and "nothing saturates on any x86 CPU").
    assert line in (tmp_path / "o" / "summary.md").read_text()


def test_without_the_flag_there_is_no_prediction(built, tmp_path):
    b = built("convnet")
    args = ["compare", str(b.fp32), str(b.int8["dynamic"]), "--inputs", str(b.inputs_path)]
    assert main([*args, "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert "deploy_isa" not in json.loads((tmp_path / "o" / "diag.json").read_text())
