"""`diag check`: a CI gate over a ``diag.json`` — thresholds on every model output, one line per gate.

A gate is a bound on one metric of the verdict (``verdict.outputs[*]`` in ``diag.json``), applied to
every model output, or on the model's overall grade. Every gate prints a line, passed or failed, with
the value, the bound and the margin, so a red CI job says which gate failed and by how much.

NOTE: metrics that only exist for some outputs (top-1 agreement needs a class-like output, accuracy
drop needs ``--labels``) are *skipped with a printed note* on the outputs where they are null, but a
gate that applies to *no* output at all FAILS ("not applicable to any output"). A gate the run cannot
measure must never pass vacuously: a CI job that asked for ``--min-agreement`` on an embedding model
would otherwise stay green forever. Non-finite values fail too (``nan`` cosine is not >= anything),
except an SQNR of ``inf`` (identical outputs), which passes every ``--min-sqnr``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import number_from_json
from diag.foundations.metricnames import gates
from diag.foundations.summary import Summary
from diag.foundations.untrusted import fields_of
from diag.report.documents import read_document

#: Verdict grades, best first; ``--max-grade`` fails on any grade after the bound.
GRADES = ("excellent", "acceptable", "marginal", "reject")

#: gate -> (diag.json key in verdict.outputs[*], "min" or "max", number format); the names,
#: directions and formats are :mod:`diag.foundations.metricnames`'.
METRIC_GATES: dict[str, tuple[str, str, str]] = {
    flag: (key, "min" if higher else "max", gate.fmt) for flag, (key, higher, gate) in gates().items()
}


@dataclass(frozen=True)
class Gates:
    """The bounds ``diag check`` enforces; ``None`` means "no gate".

    Attributes:
        min_sqnr: lowest acceptable output SQNR in dB.
        min_cosine: lowest acceptable per-sample cosine (``cosine_min``) of every output.
        max_abs: highest acceptable max abs error of every output.
        min_agreement: lowest acceptable top-1 agreement (fraction, 0.99 = 99 %) of class-like outputs.
        max_accuracy_drop: highest acceptable FP32 - INT8 top-1 accuracy drop (fraction) with ``--labels``.
        max_f1_drop: highest acceptable FP32 - INT8 macro-F1 drop (fraction) with ``--labels``.
        max_grade: worst acceptable model grade (``excellent`` … ``reject``).
        outputs: restrict the metric gates to these output names (all outputs when empty).
    """

    min_sqnr: float | None = None
    min_cosine: float | None = None
    max_abs: float | None = None
    min_agreement: float | None = None
    max_accuracy_drop: float | None = None
    max_f1_drop: float | None = None
    max_grade: str | None = None
    outputs: tuple[str, ...] = ()

    def metric_bounds(self) -> list[tuple[str, float]]:
        """The metric gates that were given, in a fixed order: ``[(gate, bound), ...]``.

        Example:
            >>> Gates(max_abs=0.1, min_cosine=0.999).metric_bounds()
            [('min-cosine', 0.999), ('max-abs', 0.1)]
        """
        values = {gate: getattr(self, gate.replace("-", "_")) for gate in METRIC_GATES}
        return [(gate, float(v)) for gate, v in values.items() if v is not None]

    def validate(self) -> None:
        """Refuse bounds that cannot mean anything, before any file is read.

        Raises:
            DiagError: ``bad-option`` when no gate is given or a bound is out of range.

        Example:
            >>> Gates(min_cosine=2.0).validate()  # doctest: +NORMALIZE_WHITESPACE
            Traceback (most recent call last):
            ...
            diag.foundations.errors.DiagError: --min-cosine 2.0 | is outside [-1, 1]. Hint: cosine is at most 1, e.g.
            0.999
        """
        if not self.metric_bounds() and self.max_grade is None:
            raise DiagError(
                "bad-option",
                "diag check",
                "no gate given",
                "add at least one of " + ", ".join(f"--{gate}" for gate in [*METRIC_GATES, "max-grade"]),
            )
        for gate, bound in self.metric_bounds():
            check = gates()[gate][2]
            lo, hi, hint = check.low, check.high, check.hint
            if math.isnan(bound) or not lo <= bound <= hi:
                interval = f"[{lo:g}, {hi:g}]"
                raise DiagError("bad-option", f"--{gate} {bound}", f"is outside {interval}", hint)
        if self.max_grade is not None and self.max_grade not in GRADES:
            raise DiagError(
                "bad-option", f"--max-grade {self.max_grade}", "is not a grade", f"one of {', '.join(GRADES)}"
            )


@dataclass(frozen=True)
class GateResult:
    """One gate on one subject (an output or the model).

    Attributes:
        gate: the gate's flag name without dashes, e.g. ``min-cosine``.
        subject: ``output 'logits'`` or ``model``.
        status: ``pass``, ``fail`` or ``skip`` (metric absent for this output; printed, never silent).
        value: the measured value (a float, a grade, or None when absent).
        bound: the bound the user gave.
        margin: how far on the good side (>= 0) or the bad side (< 0) of the bound; grade gates count
            bands; None when there is nothing to measure.
        detail: the rest of the printed line.
    """

    gate: str
    subject: str
    status: str
    value: float | str | None
    bound: float | str
    margin: float | None
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def line(self) -> str:
        """The printed line, e.g. ``FAIL min-cosine: output 'logits' cosine_min 0.99120 < 0.999 (short by 0.00780)``.

        Example:
            >>> GateResult("max-grade", "model", "pass", "acceptable", "acceptable", 0, "grade acceptable").line()
            'PASS max-grade: model grade acceptable'
        """
        return f"{self.status.upper()} {self.gate}: {self.subject} {self.detail}"


def _value(raw: Any) -> float | None:
    """diag.json writes non-finite numbers as strings; None stays None (metric not applicable)."""
    return None if raw is None else number_from_json(raw, strict=True)


def _metric_results(outputs: list[dict[str, Any]], gate: str, bound: float) -> list[GateResult]:
    key, kind, fmt = METRIC_GATES[gate]
    results: list[GateResult] = []
    for out in outputs:
        subject = f"output '{out['name']}'"
        value = _value(out.get(key))
        if value is None:
            detail = f"{gates()[gate][2].why_null or f'has no {key}'}; gate not applied"
            results.append(GateResult(gate, subject, "skip", None, bound, None, detail))
            continue
        ok = value >= bound if kind == "min" else value <= bound
        margin = value - bound if kind == "min" else bound - value
        if math.isnan(margin):  # nan value, or inf - inf
            margin = 0.0 if ok else -math.inf
        op = (">=" if ok else "<") if kind == "min" else ("<=" if ok else ">")
        detail = f"{key} {value:{fmt}} {op} {bound:g}"
        if math.isnan(value):
            detail += " (not a number: the outputs contain nan)"
        elif math.isfinite(margin):
            word = "margin" if ok else ("short by" if kind == "min" else "over by")
            detail += f" ({word} {abs(margin):{fmt}})"
        results.append(GateResult(gate, subject, "pass" if ok else "fail", value, bound, margin, detail))
    if results and all(r.status == "skip" for r in results):
        names = ", ".join(f"'{o['name']}'" for o in outputs)
        detail = f"{key} is not applicable to any output ({names}); the gate cannot pass"
        results.append(GateResult(gate, "model", "fail", None, bound, None, detail))
    return results


def _grade_result(grade: str, bound: str) -> GateResult:
    bands = GRADES.index(bound) - GRADES.index(grade)
    if bands >= 0:
        return GateResult("max-grade", "model", "pass", grade, bound, bands, f"grade {grade} is within {bound}")
    s = "s" if bands < -1 else ""
    detail = f"grade {grade} is worse than {bound} (by {-bands} band{s})"
    return GateResult("max-grade", "model", "fail", grade, bound, bands, detail)


def check_document(doc: dict[str, Any], gates: Gates) -> list[GateResult]:
    """Apply ``gates`` to a loaded ``diag.json``: one result per gate and output, in gate order.

    Never raises for a failing gate (that is a result, not an error); raises ``DiagError`` for gates
    that cannot be evaluated at all (none given, out-of-range bound, unknown ``outputs`` name).

    Example:
        >>> from diag.report.documents import read_document
        >>> results = check_document(read_document("demo/diag.json"), Gates(min_cosine=0.999))  # doctest: +SKIP
        >>> [r.line() for r in results]  # doctest: +SKIP
        ["FAIL min-cosine: output 'logits' cosine_min 0.99629 < 0.999 (short by 0.00271)"]
    """
    gates.validate()
    outputs: list[dict[str, Any]] = list(doc["verdict"]["outputs"])
    if gates.outputs:
        known = [o["name"] for o in outputs]
        unknown = [n for n in gates.outputs if n not in known]
        if unknown:
            raise DiagError(
                "bad-option",
                f"--output {unknown[0]}",
                "is not an output of the compared model",
                f"outputs are: {', '.join(known)}",
            )
        outputs = [o for o in outputs if o["name"] in gates.outputs]
    results: list[GateResult] = []
    for gate, bound in gates.metric_bounds():
        results.extend(_metric_results(outputs, gate, bound))
    if gates.max_grade is not None:
        results.append(_grade_result(doc["verdict"]["grade"], gates.max_grade))
    return results


def check_file(path: str | os.PathLike[str], gates: Gates) -> list[GateResult]:
    """`diag check` as one call: validate the gates, load ``path`` (schema checked), apply them.

    Example:
        >>> results = check_file("demo/diag.json", Gates(max_grade="acceptable"))  # doctest: +SKIP
        >>> any(r.failed for r in results)  # doctest: +SKIP
        False
    """

    gates.validate()  # a missing gate is reported before a missing file
    doc = read_document(path)
    with fields_of(path):
        return check_document(doc, gates)


def summary_line(results: list[GateResult]) -> str:
    """The last line ``diag check`` prints: the verdict of the gate and the counts.

    Example:
        >>> summary_line([GateResult("max-grade", "model", "pass", "excellent", "acceptable", 1, "")])
        'check passed: 1 passed, 0 failed, 0 skipped'
    """
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    verdict = "FAILED" if counts["fail"] else "passed"
    return f"check {verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"


@dataclass(frozen=True)
class CheckOptions:
    """``diag check DIAG.JSON`` with its gates."""

    json: str
    gates: Gates


def run_check(options: CheckOptions) -> Summary:
    """`diag check`: one line per gate and output, the summary line; failed when any gate failed.

    Lives here, not in ``diag.cli.verbs``: a CI gate reads one JSON file and must not pay for importing
    onnx and numpy (seconds) the way the verbs that run models do.
    """
    results = check_file(options.json, options.gates)
    return Summary([*(r.line() for r in results), summary_line(results)], any(r.failed for r in results))
