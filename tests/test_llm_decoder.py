"""A Llama-shaped int4 decoder (external data, MatMulNBits, causal -inf mask, one planted down_proj channel).

diag must name the planted node, group the error per decoder layer and projection, say nothing
about the mask's -inf, grade the logits token by token (checked against numpy on plain
onnxruntime outputs), and write fixes and kept models that are whole with their external data.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli

from diag.analysis.decoder import layer_of, projection_of
from diag.core.metrics import OutputAccumulator, OutputSpec
from diag.fixtures.llm_models import llama_decoder, quantize_int4, save_with_external_data

CULPRIT = "/model/layers.2/mlp/down_proj/MatMul"
SAMPLES = 8


def _diag(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m diag ARGS --quiet``, checked to exit 0."""
    run = subprocess.run(
        [sys.executable, "-m", "diag", *map(str, args), "--quiet"], capture_output=True, text=True, timeout=600, cwd=cwd
    )
    assert run.returncode == 0, run.stderr
    return run


def _locations(model: Path) -> set[str]:
    """The external-data files a saved model refers to."""
    m = onnx.load(str(model), load_external_data=False)
    return {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("llm")
    f = llama_decoder()
    fp32 = save_with_external_data(f.model, d / "fp32.onnx")
    int4 = quantize_int4(fp32, d / "int4.onnx")
    np.savez(d / "ids.npz", **f.make_inputs(SAMPLES))
    np.savez(d / "ids32.npz", **f.make_inputs(32, seed=2))
    out = d / "out"
    run = _diag("compare", fp32, int4, "--inputs", d / "ids.npz", "--out", out)
    (d / "stdout.txt").write_text(run.stdout)
    return {"dir": d, "fp32": fp32, "int4": int4, "out": out, "ids": d / "ids.npz", "ids32": d / "ids32.npz"}


def _doc(llm: dict[str, Path]) -> dict:
    return json.loads((llm["out"] / "diag.json").read_text())


def test_fixture_keeps_its_weights_outside_and_is_really_int4(llm):
    for key, data in (("fp32", "fp32.onnx.data"), ("int4", "int4.onnx.data")):
        m = onnx.load(str(llm[key]), load_external_data=False)
        assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
        assert (llm["dir"] / data).exists()
    q = onnx.load(str(llm["int4"]), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in q.graph.node) == 4 * 7 + 1  # 7 projections x 4 layers + lm_head


def test_names_the_planted_down_proj(llm):
    doc = _doc(llm)
    roots = [n["name"] for n in doc["nodes"] if n["role"] == "root-cause"]
    assert roots == [CULPRIT]
    assert CULPRIT in doc["verdict"]["cause"]
    stdout = (llm["dir"] / "stdout.txt").read_text()
    assert f"root cause: {CULPRIT}" in stdout
    assert "per layer (4 layers): worst is layer 2 (mlp/down_proj" in stdout


def test_per_layer_and_per_projection_grouping(llm):
    dec = _doc(llm)["decoder"]
    assert [r["index"] for r in dec["layers"]] == [0, 1, 2, 3]
    assert [r["quantized_nodes"] for r in dec["layers"]] == [7, 7, 7, 7]
    names = [p["name"] for p in dec["projections"]]
    assert names == [
        "self_attn/q_proj",
        "self_attn/k_proj",
        "self_attn/v_proj",
        "self_attn/o_proj",
        "mlp/gate_proj",
        "mlp/up_proj",
        "mlp/down_proj",
    ]
    worst = min(dec["layers"], key=lambda r: r["worst_local_sqnr_db"])
    assert worst["index"] == 2 and worst["worst_local_node"] == CULPRIT and "root-cause" in worst["roles"]
    down = next(p for p in dec["projections"] if p["name"] == "mlp/down_proj")
    assert down["worst_layer"] == 2
    others = [v["local_sqnr_db"] for k, v in down["by_layer"].items() if k != "2"]
    assert down["by_layer"]["2"]["local_sqnr_db"] < min(others) - 6  # ~11 dB vs ~21 dB of 4-bit noise
    # the residual stream only loses SQNR along the stack
    acc = [r["accumulated_sqnr_db"] for r in dec["layers"]]
    assert acc == sorted(acc, reverse=True)
    assert [o["node"] for o in dec["outside"]] == ["/lm_head/MatMul"]
    summary = (llm["out"] / "summary.md").read_text()
    bad = f"**{down['by_layer']['2']['local_sqnr_db']:.1f}**"  # the one cell under the bad threshold, marked
    assert "**Per decoder layer**" in summary and summary.count(bad) == 1
    row = next(line for line in summary.splitlines() if line.startswith("| 2 |"))
    assert row.endswith(f"| {bad} |")  # in the down_proj column, the last one
    html = (llm["out"] / "report.html").read_text()
    assert 'id="section-decoder"' in html and 'id="plot-per-layer"><svg' in html


def test_causal_mask_minus_inf_is_not_a_finding(llm):
    doc = _doc(llm)
    masks = [n for n in doc["nodes"] if n["name"].endswith("self_attn/Add")]
    assert len(masks) == 4
    assert all(n["accumulated"]["nonfinite_fp"] > 0 and not n["nonfinite_reaches"] for n in masks)
    for text in ((llm["out"] / "summary.md").read_text(), (llm["dir"] / "stdout.txt").read_text()):
        assert "NaN/Inf" not in text
    assert "NaN/Inf first produced" not in (llm["out"] / "report.html").read_text()


def _plain_logits(llm: dict[str, Path]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.load(llm["ids"])["input_ids"]
    fp = ort.InferenceSession(str(llm["fp32"]), providers=["CPUExecutionProvider"])
    q = ort.InferenceSession(str(llm["int4"]), providers=["CPUExecutionProvider"])
    xs = np.concatenate([fp.run(None, {"input_ids": ids[i : i + 1]})[0] for i in range(len(ids))])
    ys = np.concatenate([q.run(None, {"input_ids": ids[i : i + 1]})[0] for i in range(len(ids))])
    return xs.astype(np.float64), ys.astype(np.float64)


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(axis=-1, keepdims=True)
    return a - np.log(np.exp(a).sum(axis=-1, keepdims=True))


def test_token_level_grades_match_numpy_on_plain_onnxruntime(llm):
    xs, ys = _plain_logits(llm)
    agree = xs.argmax(-1) == ys.argmax(-1)  # [N, S]
    firsts = [int(np.argmin(row)) for row in agree if not row.all()]
    lp, lq = _log_softmax(xs), _log_softmax(ys)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    out = next(o for o in _doc(llm)["verdict"]["outputs"] if o["name"] == "logits")
    assert out["positions"] == agree.size
    assert out["top1_agreement"] == pytest.approx(agree.mean(), abs=1e-6)
    fd = out["first_divergence"]
    assert fd["diverged_samples"] == len(firsts) > 0
    assert fd["earliest"] == min(firsts)
    assert sum(fd["by_position"]) == len(firsts)
    assert [fd["by_position"][p] for p in sorted(set(firsts))] == [firsts.count(p) for p in sorted(set(firsts))]
    assert out["kl_mean"] == pytest.approx(kl.mean(), rel=1e-3)
    assert out["kl_max"] == pytest.approx(kl.max(), rel=1e-3)
    assert any(r.startswith(f"first differing prediction at position {min(firsts)}") for r in out["reasons"])


def test_first_divergence_and_kl_merge_like_one_pass():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5, 7)).astype(np.float32)
    y = x + 0.6 * rng.standard_normal(x.shape).astype(np.float32)
    spec = OutputSpec(kind="logits", class_axis=2)
    whole = OutputAccumulator(spec)
    whole.update(x, y)
    a, b = OutputAccumulator(spec), OutputAccumulator(spec)
    a.update(x[:2], y[:2])
    b.update(x[2:], y[2:])
    merged = OutputAccumulator.from_state(json.loads(json.dumps(a.merge(b).to_state())))
    s, m = whole.finalize(), merged.finalize()
    assert m.first_divergence == s.first_divergence and sum(s.first_divergence) > 0
    assert m.kl_mean == pytest.approx(s.kl_mean) and m.kl_max == pytest.approx(s.kl_max)
    assert s.median_divergence is not None and s.earliest_divergence == min(
        int(np.argmin(r)) for r in (x.argmax(-1) == y.argmax(-1)) if not r.all()
    )


