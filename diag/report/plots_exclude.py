"""The `diag exclude` search trajectory as an inline SVG, drawn from ``exclusion.json`` alone.

Kept apart from :mod:`diag.report.plots` so the report section can be added without touching the
compare plots; like them it reads only the JSON document, so a report can be re-rendered later.
"""

from __future__ import annotations

from typing import Any

from diag.foundations.jsonnum import number_from_json as _metric
from diag.report.plots import figure_svg, pyplot

#: marker colour per search phase (op-type checks share one colour)
PHASE_COLOURS = {
    "estimate": "#d5dbdb",  # no re-quantization: the float-region estimate of the baseline
    "baseline": "#7f8c8d",
    "search": "#2471a3",
    "verify": "#148f77",
    "prune": "#d35400",
    "op-type": "#8e44ad",
}


def trajectory_plot(doc: dict[str, Any]) -> str:
    """Excluded groups (x) vs the target metric on held-out samples (y), one dot per trial.

    Reading it: light grey dots are estimates (float regions of the baseline, no
    re-quantization), the green dot their answer re-quantized, blue dots a prefix search by
    re-quantization, orange the pruning tries (a dot under the target line is a node that had
    to stay in float), the dashed line the target, the star the returned list. Re-quantized
    trials are numbered in order. Returns an ``<svg>`` string.

    Example:
        >>> svg = trajectory_plot(json.load(open("exclusion.json")))  # doctest: +SKIP
        >>> svg.startswith("<svg")  # doctest: +SKIP
        True
    """
    plt = pyplot()
    steps = doc["search"]["trajectory"]
    metric, _, threshold = _split_target(doc["target"])
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    for phase, colour in PHASE_COLOURS.items():
        pts = [s for s in steps if s["phase"].split(" ")[0] == phase]
        if pts:
            ax.scatter(
                [s["excluded_groups"] for s in pts],
                [_metric(s["metric"]) for s in pts],
                s=22,
                color=colour,
                label=phase,
                zorder=3,
            )
    real = [s for s in steps if not s["phase"].startswith("estimate")]
    for i, s in enumerate(real):
        ax.annotate(
            str(i),
            (s["excluded_groups"], _metric(s["metric"])),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
            color="#555",
        )
    ax.axhline(threshold, color="#c0392b", ls="--", lw=0.9, label=f"target {doc['target']}")
    after = (doc["metrics"].get("after") or {}).get(metric)
    if doc.get("reachable") and after is not None:
        ax.scatter(
            [len(doc["excluded"])],
            [_metric(after)],
            marker="*",
            s=160,
            color="#27ae60",
            zorder=4,
            label="returned list",
        )
    ax.set_xlabel("node groups kept in float")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{metric} (held-out)")
    ax.set_title(f"{doc['search']['quantizations']} re-quantizations, verdict: {doc['verdict']}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return figure_svg(fig)


def _split_target(text: str) -> tuple[str, str, float]:
    op = ">=" if ">=" in text else "<="
    metric, _, value = text.partition(op)
    return metric, op, float(value)
