"""Held-out evaluation: what a target means, how the samples are split, and one candidate model measured.

Every fixing verb asks the same question of a quantized (or mixed) model: does it meet the user's
target on samples the ranking never saw? :func:`parse_target` reads ``cosine>=0.999``-style
targets (or a ``--metric`` plugin's), :func:`split_feeds` splits the inputs once into a ranking
and a held-out part, and :class:`HeldOutEvaluator` runs a model on the held-out part against the
FP32 outputs (computed once) into :class:`HeldOutMetrics`. ``exclude``, ``tiers``, ``sweep``,
``sensitivity`` and ``cluster`` all use it, so they measure alike.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag.core.feeds import Batch, FeedSource, Restartable
from diag.core.load import LoadedModel, model_from_path
from diag.core.metrics import OutputAccumulator, OutputStats
from diag.core.outputs import output_specs
from diag.core.run import run_batch, session_from_model
from diag.core.spill import SpilledBatches
from diag.core.taskmetrics import call_update, finalized, metric_factory
from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_numbers
from diag.foundations.metricnames import METRICS
from diag.foundations.numfmt import fixed_number

#: target metric -> (direction, how it is computed); the names and directions are
#: :mod:`diag.foundations.metricnames`'.
TARGET_METRICS: dict[str, tuple[str, str]] = {
    m.target: (">=" if m.higher_is_better else "<=", m.how or "") for m in METRICS if m.target is not None
}
#: The value a metric takes when an evaluated output holds NaN/Inf: the worst it can be.
WORST: dict[str, float] = {m.target: m.worst for m in METRICS if m.target is not None and m.worst is not None}
#: FP32 held-out outputs are kept in memory up to this many bytes, past it on disk (memory maps).
IN_MEMORY_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Target:
    """A goal such as ``cosine>=0.999``: one metric, a direction, a threshold.

    Example:
        >>> t = parse_target("cosine>=0.999")
        >>> t.met(0.9995), t.met(0.99)
        (True, False)
    """

    metric: str
    op: str
    value: float

    def met(self, measured: float | None) -> bool:
        if measured is None or math.isnan(measured):
            return False
        return measured >= self.value if self.op == ">=" else measured <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def parse_target(text: str, plugin: dict[str, str] | None = None) -> Target:
    """Parse ``metric>=value`` / ``metric<=value`` (see :data:`TARGET_METRICS`).

    ``plugin`` adds the names a ``--metric`` plugin declares (``{name: "higher" | "lower"}``).

    Example:
        >>> parse_target("max_abs<=0.1")
        Target(metric='max_abs', op='<=', value=0.1)
        >>> parse_target("map50>=0.6", {"map50": "higher"})
        Target(metric='map50', op='>=', value=0.6)
    """
    known = {k: d for k, (d, _) in TARGET_METRICS.items()}
    known.update({k: ">=" if v == "higher" else "<=" for k, v in (plugin or {}).items()})
    m = re.fullmatch(r"\s*([A-Za-z_0-9.]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*", text or "")
    names = ", ".join(f"{k}{d}" for k, d in known.items())
    if not m:
        raise DiagError("bad-option", f"--target {text!r}", "is not metric>=value or metric<=value", f"one of {names}")
    metric, op, raw = m.groups()
    if metric not in known:
        hint = f"one of {names}" + ("" if plugin else " (or a name a --metric plugin declares)")
        raise DiagError("bad-option", f"--target {text!r}", f"has unknown metric '{metric}'", hint)
    want = known[metric]
    if op != want:
        better = "higher" if want == ">=" else "lower"
        raise DiagError(
            "bad-option", f"--target {text!r}", f"{metric}: {better} is better", f"write {metric}{want}{raw}"
        )
    try:
        value = float(raw)
    except ValueError as e:
        raise DiagError("bad-option", f"--target {text!r}", f"'{raw}' is not a number", "e.g. cosine>=0.999") from e
    return Target(metric, op, value)


@dataclass(frozen=True)
class HeldOutMetrics:
    """Output metrics of one INT8 (or mixed) model against FP32 on the held-out samples.

    ``cosine`` is the min per-sample cosine over all outputs (as :class:`OutputAccumulator`),
    ``max_abs`` the max over all outputs, ``agreement`` the worst top-1 agreement of class-like
    outputs (``None`` when no output is class-like); accuracy and macro-F1 need labels.

    ``nonfinite_samples`` counts held-out samples with NaN/Inf in an output of the evaluated model
    where FP32's is finite. Such a sample counts as the worst value: cosine -1, max_abs inf, a
    disagreeing row, a wrong prediction; and :meth:`value` returns the worst value of any metric
    while one exists, so no target is met by a model that outputs NaN.
    """

    samples: int
    cosine: float
    cosine_mean: float
    max_abs: float
    agreement: float | None
    accuracy_fp32: float | None = None
    accuracy_int8: float | None = None
    f1_fp32: float | None = None
    f1_int8: float | None = None
    nonfinite_samples: int = 0
    #: Values of a ``--metric`` plugin (:mod:`diag.core.taskmetrics`), by the names it declares.
    task: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy_drop(self) -> float | None:
        if self.accuracy_fp32 is None or self.accuracy_int8 is None:
            return None
        return self.accuracy_fp32 - self.accuracy_int8

    @property
    def f1_drop(self) -> float | None:
        if self.f1_fp32 is None or self.f1_int8 is None:
            return None
        return self.f1_fp32 - self.f1_int8

    def value(self, metric: str) -> float | None:
        """The figure a target is checked against (the worst possible one while any sample is NaN/Inf)."""
        v = self.task[metric] if metric in self.task else getattr(self, metric, None)
        if v is None:
            return None
        if self.nonfinite_samples:
            return WORST.get(metric, -math.inf if TARGET_METRICS.get(metric, (">=",))[0] == ">=" else math.inf)
        return float(v)

    def meets(self, target: Target) -> bool:
        """Whether these metrics meet ``target``: never while any sample is NaN/Inf.

        Example:
            >>> m.meets(parse_target("cosine>=0.999"))  # doctest: +SKIP
            True
        """
        return not self.nonfinite_samples and target.met(self.value(target.metric))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["accuracy_drop"] = self.accuracy_drop
        d["f1_drop"] = self.f1_drop
        return json_numbers(d, digits=None, nan=None)  # exclusion.json writes NaN as null


# ---------------------------------------------------------------- held-out split


@dataclass(frozen=True)
class Split:
    """Which samples rank (and calibrate) and which are held out, in input order.

    ``batch`` (rows per run) is recorded because dynamic quantization picks its activation scale
    per run: the same model scores differently on the same rows batched differently.
    """

    ranking: FeedSource
    held_out: FeedSource
    ranking_samples: int
    held_out_first: int
    held_out_samples: int
    batch: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "ranking": f"samples 0..{self.ranking_samples - 1}",
            "held_out": f"samples {self.held_out_first}..{self.held_out_first + self.held_out_samples - 1}",
            "ranking_samples": self.ranking_samples,
            "held_out_first": self.held_out_first,
            "held_out_samples": self.held_out_samples,
        }


def split_feeds(feeds: FeedSource, holdout: float) -> Split:
    """Cut a feed stream into a ranking part (first samples) and a held-out part (the rest).

    Cuts fall on batch boundaries (a batch is never split), so the held-out share is as close to
    ``holdout`` as the batch size allows. Each part stays a restartable stream.

    Example:
        >>> s = split_feeds(source, 0.5)  # doctest: +SKIP
        >>> s.to_dict()["held_out"]  # doctest: +SKIP
        'samples 16..31'
    """
    if not 0.0 < holdout < 1.0:
        raise DiagError("bad-option", f"--holdout {holdout}", "must be between 0 and 1 (exclusive)", "e.g. 0.5")
    sizes = [b.size for b in feeds]
    total = sum(sizes)
    if len(sizes) < 2:
        raise DiagError(
            "bad-inputs",
            "inputs",
            f"hold {total} sample(s) in {len(sizes)} batch(es); ranking and held-out need one batch each",
            "give more samples (or a smaller --batch)",
        )
    want_rank = total - max(1, round(total * holdout))
    cut, seen = 0, 0
    while cut < len(sizes) - 1 and seen + sizes[cut] <= max(want_rank, sizes[0]):
        seen += sizes[cut]
        cut += 1
    cut = max(cut, 1)
    seen = sum(sizes[:cut])

    def part(first: int, last: int) -> Callable[[], Iterator[Batch]]:
        def gen() -> Iterator[Batch]:
            for i, b in enumerate(feeds):
                if i >= last:
                    break  # the ranking part ends before the held-out one: read no further
                if i >= first:
                    yield Batch(i - first, b.feeds, b.size)

        return gen

    ranking = FeedSource(f"{feeds.description}, samples 0..{seen - 1}", Restartable(part(0, cut)), seen, feeds.specs)
    held = FeedSource(
        f"{feeds.description}, samples {seen}..{total - 1}",
        Restartable(part(cut, len(sizes))),
        total - seen,
        feeds.specs,
    )
    return Split(ranking, held, seen, seen, total - seen, max(sizes))


# ---------------------------------------------------------------- evaluation


class HeldOutEvaluator:
    """Runs a model on the held-out split and measures its outputs against FP32.

    The FP32 outputs are computed once, here, and the FP32 session is released: a search keeps
    an evaluator alive through every re-quantization, and at 500M parameters that session held
    2 GB beside the quantizer's own copy of the FP32 model (two evaluators, exact and deploy
    level: 4.4 GB before any trial). Outputs up to :data:`IN_MEMORY_BYTES` stay in memory, more
    go to disk (:class:`~diag.core.spill.SpilledBatches`, read back as memory maps a batch at a
    time); only if the disk refuses them does the FP32 session stay and run again beside every
    candidate.
    """

    def __init__(
        self,
        fp: LoadedModel,
        held_out: FeedSource,
        first_sample: int,
        labels: np.ndarray | None,
        threads: int | None,
        metric: str | None = None,
        opt_level: str = "disabled",
    ) -> None:

        #: "disabled" (exact mode: what the search compares) or "all" (as onnxruntime runs by default).
        self.opt_level = opt_level
        self.metric = metric
        self._make_metric = metric_factory(metric) if metric else None
        self.held_out = held_out
        self.first = first_sample
        self.labels = labels
        self.threads = threads
        self.output_names = [o.name for o in fp.graph.output]
        # Outputs are measured by kind (no top-1 agreement over a probability map) and Concat parts
        # on their own: a detector's destroyed score part fails a cosine target the whole passes.
        self.specs = output_specs(fp.proto)
        session = session_from_model(fp.proto, f"FP32 model '{fp.path}'", opt_level, threads, fp.external_dir)
        self._in_memory: list[dict[str, np.ndarray]] = []
        sizes: list[int] = []
        self._on_disk: SpilledBatches | None = None
        #: the FP32 session, kept only when its outputs could not be kept (it runs again per evaluation)
        self._fp_sess: Any = None
        size = 0
        for batch in held_out:
            out = self._run(session, batch.feeds, "FP32 model")
            size += sum(v.nbytes for v in out.values())
            if self._on_disk is None and size > IN_MEMORY_BYTES:
                self._on_disk = SpilledBatches(sys.maxsize)
                for kept, kept_size in zip(self._in_memory, sizes, strict=True):
                    self._on_disk.add(kept, kept_size)
                self._in_memory = []
            if self._on_disk is not None:
                self._on_disk.add(out, batch.size)
                if not self._on_disk.usable:  # an object array, a full disk: run FP32 every time
                    self._on_disk.close()
                    self._on_disk, self._fp_sess = None, session
                    break
            else:
                for value in out.values():
                    value.flags.writeable = False  # shared by every evaluation, as the maps on disk are
                self._in_memory.append(out)
                sizes.append(batch.size)
        del session

    def _run(self, sess: Any, feeds: dict[str, np.ndarray], role: str) -> dict[str, np.ndarray]:
        return {k: v for k, v in run_batch(sess, feeds, role).items() if k in self.output_names}

    def _reference(self, index: int, batch: Batch) -> dict[str, np.ndarray]:
        """The FP32 outputs of held-out batch ``index``."""
        if self._fp_sess is not None:
            return self._run(self._fp_sess, batch.feeds, "FP32 model")
        if self._on_disk is not None:
            return self._on_disk.batch(index)
        return self._in_memory[index]

    def evaluate(self, model_path: Path) -> HeldOutMetrics:
        """Metrics of ``model_path`` vs FP32 on every held-out sample.

        Example:
            >>> ev.evaluate(Path("mixed.onnx")).cosine  # doctest: +SKIP
            0.9994
        """
        q = model_from_path(model_path, "quantized model")
        return self.evaluate_model(q.proto, model_path.name, q.external_dir)  # its weights stay on disk

    def evaluate_model(
        self, proto: onnx.ModelProto, name: str, external_data_dir: Path | None = None
    ) -> HeldOutMetrics:
        """:meth:`evaluate` for a model in memory (an estimate's float-region model); a model
        that keeps its weights in external files reads them from ``external_data_dir``."""

        model_path = Path(name)
        role = f"quantized model '{name}'"
        sess = session_from_model(proto, role, self.opt_level, self.threads, external_data_dir)
        accs = {name: OutputAccumulator(self.specs.get(name)) for name in self.output_names}
        task = self._make_metric() if self._make_metric is not None else None
        truth: list[np.ndarray] = []
        pred_fp: list[np.ndarray] = []
        pred_q: list[np.ndarray] = []
        start = self.first
        total = broken = 0
        for i, batch in enumerate(self.held_out):
            ref = self._reference(i, batch)
            got = self._run(sess, batch.feeds, f"quantized model '{model_path.name}'")
            bad = np.zeros(batch.size, dtype=bool)
            for name in self.output_names:
                accs[name].update(ref[name], got[name])
                bad |= _nonfinite_rows(ref[name], got[name], batch.size)
            total += batch.size
            broken += int(bad.sum())
            if task is not None:
                rows = self.labels[start : start + batch.size] if self.labels is not None else None
                # The plugin gets arrays of its own, as in diag compare: the kept FP32 outputs are read-only.
                call_update(task, str(self.metric), {k: np.array(v) for k, v in ref.items()}, got, rows)
            if self.labels is not None:
                first = self.output_names[0]
                if ref[first].ndim != 2 or ref[first].shape[0] != batch.size:
                    raise DiagError(
                        "bad-inputs",
                        "--labels",
                        f"needs the first model output to be [batch, classes], it is {ref[first].shape}",
                        "use a cosine, max_abs or agreement target for this model",
                    )
                if start + batch.size > len(self.labels):
                    raise DiagError(
                        "bad-inputs",
                        "--labels",
                        f"has {len(self.labels)} labels but the inputs have more samples",
                        "give one label per sample",
                    )
                truth.append(self.labels[start : start + batch.size])
                pred_fp.append(ref[first].argmax(axis=1))
                pred_q.append(np.where(bad, -1, got[first].argmax(axis=1)))  # a NaN row is no prediction
            start += batch.size
        stats = [a.finalize() for a in accs.values()]
        agreements = [s.top1_agreement for s in stats if s.top1_agreement is not None]
        metrics = HeldOutMetrics(
            samples=total,
            cosine=-1.0 if broken else _nan_min(_cosines(stats)),
            cosine_mean=min(_mean_with_worst(a) for a in accs.values()),
            max_abs=math.inf if broken else max(s.max_abs for s in stats),
            agreement=min(agreements) if agreements else None,
            nonfinite_samples=broken,
        )
        if truth:
            t, f, q8 = np.concatenate(truth), np.concatenate(pred_fp), np.concatenate(pred_q)
            metrics = dataclasses.replace(
                metrics,
                accuracy_fp32=float((f == t).mean()),
                accuracy_int8=float((q8 == t).mean()),
                f1_fp32=macro_f1(t, f),
                f1_int8=macro_f1(t, q8),
            )
        if task is not None:
            metrics = dataclasses.replace(metrics, task=finalized(task, str(self.metric)))
        return metrics


def _nonfinite_rows(ref: np.ndarray, got: np.ndarray, size: int) -> np.ndarray:
    """Per sample of a batch: does ``got`` hold NaN/Inf where ``ref`` (FP32) is finite?

    An output without a sample axis marks every sample of the batch when it has any.
    """
    ref, got = np.asarray(ref), np.asarray(got)
    if not (np.issubdtype(got.dtype, np.floating) and np.issubdtype(ref.dtype, np.floating)):
        return np.zeros(size, dtype=bool)
    if got.ndim and got.shape[0] == size and ref.shape == got.shape:
        r, g = ref.reshape(size, -1), got.reshape(size, -1)
        return np.isfinite(r).all(axis=1) & ~np.isfinite(g).all(axis=1)
    return np.full(size, bool(np.isfinite(ref).all() and not np.isfinite(got).all()))


def _cosines(stats: list[OutputStats]) -> list[float]:
    """Min per-sample cosine of every output and of every Concat part of an output."""
    return [s.cosine_min for s in stats] + [p.cosine_min for s in stats for p, _, _ in s.parts.values()]


def _nan_min(values: Iterable[float]) -> float:
    """The min, or NaN when any value is NaN (Python's min() would skip it or not, by position)."""
    vals = list(values)
    return math.nan if any(math.isnan(v) for v in vals) else min(vals)


def _mean_with_worst(acc: OutputAccumulator) -> float:
    """Mean per-sample cosine with every NaN/Inf sample counted as -1 (the worst cosine)."""
    n = acc.samples + acc.nonfinite
    return (acc.cos_sum - acc.nonfinite) / n if n else math.nan


def macro_f1(truth: np.ndarray, pred: np.ndarray) -> float:
    """Macro-F1 over the classes present in ``truth``: mean of 2·TP / (2·TP + FP + FN).

    Example:
        >>> macro_f1(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1]))
        0.7333333333333334
    """
    scores = []
    for c in np.unique(truth):
        tp = int(((pred == c) & (truth == c)).sum())
        fp = int(((pred == c) & (truth != c)).sum())
        fn = int(((pred != c) & (truth == c)).sum())
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0)
    return float(np.mean(scores)) if scores else math.nan


def format_metric(v: float | None, target: Target | None = None) -> str:
    """Four decimals, or one more than the target has, so that 0.99995 never prints as 1.0000."""
    if v is None:
        return "n/a"
    digits = 4
    if target is not None:
        digits = max(4, len(f"{target.value:g}".partition(".")[2]) + 1)
    return fixed_number(v, digits)
