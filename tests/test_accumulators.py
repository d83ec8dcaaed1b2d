"""Every accumulator follows diag.core.state.Accumulator: merge of two halves == one run, and a state round trip.

For each accumulator (and the composite CompareState) the same small synthetic batches are fed
three ways: all to one accumulator, and half to each of two that are then merged (directly, and
through a JSON round trip of the second half, as shard files do). Field by field, histograms and
counts must be exactly equal and sums equal to float tolerance. ``from_state(to_state(x))`` must
give back every field bit for bit, through ``json.dumps(allow_nan=False)`` (plain JSON only).

The tests can fail: every field of each accumulator, after the batches, differs from a fresh
accumulator's (checked first, bar the listed exceptions), so a field left out of ``to_state``
comes back as its default and the round trip fails naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from diag.analysis.compare import CompareState
from diag.core.distributions import DistributionAccumulator, GridInfo, Pow2Histogram
from diag.core.fp16 import Fp16Range
from diag.core.instrument import FusedKernel
from diag.core.metrics import ErrorAccumulator, OutputAccumulator, OutputPart, OutputSpec
from diag.core.state import Accumulator
from diag.core.taskmetrics import F1Metric, PluginMetric, metric_factory

PLUGIN = "taskmetric_plugins:rel_error"
BATCHES = 6


def _batches(seed: int = 0) -> list[dict[str, Any]]:
    """Six batches of an FP32 tensor [2, 8, 4] and an 'INT8' one close to it, logits and labels.

    Batch 1 holds a NaN on the INT8 side, batch 4 one on the FP32 side and values far out of
    range (clipping, FP16 overflow); batch 2 tiny values (FP16 subnormals and flushes).
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(BATCHES):
        x = rng.normal(0.0, 1.0 + i, (2, 8, 4)).astype(np.float32)
        x[:, 3] *= 9.0  # an outlier channel
        y = (x + rng.normal(0.0, 0.05, x.shape)).astype(np.float32)
        if i == 1:
            y[0, 0, 0] = np.nan
        if i == 2:
            x[1, 1, :2] = (1e-6, 1e-9)
        if i == 4:
            x[0, 0, 0] = np.nan
            x[1, 2, 1] = 1e5
        logits = rng.normal(0.0, 1.0, (4, 6, 5)).astype(np.float32)
        q = (logits + rng.normal(0.0, 0.3, logits.shape)).astype(np.float32)
        if i == 3:
            q[2, 0, 0] = np.inf
        if i == 5:
            logits[1, 0, 0] = np.nan
        out.append(
            {
                "x": x,
                "y": y,
                "scale": 0.02 * (1 + i),
                "logits": logits,
                "q": q,
                "local": (logits + rng.normal(0.0, 0.1, logits.shape)).astype(np.float32),
                "labels": rng.integers(0, 5, 4),
            }
        )
    return out


SPEC = OutputSpec(
    kind="logits",
    class_axis=2,
    mask_threshold=0.5,
    part_axis=1,
    concat_axis=1,
    parts=(OutputPart("boxes", "logits", 0, 2, "a"), OutputPart("scores", "logits", 2, 6, "b")),
    concat_node="cat",
    evidence="test",
)
GRID = GridInfo(scale=0.05, zero_point=128.0, qmin=0, qmax=255)


def _feed_error(acc: ErrorAccumulator, b: dict[str, Any]) -> None:
    acc.update(b["x"], b["y"], b["scale"])


def _feed_output(acc: OutputAccumulator, b: dict[str, Any]) -> None:
    acc.update(b["logits"], b["q"], "out")
    acc.update_local(b["logits"], b["local"])


def _feed_distribution(acc: DistributionAccumulator, b: dict[str, Any]) -> None:
    acc.update(b["x"], b["y"], b["scale"])


def _feed_task(acc: F1Metric | PluginMetric, b: dict[str, Any]) -> None:
    acc.update({"out": b["logits"][:, 1]}, {"out": b["q"][:, 1]}, b["labels"])


