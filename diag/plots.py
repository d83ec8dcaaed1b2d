"""matplotlib figures rendered to inline SVG strings (Agg backend, imported lazily).

Plots are drawn from the JSON document only, so ``diag report`` can redraw them later.
"""

from __future__ import annotations

import io
import math
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    _pyplot().close(fig)
    text = buf.getvalue()
    # Drop the XML prolog/doctype so the SVG can be inlined in HTML; metadata carries a date.
    start = text.find("<svg")
    text = text[start:]
    return _strip_metadata(text)


def _strip_metadata(svg: str) -> str:
    a = svg.find("<metadata>")
    b = svg.find("</metadata>")
    if a != -1 and b != -1:
        svg = svg[:a] + svg[b + len("</metadata>") :]
    return svg


def _clip_db(v: float | str | None, cap: float = 80.0) -> float:
    if v is None or isinstance(v, str):
        return cap if v in ("inf", None) else -10.0
    return max(-10.0, min(cap, float(v)))


def error_along_graph(nodes: list[dict[str, Any]], bad_db: float) -> str:
    """SQNR of every node in topological order: accumulated (line) vs local (dots).

    Reading it: where the accumulated line drops and the local dot sits on it, the node is a
    root cause; where the line is low but the dot is high, the node inherits the error.
    """
    plt = _pyplot()
    ordered = sorted(nodes, key=lambda n: n["index"])
    xs = list(range(len(ordered)))
    acc = [_clip_db(n["accumulated"]["sqnr_db"]) for n in ordered]
    loc = [_clip_db(n["local"]["sqnr_db"]) if n.get("local") else math.nan for n in ordered]
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=80)
    ax.plot(xs, acc, color="#c0392b", lw=1.4, label="accumulated SQNR (real INT8 model)")
    ax.scatter(xs, loc, s=10, color="#2471a3", label="local SQNR (node fed FP32 inputs)", zorder=3)
    ax.axhline(bad_db, color="#7f8c8d", ls="--", lw=0.8, label=f"bad below {bad_db:g} dB")
    roots = [i for i, n in enumerate(ordered) if n["role"] == "root-cause"]
    for i in roots[:5]:
        ax.annotate(
            ordered[i]["name"][:28],
            (i, acc[i]),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=7,
            color="#c0392b",
        )
    ax.set_xlabel("node (topological order)")
    ax.set_ylabel("SQNR dB (capped at 80)")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    return _svg(fig)
