"""Recipe sweep (`diag sweep`): measure the quantization folklore on the user's own model.

Guides promise "golden" onnxruntime settings (QUInt8 weights are fastest, per-channel is free,
``ActivationSymmetric`` is 15-20 % faster, ``reduce_range`` is never needed, dynamic quantization
gives 2-3x on CPU). On real models several of these are false, so the sweep quantizes the model
with every recipe of a grid and *measures*: output metrics on held-out samples, model size,
quantization time and latency against FP32 with the noise shown.

Pipeline: :func:`expand_grid` (grid -> recipes) -> for each recipe :func:`diag.fix.quantize.quantize_model`
-> :class:`diag.fix.evaluate.HeldOutEvaluator` (metrics) -> :func:`diag.fix.bench.bench_models` repeated
(latency) -> one JSON line appended to ``sweep.jsonl`` -> :func:`rank_entries`, :func:`pareto_front`,
:func:`folklore` -> ``sweep.json``, ``sweep.md``, ``sweep.html``, ``pareto.svg``, ``best.recipe.json``.

NOTE: latency is measured as a *speedup against FP32 in the same bench call* (the two models
interleaved batch by batch), repeated ``repeats`` times. Two recipes are measured minutes apart on a
shared machine; their raw milliseconds drift with the background load, their speedups over an FP32
run interleaved with each of them much less. Differences inside the noise (the speedup ranges over
the repeats overlap, or differ by less than :data:`NOISE_BAND`) are reported as "no measurable
difference" and share a rank instead of being ordered.

NOTE: resumable by construction. Each finished recipe (measured or skipped) is appended as one
line to ``sweep.jsonl`` and flushed before the next starts; a re-run with the same model, inputs
and bench settings reuses every line whose recipe is in the grid and measures only the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from diag.core.feeds import FeedSource, FeedSpec, load_labels
from diag.core.load import float_model_from_path
from diag.core.recipe import STATIC_ONLY, Recipe, inline_json, read_recipe_file
from diag.fix.bench import BenchOptions, bench_models, physical_cores
from diag.fix.evaluate import HeldOutEvaluator, Target, parse_target, split_feeds
from diag.fix.quantize import quantize_model
from diag.foundations.cpu import kernel_path
from diag.foundations.environment import environment
from diag.foundations.errors import DiagError
from diag.foundations.files import make_work_dir, remove_tree, signals_held
from diag.foundations.files import out_dir as checked_out_dir
from diag.foundations.jsonnum import json_numbers
from diag.foundations.metricnames import METRICS, labelled_names
from diag.foundations.numfmt import table_cell
from diag.foundations.ortfacts import DEPLOY_LEVEL
from diag.foundations.progress import Progress
from diag.foundations.untrusted import MAX_DEPTH, max_depth

#: The default grid: the settings popular guides make claims about.
DEFAULT_GRID: dict[str, Any] = {
    "mode": ["dynamic", "static"],
    "quant_format": ["QDQ", "QOperator"],
    "activation_type": "QUInt8",
    "weight_type": ["QInt8", "QUInt8"],
    "per_channel": [False, True],
    "reduce_range": [False, True],
    "extra_options": {"ActivationSymmetric": [False, True]},
}
#: Relative speed differences below this are "no measurable difference" even when the ranges do not overlap.
NOISE_BAND = 0.05
#: objective -> (better direction, what it is); the names and directions are :mod:`diag.foundations.metricnames`'.
OBJECTIVES: dict[str, tuple[str, str]] = {
    m.objective: ("max" if m.higher_is_better else "min", m.what or "") for m in METRICS if m.objective is not None
}
#: keys whose recipe value is itself a list: a list of names is a fixed value, a list of lists an axis.
LIST_KEYS = ("op_types_to_quantize", "nodes_to_quantize", "nodes_to_exclude")
JSONL = "sweep.jsonl"


# ---------------------------------------------------------------- the grid


def load_grid(value: str | os.PathLike[str] | None) -> tuple[dict[str, Any], str | None]:
    """The grid from ``--grid``: a ``.toml`` / ``.json`` file, inline JSON (``{...}``), or the default.

    Returns the grid and the folder a ``calibration`` key in it is relative to (None for the default).

    Example:
        >>> load_grid('{"mode": ["dynamic"], "per_channel": [false, true]}')[0]["per_channel"]
        [False, True]
    """
    if value is None:
        return json.loads(json.dumps(DEFAULT_GRID)), None
    text = str(value)
    if text.lstrip().startswith("{"):
        grid = inline_json(text, "--grid", '{"per_channel": [false, true]}')
        if not isinstance(grid, dict):
            raise DiagError("bad-recipe", "inline --grid", "is not a table of settings", '{"mode": ["dynamic"]}')
        return grid, "."
    return read_recipe_file(value), str(Path(value).parent)


def _axes(grid: dict[str, Any]) -> list[tuple[tuple[str, ...], list[Any]]]:
    """(key path, values) per grid key; a fixed key is an axis of one value."""
    axes: list[tuple[tuple[str, ...], list[Any]]] = []
    for key, value in grid.items():
        if key == "extra_options" and isinstance(value, dict):
            for opt, v in value.items():
                axes.append((("extra_options", opt), list(v) if isinstance(v, list) else [v]))
            continue
        if key in LIST_KEYS:
            is_axis = isinstance(value, list) and value and all(isinstance(v, list) for v in value)
            axes.append(((key,), list(value) if is_axis else [value]))
            continue
        axes.append(((key,), list(value) if isinstance(value, list) else [value]))
    for path, values in axes:
        if not values:
            raise DiagError("bad-recipe", f"grid key '{'.'.join(path)}'", "is an empty list", "give at least one value")
    return axes


def expand_grid(grid: dict[str, Any], base_dir: str | None = None, source: str = "grid") -> list[Recipe]:
    """Every combination of the grid's lists as a validated :class:`Recipe`, duplicates dropped.

    A list is an axis, a scalar a fixed key; under ``extra_options`` every list is an axis; for
    ``op_types_to_quantize`` / ``nodes_to_quantize`` / ``nodes_to_exclude`` a list of names is one
    fixed value and a list of lists an axis. Static-only keys (``quant_format``,
    ``activation_type``, ``calibrate_method``, ...) are dropped from dynamic combinations, so the
    default grid gives 16 dynamic + 32 static = 48 recipes; a weight-only combination keeps `calibration`
    only under GPTQ (the one algorithm that reads it). Order: grid order, last key fastest.

    Example:
        >>> [r.mode for r in expand_grid({"mode": ["dynamic", "static"], "quant_format": ["QDQ", "QOperator"]})]
        ['dynamic', 'static', 'static']
    """
    if not isinstance(grid, dict) or not grid:
        raise DiagError("bad-recipe", source, "is empty", 'write e.g. {"mode": ["dynamic", "static"]}')
    axes = _axes(grid)
    seen: set[str] = set()
    out: list[Recipe] = []
    for combo in itertools.product(*(values for _, values in axes)):
        data: dict[str, Any] = {}
        for (path, _), value in zip(axes, combo, strict=True):
            if len(path) == 2:
                data.setdefault("extra_options", {})[path[1]] = value
            else:
                data[path[0]] = value
        if data.get("mode", Recipe.mode) == "dynamic":
            data = {k: v for k, v in data.items() if k not in STATIC_ONLY}
        if data.get("mode") == "weight_only" and data.get("algorithm", "RTN") != "GPTQ":
            # A grid comparing RTN, k_quant, HQQ and GPTQ names GPTQ's calibration once, for GPTQ.
            data = {k: v for k, v in data.items() if k not in ("calibration", "calibration_samples")}
        recipe = Recipe.from_dict(data, source)
        recipe.base_dir = base_dir
        key = _canonical(recipe)
        if key not in seen:
            seen.add(key)
            out.append(recipe)
    return out


def recipe_file_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as a recipe file holds it; a dynamic one without static-only keys (`diag lint` flags them).

    Example:
        >>> "quant_format" in recipe_file_dict(Recipe(mode="dynamic"))
        False
    """
    d = recipe.to_dict()
    if recipe.mode == "dynamic":
        d = {k: v for k, v in d.items() if k not in STATIC_ONLY}
    return d