def _feed_state(state: CompareState, b: dict[str, Any]) -> None:
    """One batch into every kind of accumulator the composite holds."""
    if not state.task:
        state.task = {"f1": F1Metric("out"), "plugin": PluginMetric(PLUGIN, metric_factory(PLUGIN)())}
        state.fused = [FusedKernel("k", "FusedConv", ["conv"], ["conv_fp"])]
        state.passes = 2
    state.accumulated.setdefault("t", ErrorAccumulator()).update(b["x"], b["y"], b["scale"])
    state.local.setdefault("t", ErrorAccumulator()).update(b["x"], b["x"] + 0.01, GRID.scale)
    state.outputs.setdefault("out", OutputAccumulator(SPEC)).update(b["logits"], b["q"], "out")
    state.deployed.setdefault("out", OutputAccumulator(whole=True)).update(b["logits"], b["local"], "out")
    state.distributions.setdefault("t", DistributionAccumulator(GRID, "Conv")).update(b["x"], b["y"])
    state.fp16_ranges.setdefault("t", Fp16Range()).update(b["x"])
    state.numpy_reduced.setdefault("pass", "whole pass reduced in numpy: a test")
    # Padding masked out: the all-positions errors beside the real positions' (diag.core.positions).
    state.mask_input = "attention_mask"
    state.positions += 2 * len(b["labels"])
    state.padding += len(b["labels"])
    state.all_positions.setdefault("t", ErrorAccumulator()).update(b["x"], b["y"] * 1.5, b["scale"])
    state.all_positions_local.setdefault("t", ErrorAccumulator()).update(b["x"], b["x"] + 0.02, GRID.scale)
    for metric in state.task.values():
        _feed_task(metric, b)
    n = len(b["labels"])
    state.labelled = {k: v + n for k, v in state.labelled.items()}
    state.samples += n
    state.batches += 1
    state.local_samples += n - 1  # one sample of each batch without local error


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], Any]
    feed: Callable[[Any, dict[str, Any]], None]
    #: Fields a fresh accumulator already has right after the batches (nothing to lose in to_state).
    unchanged: frozenset[str] = frozenset()
    #: Fields deliberately not in the state (documented where they are declared).
    not_state: frozenset[str] = frozenset()


CASES = [
    Case("ErrorAccumulator", ErrorAccumulator, _feed_error),
    Case(
        "OutputAccumulator",
        lambda: OutputAccumulator(SPEC, whole=True),
        _feed_output,
        # classlike starts True and stays True for logits; the spec is the constructor's.
        unchanged=frozenset({"classlike", "spec"}),
    ),
    Case(
        "DistributionAccumulator",
        lambda: DistributionAccumulator(GRID, "Conv", axis=2),
        _feed_distribution,
        # The constructor's grid, hint and axis; channel counts never change in these batches.
        unchanged=frozenset({"grid", "channel_hint", "axis_override", "channel_consistent"}),
    ),
    Case("Pow2Histogram", Pow2Histogram, lambda h, b: h.update(b["x"])),
    Case("F1Metric", lambda: F1Metric("out"), _feed_task, unchanged=frozenset({"output"})),
    Case(
        "PluginMetric",
        lambda: PluginMetric(PLUGIN, metric_factory(PLUGIN)()),
        _feed_task,
        unchanged=frozenset({"spec"}),
    ),
    Case("Fp16Range", Fp16Range, lambda r, b: r.update(b["x"])),
    # numpy_reduced says which tensors the numpy reference reduced in *this* process: not state.
    # kept_outputs is a handle on files the engine writes for this process's effect check: no batch
    # sets it through the accumulator, and it is not state.
    Case(
        "CompareState",
        CompareState,
        _feed_state,
        unchanged=frozenset({"kept_outputs"}),
        not_state=frozenset({"numpy_reduced", "kept_outputs"}),
    ),
]


def _fields(obj: Any) -> dict[str, Any]:
    """Every attribute of an accumulator: its __dict__ and the __slots__ of its classes."""
    names: dict[str, Any] = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            names[slot] = getattr(obj, slot)
    return names


def _is_record(v: Any) -> bool:
    return hasattr(v, "__dict__") or hasattr(type(v), "__slots__") or dataclasses.is_dataclass(v)


def _differences(a: Any, b: Any, path: str, rel: float) -> list[str]:
    """Where ``a`` and ``b`` differ, field by field; floats within ``rel`` (0: bit for bit)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return [f"{path}: {a!r} != {b!r}"]
        if a.dtype.kind == "f" and rel:
            ok = np.allclose(a, b, rtol=rel, atol=rel * float(np.max(np.abs(b), initial=0.0)), equal_nan=True)
        else:
            ok = np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        return [] if ok else [f"{path}: arrays differ"]
    if isinstance(a, float) and isinstance(b, float):
        if a == b or (math.isnan(a) and math.isnan(b)) or (rel and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)):
            return []
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]", rel)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            return [f"{path}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]", rel)]
    if _is_record(a) and not isinstance(a, (str, int, float, bool, type(None))):
        if type(a) is not type(b):
            return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
        fa, fb = _fields(a), _fields(b)
        return [
            d for k in sorted(fa.keys() | fb.keys()) for d in _differences(fa.get(k), fb.get(k), f"{path}.{k}", rel)
        ]
    return [] if (a == b and type(a) is type(b)) else [f"{path}: {a!r} != {b!r}"]


def _top_field(difference: str) -> str:
    """The accumulator's own field a difference is in: ``CompareState.local['t'].n: ...`` -> ``local``."""
    m = re.match(r"\w+\.(\w+)", difference)
    return m.group(1) if m else ""