@pytest.mark.parametrize(
    ("name", "layer", "projection"),
    [
        ("/model/layers.2/mlp/down_proj/MatMul", 2, "mlp/down_proj"),
        ("/model/layers.31/attn/o_proj/MatMulNBits", 31, "attn/o_proj"),
        ("/transformer/h.0/attn/c_attn/MatMul", 0, "attn/c_attn"),
        ("/bert/encoder/layer.3/attention/self/query/MatMul", 3, "attention/self/query"),
        ("model.layers.0.mlp.down_proj.MatMul_Q4", 0, "mlp/down_proj"),
        ("/model/decoder/layers.1/encoder_attn/k_proj/MatMul", 1, "encoder_attn/k_proj"),
    ],
)
def test_layer_and_projection_from_exporters_names(name, layer, projection):
    found = layer_of(name)
    assert found is not None and found[0] == layer
    assert projection_of(name) == projection


@pytest.mark.parametrize("name", ["/lm_head/MatMul", "/model/embed_tokens/Gather", "layer_norm/Mul", "heads/MatMul"])
def test_names_outside_any_layer(name):
    assert layer_of(name) is None


def test_inferred_recipe_excludes_only_matmuls_the_quantizer_would_have_quantized(llm, tmp_path):
    """Attention's activation x activation MatMuls are never quantized: listing them in
    nodes_to_exclude is advice that changes nothing (helper finding on the KV-cache benchmark)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from diag.fix.weightonly import infer_weight_only

    settings = _doc(llm)["recommendation"]["recipe"]["settings"]
    assert settings["mode"] == "weight_only" and "nodes_to_exclude" not in settings
    fp32 = onnx.load(str(llm["fp32"]))
    kept = next(n.name for n in fp32.graph.node if n.op_type == "MatMul" and n.input[1] in
                {t.name for t in fp32.graph.initializer})  # fmt: skip
    quantizer = MatMulNBitsQuantizer(fp32, block_size=32, is_symmetric=True, bits=4, nodes_to_exclude=[kept])
    quantizer.process()
    recipe, evidence = infer_weight_only(quantizer.model.model)
    assert recipe["nodes_to_exclude"] == [kept]
    assert evidence[-1] == f"1 MatMul node(s) left in float: {kept}"


def test_fix_snippet_and_kept_models_are_whole_with_external_data(llm, tmp_path, capsys):
    summary = (llm["out"] / "summary.md").read_text()
    assert "save_as_external_data=True, location='int4.fixed.onnx.data'" in summary
    # the starting point is measured with external data (the effect check reads the region's weights)
    assert "estimated on 8 samples with the list in float inside the INT8 model" in summary
    out = tmp_path / "ex"
    args = ["--inputs", llm["ids32"], "--target", "cosine>=0.97", "--out", out, "--bench-runs", "0", "--quiet"]
    code, printed, err = run_cli(["exclude", llm["fp32"], "--int8", llm["int4"], *args], capsys)
    assert code == 0, err
    # every trial is the user's int4 model with float regions spliced in, external data and all
    assert "spliced from your INT8 model (no re-quantization)" in printed
    mixed = out / "fp32.mixed.onnx"
    assert _locations(mixed) == {"fp32.mixed.onnx.data"} and (out / "fp32.mixed.onnx.data").exists()
    excluded = json.loads((out / "exclusion.json").read_text())["nodes_to_exclude"]
    assert CULPRIT in excluded
    sess = ort.InferenceSession(str(mixed), providers=["CPUExecutionProvider"])  # loads on its own
    ids = np.load(llm["ids"])["input_ids"][:1]
    assert sess.run(None, {"input_ids": ids})[0].shape == (1, 16, 512)


def test_tier_plan_names_a_whole_projection_and_its_model_is_whole(tmp_path, capsys):
    """Every layer's down_proj has the planted channel: the plan is "mlp/down_proj in every layer"."""
    f = llama_decoder(outlier_layer=None)
    fp32 = save_with_external_data(f.model, tmp_path / "fp32.onnx")
    int4 = quantize_int4(fp32, tmp_path / "int4.onnx")
    np.savez(tmp_path / "ids.npz", **f.make_inputs(32, seed=2))
    out = tmp_path / "tiers"
    args = ["--inputs", tmp_path / "ids.npz", "--target", "cosine>=0.97", "--tiers", "int4,int8,fp32", "--out", out]
    code, printed, err = run_cli(["exclude", fp32, "--int8", int4, *args, "--bench-runs", "0", "--quiet"], capsys)
    assert code == 0, err
    plan = json.loads((out / "tiers.json").read_text())
    assert sorted(plan["by_tier"]["int8"]) == [f"/model/layers.{i}/mlp/down_proj/MatMul" for i in range(4)]
    assert plan["by_projection"] == {"int8": "mlp/down_proj in every layer (4)"}
    assert "  int8 (4 nodes): mlp/down_proj in every layer (4)" in printed
    # The plan's report diagnoses the all-int4 model: weight-only remedies, and no command naming
    # the search's deleted work folder (it once named the temp diag-tiers-*/plan000.onnx).
    summary = (out / "summary.md").read_text()
    # No down_proj alone explains the all-int4 model's error; the projection in every layer does
    # (the group the plan keeps at 8 bits), measured as one float region (diag.analysis.levers).
    assert "cause: mlp/down_proj quantized in every layer: keeping the mlp/down_proj projection of 4 layers" in summary
    assert "per_channel=True" not in summary and "16-bit activations" not in summary
    assert "diag-tiers" not in summary and "plan000" not in summary
    assert json.loads((out / "diag.json").read_text())["recommendation"]["verify_command"] == ""
    model = out / "fp32.plan.onnx"
    assert _locations(model) == {"fp32.plan.onnx.data"}
    m = onnx.load(str(model), load_external_data=False)
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits") for n in m.graph.node if n.op_type == "MatMulNBits"
    }
    # Spliced into the user's model: the re-blocked nodes carry diag's prefix, the rest are the user's.
    assert {k.removeprefix("diag_float/").removesuffix("_Q8") for k, v in bits.items() if v == 8} == set(
        plan["by_tier"]["int8"]
    )
    assert all(k.startswith("diag_float/") for k, v in bits.items() if v == 8)
    assert plan["method"] == "surgical" and plan["quantizations"] == 0
    ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])  # loads on its own


