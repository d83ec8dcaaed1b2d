"""Fixes verified on the model the user ships (issue 41): float regions spliced into *their* INT8 model.

`diag exclude --int8 USER.onnx` measures the user's model itself as "before", every trial is that
model with float regions spliced in (no quantizer runs), and the mixed model it writes is the
user's model with those regions in float and every other node and initializer untouched. Each
figure printed is re-computed here with plain onnxruntime sessions on the files diag wrote.
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
from onnxruntime.quantization import QuantType, quantize_dynamic

from diag.core.match import match_models
from diag.core.protos import node_id
from diag.core.surgery import PREFIX, spliced_model
from diag.fixtures import models, thirdparty
from diag.fixtures.quantize import FORMATS, quantize


def _session(path: Path | str, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _min_cosine(fp32: Path, model: Path, feeds: dict[str, np.ndarray], first: int, batch: int, level) -> float:
    """Min per-sample cosine over outputs, FP32 (exact) vs ``model`` at ``level``, by plain onnxruntime."""
    a, b = _session(fp32, ort.GraphOptimizationLevel.ORT_DISABLE_ALL), _session(model, level)
    total = len(next(iter(feeds.values())))
    worst = 1.0
    for start in range(first, total, batch):
        chunk = {k: v[start : start + batch] for k, v in feeds.items()}
        for x, y in zip(a.run(None, chunk), b.run(None, chunk), strict=True):
            x2, y2 = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
            cos = (x2 * y2).sum(1) / np.sqrt((x2 * x2).sum(1) * (y2 * y2).sum(1))
            worst = min(worst, float(cos.min()))
    return worst


def _outside_regions_unchanged(user: onnx.ModelProto, mixed: onnx.ModelProto, region: set[str]) -> set[str]:
    """Every node of ``user`` outside ``region`` (INT8 node ids: name, or ``Op#index``) is in ``mixed``
    byte for byte, and so is every initializer; what ``mixed`` adds is named under diag's prefix.
    Returns the ids of the user's nodes that the splice replaced (all inside ``region``)."""
    mixed_nodes = {n.SerializeToString() for n in mixed.graph.node}
    gone = {node_id(n, i) for i, n in enumerate(user.graph.node) if n.SerializeToString() not in mixed_nodes}
    assert gone and gone <= region, f"nodes outside the regions changed or vanished: {sorted(gone - region)}"
    user_nodes = {n.SerializeToString() for n in user.graph.node}
    added = [n.name for n in mixed.graph.node if n.SerializeToString() not in user_nodes]
    assert added and all(a.startswith(PREFIX) for a in added), added
    user_inits = {i.name: i.SerializeToString() for i in user.graph.initializer}
    for init in mixed.graph.initializer:
        if init.name in user_inits:
            assert init.SerializeToString() == user_inits[init.name], init.name
        else:
            assert init.name.startswith(PREFIX), init.name
    kept = [n for i, n in enumerate(user.graph.node) if node_id(n, i) not in gone]
    read = {t for n in kept for t in n.input} & set(user_inits)
    assert read <= {i.name for i in mixed.graph.initializer}
    assert [(o.name, o.type) for o in mixed.graph.output] == [(o.name, o.type) for o in user.graph.output]
    return gone


def _with_quantizers_only_it_reads(user: onnx.ModelProto, region: set[str]) -> set[str]:
    """``region`` plus the QuantizeLinear/DequantizeLinear nodes whose outputs only the region reads.

    NNCF quantizes a Relu's output as that Relu's own Q/DQ pair, where onnxruntime fuses Conv+Relu:
    with the pool that alone reads it kept in float, the pair goes too (as ``nodes_to_exclude``
    leaves the inputs of an excluded node unquantized), though the pair is in the Relu's group.
    """
    ids = {node_id(n, i): n for i, n in enumerate(user.graph.node)}
    readers: dict[str, set[str]] = {}
    for key, n in ids.items():
        for t in n.input:
            readers.setdefault(t, set()).add(key)
    out = set(region)
    grown = True
    while grown:
        grown = False
        for key, n in ids.items():
            if key in out or n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                continue
            read_by = {r for t in n.output for r in readers.get(t, set())}
            if read_by and read_by <= out:
                out.add(key)
                grown = True
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("fixture", "node"), [("convnet", "conv2"), ("transformer", "layer1/ffn/fc1/MatMul")])
def test_spliced_model_differs_from_the_users_only_inside_the_region(fixture, node, fmt, tmp_path) -> None:
    fx = models.build(fixture)
    fp_path, q_path = tmp_path / "m.fp32.onnx", tmp_path / f"m.{fmt}.onnx"
    onnx.save(fx.model, fp_path)
    quantize(fp_path, q_path, fmt, calibration=fx.make_inputs(8, 3))
    fp, q = onnx.load(fp_path), onnx.load(q_path)
    matching = match_models(fp, q)
    group = next(g for g in matching.groups if node in g.fp_nodes)
    assert group.quantized, f"{node} is not quantized in {fmt}"
    mixed = spliced_model(fp, q, group.fp_nodes, matching)
    # Only the group's own INT8 nodes go (a DynamicQuantizeLinear / QuantizeLinear other quantized
    # nodes still read stays, outside the region).
    _outside_regions_unchanged(q, mixed, set(group.int8_nodes))
    # It runs, and the region computes the FP32 node: the float copy of the node is there.
    copy = [n for n in mixed.graph.node if n.name == PREFIX + node]
    assert len(copy) == 1 and copy[0].op_type == next(n.op_type for n in fp.graph.node if n.name == node)
    x = fx.make_inputs(2, 5)
    onnx.save(mixed, tmp_path / "mixed.onnx")
    _session(tmp_path / "mixed.onnx", ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, x)


