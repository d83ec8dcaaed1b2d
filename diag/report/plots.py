"""matplotlib figures rendered to inline SVG strings (Agg backend, imported lazily).

Plots are drawn from the JSON document only, so ``diag report`` can redraw them later.
"""

from __future__ import annotations

import io
import math
import re
from typing import Any

import networkx as nx

from diag.analysis.analyze import shortened_path
from diag.core.distributions import BINS, Pow2Histogram


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, set up for small, stable inline SVG."""
    import matplotlib

    matplotlib.use("Agg")
    # Text stays text in the SVG (the browser's fonts draw it): files are several times smaller
    # and faster to write than with every glyph as a path.
    matplotlib.rcParams["svg.fonttype"] = "none"
    matplotlib.rcParams["svg.hashsalt"] = "diag"  # stable ids: the same plot gives the same bytes
    # Node names come from untrusted models: "$...$" in one must stay text, not become mathtext
    # (an invalid formula made matplotlib raise and the whole report fail).
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def figure_svg(fig: Any) -> str:
    """``fig`` as an inline ``<svg>`` element (closed after), safe to embed in a report."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    pyplot().close(fig)
    text = buf.getvalue()
    # Drop the XML prolog/doctype so the SVG can be inlined in HTML; metadata carries a date.
    start = text.find("<svg")
    text = text[start:]
    # Node names come from untrusted models and matplotlib copies control characters verbatim.
    text = re.sub("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", "", text)
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
    plt = pyplot()
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
    return figure_svg(fig)


def per_layer(decoder: dict[str, Any], bad_db: float) -> str:
    """Per decoder layer: the worst local SQNR of its quantized nodes (dots) and the accumulated
    SQNR after it (line) — the picture LLM users draw by hand to find the layer that breaks.

    Reading it: a dot far under the others is the layer that adds the error; a line that steps
    down there and stays down is that error carried to the output by the residual stream.
    """
    plt = pyplot()
    layers = decoder["layers"]
    xs = [r["index"] for r in layers]
    acc = [_clip_db(r["accumulated_sqnr_db"]) for r in layers]
    loc = [_clip_db(r["worst_local_sqnr_db"]) if r["worst_local_sqnr_db"] is not None else math.nan for r in layers]
    fig, ax = plt.subplots(figsize=(9, 3.0), dpi=80)
    ax.plot(xs, acc, color="#c0392b", lw=1.4, marker="o", ms=3, label="accumulated SQNR after the layer")
    ax.scatter(xs, loc, s=18, color="#2471a3", label="worst local SQNR in the layer", zorder=3)
    ax.axhline(bad_db, color="#7f8c8d", ls="--", lw=0.8, label=f"bad below {bad_db:g} dB")
    finite = [(v, x) for v, x in zip(loc, xs, strict=True) if not math.isnan(v)]
    if finite:
        v, x = min(finite)
        worst = next(r for r in layers if r["index"] == x)
        ax.annotate(
            str(worst["worst_local_node"] or "")[-40:],
            (x, v),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=7,
            color="#2471a3",
        )
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("SQNR dB (capped at 80)")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    return figure_svg(fig)


def _display_bins(state: dict[str, Any], lo: int, hi: int, target: int = 300) -> tuple[list[float], list[float]]:
    """Rebin a stored histogram's bins [lo, hi) to at most ``target`` bins, as shares of its values.

    Shares, not counts: the FP32 and INT8 histograms are built from subsamples of different
    sizes (see ``diag.core.distributions.DISPLAY_SAMPLE_MAX``), so only shares overlay.
    """

    limit = math.ldexp(1.0, state["exponent"])
    width = 2 * limit / BINS
    counts = [0] * (hi - lo)
    for i, c in enumerate(state["counts"]):
        j = state["first"] + i - lo
        if 0 <= j < len(counts):
            counts[j] += c
    step = max(1, math.ceil(len(counts) / target))
    total = max(1, sum(state["counts"]))
    xs, ys = [], []
    for k in range(0, len(counts), step):
        xs.append(-limit + (lo + k) * width)
        ys.append(sum(counts[k : k + step]) / total)
    xs.append(-limit + (lo + len(counts)) * width)
    return xs, ys