def test_projection_phrase_names_whole_projections():
    from diag.analysis.decoder import projection_phrase

    universe = [f"/model/layers.{i}/mlp/{p}/MatMul" for i in range(4) for p in ("up_proj", "down_proj")]
    every_down = [f"/model/layers.{i}/mlp/down_proj/MatMul" for i in range(4)]
    assert projection_phrase([*every_down, "/lm_head/MatMul"], universe) == (
        "mlp/down_proj in every layer (4), /lm_head/MatMul"
    )
    assert projection_phrase([*every_down, "/model/layers.1/mlp/up_proj/MatMul"], universe) == (
        "mlp/up_proj in layer 1, mlp/down_proj in every layer (4)"
    )
    assert projection_phrase(every_down[:3], universe) is None  # no projection whole: the node names
    assert projection_phrase(["/lm_head/MatMul"], universe) is None  # nothing in a layer: the list is the name
    assert projection_phrase(every_down[:1], universe) is None  # "mlp/down_proj in layer 0" is not shorter
    # torch's dynamo exporter: node_linear_N, the module path in the node metadata (module_paths)
    paths = {f"node_linear_{i}": f"model.layers.{i}.mlp.down_proj/linear_{i}" for i in range(4)}
    paths["node_linear_9"] = "lm_head/linear_9"
    named = [*paths]
    assert projection_phrase(named, named, paths) == "mlp/down_proj in every layer (4), lm_head (node_linear_9)"