def _canonical(recipe: Recipe) -> str:
    return json.dumps(recipe.to_dict(), sort_keys=True)


def varying_keys(recipes: list[Recipe]) -> list[str]:
    """Recipe keys (``extra_options.X`` for options) whose value differs between recipes, in recipe order.

    Example:
        >>> varying_keys([Recipe(per_channel=True), Recipe(per_channel=False)])
        ['per_channel']
    """
    flat = [_flat(r.to_dict()) for r in recipes]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    # A static-only key missing from dynamic recipes does not vary by being missing.
    return [k for k in keys if len({json.dumps(f[k], sort_keys=True) for f in flat if k in f}) > 1]


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    """Keys as ``extra_options.X`` for options; a dynamic recipe's static-only keys (inert defaults) left out."""
    dynamic = d.get("mode") == "dynamic"
    out = {k: v for k, v in d.items() if k != "extra_options" and not (dynamic and k in STATIC_ONLY)}
    out.update({f"extra_options.{k}": v for k, v in (d.get("extra_options") or {}).items()})
    return out


def recipe_label(recipe: dict[str, Any], varying: list[str]) -> str:
    """A short name for a recipe: its format, then the varying settings (false flags left out).

    Example:
        >>> recipe_label({"mode": "static", "quant_format": "QDQ", "per_channel": True}, ["mode", "per_channel"])
        'QDQ per_channel'
    """
    flat = _flat(recipe)
    parts = ["dynamic" if flat.get("mode") == "dynamic" else str(flat.get("quant_format", "QDQ"))]
    if flat.get("mode") == "weight_only":  # MatMulNBitsQuantizer: MatMulNBits or block-wise int4 QDQ
        parts = [f"weight_only {parts[0]}"]
    for key in varying:
        if key in ("mode", "quant_format") or key not in flat:
            continue
        name = key.removeprefix("extra_options.")
        value = flat[key]
        if value is True:
            parts.append(name)
        elif value is False or value is None:
            continue
        elif key == "weight_type":
            parts.append(f"w:{value}")
        elif key == "activation_type":
            parts.append(f"a:{value}")
        else:
            parts.append(f"{name}={json.dumps(value) if not isinstance(value, str) else value}")
    return " ".join(parts)


# ---------------------------------------------------------------- one entry


@dataclass
class SweepEntry:
    """One recipe of the sweep: measured, or skipped with the reason.

    Attributes:
        key: hash of the recipe and the measurement context (model, inputs, bench settings);
            what resuming matches on.
        recipe: the recipe as a recipe file would hold it.
        status: ``ok`` or ``skipped``.
        reason: why it was skipped (onnxruntime's own message).
        metrics: :meth:`diag.fix.evaluate.HeldOutMetrics.to_dict` on the held-out samples.
        size_bytes: INT8 model file size (with external data).
        quantize_s: wall time of the guarded quantization.
        latency: see :func:`latency_summary`; None when ``runs`` is 0.
        actions: what the guarded quantizer did (opset upgrade, Constant lifting, ...).
        model_sha256: hash of the INT8 model file.
        identical_to: key of an earlier entry whose INT8 model is byte-identical (its numbers are reused).
        run_id: which invocation measured it (unchanged when a later run resumes).
    """

    key: str
    recipe: dict[str, Any]
    status: str
    reason: str | None = None
    metrics: dict[str, Any] | None = None
    size_bytes: int | None = None
    quantize_s: float | None = None
    latency: dict[str, Any] | None = None
    actions: list[str] = field(default_factory=list)
    model_sha256: str | None = None
    identical_to: str | None = None
    run_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepEntry:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def latency_summary(pairs: list[tuple[Any, Any]], band: float = NOISE_BAND) -> dict[str, Any]:
    """Reduce repeated (FP32, INT8) :class:`~diag.fix.bench.LatencyStats` pairs to medians and noise ranges.

    ``speedup`` is the median over repeats of FP32 p50 / INT8 p50 (each repeat interleaves the two
    models); ``speedup_range`` its min-max over repeats. ``vs_fp32`` is ``faster`` / ``slower`` only
    when the whole range is on one side of 1 and the median differs by more than ``band``;
    otherwise ``no measurable difference``.

    Example:
        >>> from diag.fix.bench import LatencyStats
        >>> fp = LatencyStats("a", 5, 1, 1, 2.0, 2.0, 2.2, 1.9, 2.3, 2.0, 500.0, None)
        >>> q = LatencyStats("b", 5, 1, 1, 1.0, 1.0, 1.1, 0.9, 1.2, 1.0, 1000.0, 2.0)
        >>> latency_summary([(fp, q), (fp, q)])["vs_fp32"]
        'faster'
    """
    p50 = [q.p50_ms for _, q in pairs]
    p99 = [q.p99_ms for _, q in pairs]
    ref = [f.p50_ms for f, _ in pairs]
    speed = [f.p50_ms / q.p50_ms if q.p50_ms > 0 else math.inf for f, q in pairs]
    s, lo, hi = statistics.median(speed), min(speed), max(speed)
    if lo > 1.0 and s > 1.0 + band:
        vs = "faster"
    elif hi < 1.0 and s < 1.0 / (1.0 + band):
        vs = "slower"
    else:
        vs = "no measurable difference"
    first = pairs[0][1]
    return {
        "p50_ms": statistics.median(p50),
        "p50_range_ms": [min(p50), max(p50)],
        "p99_ms": statistics.median(p99),
        "fp32_p50_ms": statistics.median(ref),
        "speedup": s,
        "speedup_range": [lo, hi],
        "vs_fp32": vs,
        "repeats": len(pairs),
        "runs": first.runs,
        "warmup": first.warmup,
        "threads": first.threads,
    }


