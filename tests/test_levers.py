"""Causes a user can act on (issue 42 item 1): a recipe lever is a candidate cause, measured like a node.

The ``attention_lever`` fixture's error is spread over its 8 activation x activation MatMuls (no
one of them recovers half of it) and comes from one recipe line, ``MatMulConstBOnly: False``. The
headline must name that lever with its measured effect, and the lever's fix, applied to the user's
own quantize_dynamic call, must remove the error when measured with plain onnxruntime.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli
from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
from plain_ort import Rows

from diag.analysis.levers import group_candidates
from diag.cli import commands as cli
from diag.core.feeds import FeedSpec
from diag.core.match import match_models
from diag.fixtures import models

ACT_ACT = [f"layer{i}/attn/{m}" for i in range(4) for m in ("MatMul", "MatMul_1")]


def _sqnr(fp32: Path, model: Path, feeds: dict[str, np.ndarray]) -> float:
    """SQNR (dB) of the logits over every sample, plain onnxruntime at its default level."""
    ref = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float64)
    got = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float64)
    return float(10 * np.log10((ref**2).sum() / ((got - ref) ** 2).sum()))


@pytest.fixture(scope="module")
def lever(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("lever")
    fx = models.build("attention_lever")
    fp, q, x = d / "enc.fp32.onnx", d / "enc.int8.onnx", d / "enc.npz"
    onnx.save(fx.model, fp)
    # The popular guide's line: quantize the activation x activation MatMuls too.
    quantize_dynamic(
        str(fp), str(q), weight_type=QuantType.QUInt8, per_channel=True, extra_options={"MatMulConstBOnly": False}
    )
    feeds = fx.make_inputs(32, 3)
    np.savez(x, **feeds)
    return fp, q, x, feeds


def test_the_headline_names_the_recipe_lever_with_its_measured_effect(lever, tmp_path, capsys) -> None:
    fp, q, x, _ = lever
    out = tmp_path / "out"
    assert cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--out", str(out), "--quiet"]) in (
        0,
        3,
    )
    printed = capsys.readouterr().out
    doc = json.loads((out / "diag.json").read_text())
    effects = doc["effects"]
    # No node alone explains the error ...
    assert max(e["recovered"] for e in effects["effects"]) < 0.5
    # ... the 8 activation x activation MatMuls together do, and they are named by the lever that quantizes them.
    group = effects["groups"][0]
    assert group["kind"] == "act_act_matmuls" and sorted(group["fp_nodes"]) == sorted(ACT_ACT)
    assert group["lever"] == "MatMulConstBOnly=False" and group["recovered"] >= 0.9
    headline = next(line for line in printed.splitlines() if line.startswith("verdict:"))
    assert "cause: MatMulConstBOnly=False: keeping the 8 activation x activation MatMuls in float recovers " in headline
    assert f"recovers {group['recovered']:.0%} of the error of logits" in headline
    assert "drop MatMulConstBOnly: False from extra_options" in headline
    assert "single root cause" not in headline and not [n for n in doc["nodes"] if n["role"] == "root-cause"]
    assert "(MatMulConstBOnly=False)" in printed  # the terminal's effect line for the groups
    assert "the 8 activation x activation MatMuls" in (out / "report.html").read_text()
    assert "cause: MatMulConstBOnly=False" in (out / "summary.md").read_text()


def test_the_levers_fix_applied_to_the_users_call_removes_the_error(lever, tmp_path) -> None:
    """The claim checked on the user's own pipeline: the same quantize_dynamic call without the line."""
    fp, q, _, feeds = lever
    fixed = tmp_path / "fixed.onnx"
    quantize_dynamic(str(fp), str(fixed), weight_type=QuantType.QUInt8, per_channel=True)
    before, after = _sqnr(fp, q, feeds), _sqnr(fp, fixed, feeds)
    assert after > before + 10, (before, after)
    m = onnx.load(str(fixed))
    assert sum(n.op_type == "MatMulInteger" for n in m.graph.node) == 4 * 6 + 1  # the weight MatMuls only