@pytest.fixture(scope="module")
def const_b_off(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    """The transformer quantized with the popular guide's line MatMulConstBOnly=False: its attention
    scores and context MatMuls (two activation inputs) are quantized too, which onnxruntime's
    quantize_dynamic default (True) would not do."""
    d = tmp_path_factory.mktemp("constb")
    fx = models.build("transformer")
    fp, q, x = d / "t.fp32.onnx", d / "t.int8.onnx", d / "t.npz"
    onnx.save(fx.model, fp)
    quantize_dynamic(
        str(fp), str(q), weight_type=QuantType.QUInt8, per_channel=True, extra_options={"MatMulConstBOnly": False}
    )
    feeds = fx.make_inputs(32, 12)
    np.savez(x, **feeds)
    return fp, q, x, feeds


def test_exclude_int8_measures_and_fixes_the_users_own_model(const_b_off, tmp_path, capsys) -> None:
    fp, q, x, feeds = const_b_off
    before_bytes = q.read_bytes()
    out = tmp_path / "out"
    args = ["exclude", fp, "--int8", q, "--inputs", x, "--batch", "8", "--target", "cosine>=0.999"]
    code, printed, err = run_cli([*args, "--bench-runs", "0", "--quiet", "--out", out], capsys)
    assert code == 0, err
    doc = json.loads((out / "exclusion.json").read_text())
    assert doc["method"] == "surgical" and doc["int8"] == str(q)
    assert doc["search"]["quantizations"] == 0 and doc["search"]["splices"] >= 1
    held = doc["split"]["held_out_first"]
    exact, deployed = ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # "before" is the user's file as plain onnxruntime runs it, not a rebuild of it.
    assert doc["metrics"]["before"]["cosine"] == pytest.approx(_min_cosine(fp, q, feeds, held, 8, exact), abs=1e-6)
    # The mixed model diag wrote reproduces the printed "after", exact and as deployed.
    mixed = out / "t.mixed.onnx"
    after = _min_cosine(fp, mixed, feeds, held, 8, exact)
    assert doc["metrics"]["after"]["cosine"] == pytest.approx(after, abs=1e-6)
    assert after >= 0.999
    assert doc["metrics"]["after_deployed"]["cosine"] == pytest.approx(
        _min_cosine(fp, mixed, feeds, held, 8, deployed), abs=1e-6
    )
    # ... and it is the user's model with the regions in float, nothing else changed.
    user, written = onnx.load(q), onnx.load(mixed)
    groups = match_models(onnx.load(fp), user).groups
    region = {i for g in groups if set(g.fp_nodes) & set(doc["nodes_to_exclude"]) for i in g.int8_nodes}
    _outside_regions_unchanged(user, written, region)
    # The act x act MatMuls the user's recipe quantized are still quantized in the fix.
    count = sum(n.op_type == "MatMulInteger" for n in written.graph.node)
    assert count == sum(n.op_type == "MatMulInteger" for n in user.graph.node) - len(doc["nodes_to_exclude"])
    lines = printed.splitlines()
    assert any(line.startswith("  inside your INT8 model: ") and "stay INT8" for line in lines), printed
    assert "spliced from your INT8 model (no re-quantization)" in printed
    assert q.read_bytes() == before_bytes  # the user's model is read, never written
    # reproduce.py rebuilds the verified model byte for byte (it calls diag's splice).
    snippet = (out / "reproduce.py").read_text()
    assert json.dumps(doc["nodes_to_exclude"]) in snippet
    runpy.run_path(str(out / "reproduce.py"), run_name="__main__")
    assert (out / "t.reproduced.onnx").read_bytes() == mixed.read_bytes()
    assert "your INT8 model" in (out / "report.html").read_text()


def test_max_trials_caps_a_surgical_search_too(const_b_off, tmp_path, capsys) -> None:
    """--max-trials counts the models a search measures, the user's own included: splices count as
    trials (they did not, and a surgical search ran past its cap)."""
    fp, q, x, _ = const_b_off
    args = ["exclude", fp, "--int8", q, "--inputs", x, "--batch", "8", "--target", "cosine>=0.9995"]
    code, printed, err = run_cli([*args, "--bench-runs", "0", "--quiet", "--out", tmp_path / "full"], capsys)
    full = json.loads((tmp_path / "full" / "exclusion.json").read_text())["search"]
    assert code == 0 and full["splices"] >= 3, printed + err
    code, printed, err = run_cli(
        [*args, "--bench-runs", "0", "--quiet", "--max-trials", "4", "--out", tmp_path / "o"], capsys
    )
    doc = json.loads((tmp_path / "o" / "exclusion.json").read_text())["search"]
    assert doc["splices"] == 3, "the user's model and three splices: four trials"
    assert doc["budget"]["exhausted"] and doc["budget"]["reason"] == "--max-trials 4 reached"


def test_a_list_keeping_every_group_in_float_is_not_a_fix(const_b_off, tmp_path, capsys) -> None:
    fp, q, x, _ = const_b_off
    args = ["exclude", fp, "--int8", q, "--inputs", x, "--batch", "8", "--target", "cosine>=0.9999999"]
    code, printed, err = run_cli([*args, "--bench-runs", "0", "--quiet", "--out", tmp_path / "o"], capsys)
    assert code == 3, printed + err
    doc = json.loads((tmp_path / "o" / "exclusion.json").read_text())
    assert doc["verdict"] == "not reachable" and doc["nodes_to_exclude"] == []
    assert "NOT REACHABLE" in printed
    assert not (tmp_path / "o" / "t.mixed.onnx").exists()


def test_a_recipe_that_does_not_rebuild_the_users_model_is_said_and_the_fix_is_surgical(
    const_b_off, tmp_path, capsys
) -> None:
    fp, q, x, _ = const_b_off
    recipe = tmp_path / "guide.json"  # the guide's config without its MatMulConstBOnly line
    recipe.write_text(json.dumps({"mode": "dynamic", "weight_type": "QUInt8", "per_channel": True}))
    user = onnx.load(q)
    ours = sum(n.op_type == "MatMulInteger" for n in user.graph.node)
    rebuilt = tmp_path / "default.onnx"
    quantize_dynamic(str(fp), str(rebuilt), weight_type=QuantType.QUInt8, per_channel=True)
    theirs = sum(n.op_type == "MatMulInteger" for n in onnx.load(rebuilt).graph.node)
    assert ours > theirs
    common = ["--inputs", x, "--batch", "8", "--target", "cosine>=0.999", "--bench-runs", "0", "--quiet"]
    code, printed, err = run_cli(
        ["exclude", fp, "--int8", q, "--recipe", recipe, *common, "--out", tmp_path / "a"], capsys
    )
    assert code == 0, err
    line = next(x for x in printed.splitlines() if x.strip().startswith("round trip:"))
    assert f"your model quantizes {ours} MatMuls, the recipe {theirs}" in line, line
    assert f"the {ours - theirs} with two activation inputs" in line and "MatMulConstBOnly=False" in line, line
    assert "splicing float regions into it instead" in line
    doc = json.loads((tmp_path / "a" / "exclusion.json").read_text())
    assert doc["method"] == "surgical" and doc["search"]["quantizations"] == 0

    # --requantize refuses to fix a model the recipe does not rebuild: one line, exit 2, nothing written.
    code, printed, err = run_cli(
        ["exclude", fp, "--int8", q, "--recipe", recipe, "--requantize", *common, "--out", tmp_path / "b"], capsys
    )
    assert code == 2, printed + err
    assert err.startswith("diag: error[recipe-mismatch]: ") and len(err.strip().splitlines()) == 1, err
    assert "MatMulConstBOnly=False" in err
    assert not (tmp_path / "b" / "exclusion.json").exists()


def test_requantize_after_a_proven_round_trip_measures_the_users_model(const_b_off, tmp_path, capsys) -> None:
    fp, q, x, feeds = const_b_off
    common = ["--inputs", x, "--batch", "8", "--target", "cosine>=0.999", "--bench-runs", "0", "--quiet"]
    code, printed, err = run_cli(["exclude", fp, "--int8", q, "--requantize", *common, "--out", tmp_path / "r"], capsys)
    assert code == 0, err
    assert "round trip: the recipe rebuilds your INT8 model exactly" in printed
    doc = json.loads((tmp_path / "r" / "exclusion.json").read_text())
    assert doc["method"] == "requantized" and doc["search"]["quantizations"] >= 1
    assert doc["recipe"]["extra_options"]["MatMulConstBOnly"] is False
    held = doc["split"]["held_out_first"]
    exact = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert doc["metrics"]["before"]["cosine"] == pytest.approx(_min_cosine(fp, q, feeds, held, 8, exact), abs=1e-6)


def _producer_model(kind: str, fp: Path, q: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    from diag.fixtures import producers

    if kind == "modelopt":
        return producers.modelopt_style(q)
    if kind == "modelopt-fp16":
        return producers.modelopt_fp16_style(q)
    if kind == "nncf":
        return producers.nncf_style(q)
    return producers.smoothquant_style(onnx.load(fp), q, feeds)[1]


@pytest.mark.parametrize(
    ("kind", "fixture"),
    [
        ("modelopt", "convnet"),
        ("modelopt-fp16", "convnet"),
        ("nncf", "transformer"),
        ("smooth", "transformer"),
        ("nncf-real", "convnet"),
        ("nncf-real", "transformer"),
    ],
)
def test_exclude_int8_fixes_models_of_other_quantizers_in_place(kind, fixture, tmp_path, capsys) -> None:
    """ModelOpt's float weights before a QuantizeLinear, NNCF's ``dq_output_*`` names and its
    SmoothQuant Mul nodes, and models NNCF itself quantized (``nncf.quantize``: its own QDQ
    placement, calibration, bias correction and, on the transformer, SmoothQuant): the fix is
    spliced into that model, no onnxruntime quantizer is called, and every figure printed is what
    plain onnxruntime measures on the files."""
    fx = models.build(fixture)
    fp, ort_q, user, x = tmp_path / "m.fp32.onnx", tmp_path / "m.ort.onnx", tmp_path / "m.int8.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    feeds = fx.make_inputs(32, 12)
    np.savez(x, **feeds)
    if kind == "nncf-real":
        calibration = thirdparty.one_sample_batches(fx.make_inputs(16, 3))
        onnx.save(thirdparty.nncf_quantized(fx.model, calibration, transformer=fixture == "transformer"), user)
        if fixture == "transformer":  # NNCF's own SmoothQuant ran: its Mul nodes are in the model
            assert any(n.name.endswith("/nncf_smooth_quant") for n in onnx.load(user).graph.node)
    else:
        quantize(fp, ort_q, "qdq", calibration=fx.make_inputs(8, 3))
        onnx.save(_producer_model(kind, fp, onnx.load(ort_q), fx.make_inputs(8, 3)), user)
    exact, deployed = ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    before = _min_cosine(fp, user, feeds, 16, 8, exact)
    target = f"cosine>={1 - (1 - before) / 3:.6f}"  # a third of the error: the search must keep nodes in float
    out = tmp_path / "out"
    args = ["exclude", fp, "--int8", user, "--inputs", x, "--batch", "8", "--target", target, "--bench-runs", "0"]
    code, printed, err = run_cli([*args, "--quiet", "--out", out], capsys)
    assert code == 0, printed + err
    doc = json.loads((out / "exclusion.json").read_text())
    assert doc["method"] == "surgical" and doc["search"]["quantizations"] == 0
    assert doc["producer"]["key"] == ("modelopt" if kind.startswith("modelopt") else "nncf")
    assert doc["metrics"]["before"]["cosine"] == pytest.approx(before, abs=1e-6)
    mixed = out / "m.mixed.onnx"
    assert doc["metrics"]["after"]["cosine"] == pytest.approx(_min_cosine(fp, mixed, feeds, 16, 8, exact), abs=1e-6)
    assert doc["metrics"]["after_deployed"]["cosine"] == pytest.approx(
        _min_cosine(fp, mixed, feeds, 16, 8, deployed), abs=1e-6
    )
    users, written = onnx.load(user), onnx.load(mixed)
    groups = match_models(onnx.load(fp), users).groups
    region = {i for g in groups if set(g.fp_nodes) & set(doc["nodes_to_exclude"]) for i in g.int8_nodes}
    _outside_regions_unchanged(users, written, _with_quantizers_only_it_reads(users, region))
    snippet = (out / "reproduce.py").read_text()
    if not kind.startswith("modelopt"):
        assert "nncf.IgnoredScope(names=[" in snippet
    for name in doc["nodes_to_exclude"]:
        assert repr(name) in snippet or json.dumps(name) in snippet


def test_exclude_max_memory_splits_the_ranking_pass_as_compare_does(const_b_off, tmp_path, capsys) -> None:
    """``--max-memory`` bounds exclude's ranking pass, the one run that exposes every tensor, exactly
    as in `diag compare`: its tensors are split into passes, and the answer does not change."""
    fp, q, x, _ = const_b_off
    common = ["--inputs", x, "--batch", "8", "--target", "cosine>=0.999", "--bench-runs", "0", "--quiet"]
    answers = {}
    for budget in (None, "300KB"):
        out = tmp_path / str(budget)
        flags = ["--max-memory", budget] if budget else []
        code, _, err = run_cli(["exclude", fp, "--int8", q, *common, *flags, "--out", out], capsys)
        assert code == 0, err
        passes = json.loads((out / "diag.json").read_text())["run"]["passes"]
        assert (passes > 1) == (budget is not None), passes
        doc = json.loads((out / "exclusion.json").read_text())
        answers[budget] = (doc["nodes_to_exclude"], doc["metrics"]["after"]["cosine"])
    assert answers[None] == answers["300KB"]


def test_modelopts_default_float16_output_is_compared_locally_and_its_effects_measured(tmp_path, capsys) -> None:
    """Issue 43 item 3: ModelOpt's default output (int8 QDQ around float16 compute) made ``diag
    compare`` exit 2 ``invalid-model`` on diag's own cut model (float32 fed to a float16
    QuantizeLinear) and blame the user's model. Now the cut and the float regions follow the
    model's float16: every node's local error and effect is measured, and inspect names the
    float16 nodes."""
    from diag.fixtures import producers

    fx = models.build("convnet")
    fp, ort_q, user, x = tmp_path / "m.fp32.onnx", tmp_path / "m.ort.onnx", tmp_path / "m.mo16.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    np.savez(x, **fx.make_inputs(16, 12))
    quantize(fp, ort_q, "qdq", calibration=fx.make_inputs(8, 3))
    onnx.save(producers.modelopt_fp16_style(onnx.load(ort_q)), user)
    code, printed, err = run_cli(["inspect", user], capsys)
    assert code == 0 and "precision:  fp16 " in printed and "made by:    NVIDIA ModelOpt" in printed, printed
    out = tmp_path / "o"
    code, printed, err = run_cli(["compare", fp, user, "--inputs", x, "--batch", "8", "--quiet", "--out", out], capsys)
    assert code in (0, 3), err
    doc = json.loads((out / "diag.json").read_text())
    convs = [n for n in doc["nodes"] if n["op_type"].startswith("Conv")]
    assert len(convs) == 3 and all(isinstance(n["local"]["sqnr_db"], float) for n in convs)
    assert doc["effects"]["skipped"] == {}, doc["effects"]["skipped"]
    assert {e["node"] for e in doc["effects"]["effects"]} >= {n["name"] for n in convs}