def compare_latency(a: dict[str, Any] | None, b: dict[str, Any] | None, band: float = NOISE_BAND) -> int:
    """1 when ``a`` is measurably faster than ``b``, -1 when slower, 0 when inside the noise.

    Measurably means: the speedup ranges over the repeats do not overlap *and* the median speedups
    differ by more than ``band`` (relative).

    Example:
        >>> compare_latency({"speedup": 2.0, "speedup_range": [1.9, 2.1]}, {"speedup": 1.0, "speedup_range": [0.9, 1.1]})
        1
        >>> compare_latency({"speedup": 1.02, "speedup_range": [0.9, 1.1]}, {"speedup": 1.0, "speedup_range": [0.95, 1.05]})
        0
    """  # noqa: E501
    if not a or not b:
        return 0
    (alo, ahi), (blo, bhi) = a["speedup_range"], b["speedup_range"]
    if alo > bhi and a["speedup"] > b["speedup"] * (1.0 + band):
        return 1
    if ahi < blo and b["speedup"] > a["speedup"] * (1.0 + band):
        return -1
    return 0


# ---------------------------------------------------------------- ranking, Pareto front, folklore


def objective_value(entry: SweepEntry, objective: str) -> float | None:
    """The figure ``objective`` ranks by (None when the entry has none, e.g. agreement on a detector).

    Example:
        >>> objective_value(SweepEntry("k", {}, "ok", metrics={"cosine": 0.99}), "cosine")
        0.99
    """
    if not entry.ok:
        return None
    if objective == "latency":
        return entry.latency["speedup"] if entry.latency else None
    if objective == "size":
        return float(entry.size_bytes) if entry.size_bytes is not None else None
    v = (entry.metrics or {}).get(objective)
    return None if v is None or isinstance(v, str) else float(v)


def rank_entries(entries: list[SweepEntry], objective: str) -> list[tuple[str, SweepEntry]]:
    """Measured entries sorted by ``objective`` (best first), each with its rank label.

    Accuracy metrics and size are deterministic: equal values share a rank and are ordered by
    measured speed (:func:`compare_latency`), then grid order.
    For ``latency`` a rank is a noise group: an entry starts a new rank only when it is measurably
    slower (:func:`compare_latency`) than the first entry of the current rank; inside a rank
    entries are ordered by min cosine, not by their (unmeasurable) speed difference. Shared ranks
    are written ``=2``. Entries without the objective's figure come last, unranked (``-``).

    Example:
        >>> [r for r, _ in rank_entries(entries, "cosine")]  # doctest: +SKIP
        ['1', '=2', '=2', '4']
    """
    if objective not in OBJECTIVES:
        names = ", ".join(OBJECTIVES)
        raise DiagError("bad-option", f"--objective {objective}", "is not an objective", f"one of {names}")
    ok = [e for e in entries if e.ok]
    have = [e for e in ok if objective_value(e, objective) is not None]
    missing = [e for e in ok if objective_value(e, objective) is None]
    sign = -1.0 if OBJECTIVES[objective][0] == "max" else 1.0
    ranks: list[int] = []
    if objective == "latency":
        have.sort(key=lambda e: -objective_value(e, "latency"))  # type: ignore[operator]
        groups: list[list[SweepEntry]] = []
        for e in have:
            if groups and compare_latency(groups[-1][0].latency, e.latency) != 1:
                groups[-1].append(e)
            else:
                groups.append([e])
        have = []
        for g in groups:
            g.sort(key=lambda e: -(objective_value(e, "cosine") or -math.inf))
            ranks += [len(have) + 1] * len(g)
            have += g
    else:
        have = _sorted_with_speed_ties(have, objective, sign)
        for i, e in enumerate(have):
            same = i and objective_value(e, objective) == objective_value(have[i - 1], objective)
            ranks.append(ranks[-1] if same else i + 1)
    counts = {r: ranks.count(r) for r in ranks}
    out = [(f"={r}" if counts[r] > 1 else str(r), e) for r, e in zip(ranks, have, strict=True)]
    return out + [("-", e) for e in missing]


def _sorted_with_speed_ties(entries: list[SweepEntry], objective: str, sign: float) -> list[SweepEntry]:
    """Sort by the objective; among equal values the measurably faster entry first, else grid order."""

    order = {id(e): i for i, e in enumerate(entries)}

    def cmp(a: SweepEntry, b: SweepEntry) -> int:
        va, vb = sign * objective_value(a, objective), sign * objective_value(b, objective)  # type: ignore[operator]
        if va != vb:
            return -1 if va < vb else 1
        faster = compare_latency(a.latency, b.latency)
        if faster:
            return -faster
        return order[id(a)] - order[id(b)]

    return sorted(entries, key=functools.cmp_to_key(cmp))


def accuracy_objective(objective: str, entries: list[SweepEntry]) -> str:
    """The accuracy axis of the Pareto front: the objective when it is an accuracy metric, else cosine."""
    if objective in ("latency", "size"):
        return "cosine"
    if not any(objective_value(e, objective) is not None for e in entries):
        return "cosine"
    return objective


def pareto_front(entries: list[SweepEntry], accuracy: str = "cosine") -> list[SweepEntry]:
    """Measured entries no other entry beats on both accuracy and latency, fastest first.

    ``b`` dominates ``a`` when it is at least as accurate and measurably faster, or strictly more
    accurate and not measurably slower (inside the latency noise, accuracy decides). Without
    latency (``--runs 0``) the front is the most accurate entries.

    Example:
        >>> [e.recipe["mode"] for e in pareto_front(entries)]  # doctest: +SKIP
        ['dynamic', 'static']
    """
    better = OBJECTIVES[accuracy][0]
    pts = [e for e in entries if e.ok and objective_value(e, accuracy) is not None]

    def acc(e: SweepEntry) -> float:
        v = objective_value(e, accuracy)
        assert v is not None
        return v if better == "max" else -v

    def dominates(b: SweepEntry, a: SweepEntry) -> bool:
        c = compare_latency(b.latency, a.latency)
        return (acc(b) >= acc(a) and c == 1) or (acc(b) > acc(a) and c >= 0)

    front = [a for a in pts if not any(dominates(b, a) for b in pts if b is not a)]
    front.sort(key=lambda e: (-(e.latency or {}).get("speedup", 0.0), -acc(e)))
    return front


