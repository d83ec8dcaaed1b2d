"""The model's graph in report.html: the data its drawing reads, from a diag.json document.

A reviewer should *see* where the error enters and how it travels. The report draws the FP32
graph, one box per node finding (a fused group is one box), coloured by local SQNR, accumulated
SQNR or measured effect, with the root causes and victims marked, the error path highlighted and
the nodes a verified fix keeps in float outlined. The drawing is laid out in the browser by dagre
(``reports_templates/dagre.min.js``, MIT, inlined: the report stays one file that opens offline).

NOTE: why dagre. The layout must be layered (data flows one way), minimise crossings and stay fast
on a collapsed 500M decoder; dagre is the maintained Sugiyama implementation behind most graph
viewers (50 KB minified, no dependency), while networkx has no layered layout with crossing
reduction and grandalf, the Python one, is GPL. Laying out in the page also keeps diag.json free
of coordinates that would change with every drawing.

Repeated blocks (transformer layers, read off node names: :func:`diag.analysis.decoder.layer_of`)
start collapsed into one box each when the graph has more than :data:`COLLAPSE_ABOVE` findings; a
click expands one. Every drawn box carries its FP32 node names in ``data-node`` attributes (the
members of a group or of a collapsed block as child elements), so tests and users' scripts can
address a node. Names are set as text and attributes by the page script, never parsed as HTML.
"""

from __future__ import annotations

import json
import math
from typing import Any

from diag.analysis.decoder import layer_of

#: The layout library's file in ``reports_templates/`` (dagre 3.1.4, its MIT licence at the top).
GRAPH_LIBRARY = "dagre.min.js"
#: Findings above which repeated blocks start collapsed.
COLLAPSE_ABOVE = 120
#: A non-finite SQNR (no error at all) is drawn as this many dB: the best colour.
NO_ERROR_DB = 999.0
#: INT8 nodes listed per box in the detail panel.
INT8_SHOWN = 8


def _db(stats: dict[str, Any] | None) -> float | None:
    value = (stats or {}).get("sqnr_db")
    if isinstance(value, str) and value == "inf":
        return NO_ERROR_DB
    if isinstance(value, (int, float)) and math.isfinite(value):
        return round(float(value), 2)
    return None


