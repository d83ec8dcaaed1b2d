"""Statistics computed inside onnxruntime (the diagnostic graph) equal the numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diag.compare import CompareOptions, CompareState, load_pair, run_comparison
from diag.feeds import feeds_from_arrays, input_specs
from diag.match import match_models

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


def assert_same_statistics(ref: CompareState, got: CompareState) -> None:
    """Every running sum within float tolerance; maxima, counts and histogram bins exactly equal."""
    assert (got.samples, got.batches) == (ref.samples, ref.batches)
    assert got.numpy_reduced == {}, got.numpy_reduced
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
        for k in ("count", "clipped_low", "clipped_high", "fp_min", "fp_max", "ch_count", "dyn_scales", "rank", "axis"):
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