#: The claims the default grid tests: (id, claim, recipe key that differs in a pair, value the claim favours).
CLAIMS = (
    ("quint8-fastest", "QUInt8 weights are always fastest", "weight_type", "QUInt8", "QInt8"),
    ("per-channel-free", "per-channel weights cost nothing", "per_channel", True, False),
    (
        "activation-symmetric-faster",
        "ActivationSymmetric speeds inference up by 15-20 %",
        "extra_options.ActivationSymmetric",
        True,
        False,
    ),
    ("reduce-range-unneeded", "reduce_range is never needed (it never helps accuracy)", "reduce_range", True, False),
)


def _pairs(entries: list[SweepEntry], key: str, a: Any, b: Any) -> list[tuple[SweepEntry, SweepEntry]]:
    """Entries that differ only in ``key`` (``a`` vs ``b``), both measured."""
    by_rest: dict[str, dict[str, SweepEntry]] = {}
    for e in entries:
        if not e.ok:
            continue
        flat = _flat(e.recipe)
        if key not in flat and not key.startswith("extra_options."):
            continue
        value = flat.pop(key, False if key.startswith("extra_options.") else None)
        if value not in (a, b):
            continue
        rest = json.dumps(flat, sort_keys=True)
        by_rest.setdefault(rest, {})[json.dumps(value)] = e
    return [(d[json.dumps(a)], d[json.dumps(b)]) for d in by_rest.values() if json.dumps(a) in d and json.dumps(b) in d]


def folklore(entries: list[SweepEntry]) -> list[dict[str, Any]]:
    """Check the popular tuning claims against the measured entries, pair by pair.

    A pair is two recipes that differ only in the setting the claim is about. Speed differences
    inside the noise count as "no measurable difference". Each claim gets a verdict: ``held``,
    ``did not hold`` or ``not tested`` (the grid has no such pair), and one sentence of evidence.

    Example:
        >>> [c["verdict"] for c in folklore(entries)]  # doctest: +SKIP
        ['did not hold', 'held', 'did not hold', 'held', 'did not hold']
    """
    out: list[dict[str, Any]] = []
    for cid, claim, key, fav, other in CLAIMS:
        pairs = _pairs(entries, key, fav, other)
        if not pairs:
            out.append({"id": cid, "claim": claim, "verdict": "not tested", "evidence": "no pair in the grid"})
            continue
        if cid == "reduce-range-unneeded":
            gains = [(x, y) for x, y in pairs if _cos(x) - _cos(y) > 1e-6]
            verdict = "held" if not gains else "did not hold"
            best = max((_cos(x) - _cos(y) for x, y in pairs), default=0.0)
            ev = (
                f"reduce_range raised min cosine in {len(gains)} of {len(pairs)} pairs"
                + (f" (by up to {best:.4g})" if gains else "")
                + f"; it lowered it in {sum(_cos(x) - _cos(y) < -1e-6 for x, y in pairs)}"
            )
            out.append({"id": cid, "claim": claim, "verdict": verdict, "evidence": ev})
            continue
        timed = [(x, y) for x, y in pairs if x.latency and y.latency]
        if not timed:
            out.append({"id": cid, "claim": claim, "verdict": "not tested", "evidence": "latency not measured"})
            continue
        cmp = [compare_latency(x.latency, y.latency) for x, y in timed]
        faster, slower, same = cmp.count(1), cmp.count(-1), cmp.count(0)
        identical = sum(1 for x, y in timed if x.model_sha256 and x.model_sha256 == y.model_sha256)
        ratios = [x.latency["speedup"] / y.latency["speedup"] for x, y in timed]  # type: ignore[index]
        med = statistics.median(ratios)
        counts = f"{faster} faster, {slower} slower, {same} no measurable difference"
        if cid == "per-channel-free":
            verdict = "held" if slower == 0 else "did not hold"
            dcos = statistics.median(_cos(x) - _cos(y) for x, y in timed)
            ev = f"per-channel vs per-tensor in {len(timed)} pairs: {counts}; median speed ratio {med:.2f}x; "
            ev += f"median min-cosine change {dcos:+.4g}"
        elif cid == "activation-symmetric-faster":
            verdict = "held" if faster == len(timed) and med >= 1.15 else "did not hold"
            ev = f"on vs off in {len(timed)} pairs: {counts}; median speed ratio {med:.2f}x"
        else:
            verdict = "held" if faster == len(timed) else "did not hold"
            ev = f"QUInt8 vs QInt8 weights in {len(timed)} pairs: {counts}; median speed ratio {med:.2f}x"
        if identical:
            ev += f"; {identical} pair(s) gave byte-identical models (the setting had no effect)"
        out.append({"id": cid, "claim": claim, "verdict": verdict, "evidence": ev})
    dyn = [e for e in entries if e.ok and e.recipe.get("mode") == "dynamic" and e.latency]
    if dyn:
        lo = min(e.latency["speedup"] for e in dyn)  # type: ignore[index]
        hi = max(e.latency["speedup"] for e in dyn)  # type: ignore[index]
        reached = len([e for e in dyn if e.latency and e.latency["speedup_range"][0] >= 2.0])
        verdict = "held" if reached == len(dyn) else "did not hold"
        ev = f"dynamic recipes ran at {lo:.2f}x-{hi:.2f}x FP32 speed; {reached} of {len(dyn)} reached 2x"
        out.append(
            {
                "id": "dynamic-2-3x",
                "claim": "dynamic quantization gives 2-3x on CPU",
                "verdict": verdict,
                "evidence": ev,
            }
        )
    else:
        out.append(
            {
                "id": "dynamic-2-3x",
                "claim": "dynamic quantization gives 2-3x on CPU",
                "verdict": "not tested",
                "evidence": "no timed dynamic recipe in the grid",
            }
        )
    return out


def _cos(e: SweepEntry) -> float:
    v = objective_value(e, "cosine")
    return -math.inf if v is None else v