def graph_data(doc: dict[str, Any]) -> dict[str, Any] | None:
    """What the report's graph script draws: boxes, edges, blocks and marks (None without nodes).

    Example:
        >>> doc = {"nodes": [
        ...     {"name": "a", "fp_nodes": ["a"], "op_type": "Conv", "tensor": "ta", "inputs": [], "role": "root-cause",
        ...      "quantized": True, "local": {"sqnr_db": 7.5}, "accumulated": {"sqnr_db": 7.0}, "int8_nodes": ["a_q"]},
        ...     {"name": "b", "fp_nodes": ["b"], "op_type": "Relu", "tensor": "tb", "inputs": ["ta"], "role": "victim",
        ...      "quantized": False, "local": None, "accumulated": {"sqnr_db": 6.0}, "int8_nodes": []}],
        ...     "verdict": {"outputs": [{"error_path": ["a", "b"]}]}}
        >>> g = graph_data(doc)
        >>> g["edges"], [u["path"] for u in g["units"]], g["units"][0]["local"]
        ([[0, 1]], [True, True], 7.5)
    """
    nodes = doc.get("nodes") or []
    if not nodes:
        return None
    writer = {n["tensor"]: i for i, n in enumerate(nodes) if n.get("tensor")}
    effects = {
        tuple(e["fp_nodes"]): e.get("recovered")
        for e in (doc.get("effects") or {}).get("effects") or []
        if isinstance(e.get("fp_nodes"), list)
    }
    on_path = {p for o in (doc.get("verdict") or {}).get("outputs") or [] for p in o.get("error_path") or []}
    kept = set((doc.get("exclusion") or {}).get("nodes_to_exclude") or [])
    layers = {  # a stack's layer, from the module path torch recorded, else from the node's name
        i: layer_of(n.get("module") or n["fp_nodes"][0]) if n.get("fp_nodes") else None for i, n in enumerate(nodes)
    }
    blocks = {w[0] for w in layers.values() if w is not None}
    health = (doc.get("distributions") or {}).get("tensors") or {}
    plotted = set((doc.get("distributions") or {}).get("plotted") or {})
    units = []
    for i, n in enumerate(nodes):
        effect = effects.get(tuple(n.get("fp_nodes") or ()))
        where = layers[i] if len(blocks) >= 2 else None
        units.append(
            {
                "name": n["name"],
                "members": list(n.get("fp_nodes") or []),
                "op": n.get("op_type") or "",
                "role": n.get("role") or "",
                "q": bool(n.get("quantized")),
                "local": _db(n.get("local")),
                "acc": _db(n.get("accumulated")),
                "effect": round(100 * float(effect), 1)
                if isinstance(effect, (int, float)) and math.isfinite(effect)
                else None,
                "path": n["name"] in on_path,
                "kept": any(m in kept for m in n.get("fp_nodes") or ()),
                "block": f"layer {where[0]}" if where is not None else None,
                "int8": list(n.get("int8_nodes") or [])[:INT8_SHOWN],
                "health": _health(health.get(n.get("tensor") or ""), n.get("tensor") in plotted),
            }
        )
    edges = sorted(
        {(writer[t], i) for i, n in enumerate(nodes) for t in n.get("inputs") or [] if t in writer and writer[t] != i}
    )
    return {
        "units": units,
        "edges": [list(e) for e in edges],
        "collapsed": len(nodes) > COLLAPSE_ABOVE and len(blocks) >= 2,
        "bad_db": (doc.get("thresholds") or {}).get("bad_sqnr_db", 20),
    }


def _health(h: dict[str, Any] | None, plotted: bool) -> dict[str, Any] | None:
    """The output tensor's quantization health, as the detail panel shows it (None: not measured)."""
    if not h or h.get("grid") in (None, "none"):  # a float tensor: no grid to be healthy on
        return None
    bits, grid = h.get("effective_bits"), h.get("grid_bits")
    return {
        "bits": round(float(bits), 1) if isinstance(bits, (int, float)) and math.isfinite(bits) else None,
        "grid_bits": grid if isinstance(grid, (int, float)) else None,
        "clipped": round(100 * float(h.get("clip_fraction") or 0.0), 3),
        "outliers": [int(o["index"]) for o in h.get("outliers") or [] if isinstance(o, dict) and "index" in o][:4],
        "reasons": [str(r) for r in h.get("reasons") or []][:3],
        "plotted": plotted,
        "hist": _histogram(h.get("histogram"), h.get("grid_range")),
    }


def _histogram(hist: dict[str, Any] | None, grid_range: list[Any] | None) -> dict[str, Any] | None:
    """The output's FP32 and INT8 bars and the grid's range, for the panel's picture (None: no bars)."""
    if not isinstance(hist, dict) or not hist.get("fp32"):
        return None
    bounds = [hist.get("lo"), hist.get("hi")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in bounds):
        return None
    lo, hi = (float(v) for v in bounds)  # type: ignore[arg-type]
    if hi <= lo:
        return None
    grid = [float(v) for v in grid_range or [] if isinstance(v, (int, float)) and math.isfinite(v)]
    return {
        "lo": lo,
        "hi": hi,
        "fp": [int(v) for v in hist["fp32"]],
        "q": [int(v) for v in hist.get("int8") or []],
        "grid": grid if len(grid) == 2 else None,
    }


def graph_json(doc: dict[str, Any]) -> str:
    """:func:`graph_data` as JSON safe inside a ``<script type="application/json">`` element ("" without nodes).

    ``<``, ``>`` and ``&`` are written as JSON unicode escapes, so no node name can close the script
    element or open a comment; the page reads the text back with ``JSON.parse``.
    """
    data = graph_data(doc)
    if data is None:
        return ""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.translate({ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"})
