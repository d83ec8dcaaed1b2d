"""One table of metrics: a metric's ``diag.json`` key, target, objective and gate, its direction,
and what each vocabulary says and prints about it.

diag names one metric in up to four places, and the names differ: the per-sample cosine is
``cosine_min`` in ``diag.json`` (``verdict.outputs[*]``, what ``diag diff`` compares and ``diag
check`` reads), ``cosine`` in a held-out evaluation (``--target cosine>=0.999``, ``sweep
--objective cosine``) and ``--min-cosine`` as a gate. Every one of them is user-facing, so none is
renamed; this table says which names are one metric, which way is better, and the facts each
vocabulary needs about it (a gate's flag help, range and number format; a target's meaning and
worst value; an objective's description; the help texts' lines). ``diff``, ``gate``, ``evaluate``,
``sweep``, ``exclude``, ``exclude_view`` and the CLI derive theirs from it, so a metric is one row
here (``tests/test_metric_names.py`` fails when one of them accepts a name the table does not hold
or prints a text it does not).

A foundation module: it imports nothing from diag, nor numpy or onnx (``diag check`` and ``diag
diff`` read it and must start without them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    """What ``diag check --<flag>`` says and checks: its help, how its line prints the value, its range.

    Attributes:
        metavar: the bound's name in ``diag check --help``.
        help: the flag's help line.
        fmt: the format of the value in a gate line (``f"{value:{fmt}}"``).
        low: the lowest bound that means something (``bad-option`` below it).
        high: the highest.
        hint: the hint of a bound outside ``[low, high]``.
        why_null: the SKIP line's reason when an output has no value (default: ``has no <key>``).
    """

    metavar: str
    help: str
    fmt: str
    low: float
    high: float
    hint: str
    why_null: str | None = None


@dataclass(frozen=True)
class MetricNames:
    """One metric: its names, which way is better, and what each vocabulary says about it; None
    where a vocabulary has no such metric.

    Attributes:
        key: its key in ``diag.json``'s ``verdict.outputs[*]`` (``diag diff``, ``diag check``).
        target: its name in ``--target NAME>=V`` / ``NAME<=V`` (a held-out evaluation's figure,
            a field or property of ``evaluate.HeldOutMetrics``).
        objective: its name in ``diag sweep --objective NAME``.
        gate: its ``diag check`` flag without the dashes: ``min-...`` when higher is better,
            ``max-...`` when lower is.
        higher_is_better: which way is better (``>=`` targets, ``min-`` gates, sweep's ``max``).
        check: the gate's help, format and range (with ``gate``).
        how: how the target is computed (``evaluate.TARGET_METRICS``, written into ``exclusion.json``).
        worst: the target's value while an evaluated output holds NaN/Inf (``evaluate.WORST``).
        target_help: its lines in ``diag exclude --help``'s list of targets.
        what: what the objective is (``sweep.OBJECTIVES``, written into ``sweep.json``).
        objective_help: its lines in ``diag sweep --help``'s list of objectives.
        labels: the target or objective needs ``--labels``.
    """

    key: str | None
    target: str | None
    objective: str | None
    gate: str | None
    higher_is_better: bool
    check: Gate | None = None
    how: str | None = None
    worst: float | None = None
    target_help: tuple[str, ...] = ()
    what: str | None = None
    objective_help: tuple[str, ...] = ()
    labels: bool = False


_FRACTION = "a fraction, e.g. 0.005 for 0.5 %"

#: Every metric diag names, in the order ``diag diff`` lists them and the help texts print them.
METRICS: tuple[MetricNames, ...] = (
    MetricNames(
        "sqnr_db",
        None,
        None,
        "min-sqnr",
        True,
        check=Gate("DB", "fail when an output's SQNR is below DB", ".2f", -math.inf, math.inf, "in dB, e.g. 20"),
    ),
    MetricNames(
        "cosine_min",
        "cosine",
        "cosine",
        "min-cosine",
        True,
        check=Gate(
            "C",
            "fail when an output's min per-sample cosine < C",
            ".5f",
            -1.0,
            1.0,
            "cosine is at most 1, e.g. 0.999",
        ),
        how="min over held-out samples and model outputs of the per-sample cosine sum(x*y)/sqrt(sum x^2 * sum y^2), "
        "x = FP32 output, y = INT8 output",
        worst=-1.0,
        target_help=("min over samples and outputs of the per-sample cosine sum(x*y)/sqrt(sum x^2 * sum y^2)",),
        what="min per-sample cosine over held-out samples and outputs",
        objective_help=("min over samples and outputs of sum(x*y)/sqrt(sum x^2 * sum y^2) (higher is better)",),
    ),
    MetricNames(
        "cosine_mean",
        None,
        "cosine_mean",
        None,
        True,
        what="mean per-sample cosine (worst output)",
        objective_help=("mean per-sample cosine, worst output",),
    ),
    MetricNames(
        "max_abs",
        "max_abs",
        "max_abs",
        "max-abs",
        False,
        check=Gate(
            "E", "fail when an output's max abs error > E", ".4g", 0.0, math.inf, "an absolute error is >= 0, e.g. 0.1"
        ),
        how="max |y - x| over every element of every held-out output",
        worst=math.inf,
        target_help=("max |y - x| over every element of every output",),
        what="max |INT8 - FP32| over every held-out output element",
        objective_help=("max |y - x| over every output element (lower is better)",),
    ),
    MetricNames(
        "top1_agreement",
        "agreement",
        "agreement",
        "min-agreement",
        True,
        check=Gate(
            "F",
            "fail when a class-like output's top-1 agreement < F (0.99)",
            ".5f",
            0.0,
            1.0,
            "a fraction, e.g. 0.99 for 99 %",
            why_null="has no top-1 agreement (not class-like)",
        ),
        how="top-1 agreement: share of rows (last axis = classes) whose argmax agrees with FP32; "
        "worst class-like output",
        worst=0.0,
        target_help=(
            "top-1 agreement: share of rows (last axis = classes) whose argmax equals FP32's",
            "(worst class-like output)",
        ),
        what="top-1 agreement with FP32 (worst class-like output)",
        objective_help=("top-1 agreement with FP32, worst class-like output",),
    ),
    MetricNames("accuracy_int8", None, None, None, True),
    MetricNames(
        "accuracy_drop",
        "accuracy_drop",
        "accuracy_drop",
        "max-accuracy-drop",
        False,
        check=Gate(
            "F",
            "fail when the FP32 - INT8 top-1 accuracy drop (run with --labels) > F (0.005 = 0.5 %)",
            ".5f",
            -1.0,
            1.0,
            _FRACTION,
            why_null="has no accuracy drop (run without --labels, or not the first output)",
        ),
        how="top-1 accuracy of FP32 minus INT8 on the first output, against --labels",
        worst=1.0,
        target_help=("top-1 accuracy FP32 minus quantized on the first output, against --labels",),
        what="FP32 minus INT8 top-1 accuracy on the first output (--labels)",
        objective_help=("FP32 minus INT8 top-1 accuracy, first output, --labels",),
        labels=True,
    ),
    MetricNames("f1_macro_int8", None, None, None, True),
    MetricNames(
        "f1_macro_drop",
        "f1_drop",
        "f1_drop",
        "max-f1-drop",
        False,
        check=Gate(
            "F",
            "fail when the FP32 - INT8 macro-F1 drop (run with --labels) > F (0.005 = 0.5 %)",
            ".5f",
            -1.0,
            1.0,
            _FRACTION,
            why_null="has no F1 drop (run without --labels, or not the first output)",
        ),
        how="macro-F1 (mean over the labelled classes) of FP32 minus INT8 on the first output, --labels",
        worst=1.0,
        target_help=(
            "macro-F1 (mean over labelled classes of 2TP/(2TP+FP+FN)) FP32 minus quantized,",
            "first output, against --labels",
        ),
        what="FP32 minus INT8 macro-F1 on the first output (--labels)",
        objective_help=("FP32 minus INT8 macro-F1, first output, --labels",),
        labels=True,
    ),
    # sweep only: a recipe's speed-up over FP32 and its file size, not an output metric
    MetricNames(
        None,
        None,
        "latency",
        None,
        True,
        what="speedup over FP32 (p50 of FP32 / p50 of INT8, median over repeats)",
        objective_help=(
            "speedup = FP32 p50 / INT8 p50 (median over --repeats); recipes whose speedup ranges",
            'overlap or differ by < 5 % share a rank ("no measurable difference")',
        ),
    ),
    MetricNames(None, None, "size", None, False, what="INT8 model file size", objective_help=("INT8 model file size",)),
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


def gates() -> dict[str, tuple[str, bool, Gate]]:
    """``diag check`` gate flags (without the dashes) -> (the ``diag.json`` key it bounds, higher
    is better, what the gate says and checks).

    Example:
        >>> key, higher, gate = gates()["max-abs"]
        >>> key, higher, gate.metavar, gate.low
        ('max_abs', False, 'E', 0.0)
    """
    found = {}
    for m in METRICS:
        if m.gate is not None:
            assert m.key is not None and m.check is not None, f"--{m.gate} bounds no diag.json key, or says nothing"
            found[m.gate] = (m.key, m.higher_is_better, m.check)
    return found


def held_out_names() -> tuple[str, ...]:
    """The held-out figures of an evaluation (targets and objectives that are output metrics), in order.

    Example:
        >>> held_out_names()
        ('cosine', 'cosine_mean', 'max_abs', 'agreement', 'accuracy_drop', 'f1_drop')
    """
    return tuple(name for m in METRICS if m.key is not None for name in [m.objective or m.target] if name)


def labelled_names() -> frozenset[str]:
    """Targets and objectives that need ``--labels``.

    Example:
        >>> sorted(labelled_names())
        ['accuracy_drop', 'f1_drop']
    """
    return frozenset(name for m in METRICS if m.labels for name in (m.target, m.objective) if name is not None)


def help_lines(column: int, names: dict[str, tuple[str, ...]]) -> str:
    """Help-text lines: each name, padded to ``column``, then its first line; the others indented to it.

    Example:
        >>> print(help_lines(6, {"a>=V": ("first", "second")}), end="")
          a>=V  first
                second
    """
    lines = []
    for name, text in names.items():
        lines.append(f"  {name.ljust(column)}{text[0]}")
        lines += [f"  {' ' * column}{more}" for more in text[1:]]
    return "".join(f"{line}\n" for line in lines)


def target_help() -> str:
    """The targets' lines of ``diag exclude --help`` (``NAME>=V`` / ``NAME<=V``, then how it is computed)."""
    return help_lines(
        18,
        {f"{m.target}{'>=' if m.higher_is_better else '<='}V": m.target_help for m in METRICS if m.target is not None},
    )


def objective_help() -> str:
    """The objectives' lines of ``diag sweep --help``."""
    return help_lines(15, {m.objective: m.objective_help for m in METRICS if m.objective is not None})