# ---------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    """Everything `diag sweep` measured; :meth:`to_dict` is ``sweep.json``."""

    fp32: str
    fp32_size: int
    entries: list[SweepEntry]
    labels: dict[str, str]
    objective: str
    target: Target | None
    settings: dict[str, Any]
    split: dict[str, Any]
    calibration: str | None
    measured: int
    resumed: int
    seconds: float
    grid: dict[str, Any]
    best_recipe: Recipe | None = None
    run_id: str = ""
    #: ``--scheduler``: the cluster's workers, tasks, retries, and where latency was measured.
    cluster: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_now(self) -> int:
        """Recipes quantized and measured by this run (not resumed, not skipped)."""
        return sum(1 for e in self.entries if e.ok and e.run_id == self.run_id)

    @property
    def ranked(self) -> list[tuple[str, SweepEntry]]:
        return rank_entries(self.entries, self.objective)

    @property
    def accuracy(self) -> str:
        return accuracy_objective(self.objective, self.entries)

    @property
    def best(self) -> SweepEntry | None:
        """The first ranked entry that meets ``--target`` (every entry when there is no target)."""
        for _, e in self.ranked:
            if objective_value(e, self.objective) is None:
                continue
            if self.target is None or self.target.met(_target_value(e, self.target.metric)):
                return e
        return None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (``sweep.json``); non-finite numbers become strings.

        Example:
            >>> sorted(result.to_dict())[:3]  # doctest: +SKIP
            ['accuracy_axis', 'best', 'calibration']
        """
        best = self.best
        front = pareto_front(self.entries, self.accuracy)
        doc = {
            "schema": "diag/sweep",
            "schema_version": 1,
            "environment": environment(),
            # latency and the INT8 metrics come from onnxruntime's integer kernels on this CPU
            "kernel_path": kernel_path().to_dict(),
            "fp32": self.fp32,
            "fp32_size": self.fp32_size,
            "objective": self.objective,
            "objective_help": OBJECTIVES[self.objective][1],
            "accuracy_axis": self.accuracy,
            "target": str(self.target) if self.target else None,
            "settings": self.settings,
            "split": self.split,
            "calibration": self.calibration,
            "grid": self.grid,
            "counts": {
                "recipes": len(self.entries),
                "measured": self.measured_now,
                "resumed": self.resumed,
                "skipped": sum(1 for e in self.entries if not e.ok),
                "identical": sum(1 for e in self.entries if e.identical_to),
            },
            "seconds": round(self.seconds, 3),
            "entries": [{**e.to_dict(), "label": self.labels[e.key]} for e in self.entries],
            "ranking": [{"rank": r, "key": e.key, "label": self.labels[e.key]} for r, e in self.ranked],
            "pareto": [self.labels[e.key] for e in front],
            "best": None
            if best is None
            else {"label": self.labels[best.key], "key": best.key, "recipe": self.best_recipe_dict()},
            "folklore": folklore(self.entries),
        } | ({"cluster": self.cluster} if self.cluster else {})
        return json_numbers(doc, digits=None)

    def best_recipe_dict(self) -> dict[str, Any] | None:
        return recipe_file_dict(self.best_recipe) if self.best_recipe else None


def _target_value(e: SweepEntry, metric: str) -> float | None:
    if (e.metrics or {}).get("nonfinite_samples"):
        return None  # a model with NaN/Inf outputs meets no target
    v = (e.metrics or {}).get(metric)
    return None if v is None or isinstance(v, str) else float(v)


def _sha256(path: Path, limit: int = 2**31) -> str:
    """Hash of a file (a folder: names, sizes and mtimes); files over ``limit`` bytes: size and mtime."""
    h = hashlib.sha256()
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            st = p.stat()
            h.update(f"{p.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return h.hexdigest()
    st = path.stat()
    if st.st_size > limit:
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name == path.name or p.name.startswith(path.name))


def read_jsonl(path: Path, context: str) -> dict[str, SweepEntry]:
    """Finished entries of an earlier run with the same context, by key. A torn last line is ignored.

    Example:
        >>> read_jsonl(Path("out/sweep.jsonl"), ctx)  # doctest: +SKIP
        {'3f2a...': SweepEntry(...)}
    """
    done: dict[str, SweepEntry] = {}
    if not path.is_file():
        return done

    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            if max_depth(line) > MAX_DEPTH:
                continue
            d = json.loads(line)
        except ValueError:  # cut mid-character or mid-JSON (interrupted while writing): measured again
            continue
        if isinstance(d, dict) and d.get("context") == context and isinstance(d.get("entry"), dict):
            try:
                e = SweepEntry.from_dict(d["entry"])
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # a damaged line: that recipe is measured again
            done[e.key] = e
    return done


def _append(path: Path, context: str, entry: SweepEntry) -> None:
    line = json.dumps({"context": context, "entry": json_numbers(entry.to_dict(), digits=None)}, ensure_ascii=False)
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        raise DiagError(
            "bad-out", f"output '{path}'", f"cannot be written ({e.strerror or e})", "check free space"
        ) from e


@dataclass(frozen=True)
class SweepOptions:
    """What `diag sweep` takes besides the model, the inputs and ``--out``.

    Attributes:
        grid: what ``--grid`` takes: a ``.toml`` / ``.json`` file, inline JSON, or None for
            :data:`DEFAULT_GRID` (see :func:`load_grid`).
        calib: calibration inputs for static recipes (then every sample of the inputs is held out).
        objective: one of :data:`OBJECTIVES`.
        target: ``metric>=value`` as `diag exclude` takes it; the best recipe must meet it.
        labels: ``.npy`` class indices for ``accuracy_drop`` / ``f1_drop``.
        holdout: held-out share when ``calib`` is None.
        runs, warmup, repeats, threads: latency settings (``threads`` default: physical cores).
        progress: one line per recipe on stderr.
        scheduler: ``ADDRESS`` or ``local[:N]``: quantize and evaluate the recipes as Dask tasks
            (:class:`diag.fix.cluster.ClusterRecipes`); latency is then measured here afterwards.

    Example:
        >>> SweepOptions(runs=0).objective
        'cosine'
    """

    grid: str | os.PathLike[str] | None = None
    calib: FeedSpec | None = None
    objective: str = "cosine"
    target: str | None = None
    labels: str | None = None
    holdout: float = 0.5
    runs: int = 20
    warmup: int = 3
    repeats: int = 3
    threads: int | None = None
    progress: bool = True
    scheduler: str | None = None


@dataclass(frozen=True)
class MeasureContext:
    """What measuring one recipe needs besides the recipe: the FP32 model, the data, the bench settings."""

    fp32: Path
    #: Calibration inputs of static recipes without calibration data of their own.
    calibration: FeedSource | None
    #: None where only latency is timed (``diag.fix.cluster.ClusterRecipes``: metrics came from a worker).
    evaluator: HeldOutEvaluator | None
    held: FeedSource
    runs: int
    warmup: int
    repeats: int
    threads: int


@dataclass
class SweepRun:
    """One sweep's set-up, as a :class:`RecipeRunner` needs it."""

    fp32: Path
    #: The FP32 model as loaded (:class:`diag.core.load.LoadedModel`).
    fp: Any
    feeds: FeedSpec
    options: SweepOptions
    #: Some static recipe has no calibration data: the inputs are split for calibration.
    split_needed: bool
    held: FeedSource
    first: int
    calibration: FeedSource | None
    labels: Any
    threads: int
    work: Path


