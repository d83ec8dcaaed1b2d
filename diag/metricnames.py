"""One table of metric names: a metric's ``diag.json`` key, target, objective and gate, and its direction.

diag names one metric in up to four places, and the names differ: the per-sample cosine is
``cosine_min`` in ``diag.json`` (``verdict.outputs[*]``, what ``diag diff`` compares and ``diag
check`` reads), ``cosine`` in a held-out evaluation (``--target cosine>=0.999``, ``sweep
--objective cosine``) and ``--min-cosine`` as a gate. Every one of them is user-facing, so none is
renamed; this table says which names are one metric and which way is better, and ``diff``,
``gate``, ``evaluate``, ``sweep`` and the CLI's choices derive theirs from it
(``tests/test_metric_names.py`` fails when one of them accepts a name the table does not hold).

A foundation module: it imports nothing from diag, nor numpy or onnx (``diag check`` and ``diag
diff`` read it and must start without them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricNames:
    """The names of one metric; None where a vocabulary has no such metric.

    Attributes:
        key: its key in ``diag.json``'s ``verdict.outputs[*]`` (``diag diff``, ``diag check``).
        target: its name in ``--target NAME>=V`` / ``NAME<=V`` (a held-out evaluation's figure).
        objective: its name in ``diag sweep --objective NAME``.
        gate: its ``diag check`` flag without the dashes: ``min-...`` when higher is better,
            ``max-...`` when lower is.
        higher_is_better: which way is better (``>=`` targets, ``min-`` gates, sweep's ``max``).
    """

    key: str | None
    target: str | None
    objective: str | None
    gate: str | None
    higher_is_better: bool


#: Every metric diag names, in the order ``diag diff`` lists them and the help texts print them.
METRICS: tuple[MetricNames, ...] = (
    MetricNames("sqnr_db", None, None, "min-sqnr", True),
    MetricNames("cosine_min", "cosine", "cosine", "min-cosine", True),
    MetricNames("cosine_mean", None, "cosine_mean", None, True),
    MetricNames("max_abs", "max_abs", "max_abs", "max-abs", False),
    MetricNames("top1_agreement", "agreement", "agreement", "min-agreement", True),
    MetricNames("accuracy_int8", None, None, None, True),
    MetricNames("accuracy_drop", "accuracy_drop", "accuracy_drop", "max-accuracy-drop", False),
    MetricNames("f1_macro_int8", None, None, None, True),
    MetricNames("f1_macro_drop", "f1_drop", "f1_drop", "max-f1-drop", False),
    # sweep only: a recipe's speed-up over FP32 and its file size, not an output metric
    MetricNames(None, None, "latency", None, True),
    MetricNames(None, None, "size", None, False),
)


def output_keys() -> dict[str, bool]:
    """``diag.json`` output keys -> higher is better.

    Example:
        >>> list(output_keys())[:3]
        ['sqnr_db', 'cosine_min', 'cosine_mean']
    """
    return {m.key: m.higher_is_better for m in METRICS if m.key is not None}


def target_names() -> dict[str, bool]:
    """``--target`` names -> higher is better.

    Example:
        >>> target_names()["cosine"], target_names()["max_abs"]
        (True, False)
    """
    return {m.target: m.higher_is_better for m in METRICS if m.target is not None}


def objective_names() -> dict[str, bool]:
    """``sweep --objective`` names -> higher is better.

    Example:
        >>> list(objective_names())[-2:]
        ['latency', 'size']
    """
    return {m.objective: m.higher_is_better for m in METRICS if m.objective is not None}


def gate_flags() -> dict[str, str]:
    """``diag check`` gate flags (without the dashes) -> the ``diag.json`` output key each bounds.

    Example:
        >>> gate_flags()["min-cosine"]
        'cosine_min'
    """
    return {m.gate: m.key for m in METRICS if m.gate is not None and m.key is not None}
