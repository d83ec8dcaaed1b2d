"""`diag diff a.json b.json`: what got better or worse between two ``diag compare`` runs.

Typical pairs: before/after a recipe change (a node excluded, per-channel on, QDQ instead of
dynamic), or the same models before/after an onnxruntime upgrade. The diff reads only the two
``diag.json`` documents, never the models.

Sign conventions: every delta is ``b - a``; whether that is *better* depends on the metric (SQNR,
cosine, agreement and accuracy up are better; max abs error and accuracy drop down are better; a
grade closer to ``excellent`` is better). Nodes are matched by name (``nodes[*].name``, the FP32 node
or fused group label), so renamed or re-fused nodes show as present in only one run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_number, number_from_json
from diag.foundations.metricnames import output_keys
from diag.foundations.summary import Summary
from diag.foundations.untrusted import fields_of
from diag.report.documents import read_document
from diag.report.gate import GRADES

#: verdict.outputs[*] metric -> True when higher is better (the table in :mod:`diag.foundations.metricnames`).
OUTPUT_METRICS: dict[str, bool] = output_keys()

#: environment keys that change on every run and say nothing about the result.
VOLATILE_ENVIRONMENT = ("date",)

#: run keys compared (``seconds`` is timing noise, not a setting).
RUN_KEYS = ("inputs", "samples", "opt_level", "local_error")


def _value(raw: Any) -> float | None:
    return None if raw is None else number_from_json(raw, strict=True)


def _fmt(v: float | None, spec: str = ".6g") -> str:
    if v is None:
        return "n/a"
    return f"{v:{spec}}"


def _change(a: float | None, b: float | None, higher_is_better: bool) -> str:
    """``better``, ``worse``, ``same`` or ``n/a`` (absent in a run, or nan) for the move a -> b."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return "same" if a is None and b is None else "n/a"
    if a == b:
        return "same"
    return "better" if (b > a) == higher_is_better else "worse"


def _delta(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    d = b - a
    return None if math.isnan(d) else d


@dataclass(frozen=True)
class MetricDelta:
    """One metric of one model output in both runs; ``delta = b - a``."""

    output: str
    metric: str
    a: float | None
    b: float | None
    delta: float | None
    change: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "metric": self.metric,
            "a": json_number(self.a, digits=None),
            "b": json_number(self.b, digits=None),
            "delta": json_number(self.delta, digits=None),
            "change": self.change,
        }


@dataclass(frozen=True)
class NodeChange:
    """A node present in both runs whose quantized status or role changed."""

    name: str
    op_type: str
    quantized: tuple[bool, bool]
    role: tuple[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "op_type": self.op_type, "quantized": list(self.quantized), "role": list(self.role)}


@dataclass(frozen=True)
class SqnrDelta:
    """The accumulated or local SQNR of one node in both runs (dB); ``delta = b - a``."""

    name: str
    kind: str
    a: float
    b: float
    delta: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "a": json_number(self.a, digits=None),
            "b": json_number(self.b, digits=None),
            "delta": json_number(self.delta, digits=None),
            "change": _change(self.a, self.b, True),
        }


