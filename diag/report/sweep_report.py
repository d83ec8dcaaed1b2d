"""``sweep.json`` -> typed view model -> ``sweep.html`` and ``sweep.md``.

Drawn from the document alone (like :mod:`diag.report.view` for ``diag.json``): every number is
formatted and every cut is made here; ``reports_templates/sweep.html.j2`` loops and prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.foundations.numfmt import byte_size, table_cell
from diag.report.plots_sweep import pareto_plot
from diag.report.view import md_code, md_escape, page_environment

#: sweep.md never exceeds this many lines (a PR comment).
MD_MAX_LINES = 60
#: Skipped recipes listed in sweep.md (sweep.html lists them all).
MD_SKIPPED = 5


@dataclass
class SweepRow:
    """One ranked recipe: its metrics, size and latency as table cells."""

    rank: str
    #: Position in the ranking (1-based): the sort key of the rank column, whose ties read "=2".
    order: int
    label: str
    cosine: str
    cosine_mean: str
    max_abs: str
    agreement: str
    accuracy_drop: str
    f1_drop: str
    size: str
    p50: str
    p50_range: str
    p99: str
    speedup: str
    speedup_range: str
    vs_fp32: str
    quantize_s: str
    pareto: bool
    best: bool
    #: The row's CSS classes: "best " and / or "front".
    row_class: str
    note: str


@dataclass
class SkippedRecipe:
    label: str
    reason: str


@dataclass
class FolkloreRow:
    claim: str
    verdict: str
    #: The verdict as a CSS class ("verdict-did-not-hold").
    verdict_class: str
    evidence: str


@dataclass
class SweepView:
    """Everything sweep.html and sweep.md print, already formatted."""

    title: str
    fp32: str
    fp32_size: str
    objective: str
    objective_help: str
    accuracy_axis: str
    target: str
    counts: str
    held_out: str
    calibration: str
    timing: str
    rows: list[SweepRow]
    skipped: list[SkippedRecipe]
    pareto: list[str]
    best: str
    best_recipe: str
    folklore: list[FolkloreRow]
    plot: str
    environment: str
    seconds: str


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return byte_size(n)


def sweep_view(doc: dict[str, Any]) -> SweepView:
    """View-model of ``sweep.json`` for the HTML and Markdown reports (every number formatted here).

    Example:
        >>> sweep_view(json.load(open("sweep.json"))).rows[0].rank  # doctest: +SKIP
        '1'
    """
    entries = {e["key"]: e for e in doc["entries"]}
    front = set(doc["pareto"])
    best = (doc.get("best") or {}).get("label")
    c = doc["counts"]
    return SweepView(
        title=f"diag sweep: {Path(doc['fp32']).name}",
        fp32=doc["fp32"],
        fp32_size=_size(doc["fp32_size"]),
        objective=doc["objective"],
        objective_help=doc["objective_help"],
        accuracy_axis=doc["accuracy_axis"],
        target=doc["target"] or "none",
        counts=f"{c['recipes']} recipe(s): {c['measured']} measured now, {c['resumed']} resumed from sweep.jsonl, "
        f"{c['skipped']} skipped, {c['identical']} byte-identical to another recipe",
        held_out=doc["split"]["held_out"],
        calibration=doc["calibration"] or "none (no static recipe)",
        timing=_timing(doc),
        rows=[
            _row(entries[r["key"]], r["rank"], i, entries, front, best) for i, r in enumerate(doc["ranking"], start=1)
        ],
        skipped=[SkippedRecipe(e["label"], e["reason"]) for e in doc["entries"] if e["status"] != "ok"],
        pareto=list(doc["pareto"]),
        best=best or "none",
        best_recipe=json.dumps(doc["best"]["recipe"], indent=2) if doc.get("best") else "",
        folklore=[
            FolkloreRow(f["claim"], f["verdict"], "verdict-" + f["verdict"].replace(" ", "-"), f["evidence"])
            for f in doc["folklore"]
        ],
        plot=pareto_plot(doc) if doc["entries"] else "",
        environment=", ".join(f"{k} {v}" for k, v in doc["environment"].items()),
        seconds=f"{doc['seconds']:.1f}",
    )


def _row(
    e: dict[str, Any], rank: str, order: int, entries: dict[str, dict[str, Any]], front: set[str], best: str | None
) -> SweepRow:
    m, lat = e["metrics"] or {}, e["latency"]
    on_front, is_best = e["label"] in front, e["label"] == best
    return SweepRow(
        rank=rank,
        order=order,
        label=e["label"],
        cosine=table_cell(m.get("cosine")),
        cosine_mean=table_cell(m.get("cosine_mean")),
        max_abs=table_cell(m.get("max_abs"), 4),
        agreement=table_cell(m.get("agreement"), 4),
        accuracy_drop=table_cell(m.get("accuracy_drop"), 4),
        f1_drop=table_cell(m.get("f1_drop"), 4),
        size=_size(e["size_bytes"]),
        p50="-" if not lat else f"{lat['p50_ms']:.3f}",
        p50_range="-" if not lat else f"{lat['p50_range_ms'][0]:.3f}-{lat['p50_range_ms'][1]:.3f}",
        p99="-" if not lat else f"{lat['p99_ms']:.3f}",
        speedup="-" if not lat else f"{lat['speedup']:.2f}x",
        speedup_range="-" if not lat else f"{lat['speedup_range'][0]:.2f}-{lat['speedup_range'][1]:.2f}",
        vs_fp32="-" if not lat else lat["vs_fp32"],
        quantize_s=table_cell(e["quantize_s"], 2),
        pareto=on_front,
        best=is_best,
        row_class=("best " if is_best else "") + ("front" if on_front else ""),
        note=_note(e, entries),
    )


def _timing(doc: dict[str, Any]) -> str:
    """How latency was measured, in one sentence (or that it was not)."""
    s = doc["settings"]
    if not s["runs"]:
        return "latency not measured (--runs 0)"
    timing = (
        f"latency: {s['repeats']} repeat(s) x {s['runs']} timed runs after {s['warmup']} warm-up, FP32 and INT8 "
        f"interleaved, intra_op_num_threads={s['threads']}, optimization level all; speedup = FP32 p50 / INT8 p50, "
        f"median over repeats (range = min-max over repeats); differences whose ranges overlap or that are under "
        f"{s['noise_band']:.0%} are 'no measurable difference'"
    )
    where = (doc.get("cluster") or {}).get("latency_measured_on")
    if where:
        timing += f"; measured on {where}, one recipe at a time after the Dask tasks computed the metrics"
    return timing


def _note(e: dict[str, Any], entries: dict[str, dict[str, Any]]) -> str:
    notes = []
    if e["identical_to"]:
        notes.append(f"same model as {entries[e['identical_to']]['label'] if e['identical_to'] in entries else '?'}")
    notes += [a for a in e["actions"] if a.startswith(("upgraded", "warning", "note"))]
    return "; ".join(notes)


def render_html(view: SweepView) -> str:
    """``sweep.html``: one self-contained file (CSS, SVG inline; CSP forbids network), autoescaped."""
    return str(page_environment().get_template("sweep.html.j2").render(v=view))


def render_markdown(view: SweepView) -> str:
    """``sweep.md``: at most :data:`MD_MAX_LINES` lines; the table is cut first (sweep.html has every row).

    Example:
        >>> len(render_markdown(view).splitlines()) <= 60  # doctest: +SKIP
        True
    """
    head = [
        f"## {md_escape(view.title)}",
        "",
        f"{view.counts}. Objective: **{view.objective}** ({md_escape(view.objective_help)}); "
        f"target: {md_escape(view.target)}. Metrics on held-out {view.held_out}; calibration: "
        f"{md_escape(view.calibration)}.",
        "",
        f"**Best:** {md_code(view.best)}" + (" (written to `best.recipe.json`)" if view.best_recipe else ""),
        f"**Pareto front** ({view.accuracy_axis} vs latency): "
        + (", ".join(md_code(p) for p in view.pareto) or "none"),
        "",
    ]
    folk = ["### Folklore, measured", ""] + [
        f"- {md_escape(c.claim)}: **{c.verdict}** - {md_escape(c.evidence)}" for c in view.folklore
    ]
    skipped = (
        ["", "### Skipped", ""] + [f"- {md_code(s.label)}: {md_escape(s.reason)}" for s in view.skipped[:MD_SKIPPED]]
        if view.skipped
        else []
    )
    if len(view.skipped) > MD_SKIPPED:
        skipped.append(f"- ... and {len(view.skipped) - MD_SKIPPED} more (sweep.html)")
    tail = ["", md_escape(view.timing) + "."]
    room = MD_MAX_LINES - len(head) - len(folk) - len(skipped) - len(tail) - 2 - 2  # table head, blank, cut line
    lines = head + _md_table(view.rows, room) + [""] + folk + skipped + tail
    return "\n".join(lines[:MD_MAX_LINES]) + "\n"


def _md_table(rows: list[SweepRow], room: int) -> list[str]:
    """The recipe table in at most ``room`` rows (plus its head), with a line saying how many were cut."""
    shown = rows[: max(room, 1)] if len(rows) > room else rows
    if len(shown) < len(rows):
        shown = rows[: max(room - 1, 1)]
    # With --labels, the task figures (issue 45: the F1 drop was computed and shown nowhere but sweep.html).
    labelled = any(r.f1_drop != "-" or r.accuracy_drop != "-" for r in rows)
    head, rule = ("| accuracy drop | F1 drop ", "|---|---") if labelled else ("", "")
    table = [
        f"| rank | recipe | cosine | max abs {head}| size | p50 ms (range) | speedup (range) | vs FP32 |",
        f"|---|---|---|---{rule}|---|---|---|---|",
    ] + [
        f"| {r.rank} | {md_code(r.label)}{' (best)' if r.best else ''}{' (front)' if r.pareto else ''} "
        f"| {r.cosine} | {r.max_abs} "
        + (f"| {r.accuracy_drop} | {r.f1_drop} " if labelled else "")
        + f"| {r.size} | {r.p50} ({r.p50_range}) | {r.speedup} ({r.speedup_range}) | {r.vs_fp32} |"
        for r in shown
    ]
    if len(shown) < len(rows):
        table.append(f"_{len(rows) - len(shown)} more row(s) in sweep.html_")
    return table
