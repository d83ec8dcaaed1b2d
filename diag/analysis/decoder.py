"""Decoder layers and projections read off node names: the error of a transformer stack per layer.

An LLM user asks "which layer, which projection", not "which of 400 nodes". Exports name nodes by
module path (transformers / optimum: ``/model/layers.2/mlp/down_proj/MatMul``; onnxruntime-genai:
``/model/layers.2/attn/o_proj/MatMulNBits``; GPT-2: ``/transformer/h.0/attn/c_attn/MatMul``;
BERT: ``/bert/encoder/layer.3/attention/self/query/MatMul``), so the layer index and the
projection (the module path between the layer and the op) come from the name alone. The
torch >= 2.5 exporter (``dynamo=True``) names nodes ``node_linear_3`` but records the module path
in each node's ``pkg.torch.onnx.name_scopes`` metadata (:func:`module_paths`), which wins when
present.

Per layer: the worst local SQNR among its quantized nodes (where a layer adds error) and the
accumulated SQNR of its last node (what the stack has lost after it: the residual stream). Per
projection (``self_attn/q_proj``, ``mlp/down_proj``, ...): its local SQNR in every layer. Quantized
nodes outside any layer (``lm_head``) are listed beside the layers. Nothing here changes a
finding; a model without at least two numbered layers gets no layout.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from typing import Any

import onnx

from diag.analysis.analyze import NodeFinding
from diag.foundations.jsonnum import json_number

#: A numbered layer in a module path: ``layers.2``, ``layer.3``, ``h.0``, ``blocks_1``, ``block.4``.
_LAYER = re.compile(r"(?:^|[/.])(?:layers|layer|h|blocks|block)[._](\d+)(?=[/._]|$)")
#: Fewest numbered layers that make a model a stack worth a per-layer view.
MIN_LAYERS = 2


@dataclass(frozen=True)
class LayerRow:
    """One decoder layer: where it adds error and what the residual stream has lost after it."""

    index: int
    quantized_nodes: int
    worst_local_node: str | None
    worst_local_sqnr_db: float | None
    #: The layer's last node in graph order (the residual Add of a pre-norm block) and its
    #: accumulated SQNR: the error the whole stack carries after this layer.
    output_node: str
    accumulated_sqnr_db: float
    roles: tuple[str, ...] = ()
    #: The projection of ``worst_local_node`` (``mlp/down_proj``), when its module path names one.
    worst_local_projection: str | None = None


@dataclass(frozen=True)
class ProjectionRow:
    """One projection (a module path inside a layer, e.g. ``mlp/down_proj``) across the layers."""

    name: str
    #: layer index -> (node label, local SQNR dB, accumulated SQNR dB)
    by_layer: dict[int, tuple[str, float | None, float]]

    @property
    def worst_layer(self) -> int | None:
        """The layer where this projection's local SQNR is lowest."""
        scored = [(v[1], k) for k, v in self.by_layer.items() if v[1] is not None]
        return min(scored)[1] if scored else None


@dataclass(frozen=True)
class DecoderLayout:
    """The per-layer and per-projection view of a transformer stack."""

    layers: list[LayerRow]
    projections: list[ProjectionRow]
    #: Quantized nodes outside any numbered layer (``lm_head``, an embedding): (label, local dB, accumulated dB).
    outside: list[tuple[str, float | None, float]] = field(default_factory=list)
    #: What the stack is, read off its module paths (:func:`stack_kind`): "encoder", "decoder" or "transformer".
    stack: str = "transformer"

    @property
    def worst_layer(self) -> LayerRow | None:
        """The layer whose worst quantized node has the lowest local SQNR."""
        scored = [r for r in self.layers if r.worst_local_sqnr_db is not None]
        return min(scored, key=lambda r: (r.worst_local_sqnr_db, r.index)) if scored else None

    def to_dict(self) -> dict[str, Any]:
        """The ``decoder`` section of ``diag.json``."""
        return {
            "stack": self.stack,
            "layers": [
                {
                    "index": r.index,
                    "quantized_nodes": r.quantized_nodes,
                    "worst_local_node": r.worst_local_node,
                    "worst_local_sqnr_db": json_number(r.worst_local_sqnr_db),
                    "worst_local_projection": r.worst_local_projection,
                    "output_node": r.output_node,
                    "accumulated_sqnr_db": json_number(r.accumulated_sqnr_db),
                    "roles": list(r.roles),
                }
                for r in self.layers
            ],
            "projections": [
                {
                    "name": p.name,
                    "worst_layer": p.worst_layer,
                    "by_layer": {
                        str(k): {"node": n, "local_sqnr_db": json_number(lo), "accumulated_sqnr_db": json_number(acc)}
                        for k, (n, lo, acc) in sorted(p.by_layer.items())
                    },
                }
                for p in self.projections
            ],
            "outside": [
                {"node": n, "local_sqnr_db": json_number(lo), "accumulated_sqnr_db": json_number(acc)}
                for n, lo, acc in self.outside
            ],
        }


