"""What each model output *is*, from graph evidence, so it is graded with metrics that mean something.

Top-1 agreement means something for class scores and nothing for a probability map (an argmax over
image width) or a detector output (an argmax over anchors); a logits max-abs band means nothing for
box coordinates in pixels or for a sentence embedding. This stage reads the FP32 graph once, before
any run, and gives every output an :class:`~diag.core.metrics.OutputSpec`: its kind, the axis that holds
classes (if any), the mask threshold of a probability map, and — for an output that a ``Concat``
builds from parts (boxes in pixels next to sigmoid scores: the classic detector export) — the parts,
so each part is measured on its own and a destroyed part cannot hide behind the whole.

Kinds (``--output-kind NAME=KIND`` overrides the inference):

* ``logits`` — class scores from a linear head: top-1 agreement over the class axis, max abs error.
* ``probabilities`` — a Softmax/Sigmoid over a class axis: top-1 agreement, min per-sample cosine.
* ``probability-map`` — a Sigmoid/Softmax map with spatial axes (segmentation, text detection):
  IoU of the thresholded masks (value > 0.5), min per-sample cosine. No argmax.
* ``embedding`` — pooled / normalized vectors and hidden states: min per-sample cosine.
* ``boxes``, ``regression`` — coordinates and other real values: min per-sample cosine and the max
  abs error relative to the output's largest FP32 magnitude.
* ``detector`` — a Concat of box parts and score parts: every part graded by its own kind.

NOTE: kinds come from structure (producer op types through shape-only ops, axis sizes from shape
inference), never from tensor names: exporters name outputs ``output0`` or ``sigmoid_0.tmp_0``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import onnx

from diag.core.metrics import OutputPart, OutputSpec
from diag.foundations.errors import DiagError

KINDS = ("logits", "probabilities", "probability-map", "embedding", "boxes", "detector", "regression")

#: Ops that move or relabel values without computing new ones: the kind is that of their input.
PASSTHROUGH = frozenset({"Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Dropout"})
#: Ops whose output lies in [0, 1] per element (or sums to 1 along an axis).
SCORE_OPS = frozenset({"Sigmoid", "HardSigmoid", "Softmax"})
#: Ops that pool or normalize vectors: what comes out is an embedding.
EMBEDDING_OPS = frozenset(
    {
        "ReduceMean",
        "ReduceSum",
        "ReduceMax",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "LpNormalization",
        "LayerNormalization",
        "SimplifiedLayerNormalization",
        "SkipLayerNormalization",
    }
)
#: Linear heads: with a class-sized last axis, what comes out are logits.
LINEAR_OPS = frozenset({"MatMul", "Gemm", "MatMulInteger", "FusedMatMul"})
#: Concat parts are measured separately when there are at most this many.
MAX_PARTS = 16
#: Class axes longer than this are not classes (a vocabulary of 100k tokens still is).
MAX_CLASSES = 100_000
#: A probability map's mask is ``value > MASK_THRESHOLD``.
MASK_THRESHOLD = 0.5


@dataclass(frozen=True)
class _Graph:
    producer: dict[str, onnx.NodeProto]
    index: dict[str, int]
    shapes: dict[str, list[int | None]]
    initializers: set[str]
    inputs: frozenset[str] = frozenset()


def _graph_view(model: onnx.ModelProto) -> _Graph:
    producer: dict[str, onnx.NodeProto] = {}
    index: dict[str, int] = {}
    for i, node in enumerate(model.graph.node):
        for o in node.output:
            producer[o] = node
            index[o] = i
    shapes: dict[str, list[int | None]] = {}
    inferred = model
    # Shape inference only reads the structure; a model too large for it keeps its declared shapes.
    with contextlib.suppress(Exception):
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim
            ]
    initializers = {i.name for i in model.graph.initializer}
    inputs = frozenset(i.name for i in model.graph.input if i.name not in initializers)
    return _Graph(producer, index, shapes, initializers, inputs)


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _semantic(g: _Graph, tensor: str) -> tuple[str, onnx.NodeProto | None, list[int] | None, bool]:
    """Follow shape-only ops back from ``tensor``: (tensor before them, its producer, axis map, lost).

    The axis map sends an axis of the returned tensor to the axis of ``tensor`` (None: identity);
    ``lost`` is True once a Reshape, Flatten, Squeeze or Unsqueeze mixed the axes up.
    """
    mapping: list[int] | None = None
    lost = False
    hops = 0
    node = g.producer.get(tensor)
    while node is not None and node.op_type in PASSTHROUGH and hops < 64:
        hops += 1
        if node.op_type == "Transpose":
            p = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if p is None:
                lost = True
            else:
                # output axis j holds input axis p[j]: input axis i lands at output axis p.index(i)
                mapping = [mapping[p.index(i)] if mapping is not None else p.index(i) for i in range(len(p))]
        elif node.op_type not in ("Identity", "Cast", "Dropout"):
            lost = True
        tensor = node.input[0]
        node = g.producer.get(tensor)
    return tensor, node, mapping, lost


def _to_out(axis: int | None, mapping: list[int] | None, lost: bool) -> int | None:
    """An axis of the semantic tensor as an axis of the output (None when unknown)."""
    if axis is None or lost:
        return None
    if mapping is None:
        return axis
    return mapping[axis] if axis < len(mapping) else None


def _norm_axis(axis: int, rank: int | None) -> int | None:
    if rank is None:
        return axis if axis >= 0 else None
    return axis % rank if -rank <= axis < rank else None


def _is_normalizing_div(g: _Graph, node: onnx.NodeProto) -> bool:
    """``x / norm(x)``: a Div whose divisor comes from a ReduceL2 / Sqrt / LpNormalization."""
    if node.op_type != "Div" or len(node.input) < 2:
        return False
    _, div, _, _ = _semantic(g, node.input[1])
    hops = 0
    while div is not None and hops < 4:
        if div.op_type in ("ReduceL2", "Sqrt", "LpNormalization", "ReduceSumSquare"):
            return True
        if div.op_type not in ("Clip", "Max", "Add", "Expand", "Unsqueeze", "Reshape", "Identity"):
            return False
        hops += 1
        div = g.producer.get(div.input[0]) if div.input else None
    return False


def _kind_of(g: _Graph, tensor: str, shape: list[int | None] | None) -> tuple[str, int | None, str]:
    """(kind, class axis in ``tensor``'s axes, evidence) of one tensor, parts not considered."""
    rank = len(shape) if shape is not None else None
    src, node, mapping, lost = _semantic(g, tensor)
    if node is None:
        return "regression", None, "no producer (a graph input or constant)"
    op = node.op_type
    src_shape = g.shapes.get(src)
    src_rank = len(src_shape) if src_shape is not None else None

    def to_out(axis: int | None) -> int | None:
        return _to_out(axis, mapping, lost)

    spatial = (src_shape is not None and len(src_shape) >= 4) or (
        src_shape is not None and len(src_shape) == 3 and op != "Softmax"
    )
    if op == "Softmax" or op == "LogSoftmax":
        axis = _norm_axis(_attr(node, "axis", -1), src_rank)
        last = src_rank is not None and axis == src_rank - 1
        if op == "Softmax" and src_rank is not None and src_rank >= 4 and not last:
            return "probability-map", None, f"{op} over axis {axis} of a {src_rank}-d map ('{node.name or op}')"
        kind = "probabilities" if op == "Softmax" else "logits"
        return kind, to_out(axis), f"{op} over axis {axis} ('{node.name or op}')"
    if op in ("Sigmoid", "HardSigmoid"):
        if spatial:
            return "probability-map", None, f"{op} producing a {src_rank}-d map ('{node.name or op}')"
        if src_rank == 2:
            return "probabilities", to_out(1), f"{op} over [batch, classes] ('{node.name or op}')"
        return "probabilities", None, f"{op} ('{node.name or op}')"
    if op in EMBEDDING_OPS or _is_normalizing_div(g, node):
        what = "normalized" if op != "ReduceMean" and op != "GlobalAveragePool" else "pooled"
        return "embedding", None, f"{what} vectors from {op} ('{node.name or op}')"
    if op == "Add" and src_rank in (2, 3):
        # A bias Add or a sum of linear heads is still a linear head; a residual Add writes hidden states.
        feeders = [g.producer.get(i) for i in node.input]
        if any(f is not None and f.op_type in LINEAR_OPS | {"Add"} for f in feeders) and all(
            f is None or f.op_type in LINEAR_OPS | {"Add"} for f in feeders
        ):
            op = "MatMul"
        else:
            return "embedding", None, f"hidden states from a residual Add ('{node.name or op}')"
    if op in LINEAR_OPS:
        classes = shape[-1] if shape else None
        if rank is not None and rank in (2, 3) and classes is not None and 2 <= classes <= MAX_CLASSES:
            return "logits", rank - 1, f"linear head {op} with {classes} classes on the last axis"
        if rank is not None and rank in (2, 3) and classes is None:
            return "logits", rank - 1, f"linear head {op} (class count symbolic)"
        return "regression", None, f"{op} output of rank {rank}"
    return "regression", None, f"computed by {op} ('{node.name or op}')"


def _parts(
    g: _Graph, tensor: str, shape: list[int | None] | None
) -> tuple[int, int, tuple[OutputPart, ...], str] | None:
    """The parts of an output that a Concat builds (axis in the output's axes), if their sizes are known."""
    src, node, mapping, lost = _semantic(g, tensor)
    if node is None or node.op_type != "Concat" or not 2 <= len(node.input) <= MAX_PARTS or lost:
        return None
    src_rank = len(g.shapes[src]) if src in g.shapes else (len(shape) if shape else None)
    axis = _norm_axis(_attr(node, "axis", 0), src_rank)
    if axis is None or axis == 0:
        return None  # a Concat over the batch axis stacks samples, not parts
    sizes: list[int] = []
    for inp in node.input:
        s = g.shapes.get(inp)
        size = s[axis] if s is not None and axis < len(s) else None
        if size is None:
            return None
        sizes.append(size)
    out_axis = _to_out(axis, mapping, lost)
    if out_axis is None:
        return None
    parts = []
    start = 0
    for inp, size in zip(node.input, sizes, strict=True):
        kind, _, _ = _kind_of(g, inp, g.shapes.get(inp))
        if kind in ("probabilities", "probability-map"):
            kind, label = "probabilities", "scores"
        elif kind == "logits":
            label = "scores"
        else:
            kind, label = "boxes", "boxes"
        parts.append(OutputPart(f"{label} [{start}:{start + size}]", kind, start, start + size, inp))
        start += size
    return out_axis, axis, tuple(parts), node.name or f"Concat#{g.index[src]}"


def _appended(g: _Graph, tensor: str) -> tuple[str, int, int, str] | None:
    """A KV cache's present: (past input, axis in the output, axis in the past, Concat) when
    ``tensor`` is a Concat whose first input is a model input (through Identity / Cast only).

    ``Concat(past_key_values.N.key, new_key, axis=2)`` is how every exporter (optimum,
    onnxruntime-genai, torch dynamo) grows a decoder's cache: the first positions are the fed
    past, copied; only the rest is computed.
    """
    _, node, mapping, lost = _semantic(g, tensor)
    if node is None or node.op_type != "Concat" or len(node.input) != 2 or lost:
        return None
    past = node.input[0]
    hops = 0
    while past not in g.inputs and hops < 4:
        writer = g.producer.get(past)
        if writer is None or writer.op_type not in ("Identity", "Cast"):
            return None
        past, hops = writer.input[0], hops + 1
    if past not in g.inputs:
        return None
    rank = len(g.shapes[past]) if past in g.shapes else None
    axis = _norm_axis(_attr(node, "axis", 0), rank)
    if axis is None or axis == 0:
        return None
    out_axis = _to_out(axis, mapping, lost)
    if out_axis is None:
        return None
    return past, out_axis, axis, node.name or f"Concat#{g.index[node.output[0]]}"


def output_specs(model: onnx.ModelProto, overrides: dict[str, str] | None = None) -> dict[str, OutputSpec]:
    """One :class:`OutputSpec` per model output, inferred from the graph (``overrides`` win).

    Example:
        >>> specs = output_specs(onnx.load("det.onnx"))  # doctest: +SKIP
        >>> specs["sigmoid_0.tmp_0"].kind, specs["sigmoid_0.tmp_0"].class_axis  # doctest: +SKIP
        ('probability-map', None)
    """
    overrides = dict(overrides or {})
    names = [o.name for o in model.graph.output]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise DiagError(
            "bad-option",
            f"--output-kind {unknown[0]}=...",
            "names no output of the model",
            f"the outputs are: {', '.join(names)}",
        )
    g = _graph_view(model)
    specs: dict[str, OutputSpec] = {}
    for name in names:
        shape = g.shapes.get(name)
        kind, class_axis, evidence = _kind_of(g, name, shape)
        appended = _appended(g, name)
        parts = _parts(g, name, shape) if appended is None else None
        if appended is not None:
            evidence += (
                f"; Concat '{appended[3]}' appends to model input '{appended[0]}' (a KV cache): "
                "graded on the new positions only"
            )
        part_axis: int | None = None
        concat_axis: int | None = None
        part_list: tuple[OutputPart, ...] = ()
        concat = None
        if parts is not None:
            part_axis, concat_axis, part_list, concat = parts
            kinds = {p.kind for p in part_list}
            if "probabilities" in kinds and "boxes" in kinds:
                kind, class_axis = "detector", None
                evidence = f"Concat '{concat}' of box and score parts along axis {part_axis}"
            else:
                evidence += f"; built by Concat '{concat}' of {len(part_list)} parts"
        given = overrides.get(name)
        if given is not None:
            if given not in KINDS:
                raise DiagError(
                    "bad-option",
                    f"--output-kind {name}={given}",
                    "is not a known output kind",
                    f"use one of {', '.join(KINDS)}",
                )
            if given in ("logits", "probabilities") and class_axis is None and shape:
                class_axis = len(shape) - 1
            if given not in ("logits", "probabilities"):
                class_axis = None
            kind, evidence = given, f"given with --output-kind (inferred: {kind})"
        specs[name] = OutputSpec(
            kind=kind,
            class_axis=class_axis,
            mask_threshold=MASK_THRESHOLD if kind == "probability-map" else None,
            part_axis=part_axis,
            concat_axis=concat_axis,
            parts=part_list,
            concat_node=concat,
            evidence=evidence,
            appended_to=appended[0] if appended else None,
            appended_axis=appended[1] if appended else None,
            appended_input_axis=appended[2] if appended else None,
        )
    return specs


def channel_axes(specs: dict[str, OutputSpec]) -> dict[str, int]:
    """Channel axes the graph proves: a Concat-built output's part axis and its parts' Concat axis.

    Example:
        >>> channel_axes(output_specs(detector_model))  # doctest: +SKIP
        {'output0': 1, 'boxes': 1, 'scores': 1}
    """
    axes: dict[str, int] = {}
    for name, spec in specs.items():
        if spec.part_axis is None or spec.concat_axis is None:
            continue
        axes[name] = spec.part_axis
        for p in spec.parts:
            axes.setdefault(p.source, spec.concat_axis)
    return axes


def parse_output_kinds(items: list[str] | None) -> dict[str, str]:
    """``["logits=probabilities", ...]`` (the CLI's ``--output-kind``) as a dict, checked.

    Example:
        >>> parse_output_kinds(["prob=probability-map"])
        {'prob': 'probability-map'}
    """
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, kind = item.rpartition("=")
        if not sep or not name:
            raise DiagError(
                "bad-option",
                f"--output-kind {item}",
                "is not NAME=KIND",
                f"e.g. --output-kind logits=logits ({', '.join(KINDS)})",
            )
        if kind not in KINDS:
            raise DiagError(
                "bad-option", f"--output-kind {item}", f"'{kind}' is not a known kind", f"use one of {', '.join(KINDS)}"
            )
        out[name] = kind
    return out