@dataclass
class DocumentDiff:
    """Everything that differs between run ``a`` and run ``b``; ``lines()`` for the terminal, ``to_dict()`` for JSON.

    Attributes:
        a, b: labels of the two runs (their paths).
        grade: the model grade in a and b, and ``better``/``worse``/``same``.
        settings: changed settings as ``{key: (a, b)}``: INT8 format, recipe, run options, models.
        environment: changed versions as ``{key: (a, b)}`` (the date is ignored).
        outputs: per-output metric deltas (outputs present in both runs, every metric).
        outputs_only: output names present in only one run, ``{"a": [...], "b": [...]}``.
        status_changes: nodes whose quantized status or role changed.
        sqnr_changes: the ``top`` largest accumulated and local SQNR changes, largest first.
        nodes_only: node names present in only one run, ``{"a": [...], "b": [...]}``.
        exclude: the recommended ``nodes_to_exclude`` in a and b.
        top: how many status changes ``lines()`` prints (``to_dict()`` has them all).
    """

    a: str
    b: str
    grade: tuple[str, str, str]
    settings: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    environment: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    outputs: list[MetricDelta] = field(default_factory=list)
    outputs_only: dict[str, list[str]] = field(default_factory=dict)
    status_changes: list[NodeChange] = field(default_factory=list)
    sqnr_changes: dict[str, list[SqnrDelta]] = field(default_factory=dict)
    nodes_only: dict[str, list[str]] = field(default_factory=dict)
    exclude: tuple[list[str], list[str]] = ([], [])
    top: int = 10

    def output_changes(self, change: str) -> list[MetricDelta]:
        """The output metrics that moved in one direction, e.g. ``diff.output_changes("worse")``.

        Example:
            >>> d = DocumentDiff("a", "b", ("excellent", "excellent", "same"))
            >>> d.output_changes("worse")
            []
        """
        return [m for m in self.outputs if m.change == change]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a stable key order (non-finite numbers as ``"inf"``/``"nan"`` strings).

        Example:
            >>> DocumentDiff("a", "b", ("acceptable", "excellent", "better")).to_dict()["grade"]
            {'a': 'acceptable', 'b': 'excellent', 'change': 'better'}
        """
        return {
            "schema": "diag/diff",
            "schema_version": 1,
            "a": self.a,
            "b": self.b,
            "grade": {"a": self.grade[0], "b": self.grade[1], "change": self.grade[2]},
            "settings": {k: {"a": a, "b": b} for k, (a, b) in self.settings.items()},
            "environment": {k: {"a": a, "b": b} for k, (a, b) in self.environment.items()},
            "outputs": [m.to_dict() for m in self.outputs],
            "outputs_only": self.outputs_only,
            "status_changes": [c.to_dict() for c in self.status_changes],
            "sqnr_changes": {k: [d.to_dict() for d in v] for k, v in self.sqnr_changes.items()},
            "nodes_only": self.nodes_only,
            "nodes_to_exclude": {"a": self.exclude[0], "b": self.exclude[1]},
        }

    def lines(self) -> list[str]:
        """The terminal report: only what changed, then one summary line.

        Example:
            >>> DocumentDiff("a.json", "b.json", ("acceptable", "excellent", "better")).lines()[:2]
            ['a: a.json', 'b: b.json']
        """
        out = [f"a: {self.a}", f"b: {self.b}"]
        g_a, g_b, g_change = self.grade
        out.append(f"grade: {g_a} -> {g_b} ({g_change})")
        for key, (a, b) in self.settings.items():
            out.append(f"setting {key}: {a} -> {b}")
        for key, (a, b) in self.environment.items():
            out.append(f"environment {key}: {a} -> {b}")
        current = None
        for m in self.outputs:
            if m.output != current:
                current = m.output
                out.append(f"output {m.output}:")
            delta = "" if m.delta is None else f"{m.delta:+.4g}"
            out.append(f"  {m.metric:<15} {_fmt(m.a):>10} -> {_fmt(m.b):<10} {delta:>10}  {m.change}")
        for side in ("a", "b"):
            if self.outputs_only.get(side):
                out.append(f"outputs only in {side}: {', '.join(self.outputs_only[side])}")
        if self.status_changes:
            # NOTE: nodes leaving quantization first: after an exclusion that is what the user looks for.
            ranked = sorted(self.status_changes, key=lambda c: c.quantized != (True, False))
            out.append(f"nodes whose status changed (a -> b): {len(ranked)}")
            for c in ranked[: self.top]:
                parts = []
                if c.quantized[0] != c.quantized[1]:
                    parts.append("no longer quantized" if c.quantized[0] else "now quantized")
                if c.role[0] != c.role[1]:
                    parts.append(f"role {c.role[0]} -> {c.role[1]}")
                out.append(f"  {c.name} ({c.op_type}): {', '.join(parts)}")
            if len(ranked) > self.top:
                out.append(f"  ... and {len(ranked) - self.top} more (--top, or --json for all)")
        for kind, deltas in self.sqnr_changes.items():
            if deltas:
                out.append(f"largest {kind} SQNR changes (dB):")
                for d in deltas:
                    delta = f"{d.delta:+.1f}" if math.isfinite(d.delta) else f"{d.delta:+}"
                    out.append(
                        f"  {d.name}: {_fmt(d.a, '.1f')} -> {_fmt(d.b, '.1f')} ({delta}, {_change(d.a, d.b, True)})"
                    )
        for side in ("a", "b"):
            names = self.nodes_only.get(side, [])
            if names:
                shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                out.append(f"nodes only in {side} ({len(names)}): {shown}")
        if self.exclude[0] != self.exclude[1]:
            out.append(f"nodes_to_exclude: {self.exclude[0]} -> {self.exclude[1]}")
        better, worse = len(self.output_changes("better")), len(self.output_changes("worse"))
        moved = sum(1 for d in self.sqnr_changes.get("accumulated", []) if d.delta != 0)
        left = sum(c.quantized == (True, False) for c in self.status_changes)
        joined = sum(c.quantized == (False, True) for c in self.status_changes)
        roles = sum(c.role[0] != c.role[1] for c in self.status_changes)
        out.append(
            f"summary: grade {g_change}; {better} output metric(s) better, {worse} worse; "
            f"{left} node(s) no longer quantized, {joined} newly quantized, {roles} role change(s); "
            f"{sum(len(v) for v in self.nodes_only.values())} node(s) in one run only"
            + ("" if moved or better or worse else "; no metric moved")
        )
        return out


def _changed(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...] | None = None) -> dict[str, tuple[Any, Any]]:
    names = keys if keys is not None else tuple(dict.fromkeys([*a, *b]))
    return {k: (a.get(k), b.get(k)) for k in names if a.get(k) != b.get(k)}


def _sqnr_deltas(a_nodes: dict[str, Any], b_nodes: dict[str, Any], kind: str, top: int) -> list[SqnrDelta]:
    deltas: list[SqnrDelta] = []
    for name, na in a_nodes.items():
        nb = b_nodes.get(name)
        if nb is None or na[kind] is None or nb[kind] is None:
            continue
        va, vb = _value(na[kind]["sqnr_db"]), _value(nb[kind]["sqnr_db"])
        if va is None or vb is None or va == vb or math.isnan(va) or math.isnan(vb):
            continue
        deltas.append(SqnrDelta(name, kind, va, vb, vb - va))
    # NOTE: a node going from a finite SQNR to inf (identical, e.g. kept in float) is the largest change
    # there is; ties broken by name so the output is stable.
    deltas.sort(key=lambda d: (-abs(d.delta), d.name))
    return deltas[:top]


def diff_documents(
    a: dict[str, Any], b: dict[str, Any], top: int = 10, labels: tuple[str, str] = ("a", "b")
) -> DocumentDiff:
    """Compare two loaded ``diag.json`` documents (``diag.report.documents.read_document``): ``b`` relative to ``a``.

    Args:
        a: the baseline run.
        b: the new run.
        top: how many nodes to list per SQNR ranking (accumulated and local).
        labels: names of the runs in the output (their paths).

    Example:
        >>> from diag.report.documents import read_document
        >>> d = diff_documents(read_document("base/diag.json"), read_document("excl/diag.json"))  # doctest: +SKIP
        >>> [c.name for c in d.status_changes if c.quantized == (True, False)]  # doctest: +SKIP
        ['layer1/ffn/fc1/MatMul']
    """
    ga, gb = a["verdict"]["grade"], b["verdict"]["grade"]
    grade_change = "same" if ga == gb else ("better" if GRADES.index(gb) < GRADES.index(ga) else "worse")
    settings: dict[str, tuple[Any, Any]] = {}
    for side in ("fp32", "int8"):
        for k, v in _changed(a["models"][side], b["models"][side], ("path", "format")).items():
            settings[f"{side}.{k}"] = v
    if a.get("recipe") != b.get("recipe"):  # written by recipe-driven runs; absent otherwise
        settings["recipe"] = (a.get("recipe"), b.get("recipe"))
    for k, v in _changed(a["run"], b["run"], RUN_KEYS).items():
        settings[f"run.{k}"] = v
    env = {k: v for k, v in _changed(a["environment"], b["environment"]).items() if k not in VOLATILE_ENVIRONMENT}

    outs_a = {o["name"]: o for o in a["verdict"]["outputs"]}
    outs_b = {o["name"]: o for o in b["verdict"]["outputs"]}
    outputs: list[MetricDelta] = []
    for name, oa in outs_a.items():
        ob = outs_b.get(name)
        if ob is None:
            continue
        for metric, higher in OUTPUT_METRICS.items():
            va, vb = _value(oa.get(metric)), _value(ob.get(metric))
            if va is None and vb is None:
                continue
            outputs.append(MetricDelta(name, metric, va, vb, _delta(va, vb), _change(va, vb, higher)))

    nodes_a = {n["name"]: n for n in a["nodes"]}
    nodes_b = {n["name"]: n for n in b["nodes"]}
    status = [
        NodeChange(name, na["op_type"], (na["quantized"], nb["quantized"]), (na["role"], nb["role"]))
        for name, na in sorted(nodes_a.items(), key=lambda kv: kv[1]["index"])
        if (nb := nodes_b.get(name)) is not None and (na["quantized"], na["role"]) != (nb["quantized"], nb["role"])
    ]
    return DocumentDiff(
        a=labels[0],
        b=labels[1],
        grade=(ga, gb, grade_change),
        settings=settings,
        environment=env,
        outputs=outputs,
        outputs_only={"a": [n for n in outs_a if n not in outs_b], "b": [n for n in outs_b if n not in outs_a]},
        status_changes=status,
        sqnr_changes={kind: _sqnr_deltas(nodes_a, nodes_b, kind, top) for kind in ("accumulated", "local")},
        nodes_only={
            "a": sorted(n for n in nodes_a if n not in nodes_b),
            "b": sorted(n for n in nodes_b if n not in nodes_a),
        },
        exclude=(list(a["recommendation"]["nodes_to_exclude"]), list(b["recommendation"]["nodes_to_exclude"])),
        top=top,
    )


def diff_files(a_path: str | os.PathLike[str], b_path: str | os.PathLike[str], top: int = 10) -> DocumentDiff:
    """`diag diff` as one call: load both ``diag.json`` files (schema checked) and diff them.

    Example:
        >>> print("\\n".join(diff_files("a/diag.json", "b/diag.json").lines()))  # doctest: +SKIP
        a: a/diag.json
        ...
    """

    if top < 1:
        raise DiagError("bad-option", f"--top {top}", "must be at least 1", "e.g. --top 10")
    a, b = read_document(a_path), read_document(b_path)
    with fields_of(f"{a_path}' or '{b_path}"):
        return diff_documents(a, b, top, (str(a_path), str(b_path)))


@dataclass(frozen=True)
class DiffOptions:
    """``diag diff A B [--top N] [--json]``."""

    a: str
    b: str
    top: int = 10
    #: Machine-readable JSON instead of text lines.
    as_json: bool = False


def run_diff(options: DiffOptions) -> Summary:
    """`diag diff`: what changed from ``a`` to ``b``, as text lines or (``as_json``) indented JSON.

    Lives here, not in ``diag.cli.verbs``: it reads two JSON files and must not pay for importing onnx.
    """
    result = diff_files(options.a, options.b, top=options.top)
    if options.as_json:
        return Summary(json.dumps(result.to_dict(), indent=2).splitlines())
    return Summary(list(result.lines()))