def layer_of(name: str) -> tuple[int, str] | None:
    """(layer index, the module path after the layer) of a node name, or None outside any layer.

    Example:
        >>> layer_of("/model/layers.2/mlp/down_proj/MatMul")
        (2, 'mlp/down_proj/MatMul')
        >>> layer_of("/transformer/h.11/attn/c_attn/MatMul")
        (11, 'attn/c_attn/MatMul')
        >>> layer_of("/lm_head/MatMul") is None
        True
    """
    found = list(_LAYER.finditer(name))
    if not found:
        return None
    last = found[-1]  # an encoder-decoder names "decoder/layers.1"; nested stacks take the inner index
    return int(last.group(1)), name[last.end() :].lstrip("/._")


def projection_of(name: str) -> str | None:
    """The projection a node belongs to: its module path inside the layer, without the op.

    Example:
        >>> projection_of("/model/layers.2/self_attn/q_proj/MatMul")
        'self_attn/q_proj'
        >>> projection_of("model.layers.0.mlp.down_proj.MatMul_Q4")
        'mlp/down_proj'
    """
    found = layer_of(name)
    if found is None:
        return None
    parts = [p for p in re.split(r"[/.]", found[1]) if p]
    return "/".join(parts[:-1]) or None


#: The node metadata key where torch's dynamo exporter records the module scopes of a node.
NAME_SCOPES = "pkg.torch.onnx.name_scopes"


def module_paths(model: onnx.ModelProto) -> dict[str, str]:
    """Node name -> ``<deepest module>/<op>`` from torch's exporter metadata (empty without it).

    Example:
        >>> module_paths(onnx.load("llama.onnx", load_external_data=False))["node_linear_3"]  # doctest: +SKIP
        'model.layers.0.self_attn.o_proj/linear_3'
    """
    out: dict[str, str] = {}
    for node in model.graph.node:
        raw = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
        if not raw or not node.name:
            continue
        try:
            scopes = [s for s in ast.literal_eval(raw) if isinstance(s, str) and s]
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue  # untrusted text: a malformed scope list is ignored, the node name is used
        if len(scopes) >= 2:
            out[node.name] = f"{scopes[-2]}/{scopes[-1]}"[:1000]
    return out


def _local(f: NodeFinding) -> float | None:
    return f.local.sqnr_db if f.local is not None and not math.isnan(f.local.sqnr_db) else None