class RecipeRunner(Protocol):
    """Where the sweep's recipes are quantized and measured: :class:`LocalRecipes` (this process,
    one after the other) or ``diag.fix.cluster.ClusterRecipes`` (Dask tasks, latency timed here after).

    :meth:`check` runs before any work, :meth:`start` once with every recipe still to measure,
    :meth:`entry` per recipe in grid order, :meth:`close` at the end (an interrupt included).
    """

    def check(self) -> None: ...

    def start(self, run: SweepRun, todo: list[tuple[int, Recipe, str]]) -> None: ...

    def entry(self, i: int, recipe: Recipe, key: str, by_hash: dict[str, SweepEntry]) -> SweepEntry: ...

    def note(self, line: str) -> None: ...

    def close(self) -> None: ...

    def info(self, latency: bool) -> dict[str, Any]: ...


class LocalRecipes:
    """The default :class:`RecipeRunner`: quantize, evaluate and time each recipe here, in turn."""

    def __init__(self) -> None:
        self.lines = Progress(None, "sweep", enabled=False, unit="recipes")
        self.context: MeasureContext | None = None
        self.work = Path()

    def check(self) -> None:
        """Nothing to check: this process can always measure."""

    def start(self, run: SweepRun, todo: list[tuple[int, Recipe, str]]) -> None:
        o = run.options
        evaluator = HeldOutEvaluator(run.fp, run.held, run.first, run.labels, run.threads)
        self.context = MeasureContext(
            run.fp32, run.calibration, evaluator, run.held, o.runs, o.warmup, o.repeats, run.threads
        )
        self.work = run.work

    def entry(self, i: int, recipe: Recipe, key: str, by_hash: dict[str, SweepEntry]) -> SweepEntry:
        assert self.context is not None
        return measure_recipe(recipe, key, self.work / f"{i:03d}.onnx", self.context, by_hash)

    def note(self, line: str) -> None:
        self.lines.note(line)

    def close(self) -> None:
        """Nothing to release."""

    def info(self, latency: bool) -> dict[str, Any]:
        return {}


def sweep_model(
    fp32_path: str | Path,
    feeds: FeedSpec,
    out_dir: str | Path,
    options: SweepOptions | None = None,
    on_entry: Callable[[SweepEntry], None] | None = None,
    runner: RecipeRunner | None = None,
    grid: tuple[dict[str, Any], str | None] | None = None,
) -> SweepResult:
    """Quantize ``fp32_path`` with every recipe of the grid and measure each; resumable.

    Metrics are measured on held-out samples: all of ``feeds`` when ``options.calib`` is given,
    otherwise the last ``holdout`` share (the first part calibrates static recipes, cut on batch
    boundaries as in `diag exclude`). Latency: ``repeats`` x :func:`diag.fix.bench.bench_models` of
    FP32 and the INT8 model interleaved, ``runs`` timed runs each, on the held-out batches
    (``runs=0`` skips). A recipe onnxruntime rejects (or whose model fails to run) is recorded as
    skipped with onnxruntime's message. Every finished recipe is appended to
    ``out_dir/sweep.jsonl`` at once; a later call with the same model, inputs and bench settings
    reuses those lines.

    Args:
        fp32_path: the float model (never modified).
        feeds: evaluation (and, without ``options.calib``, calibration) inputs.
        out_dir: where ``sweep.jsonl`` lives; the final files are written by ``diag.cli.verbs.sweep_to_dir``.
        options: grid, objective, target, split and bench settings (:class:`SweepOptions`).
        on_entry: called after each newly finished entry has been appended (a test hook: raising
            KeyboardInterrupt there simulates Ctrl-C).
        runner: where the recipes are measured (default :class:`LocalRecipes`); with
            ``options.scheduler`` the verb passes ``diag.fix.cluster.ClusterRecipes``.
        grid: the grid already read by :func:`load_grid` (and its folder); None reads ``options.grid``.

    Example:
        >>> r = sweep_model("fp32.onnx", FeedSpec(inputs="data.npz"), "sweep")  # doctest: +SKIP
        >>> r.best.recipe["mode"]  # doctest: +SKIP
        'static'
    """
    o = options if options is not None else SweepOptions()
    start = time.perf_counter()
    if o.scheduler is not None and runner is None:
        raise ValueError("options.scheduler needs runner=diag.fix.cluster.ClusterRecipes(...)")
    run_on: RecipeRunner = runner if runner is not None else LocalRecipes()
    run_on.check()  # no Dask, no scheduler: say so before any work
    tgt = _check_options(o)
    grid_dict, grid_dir = grid if grid is not None else load_grid(o.grid)
    recipes = expand_grid(grid_dict, grid_dir)
    fp32 = Path(fp32_path)
    fp = float_model_from_path(fp32)
    out = checked_out_dir(out_dir)
    label_array = load_labels(o.labels) if o.labels else None
    source = feeds.source(fp.proto)
    calibration, calib_desc, held, first, split = _sweep_split(feeds, fp, source, recipes, o)
    threads = o.threads or physical_cores()
    settings = _settings(o, feeds, source, threads)
    context = _context(fp32, feeds, o.calib, o.labels, split, settings)
    split_needed = o.calib is None and any(r.mode == "static" and r.calibration is None for r in recipes)
    run = SweepRun(fp32, fp, feeds, o, split_needed, held, first, calibration, label_array, threads, Path())
    entries, measured, resumed, run_id = _run_recipes(run, out, recipes, context, run_on, on_entry)
    varying = varying_keys(recipes)
    result = SweepResult(
        fp32=str(fp32),
        fp32_size=_model_bytes(fp32),
        entries=entries,
        labels={e.key: recipe_label(e.recipe, varying) for e in entries},
        objective=o.objective,
        target=tgt,
        settings=settings,
        split=split,
        calibration=calib_desc,
        measured=measured,
        resumed=resumed,
        seconds=time.perf_counter() - start,
        grid=grid_dict,
        run_id=run_id,
        cluster=run_on.info(o.runs > 0),
    )
    best = result.best
    if best is not None:
        result.best_recipe = _best_recipe(best, feeds, o.calib, split, recipes)
    return result


