"""`diag sweep`: every grid recipe quantized and measured, rejections skipped with onnxruntime's reason,
noise-aware ranking, a Pareto front, a best recipe that plain onnxruntime reproduces, and resuming
that never redoes a finished recipe."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import (
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from plain_ort import Rows
from plain_ort import min_cosine as plain_min_cosine

from diag.cli.commands import build_parser, main
from diag.cli.verbs import sweep_to_dir
from diag.core.feeds import FeedSpec
from diag.core.recipe import load_recipe
from diag.fix.bench import LatencyStats
from diag.fix.lint import lint_recipe_file
from diag.fix.sweep import (
    DEFAULT_GRID,
    JSONL,
    SweepEntry,
    SweepOptions,
    compare_latency,
    expand_grid,
    folklore,
    latency_summary,
    pareto_front,
    rank_entries,
    read_jsonl,
)
from diag.fixtures import models
from diag.foundations.errors import DiagError

# ---------------------------------------------------------------- helpers


def write_fixture(tmp: Path, name: str, samples: int = 32) -> tuple[Path, Path, dict[str, np.ndarray]]:
    fx = models.build(name)
    fp = tmp / f"{name}.fp32.onnx"
    onnx.save(fx.model, fp)
    arrays = fx.make_inputs(samples, 12)
    np.savez(tmp / "inputs.npz", **arrays)
    return fp, tmp / "inputs.npz", arrays


def plain_prepare(fp32: Path, recipe: dict, out: Path) -> Path:
    """What a user does by hand before onnxruntime's quantizer on a paddle2onnx export (plain onnx only):
    Constant-node weights become initializers, and per-channel QDQ needs opset >= 13."""
    m = onnx.load(fp32)
    keep = []
    for n in m.graph.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(n.attribute[0].t)
            t.name = n.output[0]
            m.graph.initializer.append(t)
        else:
            keep.append(n)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    if recipe["mode"] == "static" and recipe["quant_format"] == "QDQ" and recipe["per_channel"] and opset < 13:
        m = onnx.version_converter.convert_version(m, 13)
    onnx.save(m, out)
    return out


def plain_quantize(fp32: Path, recipe_path: Path, out: Path, tmp: Path) -> None:
    """Apply best.recipe.json with onnxruntime.quantization only (no diag)."""
    r = json.loads(recipe_path.read_text())
    src = plain_prepare(fp32, r, tmp / "prepared.onnx")
    common = {
        "weight_type": QuantType[r["weight_type"]],
        "per_channel": r["per_channel"],
        "reduce_range": r["reduce_range"],
        "nodes_to_exclude": r["nodes_to_exclude"],
        "extra_options": r["extra_options"],
    }
    if r["mode"] == "dynamic":
        quantize_dynamic(src, out, **common)
        return
    with np.load(recipe_path.parent / r["calibration"]) as z:
        arrays = {k: z[k] for k in z.files}
    quantize_static(
        src,
        out,
        Rows(arrays, r["calibration_samples"]),
        quant_format=QuantFormat[r["quant_format"]],
        activation_type=QuantType[r["activation_type"]],
        calibrate_method=CalibrationMethod[r["calibrate_method"]],
        **common,
    )


def lat(speedup: float, lo: float, hi: float) -> dict:
    return {"speedup": speedup, "speedup_range": [lo, hi]}


def entry(key: str, cosine: float, latency: dict | None, recipe: dict | None = None) -> SweepEntry:
    return SweepEntry(key, recipe or {"mode": "dynamic"}, "ok", metrics={"cosine": cosine}, latency=latency)


# ---------------------------------------------------------------- the grid


def test_default_grid_is_48_recipes_without_static_keys_in_dynamic_ones():
    recipes = expand_grid(json.loads(json.dumps(DEFAULT_GRID)))
    assert len(recipes) == 48
    dynamic = [r for r in recipes if r.mode == "dynamic"]
    assert len(dynamic) == 16
    assert {r.quant_format for r in recipes if r.mode == "static"} == {"QDQ", "QOperator"}
    assert all(r.activation_type == "QUInt8" for r in recipes if r.mode == "static")
    # the dynamic ones carry onnxruntime's defaults for static-only keys, nothing the grid set
    assert all(r.activation_type == "QInt8" for r in dynamic)
    assert {r.extra_options["ActivationSymmetric"] for r in recipes} == {False, True}


def test_grid_lists_are_axes_but_a_list_of_node_names_is_one_value():
    fixed = expand_grid({"mode": "dynamic", "nodes_to_exclude": ["a", "b"], "per_channel": [False, True]})
    assert [r.nodes_to_exclude for r in fixed] == [["a", "b"], ["a", "b"]]
    axis = expand_grid({"mode": "dynamic", "nodes_to_exclude": [[], ["a"]]})
    assert [r.nodes_to_exclude for r in axis] == [[], ["a"]]


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        ({"per_chanel": [True]}, "did you mean 'per_channel'"),
        ({"weight_type": ["QInt9"]}, "unknown value 'QInt9'"),
        ({"per_channel": []}, "empty list"),
    ],
)
def test_a_bad_grid_is_a_bad_recipe_error(grid, needle):
    with pytest.raises(DiagError) as e:
        expand_grid(grid)
    assert e.value.slug == "bad-recipe" and needle in str(e.value)


# ---------------------------------------------------------------- noise, ranking, Pareto


def stats(p50: float) -> LatencyStats:
    return LatencyStats("m", 10, 2, 1, p50, p50, p50 * 1.1, p50 * 0.9, p50 * 1.2, p50, 1000 / p50, None)


def test_latency_inside_the_noise_is_no_measurable_difference():
    # FP32 2.0 ms; INT8 1.0 ms then 2.1 ms: the repeats straddle 1x -> not called faster
    noisy = latency_summary([(stats(2.0), stats(1.0)), (stats(2.0), stats(2.1))])
    assert noisy["vs_fp32"] == "no measurable difference"
    assert noisy["speedup_range"] == [pytest.approx(2.0 / 2.1), pytest.approx(2.0)]
    steady = latency_summary([(stats(2.0), stats(1.0)), (stats(2.1), stats(1.0)), (stats(1.9), stats(1.0))])
    assert steady["vs_fp32"] == "faster" and steady["speedup"] == pytest.approx(2.0)
    # 3 % faster with no overlap is still inside the 5 % band
    assert latency_summary([(stats(1.03), stats(1.0))] * 3)["vs_fp32"] == "no measurable difference"
    assert latency_summary([(stats(1.0), stats(1.5))] * 3)["vs_fp32"] == "slower"


def test_compare_latency_needs_disjoint_ranges_and_a_gap_beyond_the_band():
    assert compare_latency(lat(2.0, 1.9, 2.1), lat(1.0, 0.9, 1.1)) == 1
    assert compare_latency(lat(1.0, 0.9, 1.1), lat(2.0, 1.9, 2.1)) == -1
    assert compare_latency(lat(1.2, 1.0, 1.3), lat(1.1, 1.05, 1.15)) == 0  # overlapping ranges
    assert compare_latency(lat(1.03, 1.03, 1.03), lat(1.0, 1.0, 1.0)) == 0  # disjoint but 3 % < band


def test_latency_ranking_shares_a_rank_inside_the_noise_and_orders_it_by_cosine():
    a = entry("a", 0.95, lat(2.0, 1.9, 2.1))
    b = entry("b", 0.99, lat(1.95, 1.85, 2.05))  # not measurably slower than a
    c = entry("c", 0.999, lat(1.0, 0.95, 1.05))
    d = SweepEntry("d", {"mode": "dynamic"}, "skipped", "rejected")
    ranked = rank_entries([a, b, c, d], "latency")
    assert [(r, e.key) for r, e in ranked] == [("=1", "b"), ("=1", "a"), ("3", "c")]


def test_accuracy_ranking_breaks_equal_values_by_measured_speed_then_grid_order():
    slow = entry("slow", 0.99, lat(1.0, 0.95, 1.05))
    fast = entry("fast", 0.99, lat(2.0, 1.9, 2.1))
    same = entry("same", 0.99, lat(1.02, 0.9, 1.1))
    top = entry("top", 0.999, None)
    ranked = rank_entries([slow, same, fast, top], "cosine")
    assert [(r, e.key) for r, e in ranked] == [("1", "top"), ("=2", "fast"), ("=2", "slow"), ("=2", "same")]


def test_pareto_front_keeps_what_nothing_beats_on_accuracy_and_measured_speed():
    accurate_slow = entry("accurate_slow", 0.999, lat(0.8, 0.75, 0.85))
    fast_rough = entry("fast_rough", 0.98, lat(2.0, 1.9, 2.1))
    dominated = entry("dominated", 0.97, lat(1.9, 1.85, 1.95))  # rougher, and not measurably faster
    noise_twin = entry("noise_twin", 0.985, lat(1.95, 1.8, 2.05))  # as fast within noise, more accurate
    front = pareto_front([accurate_slow, fast_rough, dominated, noise_twin])
    assert [e.key for e in front] == ["noise_twin", "accurate_slow"]


def test_folklore_claims_are_judged_on_pairs_that_differ_in_one_setting():
    def rec(wt: str, pc: bool) -> dict:
        return {"mode": "static", "quant_format": "QDQ", "weight_type": wt, "per_channel": pc, "extra_options": {}}

    entries = [
        entry("1", 0.99, lat(1.0, 0.95, 1.05), rec("QInt8", False)),
        entry("2", 0.99, lat(1.5, 1.45, 1.55), rec("QUInt8", False)),
        entry("3", 0.999, lat(0.7, 0.68, 0.72), rec("QInt8", True)),
        entry("4", 0.999, lat(1.0, 0.97, 1.03), rec("QUInt8", True)),
    ]
    claims = {c["id"]: c for c in folklore(entries)}
    assert claims["quint8-fastest"]["verdict"] == "held"
    assert "2 faster, 0 slower" in claims["quint8-fastest"]["evidence"]
    assert claims["per-channel-free"]["verdict"] == "did not hold"
    assert "0 faster, 2 slower" in claims["per-channel-free"]["evidence"]
    assert claims["activation-symmetric-faster"]["verdict"] == "not tested"
    assert claims["dynamic-2-3x"]["verdict"] == "not tested"


# ---------------------------------------------------------------- the sweep on fixtures


def test_default_grid_on_the_convnet_fixture_writes_table_front_and_a_best_recipe_plain_ort_reproduces(tmp_path):
    fp32, inputs, arrays = write_fixture(tmp_path, "convnet")
    out = tmp_path / "sweep"
    files = sweep_to_dir(
        fp32,
        FeedSpec(inputs=str(inputs), batch=8),
        out,
        SweepOptions(runs=5, warmup=1, repeats=2, threads=1, progress=False),
    ).files
    assert sorted(files) == ["best.recipe.json", "pareto.svg", "sweep.html", "sweep.json", "sweep.jsonl", "sweep.md"]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["schema"] == "diag/sweep" and doc["counts"]["recipes"] == 48
    assert doc["counts"]["measured"] + doc["counts"]["skipped"] == 48 and doc["counts"]["resumed"] == 0
    ok = [e for e in doc["entries"] if e["status"] == "ok"]
    for e in ok:
        assert 0 < e["metrics"]["cosine"] <= 1 and e["size_bytes"] > 0 and e["quantize_s"] > 0
        assert e["latency"]["repeats"] == 2 and e["latency"]["speedup_range"][0] <= e["latency"]["speedup"]
    # quantize_dynamic ignores ActivationSymmetric: those models are byte-identical and say so
    dyn_sym = [
        e for e in ok if e["recipe"]["mode"] == "dynamic" and e["recipe"]["extra_options"]["ActivationSymmetric"]
    ]
    assert len(dyn_sym) == 8 and all(e["identical_to"] for e in dyn_sym)
    # the table is sorted by min cosine; the injected outlier channel makes per-channel QDQ/QOperator win
    cosines = [next(e for e in ok if e["key"] == r["key"])["metrics"]["cosine"] for r in doc["ranking"]]
    assert cosines == sorted(cosines, reverse=True)
    assert doc["best"]["key"] == doc["ranking"][0]["key"] and doc["best"]["recipe"]["per_channel"] is True
    assert doc["pareto"] and doc["best"]["label"] in [r["label"] for r in doc["ranking"]]
    assert {c["id"] for c in doc["folklore"]} == {
        "quint8-fastest",
        "per-channel-free",
        "activation-symmetric-faster",
        "reduce-range-unneeded",
        "dynamic-2-3x",
    }
    assert all(c["verdict"] in ("held", "did not hold") for c in doc["folklore"])
    md = (out / "sweep.md").read_text()
    assert len(md.splitlines()) <= 60 and doc["best"]["label"] in md and "Folklore" in md
    html = (out / "sweep.html").read_text()
    assert (
        "Content-Security-Policy" in html and "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")
    )
    assert (out / "pareto.svg").read_text().startswith("<svg")

    # best.recipe.json is a recipe file diag reads, and plain onnxruntime reproduces its metric
    assert lint_recipe_file(out / "best.recipe.json", fp32) == []
    best = load_recipe(out / "best.recipe.json")
    assert best.mode == "static" and best.calibration_path() is not None
    plain = tmp_path / "plain.onnx"
    plain_quantize(fp32, out / "best.recipe.json", plain, tmp_path)
    split = doc["split"]
    got = plain_min_cosine(fp32, plain, arrays, split["held_out_first"], split["batch"])
    measured = next(e for e in ok if e["key"] == doc["best"]["key"])["metrics"]["cosine"]
    assert got == pytest.approx(measured, abs=1e-6)


def test_a_recipe_onnxruntime_rejects_is_reported_as_skipped_with_its_reason(tmp_path):
    fp32, inputs, _ = write_fixture(tmp_path, "convnet", samples=16)
    grid = json.dumps({"mode": "static", "activation_type": ["QInt8", "QUInt8"], "weight_type": ["QInt8", "QUInt8"]})
    out = tmp_path / "sweep"
    result = sweep_to_dir(
        fp32, FeedSpec(inputs=str(inputs), batch=4), out, SweepOptions(grid=grid, runs=0, progress=False)
    ).result
    by_label = {result.labels[e.key]: e for e in result.entries}
    assert sorted(by_label) == [
        "QDQ a:QInt8 w:QInt8",
        "QDQ a:QInt8 w:QUInt8",
        "QDQ a:QUInt8 w:QInt8",
        "QDQ a:QUInt8 w:QUInt8",
    ]
    skipped = by_label["QDQ a:QInt8 w:QUInt8"]
    assert skipped.status == "skipped"
    assert "onnxruntime rejected it" in skipped.reason
    assert "activation_type=QuantType.QInt8, weight_type=QuantType.QUInt8" in skipped.reason
    assert [e.status for label, e in sorted(by_label.items()) if label != "QDQ a:QInt8 w:QUInt8"] == ["ok"] * 3
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["counts"]["skipped"] == 1 and doc["counts"]["measured"] == 3
    assert "QDQ a:QInt8 w:QUInt8" in (out / "sweep.md").read_text().split("### Skipped")[1]
    # skipped entries are finished entries: they are in sweep.jsonl and a re-run does not retry them
    again = sweep_to_dir(
        fp32, FeedSpec(inputs=str(inputs), batch=4), out, SweepOptions(grid=grid, runs=0, progress=False)
    ).result
    assert again.resumed == 4 and again.measured == 0


class Stop(KeyboardInterrupt):
    pass


def test_resuming_after_an_interruption_does_not_redo_finished_recipes(tmp_path):
    fp32, inputs, _ = write_fixture(tmp_path, "transformer", samples=16)
    feeds = FeedSpec(inputs=str(inputs), batch=4)
    grid = json.dumps({"mode": "dynamic", "weight_type": ["QInt8", "QUInt8"], "per_channel": [False, True]})
    out = tmp_path / "sweep"
    finished: list[SweepEntry] = []

    def stop_after_two(e: SweepEntry) -> None:
        finished.append(e)
        if len(finished) == 2:
            raise Stop  # what Ctrl-C does between two recipes

    with pytest.raises(KeyboardInterrupt):
        sweep_to_dir(
            fp32,
            feeds,
            out,
            SweepOptions(grid=grid, runs=2, warmup=0, repeats=1, progress=False),
            on_entry=stop_after_two,
        )
    lines = (out / JSONL).read_text().splitlines()
    assert len(lines) == 2 and not (out / "sweep.json").exists()
    first_run = {e.key: e.run_id for e in finished}

    result = sweep_to_dir(fp32, feeds, out, SweepOptions(grid=grid, runs=2, warmup=0, repeats=1, progress=False)).result
    assert result.resumed == 2 and result.measured == 2 and len(result.entries) == 4
    for e in result.entries:
        if e.key in first_run:
            assert e.run_id == first_run[e.key]  # reused, not measured again
        else:
            assert e.run_id == result.run_id
    after = (out / JSONL).read_text().splitlines()
    assert after[:2] == lines and len(after) == 4

    # a superset grid measures only the new recipes
    bigger = json.dumps(
        {
            "mode": "dynamic",
            "weight_type": ["QInt8", "QUInt8"],
            "per_channel": [False, True],
            "reduce_range": [False, True],
        }
    )
    bigger_options = SweepOptions(grid=bigger, runs=2, warmup=0, repeats=1, progress=False)
    result2 = sweep_to_dir(fp32, feeds, out, bigger_options).result
    assert result2.resumed == 4 and result2.measured == 4 and len(result2.entries) == 8
    assert {e.key for e in result2.entries if e.run_id != result2.run_id} == {e.key for e in result.entries}

    # a torn last line (killed while writing) is ignored and that recipe measured again
    with open(out / JSONL, "a") as fh:
        fh.write('{"context": "x", "entry": {"key"')
    assert len(read_jsonl(out / JSONL, json.loads(after[0])["context"])) == 8
    # other bench settings are another measurement: nothing is reused
    other_bench = SweepOptions(grid=grid, runs=3, warmup=0, repeats=1, progress=False)
    result3 = sweep_to_dir(fp32, feeds, out, other_bench).result
    assert result3.resumed == 0 and result3.measured == 4


def test_names_from_the_grid_stay_text_in_html_and_markdown(tmp_path):
    fp32, inputs, _ = write_fixture(tmp_path, "transformer", samples=8)
    grid = json.dumps({"mode": "dynamic", "extra_options": {"<b>x</b>": [1, 2]}})
    out = tmp_path / "sweep"
    sweep_to_dir(fp32, FeedSpec(inputs=str(inputs), batch=4), out, SweepOptions(grid=grid, runs=0, progress=False))
    html = (out / "sweep.html").read_text()
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    md = (out / "sweep.md").read_text()
    assert "`dynamic <b>x</b>=1`" in md  # a code span: Markdown shows HTML in it as text
    assert "<b>x</b>" not in re.sub(r"`[^`]*`", "", md)


def test_cli_sweep_maps_flags_to_one_call_and_prints_the_best_recipe(tmp_path, capsys):
    fp32, inputs, _ = write_fixture(tmp_path, "transformer", samples=16)
    out = tmp_path / "cli"
    argv = ["sweep", str(fp32), "--inputs", str(inputs), "--batch", "4", "--runs", "0", "--out", str(out), "--quiet"]
    argv += ["--grid", '{"mode": "dynamic", "per_channel": [false, true]}', "--objective", "max_abs"]
    args = build_parser().parse_args(argv)
    assert (args.objective, args.runs, args.repeats, args.holdout) == ("max_abs", 0, 3, 0.5)
    assert main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["objective"] == "max_abs" and f"best by max_abs: {doc['best']['label']}" in text
    values = [e["metrics"]["max_abs"] for e in doc["entries"]]
    best = next(e for e in doc["entries"] if e["key"] == doc["best"]["key"])
    assert best["metrics"]["max_abs"] == min(values)
    assert f"wrote best.recipe.json: {out / 'best.recipe.json'}" in text
    # a dynamic best recipe is a clean recipe file: no inert static-only keys for diag lint to flag
    assert "quant_format" not in json.loads((out / "best.recipe.json").read_text())
    assert lint_recipe_file(out / "best.recipe.json", fp32) == []
    # latency objective without latency runs is a user error, one line
    assert main([*argv[:-2], "--objective", "latency"]) == 2
    assert "error[bad-option]" in capsys.readouterr().err


def test_a_target_no_recipe_meets_writes_no_best_recipe(tmp_path, capsys):
    fp32, inputs, _ = write_fixture(tmp_path, "transformer", samples=16)
    out = tmp_path / "t"
    (out).mkdir()
    (out / "best.recipe.json").write_text("{}")  # stale, from an earlier run
    argv = ["sweep", str(fp32), "--inputs", str(inputs), "--batch", "4", "--runs", "0", "--out", str(out), "--quiet"]
    assert main([*argv, "--grid", '{"mode": "dynamic"}', "--target", "cosine>=0.99999"]) == 0
    assert "best: none (no recipe meets cosine>=0.99999)" in capsys.readouterr().out
    assert not (out / "best.recipe.json").exists()
    assert json.loads((out / "sweep.json").read_text())["best"] is None


# ---------------------------------------------------------------- a real model from a PyPI wheel


@pytest.mark.slow
def test_real_ppocr_classifier_sweep_best_recipe_reproduces_with_plain_onnxruntime(tmp_path):
    """PP-OCR mobile direction classifier (opset 11, Constant-node weights) from the RapidOCR wheel,
    swept over the default grid's mode x format x per_channel axes (6 recipes: dynamic has no format;
    the whole 48-recipe grid runs on the convnet fixture) with short latency runs.
    """
    from diag.fixtures.thirdparty import rapidocr_model, text_images

    fp32 = rapidocr_model("cls")
    images = np.asarray(text_images(12, 48, 192, seed=3), dtype=np.float32)
    arrays = {"x": images}
    np.savez(tmp_path / "inputs.npz", **arrays)
    grid = json.dumps(
        {"mode": ["dynamic", "static"], "quant_format": ["QDQ", "QOperator"], "per_channel": [False, True]}
        | {"activation_type": "QUInt8", "weight_type": "QInt8"}
    )
    out = tmp_path / "sweep"
    files = sweep_to_dir(
        fp32,
        FeedSpec(inputs=str(tmp_path / "inputs.npz"), batch=4),
        out,
        SweepOptions(grid=grid, runs=4, warmup=1, repeats=2, threads=1, progress=False),
    ).files
    doc = json.loads((out / "sweep.json").read_text())
    n = doc["counts"]["recipes"]
    assert n == 6 and doc["counts"]["measured"] + doc["counts"]["skipped"] == n
    ok = [e for e in doc["entries"] if e["status"] == "ok"]
    assert len(ok) >= n - 1
    # the guards fired on this export and are recorded per recipe
    assert any("lifted" in a for e in ok for a in e["actions"])
    assert any("upgraded opset 11 -> 13" in a for e in ok for a in e["actions"])
    assert doc["pareto"] and "best.recipe.json" in files
    assert all(math.isfinite(e["latency"]["speedup"]) for e in ok)
    best = next(e for e in ok if e["key"] == doc["best"]["key"])
    plain = tmp_path / "plain.onnx"
    plain_quantize(fp32, out / "best.recipe.json", plain, tmp_path)
    got = plain_min_cosine(fp32, plain, arrays, doc["split"]["held_out_first"], doc["split"]["batch"])
    assert got == pytest.approx(best["metrics"]["cosine"], abs=1e-6)


READER = '''
import numpy as np

CALLS = {"n": 0, "stop_at": None}


def make():
    """Four batches of the saved inputs; raises KeyboardInterrupt (Ctrl-C) on call number stop_at."""
    CALLS["n"] += 1
    if CALLS["n"] == CALLS["stop_at"]:
        raise KeyboardInterrupt
    with np.load(__file__.replace("sweep_reader.py", "inputs.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    return [{k: v[i : i + 4] for k, v in arrays.items()} for i in range(0, 16, 4)]
'''


def test_ctrl_c_in_the_cli_exits_130_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    import importlib

    fp32, _, _ = write_fixture(tmp_path, "transformer", samples=16)
    (tmp_path / "sweep_reader.py").write_text(READER)
    monkeypatch.syspath_prepend(str(tmp_path))
    reader = importlib.import_module("sweep_reader")
    out = tmp_path / "cli"
    argv = ["sweep", str(fp32), "--reader", "sweep_reader:make", "--runs", "2", "--warmup", "0", "--repeats", "1"]
    argv += ["--grid", '{"mode": "dynamic", "weight_type": ["QInt8", "QUInt8"], "per_channel": [false, true]}']
    argv += ["--out", str(out), "--quiet"]
    reader.CALLS.update(n=0, stop_at=7)  # a few passes in: after some recipes finished, before all did
    assert main(argv) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    finished = (out / "sweep.jsonl").read_text().splitlines()
    assert 1 <= len(finished) < 4 and not (out / "sweep.json").exists()

    reader.CALLS.update(n=0, stop_at=None)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"{4 - len(finished)} measured now, {len(finished)} resumed from sweep.jsonl" in text
    assert (out / "sweep.jsonl").read_text().splitlines()[: len(finished)] == finished


def test_with_labels_the_f1_drop_is_a_column_of_the_terminal_and_sweep_md(tmp_path, capsys):
    """Issue 45: `diag sweep --labels` computed the F1 drop and showed it only in sweep.html."""
    fp32, inputs, _ = write_fixture(tmp_path, "convnet", samples=16)
    labels = tmp_path / "labels.npy"
    np.save(labels, np.arange(16) % 10)
    out = tmp_path / "f1"
    argv = ["sweep", str(fp32), "--inputs", str(inputs), "--batch", "4", "--runs", "0", "--out", str(out), "--quiet"]
    argv += ["--grid", '{"mode": "dynamic", "per_channel": [false, true]}', "--labels", str(labels)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "sweep.json").read_text())
    drops = {e["label"] if "label" in e else e["key"]: e["metrics"]["f1_drop"] for e in doc["entries"]}
    assert all(v is not None for v in drops.values()), drops
    head = next(line for line in text.splitlines() if line.strip().startswith("rank"))
    assert "F1 drop" in head
    md = (out / "sweep.md").read_text()
    assert "| accuracy drop | F1 drop |" in md
    from diag.foundations.numfmt import table_cell

    rows = [line for line in md.splitlines() if line.startswith("| ") and "`" in line]
    cells = sorted(table_cell(v, 4) for v in drops.values())
    assert sorted(row.split(" | ")[5] for row in rows) == cells, rows
