"""Model Explorer node data: diag's per-node figures as overlays on Google's Model Explorer graph.

People who debug quantized models look at graphs. Model Explorer (``pip install
ai-edge-model-explorer model-explorer-onnx``) draws an ONNX model and colours its nodes from
"node data" JSON files; nothing writes such files for ONNX quantization. Every diag.json (compare,
and the diagnosis of exclude) gets its overlays beside it, one file per figure, in the format its
``node_data_builder.GraphNodeData`` writes (``{"name", "results": {node id: {"value"}},
"thresholds"}``): a file of that shape applies to the graph on screen.

Nodes are keyed by their FP32 node names, which are the node ids of the ONNX adapter
(``model_explorer_onnx``: ``GraphNode(id=onnx_node.name)``); a fused group gives every node in it
the group's figure. Unnamed nodes (the adapter names them itself) and figures that are not finite
are left out, and the count is said.
"""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

#: File name -> (the overlay's name in Model Explorer, what it reads from a diag.json node).
OVERLAYS = {
    "modelexplorer.local.json": "diag: local SQNR (dB)",
    "modelexplorer.accumulated.json": "diag: accumulated SQNR (dB)",
    "modelexplorer.effect.json": "diag: measured effect (% of the output error removed in float)",
}
#: The fourth overlay, written with the diagnosis of `diag exclude`: the nodes its verified fix
#: keeps in float (1), on the same graph.
KEPT_IN_FLOAT = "modelexplorer.kept_in_float.json"
#: SQNR colours, worst first: a value at or below a threshold takes its colour (Model Explorer's
#: rule); the bands are diag's (bad below 20 dB, :data:`diag.analysis.analyze.BAD_SQNR_DB`).
SQNR_THRESHOLDS = [
    {"value": 10, "bgColor": "#e74c3c"},
    {"value": 20, "bgColor": "#f39c12"},
    {"value": 30, "bgColor": "#f7dc6f"},
    {"value": 1e9, "bgColor": "#abebc6"},
]
#: Effect colours: a node whose float region removes half the error or more is the cause.
EFFECT_THRESHOLDS = [
    {"value": 10, "bgColor": "#eaeded"},
    {"value": 50, "bgColor": "#f7dc6f"},
    {"value": 100, "bgColor": "#e74c3c"},
]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def node_data(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Overlay file name -> its GraphNodeData, from a diag.json document.

    Example:
        >>> doc = {"nodes": [{"fp_nodes": ["conv1", "relu1"], "unnamed": False,
        ...                   "local": {"sqnr_db": 12.5}, "accumulated": {"sqnr_db": 9.0}}],
        ...        "effects": {"effects": [{"fp_nodes": ["conv1", "relu1"], "recovered": 0.8}]}}
        >>> node_data(doc)["modelexplorer.local.json"]["results"]
        {'conv1': {'value': 12.5}, 'relu1': {'value': 12.5}}
        >>> node_data(doc)["modelexplorer.effect.json"]["results"]["conv1"]
        {'value': 80.0}
        >>> node_data({**doc, "exclusion": {"nodes_to_exclude": ["conv1"]}})[KEPT_IN_FLOAT]["results"]
        {'conv1': {'value': 1}}
    """
    local: dict[str, dict[str, float]] = {}
    accumulated: dict[str, dict[str, float]] = {}
    for n in doc.get("nodes") or []:
        if n.get("unnamed"):
            continue
        for key, into in (("local", local), ("accumulated", accumulated)):
            value = _finite((n.get(key) or {}).get("sqnr_db"))
            if value is not None:
                into.update({name: {"value": round(value, 2)} for name in n["fp_nodes"]})
    effect: dict[str, dict[str, float]] = {}
    for e in (doc.get("effects") or {}).get("effects") or []:
        value = _finite(e.get("recovered"))
        if value is not None:
            effect.update({name: {"value": round(100 * max(value, 0.0), 1)} for name in e["fp_nodes"]})
    names = list(OVERLAYS)
    out = {
        names[0]: {"name": OVERLAYS[names[0]], "results": local, "thresholds": SQNR_THRESHOLDS},
        names[1]: {"name": OVERLAYS[names[1]], "results": accumulated, "thresholds": SQNR_THRESHOLDS},
        names[2]: {"name": OVERLAYS[names[2]], "results": effect, "thresholds": EFFECT_THRESHOLDS},
    }
    kept = (doc.get("exclusion") or {}).get("nodes_to_exclude") or []
    if kept:
        out[KEPT_IN_FLOAT] = {
            "name": "diag: kept in float by the verified fix",
            "results": {name: {"value": 1} for name in kept},
            "thresholds": [{"value": 1, "bgColor": "#5dade2"}],
        }
    return out


def node_data_texts(doc: dict[str, Any]) -> dict[str, str]:
    """The overlay files' contents (:func:`node_data`), as written."""
    return {name: json.dumps(data, indent=1, ensure_ascii=False) + "\n" for name, data in node_data(doc).items()}


def open_command(doc: dict[str, Any]) -> str:
    """The command that opens the FP32 model in Model Explorer with diag's overlays (the verified
    fix's nodes too, beside an exclusion), the overlays named as in their folder and the FP32 path
    as the run was given it. NOTE: ``--extensions=model_explorer_onnx`` loads the ONNX adapter;
    without it Model Explorer answers "Unsupported model format" (``tests/test_model_explorer.py``
    runs this very command).

    Example:
        >>> open_command({"models": {"fp32": {"path": "m.onnx"}}})  # doctest: +ELLIPSIS
        'model-explorer m.onnx --extensions=model_explorer_onnx --node_data_paths=modelexplorer.local.json,...'
    """
    kept = [KEPT_IN_FLOAT] if (doc.get("exclusion") or {}).get("nodes_to_exclude") else []
    paths = ",".join([*OVERLAYS, *kept])
    model = shlex.quote(str(doc["models"]["fp32"]["path"]))
    return f"model-explorer {model} --extensions=model_explorer_onnx --node_data_paths={shlex.quote(paths)}"