def test_no_lever_is_named_where_the_recipe_did_not_pull_it(lever, tmp_path, capsys) -> None:
    """quantize_dynamic's default leaves the act x act MatMuls in float: nothing to blame on that lever."""
    fp, _, x, _ = lever
    q = tmp_path / "default.onnx"
    quantize_dynamic(str(fp), str(q), weight_type=QuantType.QUInt8, per_channel=True)
    out = tmp_path / "out"
    cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--batch", "8", "--out", str(out), "--quiet"])
    capsys.readouterr()
    doc = json.loads((out / "diag.json").read_text())
    assert "MatMulConstBOnly" not in doc["verdict"]["cause"]
    assert all(g["kind"] != "act_act_matmuls" for g in (doc.get("effects") or {}).get("groups", []))


def test_static_models_word_the_lever_in_quantize_statics_terms(lever, tmp_path) -> None:
    """quantize_static quantizes act x act MatMuls by default: the change is MatMulConstBOnly=True."""
    from diag.analysis.compare import CompareOptions, compare_models

    fp, _, x, feeds = lever
    q = tmp_path / "qdq.onnx"
    quantize_static(str(fp), str(q), Rows(feeds, 8), quant_format=QuantFormat.QDQ, per_channel=True)
    r = compare_models(fp, q, FeedSpec(inputs=str(x), batch=8), CompareOptions(progress=False, effects=0))
    groups = group_candidates(onnx.load(str(fp)), r.findings, "qdq")
    act = next(g for g in groups if g.kind == "act_act_matmuls")
    assert sorted(act.fp_nodes) == sorted(ACT_ACT)
    assert act.fix.startswith("extra_options={'MatMulConstBOnly': True}")
    # An op-type group that would leave (nearly) nothing quantized is not a fix, so not a candidate.
    assert match_models(onnx.load(str(fp)), onnx.load(str(q))).groups
    assert all(len(g.fp_nodes) <= 0.9 * sum(f.group.quantized for f in r.findings) for g in groups)


@pytest.mark.parametrize(
    ("producer", "lever_", "fix"),
    [
        ("onnxruntime", "op_types_to_quantize with {op}", "op_types_to_quantize=["),
        ("nncf", "NNCF quantizes every {op}", "nncf.IgnoredScope(types=['{op}']) in your nncf.quantize call"),
        ("modelopt", "NVIDIA ModelOpt (TensorRT Model Optimizer) quantizes every {op}", "op_types_to_exclude=['{op}']"),
        ("aimet", "Qualcomm AIMET (aimet-onnx): {op} quantized", "keep these "),
    ],
)
def test_levers_are_worded_in_the_terms_of_the_tool_that_made_the_model(lever, tmp_path, producer, lever_, fix) -> None:
    """A user of NNCF, ModelOpt or AIMET cannot set onnxruntime's op_types_to_quantize or
    MatMulConstBOnly: a group is named by that tool's own switch, or as nodes for its exclusion list."""
    from diag.analysis.compare import CompareOptions, compare_models

    fp, _, x, feeds = lever
    q = tmp_path / "qdq.onnx"
    quantize_static(str(fp), str(q), Rows(feeds, 8), quant_format=QuantFormat.QDQ, per_channel=True)
    r = compare_models(fp, q, FeedSpec(inputs=str(x), batch=8), CompareOptions(progress=False, effects=0))
    groups = group_candidates(onnx.load(str(fp)), r.findings, "qdq", producer)
    by_type = next(g for g in groups if g.kind == "op_type")
    op = by_type.label.split()[2]
    assert by_type.lever == lever_.format(op=op), by_type.lever
    assert by_type.fix.startswith(fix.format(op=op)), by_type.fix
    act = next(g for g in groups if g.kind == "act_act_matmuls")
    assert sorted(act.fp_nodes) == sorted(ACT_ACT)
    assert ("MatMulConstBOnly" in act.lever + act.fix) == (producer == "onnxruntime"), (act.lever, act.fix)


DOWN = [f"/model/layers.{i}/mlp/down_proj/MatMul" for i in range(8)]