def _run(case: Case, batches: list[dict[str, Any]]) -> Any:
    acc = case.make()
    for b in batches:
        case.feed(acc, b)
    return acc


def _round_trip(acc: Any) -> Any:
    text = json.dumps(acc.to_state(), allow_nan=False)  # plain JSON: no NaN / Infinity tokens
    return type(acc).from_state(json.loads(text))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_field_of_the_accumulator_is_exercised_by_the_batches(case):
    acc, fresh = _run(case, _batches()), case.make()
    assert isinstance(acc, Accumulator)
    untouched = sorted(
        k for k, v in _fields(acc).items() if not _differences(v, _fields(fresh)[k], k, 0.0) and k not in case.unchanged
    )
    assert untouched == [], f"{case.name}: the batches leave {untouched} at their defaults"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_from_state_of_to_state_gives_back_every_field_bit_for_bit(case):
    acc = _run(case, _batches())
    back = _round_trip(acc)
    diffs = [d for d in _differences(back, acc, case.name, 0.0) if _top_field(d) not in case.not_state]
    assert diffs == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("through_json", (False, True), ids=("objects", "json"))
def test_merge_of_two_halves_equals_one_run_over_all_batches(case, through_json):
    batches = _batches()
    one = _run(case, batches)
    a, b = _run(case, batches[:2]), _run(case, batches[2:])
    merged = a.merge(_round_trip(b) if through_json else b)
    assert merged is a
    diffs = [d for d in _differences(merged, one, case.name, 1e-9) if _top_field(d) not in case.not_state]
    assert diffs == []


def test_histograms_and_counts_merge_exactly_not_just_within_tolerance():
    batches = _batches(1)
    one = _run(CASES[2], batches)
    merged = _run(CASES[2], batches[:3]).merge(_run(CASES[2], batches[3:]))
    for hist in ("fp", "int8"):
        assert np.array_equal(getattr(merged, hist).counts, getattr(one, hist).counts)
        assert getattr(merged, hist).exponent == getattr(one, hist).exponent
    assert (merged.count, merged.clipped_low, merged.clipped_high, merged.ch_count, merged.dyn_batches) == (
        one.count,
        one.clipped_low,
        one.clipped_high,
        one.ch_count,
        one.dyn_batches,
    )
    assert merged.clipped_low + merged.clipped_high > 0


def test_dynamic_scales_are_a_summary_of_constant_size_whatever_the_batches():
    acc = DistributionAccumulator()
    x = np.ones((2, 8), np.float32)
    for i in range(1000):
        acc.update(x, x, 0.01 + i * 1e-5)
    state = acc.to_state()
    assert len(json.dumps(state)) < 2000
    h = acc.finalize()
    assert h.dynamic_batches == 1000
    assert (h.dynamic_scale_min, h.dynamic_scale_max) == (0.01, 0.01 + 999 * 1e-5)
    assert h.scale == pytest.approx(np.mean([0.01 + i * 1e-5 for i in range(1000)]), rel=1e-12)


def test_a_version_1_distribution_state_with_a_list_of_scales_is_still_read():
    acc = DistributionAccumulator()
    for s in (0.5, 0.25, 0.75):
        acc.update(np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), s)
    state = acc.to_state()
    v1 = {k: v for k, v in state.items() if k not in ("dynamic_scales", "axis_override")} | {
        "dyn_scales": [0.5, 0.25, 0.75]
    }
    back = DistributionAccumulator.from_state(v1)
    assert (back.dyn_batches, back.dyn_sum, back.dyn_min, back.dyn_max) == (3, 1.5, 0.25, 0.75)
    assert back.finalize().scale == 0.5


def test_a_quantized_attention_mask_is_measured_in_float64_not_read_as_minus_inf_db():
    """Finite mask values near float32's lowest (-3.4e38) square to inf in a float32 dot: the error
    of a quantized mask read as -inf dB and ranked its Where node first (issue 42 item 5)."""
    import math

    import numpy as np

    from diag.core.metrics import ErrorAccumulator, sum_of_squares

    x = np.array([np.finfo(np.float32).min, 0.0, 1.0, 2.0], np.float32)
    y = x.copy()
    y[0] *= np.float32(0.999)  # the mask, off by 0.1 % after quantization
    y[3] = 2.1
    acc = ErrorAccumulator()
    acc.update(x, y, s_xx=sum_of_squares(x))
    stats = acc.finalize()
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    expected = 10 * math.log10(float((x64 * x64).sum()) / float(((y64 - x64) ** 2).sum()))
    assert math.isfinite(stats.sqnr_db) and stats.sqnr_db == pytest.approx(expected, abs=1e-6)
    assert acc.nonfinite_x == acc.nonfinite_y == 0 and acc.n == 4