def distribution(name: str, plotted: dict[str, Any], health: dict[str, Any]) -> str:
    """FP32 vs INT8 histogram (log y) with the quantization grid's representable range marked.

    Values outside the shaded band are clipped by a static grid; a tall FP32 spike inside a few
    INT8 levels means the grid is too coarse where the data lives.
    """
    plt = pyplot()
    fp, q = plotted["fp32"], plotted["int8"]
    exponent = max(e for e in (fp["exponent"], q["exponent"]) if e is not None)

    hists = []
    for st in (fp, q):
        h = Pow2Histogram.from_state(st)
        h._grow_to(exponent)
        hists.append(h.to_state())
    used = [i for st in hists for i in (st["first"], st["first"] + len(st["counts"])) if st["counts"]]
    lo, hi = (min(used), max(used)) if used else (0, 1)
    fig, ax = plt.subplots(figsize=(5.2, 2.6), dpi=80)
    for st, label, color in ((hists[0], "FP32", "#2471a3"), (hists[1], "INT8 (dequantized)", "#e67e22")):
        if not st["counts"]:
            continue
        xs, ys = _display_bins(st, lo, hi)
        ax.stairs(ys, xs, label=label, color=color, lw=1.1)
    grid_range = health.get("grid_range")
    if grid_range and all(isinstance(v, float) for v in grid_range):
        low, high = grid_range
        ax.axvspan(low, high, color="#27ae60", alpha=0.08, label="representable range")
        ax.axvline(low, color="#27ae60", lw=0.8)
        ax.axvline(high, color="#27ae60", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("share of values", fontsize=7)
    ax.set_title(name[:60], fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper right")
    ax.grid(alpha=0.25)
    return figure_svg(fig)


def channel_ranges(name: str, channel_max: list[float], outliers: list[int], factor: float) -> str:
    """Per-channel max |x| with outlier channels in red and the flagging threshold dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 2.6), dpi=80)
    xs = list(range(len(channel_max)))
    bad = set(outliers)
    med = sorted(channel_max)[len(channel_max) // 2] if channel_max else 0.0
    if len(channel_max) <= 256:
        colors = ["#c0392b" if i in bad else "#5d6d7e" for i in xs]
        ax.bar(xs, channel_max, color=colors, width=0.9)
    else:
        ax.plot(xs, channel_max, color="#5d6d7e", lw=0.6)
        ax.scatter(sorted(bad), [channel_max[i] for i in sorted(bad)], color="#c0392b", s=10, zorder=3)
    for i in sorted(bad)[:8]:
        ax.annotate(str(i), (i, channel_max[i]), textcoords="offset points", xytext=(0, 2), fontsize=7, color="#c0392b")
    if med > 0:
        ax.axhline(med * factor, color="#c0392b", ls="--", lw=0.8, label=f"{factor:g}x median channel")
        ax.legend(fontsize=6, loc="upper right")
    ax.set_title(f"{name[:50]}: max |x| per channel", fontsize=8)
    ax.set_xlabel("channel / hidden dim", fontsize=7)
    ax.tick_params(labelsize=7)
    return figure_svg(fig)


#: How many edges around a root cause its neighbourhood plot reaches.
NEIGHBOURHOOD_HOPS = 2


def neighbourhood(nodes: list[dict[str, Any]], center: str, bad_db: float, hops: int = NEIGHBOURHOOD_HOPS) -> str:
    """The graph around one root cause: nodes within ``hops`` edges, left to right in graph order,
    coloured by accumulated SQNR (red = bad), the root cause outlined.

    Edges come from the document alone (a node's ``inputs`` are other nodes' ``tensor``), so
    ``diag report`` can redraw it.
    """

    plt = pyplot()
    by_name = {n["name"]: n for n in nodes}
    producer = {n["tensor"]: n["name"] for n in nodes}
    g = nx.DiGraph()
    for node in nodes:
        g.add_node(node["name"])
        for t in node.get("inputs", []):
            if t in producer and producer[t] != node["name"]:
                g.add_edge(producer[t], node["name"])
    if center not in g:
        return ""
    keep = set(nx.single_source_shortest_path_length(g.to_undirected(as_view=True), center, cutoff=hops))
    sub = g.subgraph(keep)
    order = sorted(keep, key=lambda name: by_name[name]["index"])
    depth = {name: i for i, name in enumerate(order)}
    layers: dict[int, list[str]] = {}
    for name in order:
        layer = max((depth[p] for p in sub.predecessors(name)), default=-1) + 1
        depth[name] = layer
        layers.setdefault(layer, []).append(name)
    pos = {name: (x, -i + (len(col) - 1) / 2) for x, col in layers.items() for i, name in enumerate(col)}
    tallest = max(len(col) for col in layers.values())
    fig, ax = plt.subplots(figsize=(min(9.0, 1.6 + 1.3 * len(layers)), 0.9 + 0.55 * tallest), dpi=80)
    cmap = plt.get_cmap("RdYlGn")
    colors = [cmap(min(1.0, max(0.0, _clip_db(by_name[n]["accumulated"]["sqnr_db"], 60.0) / 60.0))) for n in sub]
    nx.draw_networkx_edges(sub, pos, ax=ax, arrows=True, arrowsize=8, edge_color="#999", node_size=500)
    nx.draw_networkx_nodes(
        sub,
        pos,
        ax=ax,
        node_color=colors,
        node_size=500,
        edgecolors=["#000" if n == center else "#fff" for n in sub],
        linewidths=[2.5 if n == center else 0.5 for n in sub],
    )
    labels = {n: (n if len(n) <= 22 else "…" + n[-21:]) for n in sub}
    for n, (x, y) in pos.items():
        ax.annotate(labels[n], (x, y), textcoords="offset points", xytext=(0, -16), ha="center", fontsize=6)
        sqnr = by_name[n]["accumulated"]["sqnr_db"]
        ax.annotate(_db_text(sqnr), (x, y), ha="center", va="center", fontsize=6)
    ax.set_title(f"around {center[:60]} (accumulated SQNR dB; red below {bad_db:g})", fontsize=8)
    ax.axis("off")
    ax.margins(0.15)
    return figure_svg(fig)


def _db_text(v: float | str | None) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return "∞" if v == "inf" else v
    return f"{v:.0f}"


#: Accumulated-SQNR colours of the error-path picture, worst first (upper bound in dB, colour).
PATH_COLOURS = ((10.0, "#e74c3c"), (20.0, "#f39c12"), (30.0, "#f7dc6f"), (math.inf, "#abebc6"))


def _path_colour(db: float) -> str:
    return next(colour for bound, colour in PATH_COLOURS if db <= bound)


def error_path_picture(doc: dict[str, Any]) -> str:
    """The worst output's error path as a row of boxes, each node with its accumulated SQNR and
    coloured by it, the output last: the picture summary.md shows (an SVG file beside it: GitHub
    and GitLab render a linked image, not inline SVG). "" when no output has a path.

    A long path keeps its first and last two nodes (:func:`diag.analysis.analyze.shortened_path`):
    boxes, not a line of text, so fewer than the terminal's sentence keeps.
    """
    outputs = [o for o in doc["verdict"]["outputs"] if o.get("error_path")]
    if not outputs:
        return ""
    worst = min(outputs, key=lambda o: _clip_db(o.get("sqnr_db")))
    by_name = {n["name"]: n for n in doc["nodes"]}
    steps = shortened_path(list(worst["error_path"]), 2, 6, "... {} more ...")
    boxes = []
    for label in steps:
        node = by_name.get(label)
        db = _clip_db(node["accumulated"]["sqnr_db"]) if node and node.get("accumulated") else None
        boxes.append((label, db))
    boxes.append((f"output {worst['name']}", _clip_db(worst.get("sqnr_db"))))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(min(1.55 * len(boxes), 13), 1.1), dpi=80)
    for i, (label, db) in enumerate(boxes):
        shown = label if len(label) <= 24 else "..." + label[-21:]
        text = shown if db is None else f"{shown}\n{db:.1f} dB"
        face = "#eaeded" if db is None else _path_colour(db)
        ax.text(
            i, 0, text, ha="center", va="center", fontsize=7, bbox={"boxstyle": "round", "fc": face, "ec": "#7f8c8d"}
        )
        if i:
            ax.annotate("", (i - 0.42, 0), (i - 0.58, 0), arrowprops={"arrowstyle": "->", "color": "#7f8c8d"})
    ax.set_xlim(-0.6, len(boxes) - 0.4)
    ax.set_ylim(-0.6, 0.6)
    ax.axis("off")
    return figure_svg(fig)