@pytest.fixture(scope="module")
def projection(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("projection")
    fx = models.projection_spread()
    fp, q, x = d / "stack.fp32.onnx", d / "stack.int8.onnx", d / "stack.npz"
    onnx.save(fx.model, fp)
    quantize_dynamic(str(fp), str(q))
    feeds = fx.make_inputs(32, 1)
    np.savez(x, **feeds)
    return fp, q, x, feeds


def test_one_projection_in_every_layer_is_a_cause_named_with_its_measured_effect(projection, tmp_path, capsys) -> None:
    """The down projection of every layer explains the error no node alone does; the fix keeps exactly
    those 8 MatMuls in float, and quantize_dynamic with that nodes_to_exclude removes the error the
    headline says, measured with plain onnxruntime on the samples the effect check ran."""
    fp, q, x, feeds = projection
    out = tmp_path / "out"
    assert cli.main(["compare", str(fp), str(q), "--inputs", str(x), "--out", str(out), "--quiet"]) in (0, 3)
    printed = capsys.readouterr().out
    doc = json.loads((out / "diag.json").read_text())
    effects = doc["effects"]
    assert max(e["recovered"] for e in effects["effects"]) < 0.5
    group = effects["groups"][0]
    assert group["kind"] == "projection" and group["fp_nodes"] == DOWN
    assert group["label"] == "the mlp/down_proj projection of 8 layers"
    headline = next(line for line in printed.splitlines() if line.startswith("verdict:"))
    assert f"keeping the mlp/down_proj projection of 8 layers in float recovers {group['recovered']:.0%}" in headline
    # 8 names would bury the sentence: it counts them, and the whole list is the next line, copyable
    assert headline.endswith("fix: keep its 8 nodes in float with nodes_to_exclude (the list is under this line)")
    fix = f"nodes_to_exclude={json.dumps(DOWN)}"
    assert printed.splitlines()[printed.splitlines().index(headline) + 1] == f"  fix: {fix}"
    assert doc["verdict"]["headline"]["kind"] == "lever" and doc["verdict"]["headline"]["fix_code"] == fix
    assert f"```python\n{fix}\n```" in (out / "summary.md").read_text()
    assert (
        f'<pre id="headline-fix" class="fixcode">{fix.replace(chr(34), "&#34;")}</pre>'
        in (out / "report.html").read_text()
    )
    # The claim on the user's own call: the same quantize_dynamic with those nodes excluded.
    fixed = tmp_path / "fixed.onnx"
    quantize_dynamic(str(fp), str(fixed), nodes_to_exclude=DOWN)
    first = {k: v[: effects["samples"]] for k, v in feeds.items()}
    before, after = (10 ** (-_sqnr(fp, m, first) / 10) for m in (q, fixed))  # error over signal energy
    assert 1 - after / before == pytest.approx(group["recovered"], abs=0.02)
    assert group["recovered"] >= 0.9
    # The up projections, which quantize well, are a group that does not explain it.
    up = next(g for g in effects["groups"] if g["label"] == "the mlp/up_proj projection of 8 layers")
    assert up["recovered"] < 0.2


def _guide_recipe(folder: Path) -> Path:
    """The recipe that made the ``lever`` fixture, with the guide's two lines in extra_options."""
    recipe = folder / "recipe.json"
    settings = {"MatMulConstBOnly": False, "ActivationSymmetric": True}
    recipe.write_text(
        json.dumps({"mode": "dynamic", "weight_type": "QUInt8", "per_channel": True, "extra_options": settings})
    )
    return recipe


def test_compare_with_the_recipe_measures_each_of_its_lines_as_lint_does(lever, tmp_path, capsys) -> None:
    """Issue 42 item 4, lint inside compare: with ``--recipe FILE`` each line is measured on the model
    it builds, in the words ``diag lint --model`` prints (the same findings)."""
    fp, q, x, _ = lever
    recipe = _guide_recipe(tmp_path)
    out = tmp_path / "out"
    args = [
        "compare",
        fp,
        q,
        "--inputs",
        x,
        "--batch",
        "8",
        "--recipe",
        recipe,
        "--out",
        out,
        "--quiet",
        "--effects",
        "0",
    ]
    assert cli.main([str(a) for a in args]) in (0, 3)
    printed = capsys.readouterr().out
    doc = json.loads((out / "diag.json").read_text())
    lines = {f["where"]: f for f in doc["recipe_lines"]}
    const_b = lines["extra_options.MatMulConstBOnly"]
    assert const_b["code"] == "measured" and "output SQNR" in const_b["message"]
    figures = re.search(r"output SQNR ([-\d.]+) dB with it, ([-\d.]+) dB without", const_b["message"])
    assert figures is not None
    with_it, without = float(figures[1]), float(figures[2])
    assert without > with_it + 10
    assert lines["extra_options.ActivationSymmetric"]["code"] == "no-effect"
    assert "  recipe line: note[measured] extra_options.MatMulConstBOnly: changes the model" in printed
    assert "  recipe line: warning[no-effect] extra_options.ActivationSymmetric" in printed
    # The same words in summary.md and report.html (worded once, by lint's Finding.line).
    worded = f"note[measured] extra_options.MatMulConstBOnly: {const_b['message']}"
    assert worded in (out / "report.html").read_text()
    assert "extra_options.MatMulConstBOnly" in (out / "summary.md").read_text()
    assert cli.main(["lint", str(recipe), "--model", str(fp), "--inputs", str(x), "--batch", "8"]) in (0, 1, 2, 3)
    linted = capsys.readouterr().out
    assert f"note[measured] extra_options.MatMulConstBOnly: {const_b['message']}" in linted


def test_exclude_with_the_recipe_measures_each_of_its_lines_too(lever, tmp_path, capsys) -> None:
    """Issue 42 item 4, lint inside exclude: the same findings, printed, in exclusion.json and the report."""
    fp, q, x, _ = lever
    recipe = _guide_recipe(tmp_path)
    out = tmp_path / "out"
    args = ["exclude", fp, "--int8", q, "--recipe", recipe, "--inputs", x, "--target", "cosine>=0.999"]
    assert cli.main([str(a) for a in [*args, "--out", out, "--quiet"]]) in (0, 1)
    printed = capsys.readouterr().out
    found = json.loads((out / "exclusion.json").read_text())["recipe_lines"]
    lines = {f["where"]: f for f in found}
    assert lines["extra_options.MatMulConstBOnly"]["code"] == "measured"
    assert lines["extra_options.ActivationSymmetric"]["code"] == "no-effect"
    assert "  recipe line: warning[no-effect] extra_options.ActivationSymmetric" in printed
    message = lines["extra_options.MatMulConstBOnly"]["message"]
    assert f"note[measured] extra_options.MatMulConstBOnly: {message}" in (out / "report.html").read_text()
    assert cli.main(["lint", str(recipe), "--model", str(fp), "--inputs", str(x)]) in (0, 1, 2, 3)
    assert f"note[measured] extra_options.MatMulConstBOnly: {message}" in capsys.readouterr().out


def test_the_residual_adds_of_a_qdq_stack_are_measured_as_one_group(tmp_path, capsys) -> None:
    """Issue 42 item 1, a graph pattern: the residual Adds. A hidden dimension that dominates the
    residual stream (BERT's outlier features) is quantized at every residual Add of a QDQ model;
    the group is measured in the user's model, and its share is what onnxruntime's own
    ``nodes_to_exclude`` with those Adds gives (same calibration data, plain onnxruntime)."""
    from diag.fixtures.quantize import _ArrayReader

    fx = models.transformer(outlier_dim=None, stream_outlier_dim=3, layers=4)
    fp, q, x = tmp_path / "fp32.onnx", tmp_path / "qdq.onnx", tmp_path / "x.npz"
    onnx.save(fx.model, fp)
    calibration = fx.make_inputs(32, 7)

    def static(out: Path, exclude: list[str]) -> None:
        quantize_static(
            str(fp),
            str(out),
            _ArrayReader(calibration),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            nodes_to_exclude=exclude,
        )

    static(q, [])
    feeds = fx.make_inputs(64, 1)
    np.savez(x, **feeds)
    code, _, _ = run_cli(["compare", fp, q, "--inputs", x, "--out", tmp_path / "o", "--quiet"], capsys)
    assert code in (0, 3)
    doc = json.loads((tmp_path / "o" / "diag.json").read_text())
    group = next(g for g in doc["effects"]["groups"] if g["kind"] == "residual_adds")
    adds = [f"layer{i}/{part}/residual" for i in range(4) for part in ("attn", "ffn")]
    assert group["fp_nodes"] == adds and group["label"] == "the 8 residual Adds"
    assert group["fix"] == f"nodes_to_exclude={json.dumps(adds)}"
    excluded = tmp_path / "excluded.onnx"
    static(excluded, adds)
    first = {k: v[: doc["effects"]["samples"]] for k, v in feeds.items()}
    ref = ort.InferenceSession(str(fp), providers=["CPUExecutionProvider"]).run(None, first)[0].astype(np.float64)

    def energy(model: Path) -> float:
        got = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, first)[0]
        return float(((got - ref) ** 2).sum())

    assert group["recovered"] == pytest.approx(1 - energy(excluded) / energy(q), abs=0.05)
    assert group["recovered"] > 0.1  # the stream's outlier dimension costs a real share at the Adds