def _check_options(o: SweepOptions) -> Target | None:
    """Every option problem as a ``bad-option`` before any work; the parsed ``--target``."""
    if o.objective not in OBJECTIVES:
        raise DiagError(
            "bad-option", f"--objective {o.objective}", "is not an objective", f"one of {', '.join(OBJECTIVES)}"
        )
    if o.runs < 0 or o.warmup < 0 or o.repeats < 1:
        raise DiagError(
            "bad-option", "--runs/--warmup/--repeats", "must be >= 0, >= 0, >= 1", "e.g. --runs 20 --repeats 3"
        )
    if o.objective == "latency" and o.runs == 0:
        raise DiagError("bad-option", "--objective latency", "needs latency runs", "drop --runs 0")
    if o.objective in labelled_names() and not o.labels:
        raise DiagError("bad-option", f"--objective {o.objective}", "needs --labels", "pass --labels labels.npy")
    tgt = parse_target(o.target) if o.target else None
    if tgt is not None and tgt.metric in labelled_names() and not o.labels:
        raise DiagError("bad-option", f"--target {tgt}", "needs --labels", "pass --labels labels.npy")
    return tgt


def _sweep_split(
    feeds: FeedSpec, fp: Any, source: FeedSource, recipes: list[Recipe], o: SweepOptions
) -> tuple[FeedSource | None, str | None, FeedSource, int, dict[str, Any]]:
    """(calibration, its description, held-out source, its first sample, the split as sweep.json says it)."""
    if o.calib is None and any(r.mode == "static" and r.calibration is None for r in recipes):
        s = split_feeds(source, o.holdout)
        desc = f"{feeds.inputs or source.description}, {s.to_dict()['ranking']}"
        return s.ranking, desc, s.held_out, s.held_out_first, s.to_dict()
    calibration = o.calib.source(fp.proto) if o.calib is not None else None
    total = source.total_samples or sum(b.size for b in source)
    split = {
        "batch": feeds.batch,
        "held_out": f"samples 0..{total - 1}",
        "held_out_samples": total,
        "held_out_first": 0,
        "ranking_samples": 0,
    }
    return calibration, calibration.description if calibration is not None else None, source, 0, split


def _settings(o: SweepOptions, feeds: FeedSpec, source: FeedSource, threads: int) -> dict[str, Any]:
    return {
        "runs": o.runs,
        "warmup": o.warmup,
        "repeats": o.repeats,
        "threads": threads,
        "noise_band": NOISE_BAND,
        "batch": feeds.batch,
        "inputs": feeds.inputs or source.description,
        "labels": o.labels,
        "opt_level_metrics": "disabled",
        "opt_level_latency": DEPLOY_LEVEL,
    }


def _run_recipes(
    run: SweepRun,
    out: Path,
    recipes: list[Recipe],
    context: str,
    runner: RecipeRunner,
    on_entry: Callable[[SweepEntry], None] | None,
) -> tuple[list[SweepEntry], int, int, str]:
    """Measure every recipe not done earlier (appending each to sweep.jsonl at once), in grid order.

    Returns (entries, measured now, resumed, this run's id)."""
    jsonl = out / JSONL
    done = read_jsonl(jsonl, context)
    run_id = uuid.uuid4().hex[:12]
    entries: list[SweepEntry] = []
    by_hash: dict[str, SweepEntry] = {e.model_sha256: e for e in done.values() if e.ok and e.model_sha256}
    measured = resumed = 0
    varying = varying_keys(recipes)
    keys = [hashlib.sha256((context + _canonical(r)).encode()).hexdigest()[:16] for r in recipes]
    progress = run.options.progress
    work: Path | None = None
    try:
        with signals_held():  # assigned inside: a held Ctrl-C must not orphan the folder (see make_work_dir)
            work = make_work_dir(out, "sweep")
        run.work = work
        runner.start(run, [(i, r, k) for i, (r, k) in enumerate(zip(recipes, keys, strict=True), 1) if k not in done])
        for i, (recipe, key) in enumerate(zip(recipes, keys, strict=True), 1):
            label = recipe_label(recipe.to_dict(), varying)
            if key in done:
                entries.append(done[key])
                resumed += 1
                if progress:
                    runner.note(f"sweep {i}/{len(recipes)} {label}: done earlier (resumed)")
                continue
            entry = runner.entry(i, recipe, key, by_hash)
            entry.run_id = run_id
            _append(jsonl, context, entry)
            entries.append(entry)
            measured += 1
            if entry.ok and entry.model_sha256 and entry.model_sha256 not in by_hash:
                by_hash[entry.model_sha256] = entry
            if progress:
                runner.note(f"sweep {i}/{len(recipes)} {label}: {_progress_line(entry)}")
            if on_entry is not None:
                on_entry(entry)
    finally:
        runner.close()
        if work is not None:
            remove_tree(work)
    return entries, measured, resumed, run_id


