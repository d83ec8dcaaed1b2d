"""The `diag sweep` Pareto plot (accuracy vs speedup) as an inline SVG, drawn from ``sweep.json`` alone.

Kept apart from :mod:`diag.report.plots` like :mod:`diag.report.plots_exclude`: it reads only the JSON document,
so the report can be re-rendered later without the models.
"""

from __future__ import annotations

import math
from typing import Any

from diag.foundations.jsonnum import number_from_json as _num
from diag.report.plots import figure_svg, pyplot

#: marker colour per quantization format
FORMAT_COLOURS = {"dynamic": "#2471a3", "QDQ": "#d35400", "QOperator": "#8e44ad"}


def pareto_plot(doc: dict[str, Any]) -> str:
    """Speedup over FP32 (x, with the min-max over repeats as a bar) vs the accuracy axis (y).

    Reading it: one dot per measured recipe, coloured by format; the Pareto front is joined by a
    line and numbered as in the report's list; the star is the best recipe; the dashed vertical
    line is FP32 speed (1x). Two dots whose horizontal bars overlap are not measurably different
    in speed; a log scale is used when speedups span more than 4x. Without latency (``--runs 0``)
    every dot sits at x = 1. Returns an ``<svg>`` string.

    Example:
        >>> svg = pareto_plot(json.load(open("sweep.json")))  # doctest: +SKIP
        >>> svg.startswith("<svg")  # doctest: +SKIP
        True
    """
    plt = pyplot()
    axis = doc["accuracy_axis"]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
    ok = [e for e in doc["entries"] if e["status"] == "ok"]

    def xy(e: dict[str, Any]) -> tuple[float, float, float, float]:
        lat = e["latency"]
        y = _num((e["metrics"] or {}).get(axis))
        if not lat:
            return 1.0, y, 1.0, 1.0
        lo, hi = (_num(v) for v in lat["speedup_range"])
        return _num(lat["speedup"]), y, lo, hi

    for fmt, colour in FORMAT_COLOURS.items():
        pts = [e for e in ok if (e["recipe"].get("mode") == "dynamic") == (fmt == "dynamic")]
        pts = [e for e in pts if fmt == "dynamic" or e["recipe"].get("quant_format", "QDQ") == fmt]
        if not pts:
            continue
        vals = [xy(e) for e in pts]
        ax.errorbar(
            [v[0] for v in vals],
            [v[1] for v in vals],
            xerr=[[v[0] - v[2] for v in vals], [v[3] - v[0] for v in vals]],
            fmt="o",
            ms=4,
            color=colour,
            ecolor=colour,
            elinewidth=0.8,
            alpha=0.8,
            label=fmt,
            zorder=3,
        )
    by_label = {e["label"]: e for e in ok}
    front = [by_label[name] for name in doc["pareto"] if name in by_label]
    if front:
        pts = sorted(xy(e)[:2] for e in front)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="#27ae60", lw=1.2, zorder=2, label="Pareto front")
        for i, e in enumerate(front, 1):  # numbered as in the report's list: long labels would overlap
            x, y = xy(e)[:2]
            ax.annotate(str(i), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points", color="#333")
    best = (doc.get("best") or {}).get("label")
    if best in by_label:
        x, y = xy(by_label[best])[:2]
        ax.scatter([x], [y], marker="*", s=180, color="#27ae60", zorder=4, label="best")
    ax.axvline(1.0, color="#7f8c8d", ls="--", lw=0.9, label="FP32 speed")
    xs = [xy(e)[0] for e in ok if math.isfinite(xy(e)[0]) and xy(e)[0] > 0]
    if xs and max(xs) / min(xs) > 4:  # e.g. dynamic ConvInteger at 0.06x next to 1.1x static models
        ax.set_xscale("log")
    ax.set_xlabel("speedup over FP32 (p50; bar = min-max over repeats)")
    ax.set_ylabel(f"{axis} (held-out)")
    ax.set_title(f"{len(ok)} measured recipes, {len(front)} on the Pareto front", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return figure_svg(fig)
