"""`diag exclude --tiers`: mixed-precision plans across tiers, verified without diag's code.

Only the plan comes from `diag`; re-quantizing, running and measuring in the verification use
``MatMulNBitsQuantizer`` / ``quantize_static``, ``onnxruntime.InferenceSession`` and numpy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
from plain_ort import Rows, min_cosine

from diag.cli.commands import main
from diag.core.recipe import Recipe
from diag.fix.tiers import parse_tiers
from diag.fixtures.nbits_models import BLOCK, outlier_activation_mlp, stray_block_mlp
from diag.foundations.errors import DiagError


def plain_weight_only(fp32: Path, out: Path, recipe: dict) -> Path:
    """The recipe's MatMulNBitsQuantizer calls, by hand: bits for all, then bits=8 for node_bits nodes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(fp32))
    wide = list(recipe.get("node_bits", {}))
    logging.disable(logging.INFO)
    try:
        for bits, excluded in ((recipe["bits"], recipe["nodes_to_exclude"] + wide), (8, recipe["nodes_to_exclude"])):
            q = MatMulNBitsQuantizer(model, bits=bits, block_size=recipe["block_size"], nodes_to_exclude=excluded)
            q.process()
            model = q.model.model
    finally:
        logging.disable(logging.NOTSET)
    onnx.save(model, str(out))
    return out