def decoder_layout(findings: list[NodeFinding], paths: dict[str, str] | None = None) -> DecoderLayout | None:
    """The per-layer view of ``findings``, or None when the names hold fewer than two layers.

    ``paths``: :func:`module_paths` of the FP32 model, read instead of a node's name when present.

    Example:
        >>> layout = decoder_layout(result.findings)  # doctest: +SKIP
        >>> layout.worst_layer.index, layout.worst_layer.worst_local_node  # doctest: +SKIP
        (2, '/model/layers.2/mlp/down_proj/MatMul')
    """
    by_layer: dict[int, list[NodeFinding]] = {}
    outside: list[tuple[str, float | None, float]] = []
    paths = paths or {}

    def path(f: NodeFinding) -> str:
        return paths.get(f.group.fp_nodes[0], f.group.label) if f.group.fp_nodes else f.group.label

    for f in findings:
        if f.accumulated is None:
            continue
        found = layer_of(path(f))
        if found is not None:
            by_layer.setdefault(found[0], []).append(f)
        elif f.group.quantized:
            outside.append((f.group.label, _local(f), f.accumulated.sqnr_db))
    if len(by_layer) < MIN_LAYERS or not any(f.group.quantized for fs in by_layer.values() for f in fs):
        return None
    layers: list[LayerRow] = []
    projections: dict[str, dict[int, tuple[str, float | None, float]]] = {}
    for index in sorted(by_layer):
        members = by_layer[index]
        quantized = [f for f in members if f.group.quantized]
        scored = [(s, f.index, f) for f in quantized if (s := _local(f)) is not None]
        worst = min(scored, key=lambda t: (t[0], t[1]))[2] if scored else None
        last = max(members, key=lambda f: f.index)
        assert last.accumulated is not None
        roles = tuple(sorted({f.role for f in members if f.role not in ("ok", "victim")}))
        layers.append(
            LayerRow(
                index,
                len(quantized),
                worst.group.label if worst is not None else None,
                _local(worst) if worst is not None else None,
                last.group.label,
                last.accumulated.sqnr_db,
                roles,
                projection_of(path(worst)) if worst is not None else None,
            )
        )
        for f in quantized:
            name = projection_of(path(f))
            if name is not None:
                assert f.accumulated is not None
                projections.setdefault(name, {})[index] = (f.group.label, _local(f), f.accumulated.sqnr_db)
    # Projections in the order the first layer runs them (q, k, v, o, gate, up, down).
    order = {f.group.label: (i, f.index) for i, fs in by_layer.items() for f in fs}
    rows = sorted(
        (ProjectionRow(name, by) for name, by in projections.items()),
        key=lambda p: min(order[n] for n, _, _ in p.by_layer.values()),
    )
    names = [path(f) for fs in by_layer.values() for f in fs] + [label for label, _, _ in outside]
    return DecoderLayout(layers, rows, outside, stack_kind(names))


def stack_kind(names: list[str]) -> str:
    """``"encoder"``, ``"decoder"`` or ``"transformer"`` (both, or neither said), from module paths.

    An encoder is titled as one (BERT's ``/encoder/layer.N``, Whisper's encoder); a decoder-only
    LLM's paths say ``decoder`` or it has an ``lm_head``; names that say neither stay "transformer".

    Example:
        >>> stack_kind(["/bert/encoder/layer.0/attention/self/query/MatMul"])
        'encoder'
        >>> stack_kind(["/model/layers.0/self_attn/q_proj/MatMul", "/lm_head/MatMul"])
        'decoder'
        >>> stack_kind(["layer0/attn/q/MatMul"])
        'transformer'
    """
    low = [n.lower() for n in names]
    encoder = any("encoder" in n for n in low)
    decoder = any("decoder" in n or "lm_head" in n for n in low)
    if encoder != decoder:
        return "encoder" if encoder else "decoder"
    return "transformer"


def projection_phrase(nodes: list[str], universe: list[str], paths: dict[str, str] | None = None) -> str | None:
    """``nodes`` named by projection (``mlp/down_proj in every layer (4)``) when at least one
    projection is whole and the phrase is shorter than the node list, else None (a few scattered
    nodes read best by name). ``universe``: every node that could have been listed (a projection
    is "in every layer" when all of its nodes there are in ``nodes``).

    Example:
        >>> projection_phrase(["/model/layers.0/mlp/down_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul"],
        ...                   ["/model/layers.0/mlp/down_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul",
        ...                    "/model/layers.1/mlp/up_proj/MatMul"])
        'mlp/down_proj in every layer (2)'
    """
    paths = paths or {}

    def where(name: str) -> tuple[int, str] | None:
        found = layer_of(paths.get(name, name))
        proj = projection_of(paths.get(name, name))
        return (found[0], proj) if found is not None and proj is not None else None

    every: dict[str, set[int]] = {}
    for name in universe:
        if (w := where(name)) is not None:
            every.setdefault(w[1], set()).add(w[0])
    chosen: dict[str, set[int]] = {}
    outside: list[str] = []
    for name in nodes:
        w = where(name)
        if w is None or w[1] not in every:
            module = paths.get(name, name).split("/")[0]
            outside.append(f"{module} ({name})" if name in paths and module and module not in name else name)
        else:
            chosen.setdefault(w[1], set()).add(w[0])
    if not chosen:
        return None
    parts = []
    for proj in every:  # in the order the model runs them
        layers = chosen.get(proj)
        if not layers:
            continue
        if layers == every[proj]:
            parts.append(f"{proj} in every layer ({len(layers)})")
        else:
            parts.append(f"{proj} in layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, sorted(layers)))}")
    phrase = ", ".join(parts + outside)
    whole = any(layers == every[p] for p, layers in chosen.items())
    return phrase if whole and len(phrase) < len(", ".join(nodes)) else None