def _context(
    fp32: Path,
    feeds: FeedSpec,
    calib: FeedSpec | None,
    labels: str | None,
    split: dict[str, Any],
    settings: dict[str, Any],
) -> str:
    """What makes two measurements comparable: same model and data bytes, same split and bench settings."""
    parts: dict[str, Any] = {
        "fp32": _sha256(fp32),
        "feeds": {**dataclasses.asdict(feeds), "inputs": _sha256(Path(feeds.inputs)) if feeds.inputs else None},
        "calib": None
        if calib is None
        else {**dataclasses.asdict(calib), "inputs": _sha256(Path(calib.inputs)) if calib.inputs else None},
        "labels": _sha256(Path(labels)) if labels else None,
        "split": split,
        "settings": {k: v for k, v in settings.items() if k not in ("inputs", "labels")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measure_recipe(
    recipe: Recipe,
    key: str,
    path: Path,
    ctx: MeasureContext,
    by_hash: dict[str, SweepEntry],
    keep: bool = False,
) -> SweepEntry:
    """Quantize, evaluate and time one recipe; onnxruntime's rejections become a skipped entry.

    ``keep``: leave the INT8 model at ``path`` (a cluster worker sends it back for timing)."""
    d = recipe_file_dict(recipe)
    calib = ctx.calibration if recipe.mode == "static" and recipe.calibration is None else None
    try:
        rep = quantize_model(ctx.fp32, recipe, path, calibration=calib, progress=False)
    except DiagError as e:
        if e.slug not in ("quantize-failed", "invalid-model"):
            raise
        return SweepEntry(key, d, "skipped", f"onnxruntime rejected it: {e.problem}")
    actions = [a for a in rep.actions if not a.startswith(("verified:", "calibrated with"))]
    digest = _sha256(path)
    size = _model_bytes(path)
    same = by_hash.get(digest)
    try:
        if same is not None:
            # NOTE: a byte-identical model has identical outputs and runs the same kernels:
            # measuring it again would only add noise. The entry names whose numbers it carries.
            return SweepEntry(
                key, d, "ok", None, same.metrics, size, rep.seconds, same.latency, actions, digest, same.key
            )
        assert ctx.evaluator is not None, "measure_recipe needs an evaluator"
        metrics = ctx.evaluator.evaluate(path).to_dict()
        latency = None
        if ctx.runs > 0:
            latency = time_against_fp32(ctx.fp32, path, ctx.held, ctx)
    except DiagError as e:
        if e.slug not in ("runtime-failure", "invalid-model"):
            raise
        return SweepEntry(
            key,
            d,
            "skipped",
            f"quantized, but onnxruntime cannot run it: {e.problem}",
            None,
            size,
            rep.seconds,
            None,
            actions,
            digest,
        )
    finally:
        for p in path.parent.glob(path.name + "*"):
            if not keep:
                p.unlink(missing_ok=True)
    return SweepEntry(key, d, "ok", None, metrics, size, rep.seconds, latency, actions, digest)


def time_against_fp32(fp32: Path, path: Path, held: FeedSource, ctx: MeasureContext) -> dict[str, Any]:
    """``repeats`` benches of FP32 and the INT8 model interleaved, summarised (:func:`latency_summary`)."""
    bench = BenchOptions(runs=ctx.runs, warmup=ctx.warmup, threads=ctx.threads, progress=False)
    pairs = []
    for _ in range(ctx.repeats):
        stats = bench_models([fp32, path], held, bench)
        pairs.append((stats[0], stats[1]))
    return latency_summary(pairs)


def _progress_line(e: SweepEntry) -> str:
    if not e.ok:
        return f"skipped ({e.reason})"
    cos = (e.metrics or {}).get("cosine")
    text = f"cosine {cos:.6f}" if isinstance(cos, float) else "measured"
    if e.latency:
        text += f", {e.latency['speedup']:.2f}x FP32 ({e.latency['vs_fp32']})"
    if e.identical_to:
        text += " (identical model to an earlier recipe)"
    return text


def _best_recipe(
    best: SweepEntry, feeds: FeedSpec, calib: FeedSpec | None, split: dict[str, Any], recipes: list[Recipe]
) -> Recipe:
    """The best entry's recipe, ready for `diag quantize` / `diag exclude`: calibration data named in it."""
    recipe = Recipe.from_dict(best.recipe, "best recipe")
    source = next((r for r in recipes if _canonical(r) == _canonical(recipe)), None)
    recipe.base_dir = source.base_dir if source is not None else None
    if recipe.mode == "static" and recipe.calibration is None:
        spec = calib if calib is not None else feeds
        if spec.inputs:
            # Relative to the current folder, as given; save_recipe rebases it onto the recipe's folder.
            recipe.calibration = spec.inputs
            recipe.base_dir = "."
            if calib is None:
                recipe.calibration_samples = int(split["ranking_samples"])
            elif spec.samples:
                recipe.calibration_samples = spec.samples
    return recipe


# ---------------------------------------------------------------- outputs


#: The files of a sweep's --out besides sweep.jsonl, in the order they are printed.
OUTPUT_NAMES = ("sweep.json", "sweep.md", "sweep.html", "pareto.svg", "best.recipe.json")


def summary_lines(result: SweepResult) -> list[str]:
    """What `diag sweep` prints: counts, the best recipe and its figures, the top of the table.

    Example:
        >>> summary_lines(result)[0]  # doctest: +SKIP
        'swept 48 recipes on convnet.fp32.onnx: 48 measured, 0 resumed from sweep.jsonl, 0 skipped'
    """
    skipped = [e for e in result.entries if not e.ok]
    lines = [
        f"swept {len(result.entries)} recipe(s) on {Path(result.fp32).name}, metrics on held-out "
        f"{result.split['held_out']}: {result.measured_now} measured now, {result.resumed} resumed from {JSONL}, "
        f"{len(skipped)} skipped"
    ]
    for e in skipped[:3]:
        lines.append(f"  skipped {result.labels[e.key]}: {e.reason}")
    if len(skipped) > 3:
        lines.append(f"  ... and {len(skipped) - 3} more skipped (sweep.md)")
    ranked = result.ranked
    width = max([len("recipe"), *(len(result.labels[e.key]) for _, e in ranked[:10])])
    # With --labels the F1 drop gets a column (issue 45): it was computed and printed nowhere.
    f1 = any((e.metrics or {}).get("f1_drop") is not None for _, e in ranked)
    f1_head = f"  {'F1 drop':>9}" if f1 else ""
    lines.append(
        f"  {'rank':>4}  {'recipe':<{width}}  {'cosine':>9}  {'max abs':>9}{f1_head}  {'size KB':>8}  {'speedup':>14}"
    )
    for rank, e in ranked[:10]:
        m = e.metrics or {}
        f1_cell = f"  {table_cell(m.get('f1_drop'), 4):>9}" if f1 else ""
        sp = "-"
        if e.latency:
            lo, hi = e.latency["speedup_range"]
            sp = f"{e.latency['speedup']:.2f}x {lo:.2f}-{hi:.2f}"
        size = f"{(e.size_bytes or 0) / 1024:.1f}"
        lines.append(
            f"  {rank:>4}  {result.labels[e.key]:<{width}}  {table_cell(m.get('cosine'))[:9]:>9}  "
            f"{table_cell(m.get('max_abs'), 4):>9}{f1_cell}  {size:>8}  {sp:>14}"
        )
    if len(ranked) > 10:
        lines.append(f"  ... {len(ranked) - 10} more in sweep.md / sweep.html")
    best = result.best
    if best is None:
        why = f"no recipe meets {result.target}" if result.target else "no recipe was measured"
        lines.append(f"best: none ({why})")
    else:
        v = objective_value(best, result.objective)
        shown = f"{v:.2f}x FP32" if result.objective == "latency" else table_cell(v)
        lines.append(f"best by {result.objective}: {result.labels[best.key]} ({result.objective} {shown})")
        r = result.best_recipe
        if r is not None and r.mode == "static" and r.calibration is None:
            lines.append(
                "  note: best.recipe.json names no calibration data (the inputs came from --random or --reader): "
                "give diag quantize --calib or --reader"
            )
    front = pareto_front(result.entries, result.accuracy)
    lines.append(
        f"pareto front ({result.accuracy} vs latency): {len(front)} recipe(s), listed in sweep.md; "
        f"in {result.seconds:.1f} s"
    )
    return lines