@pytest.fixture(scope="module")
def stray(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("tiers")
    fx = stray_block_mlp()
    onnx.save(fx.model, folder / "fp32.onnx")
    arrays = fx.make_inputs(64, 1)
    np.savez(folder / "x.npz", **arrays)
    return folder / "fp32.onnx", folder / "x.npz", arrays


def run_tiers(fp32: Path, inputs: Path, out: Path, recipe: str, target: str, tiers: str) -> tuple[int, dict]:
    flags = ["--target", target, "--tiers", tiers, "--out", str(out), "--bench-runs", "0", "--quiet"]
    code = main(["exclude", str(fp32), "--recipe", recipe, "--inputs", str(inputs), *flags])
    return code, json.loads((out / "tiers.json").read_text()) if code != 2 else {}


def test_int4_plan_promotes_the_stray_head_to_8_bits_and_plain_onnxruntime_confirms_it(
    stray: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    fp32, inputs, arrays = stray
    recipe = json.dumps({"mode": "weight_only", "bits": 4, "block_size": BLOCK})
    code, plan = run_tiers(fp32, inputs, tmp_path / "tiers", recipe, "cosine>=0.94", "int4,int8,fp32")
    assert code == 0 and plan["reachable"]
    assert plan["plan"] == {"fc2": "int8"}, "the head needs 8 bits, not float"
    # Lowering the one promoted group is the baseline: measured once, not quantized again by the pruning.
    assert plan["trials"][0]["phase"] == "baseline" and all(t["promoted"] for t in plan["trials"][1:])
    assert plan["quantizations"] == len(plan["trials"])
    assert plan["recipe"]["node_bits"] == {"fc2": 8} and plan["recipe"]["nodes_to_exclude"] == []
    first = plan["split"]["held_out_first"]
    assert plan["before"]["cosine"] < 0.94 <= plan["after"]["cosine"]
    # Verified without diag: the recipe's two MatMulNBitsQuantizer calls, run and measured by hand.
    mixed = plain_weight_only(fp32, tmp_path / "plain.onnx", plan["recipe"])
    assert min_cosine(fp32, mixed, arrays, first, 1) == pytest.approx(plan["after"]["cosine"], abs=1e-6)
    assert min_cosine(fp32, mixed, arrays, first, 1) >= 0.94
    # Not larger than the FP32-only exclusion for the same target.
    code, fp32_only = run_tiers(fp32, inputs, tmp_path / "fp32only", recipe, "cosine>=0.94", "int4,fp32")
    assert code == 0 and fp32_only["plan"] == {"fc2": "fp32"}
    assert len(plan["plan"]) <= len(fp32_only["plan"])
    assert plan["sizes"]["plan"] < fp32_only["sizes"]["plan"]
    assert (tmp_path / "tiers" / "reproduce.py").read_text().count("MatMulNBitsQuantizer(model, bits=") == 2
    # The report beside the plan shows it as the verified fix, not the diagnosis's unverified starting point.
    html = (tmp_path / "tiers" / "report.html").read_text()
    summary = (tmp_path / "tiers" / "summary.md").read_text()
    assert '<ul id="tier-plan"><li>int8 (1 node): fc2</li></ul>' in html and "Starting point" not in html
    assert "<th>all int4</th><th>the plan</th>" in html and "nodes_to_exclude=[&#39;fc2&#39;]" in html
    assert "**Verified fix**: met (target `cosine>=0.94`" in summary and "\n- int8 (1 node): fc2\n" in summary
    # The calls to paste are in the summary a review quotes too, not only in report.html.
    calls = summary.split("```")[1]
    assert calls.count("MatMulNBitsQuantizer(") == 2 and "nodes_to_exclude=['fc2']" in calls
    embedded = json.loads((tmp_path / "tiers" / "diag.json").read_text())["tiers"]
    assert embedded["plan"] == plan["plan"] and "MatMulNBitsQuantizer" in embedded["snippet"]
    # One output set, all or nothing: a folder in the way of one file replaces none of the others.
    before = {p.name: p.read_bytes() for p in (tmp_path / "tiers").iterdir() if p.is_file()}
    assert {"tiers.json", "fp32.plan.onnx", "recipe.json", "reproduce.py", "diag.json"} <= set(before)
    (tmp_path / "tiers" / "report.html").unlink()
    (tmp_path / "tiers" / "report.html").mkdir()
    assert run_tiers(fp32, inputs, tmp_path / "tiers", recipe, "cosine>=0.95", "int4,int8,fp32")[0] == 2
    after = {p.name: p.read_bytes() for p in (tmp_path / "tiers").iterdir() if p.is_file()}
    assert after == {k: v for k, v in before.items() if k != "report.html"}
    assert not [p for p in (tmp_path / "tiers").iterdir() if p.name.startswith(".")], "no work folder left"


def test_a16_plan_widens_the_outlier_tensor_and_meets_a_target_all_8_bit_misses(tmp_path: Path) -> None:
    fx = outlier_activation_mlp()
    fp32 = tmp_path / "a16.onnx"
    onnx.save(fx.model, fp32)
    arrays = fx.make_inputs(64, 1)
    np.savez(tmp_path / "x.npz", **arrays)
    recipe = json.dumps({"mode": "static", "per_channel": True})
    code, plan = run_tiers(fp32, tmp_path / "x.npz", tmp_path / "out", recipe, "cosine>=0.999", "int8,a16,fp32")
    assert code == 0 and plan["before"]["cosine"] < 0.999, "all 8-bit misses the target"
    assert set(plan["plan"].values()) == {"a16"}, "16-bit activations suffice: nothing kept in float"
    overrides = plan["recipe"]["extra_options"]["TensorQuantOverrides"]
    assert overrides[fx.expected.outlier_tensor] == [{"quant_type": "QInt16"}]
    # Verified without diag: quantize_static with the same TensorQuantOverrides, calibrated on the ranking split.
    ranking = plan["split"]["ranking_samples"]
    out = tmp_path / "plain.onnx"
    quantize_static(
        str(fp32),
        str(out),
        Rows(arrays, ranking),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        extra_options={"TensorQuantOverrides": {t: [{"quant_type": QuantType.QInt16}] for t in overrides}},
    )
    assert min_cosine(fp32, out, arrays, plan["split"]["held_out_first"], 1) >= 0.999
    script = (tmp_path / "out" / "reproduce.py").read_text()
    assert "'quant_type': QuantType.QInt16" in script, "onnxruntime silently ignores a quant_type given as a string"


def test_static_plans_are_written_as_tensor_quant_overrides() -> None:
    from diag.fix.tiers import recipe_for_plan

    fp = stray_block_mlp().model
    r = Recipe(mode="static", weight_type="QInt4", activation_type="QUInt8", per_channel=True)
    assert parse_tiers("int4,int8,a16w8,fp32", r) == ["int4", "int8", "a16", "fp32"]
    out = recipe_for_plan(r, fp, {"fc2": "int8", "fc1": "a16", "fc0": "fp32"})
    assert out.nodes_to_exclude == ["fc0"]
    assert out.extra_options["TensorQuantOverrides"] == {
        "relu0_out": [{"quant_type": "QUInt16"}],
        "fc1_out": [{"quant_type": "QUInt16"}],
        "fc2.weight": [{"quant_type": "QInt8"}],
        "fc1.weight": [{"quant_type": "QInt8"}],
    }
    assert r.extra_options == {}, "the recipe given is not modified"


@pytest.mark.parametrize(
    ("text", "recipe", "says"),
    [
        ("int8,int4,fp32", Recipe(mode="weight_only", bits=4), "not ordered"),
        ("int8,fp32", Recipe(mode="weight_only", bits=4), "starts at 'int8'"),
        ("int8,a16,fp32", Recipe(mode="dynamic"), "cannot express"),
        ("int8", Recipe(mode="static"), "at least two"),
    ],
)
def test_tier_lists_a_recipe_cannot_express_are_bad_options(text: str, recipe: Recipe, says: str) -> None:
    with pytest.raises(DiagError) as e:
        parse_tiers(text, recipe)
    assert e.value.slug == "bad-option" and says in str(e.value)


@pytest.mark.parametrize("flag", [["--scheduler", "local:2"], ["--no-estimates"]])
def test_flags_the_tier_search_does_not_take_are_refused_not_ignored(tmp_path: Path, capsys, flag: list[str]) -> None:
    from diag.cli.commands import main

    argv = ["exclude", str(tmp_path / "m.onnx"), "--random", "--target", "cosine>=0.9", "--tiers", "int8,fp32"]
    assert main([*argv, *flag, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"diag: error[bad-option]: {flag[0]} with --tiers") and "\n" not in err
    assert not (tmp_path / "out").exists()


def _user_int4(fp32: Path, out: Path) -> Path:
    """The user's model: MatMulNBitsQuantizer at 4 bits, by hand (no diag)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.disable(logging.INFO)
    try:
        q = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=4, block_size=BLOCK)
        q.process()
    finally:
        logging.disable(logging.NOTSET)
    onnx.save(q.model.model, str(out))
    return out


def test_tiers_on_the_users_int4_model_splice_the_plan_into_it_no_quantizer_runs(
    stray: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path, capsys
) -> None:
    """Issue 41 item 6: a plan on the user's MatMulNBits model is that model with one weight re-blocked
    at 8 bits from its FP32 weight; nothing else changes, and plain onnxruntime reproduces every figure."""
    import runpy

    from plain_ort import min_cosine as cosine_of

    fp32, inputs, arrays = stray
    user = _user_int4(fp32, tmp_path / "user.int4.onnx")
    user_bytes = user.read_bytes()
    out = tmp_path / "plan"
    argv = ["exclude", str(fp32), "--int8", str(user), "--inputs", str(inputs), "--target", "cosine>=0.94"]
    code = main([*argv, "--tiers", "int4,int8,fp32", "--bench-runs", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    plan = json.loads((out / "tiers.json").read_text())
    assert plan["method"] == "surgical" and plan["int8"] == str(user)
    assert plan["plan"] == {"fc2": "int8"} and plan["quantizations"] == 0 and plan["splices"] >= 1
    assert "(your model) -> " in printed and "spliced from your INT8 model (no re-quantization)" in printed
    first = plan["split"]["held_out_first"]
    # "before" is the user's file, measured by plain onnxruntime; the plan file reproduces "after".
    assert cosine_of(fp32, user, arrays, first, 1) == pytest.approx(plan["before"]["cosine"], abs=1e-6)
    model = out / "fp32.plan.onnx"
    assert cosine_of(fp32, model, arrays, first, 1) == pytest.approx(plan["after"]["cosine"], abs=1e-6)
    assert plan["after"]["cosine"] >= 0.94 > plan["before"]["cosine"]
    # The plan is the user's model but for fc2's node: every other node and initializer byte for byte.
    u, p = onnx.load(str(user)), onnx.load(str(model))
    kept = [n for n in u.graph.node if n.name != "fc2_Q4"]
    assert {n.SerializeToString() for n in kept} <= {n.SerializeToString() for n in p.graph.node}
    u_inits = {i.name: i.SerializeToString() for i in u.graph.initializer}
    for init in p.graph.initializer:
        assert u_inits.get(init.name, init.SerializeToString()) == init.SerializeToString()
        assert init.name in u_inits or init.name.startswith("diag_float/")
    # The re-blocked weight is what onnxruntime's own 8-bit call writes for fc2 from the FP32 weight.
    plain = onnx.load(
        str(
            plain_weight_only(
                fp32,
                tmp_path / "plain.onnx",
                {"bits": 4, "block_size": BLOCK, "nodes_to_exclude": [], "node_bits": {"fc2": 8}},
            )
        )
    )
    eight = {i.name: i.raw_data for i in plain.graph.initializer if i.name.startswith("fc2.weight")}
    spliced = {
        i.name.removeprefix("diag_float/").removesuffix("/8bit"): i.raw_data
        for i in p.graph.initializer
        if i.name.startswith("diag_float/")
    }
    assert spliced == eight
    # reproduce.py splices (no quantizer, no recipe.json): the same bytes; the user's file is untouched.
    script = (out / "reproduce.py").read_text()
    assert "diag.splice_to_file(FP32, INT8, NODES, OUT, bits=BITS)" in script and 'BITS = {"fc2": 8}' in script
    assert not (out / "recipe.json").exists()
    runpy.run_path(str(out / "reproduce.py"))
    assert (out / "fp32.reproduced.onnx").read_bytes() == model.read_bytes()
    assert user.read_bytes() == user_bytes
    # The report beside it shows the splice as the verified fix, not a quantizer call that builds another model.
    summary = (out / "summary.md").read_text()
    assert 'diag.splice_to_file(FP32, INT8, [], OUT, bits={"fc2": 8})' in summary
    assert "MatMulNBitsQuantizer" not in summary.split("**Verified fix**")[1].split("recipe:")[0]
    assert json.loads((out / "diag.json").read_text())["models"]["int8"]["path"] == f"your INT8 model {user}"


def test_tiers_a_splice_cannot_express_on_the_users_model_are_refused_before_any_work(tmp_path: Path, capsys) -> None:
    fx = outlier_activation_mlp()
    fp32 = tmp_path / "a16.onnx"
    onnx.save(fx.model, fp32)
    arrays = fx.make_inputs(16, 1)
    np.savez(tmp_path / "x.npz", **arrays)
    user = tmp_path / "user.qdq.onnx"
    quantize_static(str(fp32), str(user), Rows(arrays, 8), quant_format=QuantFormat.QDQ, per_channel=True)
    argv = ["exclude", str(fp32), "--int8", str(user), "--inputs", str(tmp_path / "x.npz"), "--target", "cosine>=0.9"]
    assert main([*argv, "--tiers", "int8,a16,fp32", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diag: error[bad-option]: --tiers int8,a16,fp32 with --int8") and "\n" not in err
    assert "tier 'a16'" in err and "--requantize" in err
    assert not (tmp_path / "out").exists()


def test_tiers_requantize_only_after_the_round_trip_proves_the_recipe(
    stray: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path, capsys
) -> None:
    fp32, inputs, _ = stray
    user = _user_int4(fp32, tmp_path / "user.int4.onnx")
    argv = ["exclude", str(fp32), "--int8", str(user), "--inputs", str(inputs), "--target", "cosine>=0.94"]
    flags = ["--tiers", "int4,int8,fp32", "--bench-runs", "0", "--requantize"]
    assert main([*argv, *flags, "--out", str(tmp_path / "ok")]) == 0
    printed = capsys.readouterr().out
    assert "round trip: the recipe rebuilds your INT8 model exactly (3 quantized nodes)" in printed
    plan = json.loads((tmp_path / "ok" / "tiers.json").read_text())
    assert plan["method"] == "requantized" and plan["quantizations"] >= 2 and plan["plan"] == {"fc2": "int8"}
    # A recipe that does not rebuild the user's model (block size 16, the user's is 32) is refused.
    wrong = json.dumps({"mode": "weight_only", "bits": 4, "block_size": 16})
    assert main([*argv, *flags, "--recipe", wrong, "--out", str(tmp_path / "no")]) == 2
    assert "error[recipe-mismatch]" in capsys.readouterr().err
