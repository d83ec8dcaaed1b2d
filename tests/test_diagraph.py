"""Statistics computed inside onnxruntime (the diagnostic graph) equal the numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diag.analysis.compare import CompareOptions, CompareState, load_pair, run_comparison
from diag.core.feeds import feeds_from_arrays, input_specs
from diag.core.match import match_models

FORMATS = ("dynamic", "qdq", "qoperator")


def _states(b, fmt: str, samples: int = 16, batch: int = 8, **opts) -> tuple[CompareState, CompareState]:
    fp, q = load_pair(b.fp32, b.int8[fmt])
    matching = match_models(fp.proto, q.proto)
    specs = input_specs(fp.proto)
    out = []
    for how in ("numpy", "graph"):
        feeds = feeds_from_arrays(b.inputs, specs, samples, batch, "x")
        state, _ = run_comparison(fp, q, matching, feeds, CompareOptions(progress=False, reductions=how, **opts))
        out.append(state)
    return out[0], out[1]


def _close(a: float, b: float, rel: float = 2e-5, abs_: float = 1e-9) -> bool:
    return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def assert_same_statistics(ref: CompareState, got: CompareState, numpy_reduced: tuple[str, ...] = ()) -> None:
    """Every running sum within float tolerance; maxima, counts and histogram bins exactly equal."""
    assert (got.samples, got.batches) == (ref.samples, ref.batches)
    assert sorted(got.numpy_reduced) == sorted(numpy_reduced), got.numpy_reduced
    for kind in ("accumulated", "local"):
        mine, theirs = getattr(got, kind), getattr(ref, kind)
        assert mine.keys() == theirs.keys(), kind
        for name, acc in theirs.items():
            g = mine[name]
            scale = max(acc.s_xx, acc.s_ee, 1e-30)
            for slot in ("n", "n_scaled", "nonfinite_x", "nonfinite_y", "max_abs"):
                assert getattr(g, slot) == getattr(acc, slot), (kind, name, slot)
            for slot in ("s_xx", "s_yy", "s_xy", "s_ee", "s_abs_e", "s_ee_scaled"):
                # Sums relative to the tensor's energy: a near-zero s_xy may differ in its last bits.
                a, b = getattr(g, slot), getattr(acc, slot)
                ref_mag = scale if slot in ("s_xy", "s_yy") else abs(b)
                assert abs(a - b) <= 2e-5 * ref_mag + 1e-12, (kind, name, slot, a, b)
            fa, fb = g.finalize(), acc.finalize()
            assert _close(fa.sqnr_db, fb.sqnr_db, 1e-5, 1e-4), (kind, name, fa.sqnr_db, fb.sqnr_db)
            assert _close(fa.cosine, fb.cosine, 1e-6), (kind, name)
    for name, o in ref.outputs.items():
        assert vars(got.outputs[name]) == vars(o), name
    assert got.distributions.keys() == ref.distributions.keys()
    for name, d in ref.distributions.items():
        g = got.distributions[name]
        for hist in ("fp", "int8"):
            assert getattr(g, hist).exponent == getattr(d, hist).exponent, (name, hist)
            assert np.array_equal(getattr(g, hist).counts, getattr(d, hist).counts), (name, hist)
        for k in (
            "count",
            "clipped_low",
            "clipped_high",
            "fp_min",
            "fp_max",
            "ch_count",
            "rank",
            "axis",
            "dyn_batches",
            "dyn_sum",
            "dyn_min",
            "dyn_max",
        ):
            assert getattr(g, k) == getattr(d, k), (name, k)
        for arr in ("ch_min", "ch_max"):
            x, y = getattr(g, arr), getattr(d, arr)
            assert (x is None and y is None) or np.array_equal(x, y), (name, arr)
        if d.ch_sum is not None:
            spread = np.maximum(np.abs(d.ch_max), np.abs(d.ch_min)) * max(d.ch_count, 1)
            assert np.all(np.abs(g.ch_sum - d.ch_sum) <= 1e-5 * spread + 1e-6), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ("transformer", "convnet"))
def test_every_statistic_computed_in_the_graph_equals_the_numpy_reference(built, name, fmt):
    ref, got = _states(built(name), fmt)
    assert ref.local and ref.distributions and ref.accumulated
    assert_same_statistics(ref, got)


@pytest.mark.parametrize("fmt", ("dynamic", "qdq"))
def test_if_model_outputs_are_reduced_in_the_graph_like_the_numpy_reference(built, fmt):
    ref, got = _states(built("if_model"), fmt)
    assert "branch_out" in got.accumulated
    assert_same_statistics(ref, got)


def _pair_states(tmp_path, model, feeds: dict[str, np.ndarray]) -> tuple[CompareState, CompareState]:
    from test_hostile import _pair

    p = _pair(tmp_path, "m", model, feeds)
    fp, q = load_pair(p.fp32, p.int8)
    matching = match_models(fp.proto, q.proto)
    states = []
    for how in ("numpy", "graph"):
        source = feeds_from_arrays(feeds, input_specs(fp.proto), None, 2, "x")
        states.append(run_comparison(fp, q, matching, source, CompareOptions(progress=False, reductions=how))[0])
    return states[0], states[1]


def test_loop_model_outputs_are_reduced_in_the_graph_like_the_numpy_reference(tmp_path):
    from test_hostile import _loop_model, _x

    ref, got = _pair_states(tmp_path, _loop_model(), {"x": _x()})
    assert "looped" in got.accumulated and "looped" in got.local
    # The Loop's output has no rank before the run (its body's shapes are not inferred): that one
    # tensor is exposed and reduced by the numpy reference, and the state says so.
    assert "rank is unknown" in got.numpy_reduced["looped"]
    assert_same_statistics(ref, got, numpy_reduced=("looped",))


@pytest.mark.parametrize("which", ("fp32", "int8"))
def test_nan_and_inf_batches_are_reduced_by_the_numpy_reference_exactly(tmp_path, which):
    from test_hostile import _int8_log_model, _log_model, _x

    if which == "fp32":
        model, feeds, tensor, side = _log_model(), {"x": _x()}, "lg", "nonfinite_x"
    else:
        model, x = _int8_log_model()
        feeds, tensor, side = {"x": x}, "y", "nonfinite_y"
    ref, got = _pair_states(tmp_path, model, feeds)
    assert getattr(ref.accumulated[tensor], side) > 0
    # Same counts of NaN / Inf, same sums over the finite values, same histograms.
    for name, acc in ref.accumulated.items():
        for slot in acc.__slots__:
            assert getattr(got.accumulated[name], slot) == pytest.approx(getattr(acc, slot), rel=2e-5), (name, slot)
    for name, d in ref.distributions.items():
        assert np.array_equal(got.distributions[name].fp.counts, d.fp.counts), name
        assert (got.distributions[name].fp_min, got.distributions[name].fp_max) == (d.fp_min, d.fp_max), name


@pytest.mark.parametrize("known_shape", (True, False))
def test_sqnr_of_ten_million_values_with_a_large_range_matches_float64_within_a_hundredth_db(known_shape):
    # Known shape: float32 partial sums over blocks of the last axis, finished in float64;
    # unknown shape: every value cast to float64 first.
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from diag.core.diagraph import STAT_PREFIX, _Builder, _error_sums
    from diag.core.metrics import ErrorAccumulator

    rng = np.random.default_rng(0)
    n = 10_000_000
    # Magnitudes from 1e-3 to 1e4 (lognormal), either sign; INT8-like error ~1 % of each value.
    x = (np.exp(rng.normal(0.0, 2.5, n)) * rng.choice([-1.0, 1.0], n)).astype(np.float32).reshape(10, 1000, 1000)
    y = (x * (1 + 0.01 * rng.standard_normal(x.shape))).astype(np.float32)
    graph = helper.make_graph(
        [],
        "sums",
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, list(x.shape)) for v in ("x", "y")],
        [],
    )
    _error_sums(_Builder(graph, 17), "x", "y", STAT_PREFIX, x.shape if known_shape else None)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(names, {"x": x, "y": y}), strict=True))
    acc = ErrorAccumulator()
    p = STAT_PREFIX
    max_abs = max(float(np.max(out[p + "emax"])), -float(np.min(out[p + "emin"])))
    sums = (float(np.sum(out[p + k], dtype=np.float64)) for k in ("xx", "xe", "ee", "ab"))
    acc.update_from_sums(int(np.prod(out[p + "shx"])), *sums, max_abs)
    e = (y - x).astype(np.float64)
    x64 = x.astype(np.float64)
    exact = 10 * math.log10(float(np.dot(x64.ravel(), x64.ravel())) / float(np.dot(e.ravel(), e.ravel())))
    assert abs(acc.finalize().sqnr_db - exact) < 0.01, (acc.finalize().sqnr_db, exact)
    assert acc.finalize().max_abs == float(np.abs(y - x).max())


def test_a_graph_over_the_protobuf_limit_is_loaded_from_a_path_with_the_same_statistics(built, monkeypatch):
    import diag.core.diagraph
    import diag.core.run

    saved: list[str] = []

    original = diag.core.run.session_from_model

    def spy(model, *args, **kwargs):
        if not hasattr(model, "graph"):
            saved.append(str(model))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(diag.core.diagraph, "PROTOBUF_LIMIT", 1024)
    monkeypatch.setattr(diag.core.diagraph, "session_from_model", spy)  # diagraph's own name for it
    ref, got = _states(built("convnet"), "qoperator")
    assert saved and saved[0].endswith("diagnostic.onnx")
    assert_same_statistics(ref, got)


@pytest.mark.parametrize("fmt", ("dynamic", "qdq"))
def test_memory_budget_passes_and_shards_in_the_graph_match_the_numpy_reference(built, fmt):
    ref, got = _states(built("convnet"), fmt, samples=16, batch=4, max_memory=200_000)
    assert got.passes == ref.passes >= 3
    assert_same_statistics(ref, got)
    ref, got = _states(built("transformer"), fmt, samples=16, batch=4, shard=(1, 3))
    assert got.batches == 1
    assert_same_statistics(ref, got)


def test_optimized_level_keeps_its_deployed_runs_next_to_the_graph(built):
    ref, got = _states(built("transformer"), "qdq", opt_level="all")
    assert got.deployed.keys() == ref.deployed.keys() == {"logits"}
    assert vars(got.deployed["logits"]) == vars(ref.deployed["logits"])
    assert got.fused == ref.fused and got.fused
    assert_same_statistics(ref, got)


def test_cli_reductions_flag_selects_the_path(built, tmp_path, monkeypatch):
    import diag.analysis.compare
    from diag.cli.commands import main

    seen: list[str] = []
    real = diag.analysis.compare.run_comparison

    def spy(fp, q, matching, feeds, options):
        seen.append(options.reductions)
        return real(fp, q, matching, feeds, options)

    monkeypatch.setattr(diag.analysis.compare, "run_comparison", spy)
    b = built("transformer")
    args = ["compare", str(b.fp32), str(b.int8["dynamic"]), "--inputs", str(b.inputs_path), "--samples", "8", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--reductions", "graph", "--out", str(tmp_path / "b")]) == 0
    assert seen == ["numpy", "graph"]
