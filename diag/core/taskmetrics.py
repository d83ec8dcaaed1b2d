"""Task metrics: F1 against labels, and metric plugins (``--metric module:function``).

Output agreement (cosine, top-1 agreement) says how far the INT8 model is from FP32; users ship on
*task* metrics: F1 drop against labels (the quantization guides grade it < 0.5 / 1.5 / 2 %), or
their own (mAP, CER, BLEU...). Both are streaming and mergeable, like every accumulator in diag:

* :class:`TaskMetric` is the protocol: ``update(fp32_outputs, int8_outputs, labels_or_None)`` once
  per batch, ``merge(other)`` for shards, ``finalize() -> {name: value}``, and ``better``:
  ``{name: "higher" | "lower"}`` for every value finalize returns. A plugin that also has
  ``state() -> JSON-able`` and ``from_state(state) -> metric`` can be written into shard files.
* :class:`F1Metric` is the built-in one (``--labels``): macro and micro F1 of FP32 and INT8 argmax
  predictions of the first output, and their drops.
* :func:`metric_factory` loads ``module:function`` the way ``--reader`` is loaded
  (:func:`diag.core.feeds.feeds_from_reader`), and every failure is a ``bad-metric`` error naming the
  plugin.

NOTE: a plugin gets the *model outputs* of a batch, by output name, in float as the models wrote
them (never the intermediate tensors): memory stays O(one batch) whatever the plugin keeps, as
long as it keeps sums and counts, which the protocol's ``merge`` forces anyway.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from diag.core.feeds import object_from_spec
from diag.core.state import State
from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_number

DIRECTIONS = ("higher", "lower")
_T = TypeVar("_T")


@runtime_checkable
class TaskMetric(Protocol):
    """What ``--metric module:function`` must return: a streaming, mergeable task metric.

    Attributes:
        better: every name :meth:`finalize` returns -> ``"higher"`` or ``"lower"`` (which way is
            better); ``diag exclude --target NAME>=V`` needs ``higher``, ``NAME<=V`` ``lower``.

    Example:
        >>> class MeanGap:
        ...     better = {"gap": "lower"}
        ...     def __init__(self): self.s, self.n = 0.0, 0
        ...     def update(self, fp32, int8, labels):
        ...         for k in fp32:
        ...             self.s += float(np.abs(fp32[k] - int8[k]).sum()); self.n += fp32[k].size
        ...     def merge(self, other): self.s += other.s; self.n += other.n; return self
        ...     def finalize(self): return {"gap": self.s / max(self.n, 1)}
        >>> isinstance(MeanGap(), TaskMetric)
        True
    """

    @property
    def better(self) -> Mapping[str, str]: ...

    def update(
        self, fp32_outputs: dict[str, np.ndarray], int8_outputs: dict[str, np.ndarray], labels: np.ndarray | None
    ) -> None: ...

    def merge(self, other: Any) -> Any: ...

    def finalize(self) -> dict[str, float]: ...


# ---------------------------------------------------------------- built-in: F1 against labels


class F1Metric:
    """Macro and micro F1 of the FP32 and INT8 models' argmax on ``output`` against labels.

    Implements :class:`diag.core.state.Accumulator` (and :class:`TaskMetric`).

    Per class c of the labels seen: F1_c = 2·TP / (2·TP + FP + FN). Macro-F1 is the mean over the
    classes that occur in the labels (a class only ever predicted, never labelled, adds its false
    positives to the labelled classes' counts only); micro-F1 pools TP / FP / FN over those classes.
    Keeps three counts per class and model: O(classes) memory, merged by adding.

    Example:
        >>> m = F1Metric("logits")
        >>> truth = np.array([0, 0, 1, 1])
        >>> fp = np.eye(2)[[0, 0, 1, 1]]; q = np.eye(2)[[0, 1, 1, 1]]
        >>> m.update({"logits": fp}, {"logits": q}, truth)
        >>> {k: round(v, 4) for k, v in m.finalize().items() if k.startswith("f1_macro")}
        {'f1_macro_fp32': 1.0, 'f1_macro_int8': 0.7333, 'f1_macro_drop': 0.2667}
    """

    better: ClassVar[dict[str, str]] = {
        "f1_macro_fp32": "higher",
        "f1_macro_int8": "higher",
        "f1_macro_drop": "lower",
        "f1_micro_fp32": "higher",
        "f1_micro_int8": "higher",
        "f1_micro_drop": "lower",
    }

    def __init__(self, output: str) -> None:
        self.output = output
        #: class -> [tp, fp, fn] for FP32 then INT8 (six counts).
        self.counts: dict[int, list[int]] = {}
        self.samples = 0

    def update(
        self, fp32_outputs: dict[str, np.ndarray], int8_outputs: dict[str, np.ndarray], labels: np.ndarray | None
    ) -> None:
        if labels is None:
            raise DiagError("bad-option", "F1", "needs labels", "pass --labels labels.npy")
        fp, q = fp32_outputs[self.output], int8_outputs[self.output]
        if fp.ndim != 2 or fp.shape[0] != len(labels):
            raise DiagError(
                "bad-inputs",
                "--labels",
                f"needs the first model output to be [batch, classes], it is {fp.shape}",
                "drop --labels for this model",
            )
        truth = np.asarray(labels).astype(np.int64)
        for offset, pred in ((0, fp.argmax(axis=1)), (3, q.argmax(axis=1))):
            for c in np.union1d(truth, pred).tolist():
                row = self.counts.setdefault(int(c), [0] * 6)
                row[offset] += int(((pred == c) & (truth == c)).sum())
                row[offset + 1] += int(((pred == c) & (truth != c)).sum())
                row[offset + 2] += int(((pred != c) & (truth == c)).sum())
        self.samples += len(truth)

    def merge(self, other: F1Metric) -> F1Metric:
        for c, row in other.counts.items():
            mine = self.counts.setdefault(c, [0] * 6)
            for i, v in enumerate(row):
                mine[i] += v
        self.samples += other.samples
        return self

    def finalize(self) -> dict[str, float]:
        labelled = [row for row in self.counts.values() if row[0] + row[2] > 0]  # TP + FN > 0: labelled
        out: dict[str, float] = {}
        for offset, model in ((0, "fp32"), (3, "int8")):
            per_class = [_f1(r[offset], r[offset + 1], r[offset + 2]) for r in labelled]
            out[f"f1_macro_{model}"] = float(np.mean(per_class)) if per_class else math.nan
            tp, fp, fn = (sum(r[offset + i] for r in labelled) for i in range(3))
            out[f"f1_micro_{model}"] = _f1(tp, fp, fn) if labelled else math.nan
        out["f1_macro_drop"] = out["f1_macro_fp32"] - out["f1_macro_int8"]
        out["f1_micro_drop"] = out["f1_micro_fp32"] - out["f1_micro_int8"]
        return {k: out[k] for k in self.better}

    def to_state(self) -> State:
        return {"output": self.output, "samples": self.samples, "counts": {str(c): r for c, r in self.counts.items()}}

    @classmethod
    def from_state(cls, state: State) -> F1Metric:
        m = cls(str(state["output"]))
        m.samples = int(state["samples"])
        m.counts = {int(c): [int(v) for v in r] for c, r in state["counts"].items()}
        return m


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0


# ---------------------------------------------------------------- plugins


def metric_factory(spec: str) -> Callable[[], TaskMetric]:
    """Import ``module:function`` and return a factory of checked :class:`TaskMetric` objects.

    ``function()`` is called once per measurement (one compare, one exclusion candidate), so each
    starts from zero. Every failure is one ``bad-metric`` line naming the plugin.

    Example:
        >>> make = metric_factory("mymetrics:detection_map")  # doctest: +SKIP
        >>> sorted(make().better)  # doctest: +SKIP
        ['map50']
        >>> metric_factory("nope")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        diag.foundations.errors.DiagError: --metric 'nope' | is not 'package.module:function'. Hint: e.g. --metric
        mymetrics:f1
    """

    obj = f"--metric {spec!r}"
    function = object_from_spec(spec, obj, "bad-metric", "function", "e.g. --metric mymetrics:f1")
    if not callable(function):
        raise DiagError("bad-metric", obj, f"is a {type(function).__name__}, not a function", "name a factory function")

    def make() -> TaskMetric:
        try:
            made = function()
        except DiagError:
            raise
        except Exception as e:
            raise DiagError("bad-metric", obj, f"raised {type(e).__name__}: {e}", "fix the factory") from e
        return checked_metric(made, spec)

    return make


def checked_metric(made: Any, spec: str) -> TaskMetric:
    """``made`` if it follows the :class:`TaskMetric` protocol, else a ``bad-metric`` error saying what lacks."""
    obj = f"--metric {spec!r}"
    missing = [m for m in ("update", "merge", "finalize") if not callable(getattr(made, m, None))]
    if missing:
        raise DiagError(
            "bad-metric",
            obj,
            f"returned a {type(made).__name__} without {', '.join(m + '()' for m in missing)}",
            "return an object with update(fp32_outputs, int8_outputs, labels), merge(other), finalize() and better",
        )
    better = getattr(made, "better", None)
    if not isinstance(better, Mapping) or not better or any(v not in DIRECTIONS for v in better.values()):
        raise DiagError(
            "bad-metric",
            obj,
            f"returned a {type(made).__name__} whose 'better' is {better!r}",
            "declare better = {'name': 'higher' or 'lower'} for every value finalize() returns",
        )
    return made  # type: ignore[no-any-return]


def call_update(
    metric: TaskMetric, spec: str, fp32: dict[str, np.ndarray], int8: dict[str, np.ndarray], labels: Any
) -> None:
    """``metric.update(...)``; an exception in the plugin is a ``bad-metric`` error naming it."""
    _plugin_call(spec, "update", lambda: metric.update(fp32, int8, labels))


def _plugin_call(spec: str, method: str, call: Callable[[], _T]) -> _T:
    """``call()``, a call into the plugin's ``method``; an exception there is a ``bad-metric`` error
    naming the plugin and the method (a DiagError it raises passes as it is)."""
    try:
        return call()
    except DiagError:
        raise
    except Exception as e:
        raise DiagError(
            "bad-metric", f"--metric {spec!r}", f"raised {type(e).__name__} in {method}(): {e}", "fix the metric"
        ) from e


def finalized(metric: TaskMetric, spec: str) -> dict[str, float]:
    """``metric.finalize()`` checked: a dict of numbers whose names ``better`` declares."""
    obj = f"--metric {spec!r}"
    values = _plugin_call(spec, "finalize", metric.finalize)
    if not isinstance(values, Mapping):
        raise DiagError(
            "bad-metric", obj, f"finalize() returned a {type(values).__name__}, not a dict", "return {name: number}"
        )
    out: dict[str, float] = {}
    for k, v in values.items():
        if k not in metric.better:
            raise DiagError(
                "bad-metric", obj, f"finalize() returned '{k}', which 'better' does not declare", "declare it"
            )
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError) as e:
            raise DiagError("bad-metric", obj, f"finalize() returned {k}={v!r}, not a number", "return numbers") from e
    return out


def metric_state(metric: TaskMetric, spec: str) -> Any:
    """The plugin's ``state()`` for a shard file; ``bad-option`` when it cannot be serialized.

    Shard files are JSON that travel between machines: a plugin without ``state()`` /
    ``from_state()`` cannot be merged later, so ``--shard`` with it is refused up front rather
    than producing shards whose metric is lost.
    """
    if not callable(getattr(metric, "state", None)) or not callable(getattr(metric, "from_state", None)):
        raise DiagError(
            "bad-option",
            f"--metric {spec!r} with --shard",
            "the metric has no state() / from_state() pair, so its partial sums cannot be written into the shard file",
            "add state() -> JSON-able and from_state(state) -> metric to the plugin, or run without --shard",
        )

    try:
        state = metric.state()  # type: ignore[attr-defined]
        json.dumps(state)
    except Exception as e:
        raise DiagError(
            "bad-metric",
            f"--metric {spec!r}",
            f"state() is not JSON-serializable ({type(e).__name__}: {e})",
            "return plain dicts, lists and numbers",
        ) from e
    return state


def metric_from_state(factory: Callable[[], TaskMetric], spec: str, state: Any) -> TaskMetric:
    """Rebuild a plugin metric from a shard's state (``from_state``, on a fresh instance or its class)."""
    fresh = factory()
    restore = getattr(fresh, "from_state", None)
    if not callable(restore):
        raise DiagError("bad-metric", f"--metric {spec!r}", "has no from_state()", "add from_state(state) -> metric")
    return _plugin_call(spec, "from_state", lambda: checked_metric(restore(state), spec))


class PluginMetric:
    """A ``--metric`` plugin inside a comparison: the plugin with its spec, as a diag accumulator.

    Implements :class:`diag.core.state.Accumulator` over the plugin's own protocol: ``update`` /
    ``merge`` / ``finalize`` call the plugin's (an exception there is a ``bad-metric`` error naming
    it); ``to_state`` is ``{"spec": spec, "state": plugin.state()}``, and ``from_state`` imports
    the plugin again by its spec and calls its ``from_state``. It keeps what the plugin keeps.

    Example:
        >>> m = PluginMetric("mymetrics:detection_map", metric_factory("mymetrics:detection_map")())  # doctest: +SKIP
        >>> PluginMetric.from_state(m.to_state()).spec  # doctest: +SKIP
        'mymetrics:detection_map'
    """

    def __init__(self, spec: str, metric: TaskMetric) -> None:
        self.spec = spec
        self.metric = metric

    @property
    def better(self) -> Mapping[str, str]:
        return self.metric.better

    def update(
        self, fp32_outputs: dict[str, np.ndarray], int8_outputs: dict[str, np.ndarray], labels: np.ndarray | None
    ) -> None:
        call_update(self.metric, self.spec, fp32_outputs, int8_outputs, labels)

    def merge(self, other: PluginMetric) -> PluginMetric:
        merged = _plugin_call(self.spec, "merge", lambda: self.metric.merge(other.metric))
        self.metric = merged if merged is not None else self.metric
        return self

    def finalize(self) -> dict[str, float]:
        return finalized(self.metric, self.spec)

    def to_state(self) -> State:
        return {"spec": self.spec, "state": metric_state(self.metric, self.spec)}

    @classmethod
    def from_state(cls, state: State) -> PluginMetric:
        spec = str(state["spec"])
        return cls(spec, metric_from_state(metric_factory(spec), spec, state["state"]))


#: What ``CompareState.task`` holds: ``f1`` (and ``f1_exact``) with --labels, ``plugin`` with --metric.
TaskAccumulator = F1Metric | PluginMetric


# ---------------------------------------------------------------- compare / merge glue


def start_task_metrics(
    first_output: str, labels: np.ndarray | None, spec: str | None, shard: bool, exact_beside: bool = False
) -> dict[str, TaskAccumulator]:
    """The task metrics of one comparison: ``f1`` with labels, ``plugin`` with ``--metric``.

    ``exact_beside``: the outputs are graded as deployed, so ``f1`` is the deployed model's and
    ``f1_exact`` the same F1 of the exact-mode INT8 outputs, kept beside it (issue 42 item 3).

    With ``shard`` a plugin must be serializable (see :func:`metric_state`): refused here, before
    any model runs.
    """
    task: dict[str, TaskAccumulator] = {}
    if labels is not None:
        task["f1"] = F1Metric(first_output)
        if exact_beside:
            task["f1_exact"] = F1Metric(first_output)
    if spec:
        plugin = PluginMetric(spec, metric_factory(spec)())
        if shard:
            plugin.to_state()
        task["plugin"] = plugin
    return task


def task_lines(task_metrics: dict[str, Any]) -> list[str]:
    """One line per plugin metric value, for the CLI, the report and the summary.

    Example:
        >>> task_lines({"plugin": {"spec": "m:f", "values": {"map": 0.5}, "better": {"map": "higher"}}})
        ['metric m:f: map 0.5 (higher is better)']
    """
    p = task_metrics.get("plugin")
    if not p:
        return []
    return [f"metric {p['spec']}: {k} {_show(v)} ({p['better'].get(k, '?')} is better)" for k, v in p["values"].items()]


def _show(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def json_values(task_metrics: dict[str, Any]) -> dict[str, Any]:
    """``task_metrics`` with non-finite numbers as the strings diag.json uses ("nan", "inf")."""
    out: dict[str, Any] = {}
    for key, entry in task_metrics.items():
        out[key] = {**entry, "values": {k: json_number(v) for k, v in entry["values"].items()}}
        if "exact" in entry:  # the exact-mode figures beside the deployed ones
            out[key]["exact"] = {k: json_number(v) for k, v in entry["exact"].items()}
    return out


def merge_task_metrics(mine: dict[str, TaskAccumulator], theirs: dict[str, TaskAccumulator]) -> None:
    """Merge ``theirs`` into ``mine`` in place with each metric's own ``merge`` (a plugin failing: ``bad-metric``)."""
    for key, metric in theirs.items():
        have = mine.get(key)
        if have is None:
            mine[key] = metric
        elif isinstance(have, F1Metric):
            have.merge(_same_kind(F1Metric, metric, key))
        else:
            have.merge(_same_kind(PluginMetric, metric, key))


def _same_kind(kind: type[_T], metric: TaskAccumulator, key: str) -> _T:
    """``metric`` if it is a ``kind`` (the same task metric as the one it merges into), else ``TypeError``."""
    if not isinstance(metric, kind):
        raise TypeError(f"task metric '{key}' is a {kind.__name__} here, a {type(metric).__name__} there")
    return metric


def task_to_state(task: dict[str, TaskAccumulator]) -> State:
    """The task metrics' mergeable state for a shard file: ``{"f1": ..., "plugin": {"spec", "state"}}``."""
    return {key: metric.to_state() for key, metric in task.items()}


def task_from_state(state: State | None) -> dict[str, TaskAccumulator]:
    """The inverse of :func:`task_to_state`; a plugin is imported again by its recorded spec."""
    task: dict[str, TaskAccumulator] = {}
    if not state:
        return task
    for key in ("f1", "f1_exact"):
        if key in state:
            task[key] = F1Metric.from_state(state[key])
    if "plugin" in state:
        task["plugin"] = PluginMetric.from_state(state["plugin"])
    return task