def test_accuracy_level_check_reads_external_data_from_the_models_folder(llm, tmp_path, monkeypatch, capsys):
    """--accuracy-level-check builds its sessions from memory: onnxruntime must be told where the
    weights are, not find them by chance in the current folder (it used to fail with 'External
    data path ... escapes working directory' unless run from the model's folder)."""
    out = tmp_path / "o"
    monkeypatch.chdir(tmp_path)  # not the models' folder
    code, _, err = run_cli([
        "compare", llm["fp32"], llm["int4"], "--inputs", llm["ids"], "--samples", "2", "--effects", "0",
        "--accuracy-level-check", "4", "--out", out, "--quiet",
    ], capsys)  # fmt: skip
    assert code == 0, err
    check = json.loads((out / "diag.json").read_text())["accuracy_level"]
    assert check["level"] == 4 and check["samples"] == 2
    # every MatMulNBits node (7 projections a layer, and lm_head), each named as in the FP32 graph
    q = onnx.load(str(llm["int4"]), load_external_data=False)
    assert len(check["nodes"]) == sum(n.op_type == "MatMulNBits" for n in q.graph.node) > 8
    assert all(name.startswith(("/model/layers.", "/lm_head")) for name in check["nodes"])


@pytest.mark.slow
def test_a_tier_search_stopped_by_its_budget_keeps_the_plan_it_met_and_claims_nothing_it_did_not_test(
    llm, tmp_path, capsys
):
    """At 500M the tier search met cosine>=0.99 with every MatMul at int8, then ran out of time
    while narrowing: it said "not reachable ... no plan short of every node at fp32 meets it".
    A met trial is a plan (not the smallest: said so); a search stopped before any met claims nothing."""
    base = ["exclude", llm["fp32"], "--int8", llm["int4"], "--inputs", llm["ids"], "--target", "cosine>=0.995"]
    base += ["--tiers", "int4,int8,fp32", "--bench-runs", "0"]

    def tiers(out: str, *more: str) -> tuple[int, str, dict]:
        """The exit code and stdout of one ``diag exclude --tiers`` run, and its tiers.json."""
        code, printed, _ = run_cli([*base, *more, "--out", tmp_path / out], capsys)
        return code, printed, json.loads((tmp_path / out / "tiers.json").read_text())

    code, printed, full = tiers("full")
    assert code == 0 and full["reachable"] and full["budget"] is None
    # --max-trials counts quantizations, the baseline's among them: stop right after the first met trial
    limit = next(i for i, t in enumerate(full["trials"]) if t["met"]) + 1
    assert len(full["trials"]) > limit, "the search narrows after its first met trial"
    code, printed, plan = tiers("met", "--max-trials", str(limit))
    assert plan["budget"] == f"--max-trials {limit} reached"
    assert code == 0 and plan["reachable"]
    assert plan["trials"][-1]["met"] and plan["after"]["cosine"] >= 0.995
    assert len(plan["plan"]) == sum(plan["trials"][-1]["promoted"].values()) >= len(full["plan"])
    assert "met on" in printed and f"not the smallest plan: --max-trials {limit} reached" in printed
    assert (tmp_path / "met" / "fp32.plan.onnx").exists()
    # Stopped while pruning (a met plan, not every group tried one tier lower): said too. It used
    # to be kept silently, as if the plan were the smallest.
    pruning = next(i for i, t in enumerate(full["trials"]) if t["phase"] == "prune") + 2
    assert sum(t["phase"] == "prune" for t in full["trials"]) > 2
    code, printed, pruned = tiers("pruned", "--max-trials", str(pruning))
    assert [t["phase"] for t in pruned["trials"]][-2:] == ["prune", "prune"] and pruned["reachable"]
    assert pruned["budget"] == f"--max-trials {pruning} reached" and pruned["after"]["cosine"] >= 0.995
    assert f"not the smallest plan: --max-trials {pruning} reached" in printed
    summary = (tmp_path / "pruned" / "summary.md").read_text()
    assert f"**Verified fix**: met (--max-trials {pruning} reached: verified, not the smallest plan)" in summary
    code, printed, short = tiers("short", "--max-trials", "2")
    assert code == 3 and not short["reachable"]
    assert "not reached (--max-trials 2 reached)" in printed and "stopped before any plan met it" in printed
    assert "no plan short of" not in printed
    summary = (tmp_path / "short" / "summary.md").read_text()
    assert "**Verified fix**: not reached (--max-trials 2 reached before any plan met the target)" in summary
    verdict = summary.split("**Verified fix**")[1].split("INT8 format")[0]
    assert "MatMulNBitsQuantizer" not in summary and "```" not in verdict  # no calls to paste
    assert "best-fix-code" not in (tmp_path / "short" / "report.html").read_text()  # no calls to paste
