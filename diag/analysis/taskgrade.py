"""Grade task metrics: the F1 drop bands, and the output verdicts a bad F1 drop makes worse.

:mod:`diag.core.taskmetrics` (core) accumulates and finalizes task metrics; judging them is analysis:
the F1 drop is graded with the bands users grade accuracy drops by and joins the first output's
verdict (:mod:`diag.analysis.analyze`'s grades). A plugin's values are reported as they are: diag cannot
know their bands.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from diag.analysis.analyze import GRADES, OutputVerdict, overall_grade
from diag.core.taskmetrics import F1Metric, PluginMetric, TaskAccumulator


class Graded(Protocol):
    """The part of a result task metrics join (a :class:`diag.analysis.compare.CompareResult`, which imports
    this module): the output verdicts, the overall grade, and where the finalized metrics go."""

    verdicts: list[OutputVerdict]
    grade: str
    task_metrics: dict[str, Any]


#: F1 drop bands (FP32 minus INT8, a fraction): the same as the accuracy-drop bands users grade by.
F1_DROP_BAND = {"excellent": 0.005, "acceptable": 0.015, "reject_above": 0.02}


def f1_drop_grade(drop: float) -> str:
    """Grade an F1 drop (fraction) with :data:`F1_DROP_BAND`; NaN is a reject.

    Example:
        >>> f1_drop_grade(0.004), f1_drop_grade(0.012), f1_drop_grade(0.018), f1_drop_grade(0.03)
        ('excellent', 'acceptable', 'marginal', 'reject')
    """
    if math.isnan(drop):
        return "reject"
    if drop < F1_DROP_BAND["excellent"]:
        return "excellent"
    if drop < F1_DROP_BAND["acceptable"]:
        return "acceptable"
    return "reject" if drop > F1_DROP_BAND["reject_above"] else "marginal"


def attach_task_metrics(
    result: Graded,
    task: dict[str, TaskAccumulator],
    spec: str | None,
    exact_verdicts: list[OutputVerdict] | None = None,
) -> None:
    """Finalize ``task`` (a state's accumulators) into ``result.task_metrics``; grade the first output's F1 drop.

    The F1 drop is graded with :data:`F1_DROP_BAND` and joins the first output's reasons; the
    output's grade (and the model's) becomes the worse of the two. A plugin's values are reported
    as they are: diag cannot know their bands.

    Example:
        >>> attach_task_metrics(result, result.state.task, None)  # doctest: +SKIP
        >>> result.task_metrics["f1"]["values"]["f1_macro_drop"]  # doctest: +SKIP
        0.0125
    """
    out: dict[str, Any] = {}
    f1 = task.get("f1")
    if isinstance(f1, F1Metric) and f1.samples:
        values = f1.finalize()
        out["f1"] = {"output": f1.output, "samples": f1.samples, "values": values, "better": dict(f1.better)}
        _grade_f1(result.verdicts, f1.output, values)
        result.grade = overall_grade(result.verdicts)
        exact = task.get("f1_exact")
        if isinstance(exact, F1Metric) and exact.samples:
            # the same F1 of the exact-mode INT8 outputs, beside the deployed one (issue 42 item 3)
            out["f1"]["exact"] = exact.finalize()
            # an output graded exact only (a KV cache) is the same object in both lists: graded once
            own = [v for v in exact_verdicts or [] if not any(v is g for g in result.verdicts)]
            _grade_f1(own, exact.output, out["f1"]["exact"])
    plugin = task.get("plugin")
    if isinstance(plugin, PluginMetric) and spec:
        out["plugin"] = {"spec": spec, "values": plugin.finalize(), "better": dict(plugin.better)}
    result.task_metrics = out


def _grade_f1(verdicts: list[OutputVerdict], output: str, values: dict[str, float]) -> None:
    """``output``'s verdict gets the F1 figures as a reason, and the worse of its grade and the F1 drop's."""
    v = next((v for v in verdicts if v.name == output), None)
    if v is None:
        return
    grade = f1_drop_grade(values["f1_macro_drop"])
    v.reasons.append(
        f"macro-F1 {values['f1_macro_fp32']:.2%} -> {values['f1_macro_int8']:.2%}, drop "
        f"{values['f1_macro_drop']:.2%} ({grade}); micro-F1 drop {values['f1_micro_drop']:.2%}"
    )
    v.grade = GRADES[max(GRADES.index(v.grade), GRADES.index(grade))]
