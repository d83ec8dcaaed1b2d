"""Which precision each node of a low-precision model runs at: FP16 and 16-bit-activation QDQ.

:func:`diag.core.load.detect_format` tells dynamic / QDQ / QOperator apart from the ops a model holds.
Two more families come from the same onnxruntime package and need the element types instead:

* **FP16** (``onnxruntime.transformers.float16.convert_float_to_float16``): no quantization op,
  float16 weights and activations; ``keep_io_types`` adds ``Cast`` nodes at the graph's inputs and
  outputs, ``op_block_list`` / ``node_block_list`` leave nodes in float32 between ``Cast`` pairs.
* **16-bit activations in QDQ** (``activation_type=QInt16/QUInt16``, or per tensor through
  ``TensorQuantOverrides``: "A16W8"): the same Q/DQ graph, with 16-bit zero points.

The result is a breakdown ``precision -> node names`` and a format name: ``fp16``, ``qdq-a16w8``
(every activation 16-bit, weights 8-bit), ``qdq16`` (both 16-bit), and ``mixed`` when nodes run at
several precisions (an FP16 model with blocked nodes, a QDQ model whose overrides promote a few
tensors); :attr:`diag.core.load.ModelFormat.family` keeps which tool made a ``mixed`` model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import onnx

from diag.core.protos import node_id, value_dtypes

FLOAT16 = onnx.TensorProto.FLOAT16
FLOAT = onnx.TensorProto.FLOAT

#: Zero-point element types and the bit width of the grid they define.
_BITS = {
    onnx.TensorProto.INT8: 8,
    onnx.TensorProto.UINT8: 8,
    onnx.TensorProto.INT16: 16,
    onnx.TensorProto.UINT16: 16,
    onnx.TensorProto.INT4: 4,
    onnx.TensorProto.UINT4: 4,
    onnx.TensorProto.FLOAT8E4M3FN: -8,  # FLOAT8_BITS: labelled f8, not a 256-level integer grid
}
FLOAT8_BITS = -8

#: Ops that only move or reinterpret data: they run at whatever precision reaches them.
_DATA_MOVEMENT = frozenset(
    {"Cast", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Constant"}
)


#: The format kinds a precision breakdown decides (a subset of :data:`diag.core.load.FormatKind`).
PrecisionKind = Literal["fp16", "qdq-a16w8", "qdq16", "qdq-fp8", "mixed"]


@dataclass
class PrecisionBreakdown:
    """Which nodes run at which precision, and the format name that follows.

    Attributes:
        kind: ``fp16``, ``qdq-a16w8``, ``qdq16``, ``qdq`` or ``mixed``.
        family: the tool that made the model: ``fp16`` or ``qdq``.
        nodes: precision label (``fp16``, ``fp32``, ``a16w8``, ``a8w8``, ``a16``...) -> node names.
    """

    kind: PrecisionKind
    family: str
    nodes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.nodes.items()}


def has_float16(proto: onnx.ModelProto) -> bool:
    """Cheap test: any float16 initializer, graph input/output, value_info or Cast to float16.

    Runs before anything expensive so FP32 and INT8 models pay nothing.
    """
    g = proto.graph
    if any(t.data_type == FLOAT16 for t in g.initializer):
        return True
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == FLOAT16:
            return True
    for n in g.node:
        if n.op_type == "Cast" and any(a.name == "to" and a.i == FLOAT16 for a in n.attribute):
            return True
        if n.op_type == "Constant" and n.attribute and n.attribute[0].t.data_type == FLOAT16:
            return True
    return False


def fp16_breakdown(proto: onnx.ModelProto) -> PrecisionBreakdown | None:
    """Precision of every compute node of a float16 model, or None unless most compute is float16.

    A node runs in fp16 when one of its float outputs is float16, in fp32 when its float outputs
    are float32 (blocked nodes, and keep_io_types' neighbours). Data-movement ops are not counted.

    Example:
        >>> b = fp16_breakdown(convert_float_to_float16(m, node_block_list=["mm"]))  # doctest: +SKIP
        >>> b.kind, b.nodes["fp32"]  # doctest: +SKIP
        ('mixed', ['mm'])
    """
    dtypes = value_dtypes(proto)
    nodes: dict[str, list[str]] = {"fp16": [], "fp32": []}
    for i, n in enumerate(proto.graph.node):
        if n.op_type in _DATA_MOVEMENT:
            continue
        types = {dtypes.get(o) for o in n.output if o}
        if FLOAT16 in types:
            nodes["fp16"].append(node_id(n, i))
        elif FLOAT in types:
            nodes["fp32"].append(node_id(n, i))
    # NOTE: an FP32 export with a small float16 island (a fused kernel, a float16 constant path)
    # is still the float model users compare against: float16 must do most of the compute.
    if len(nodes["fp16"]) <= len(nodes["fp32"]):
        return None
    nodes = {k: v for k, v in nodes.items() if v}
    return PrecisionBreakdown("fp16" if len(nodes) == 1 else "mixed", "fp16", nodes)


def qdq_breakdown(proto: onnx.ModelProto) -> PrecisionBreakdown | None:
    """Activation / weight bit widths of every node that reads a DequantizeLinear output.

    A node's label is ``a<bits>w<bits>`` (``a<bits>`` without a quantized weight), its activation
    bits the widest of its activation inputs'. None when no activation grid is wider than 8 bits
    (plain QDQ stays ``qdq`` with no breakdown, as before).

    Example:
        >>> qdq_breakdown(a16w8_model).kind  # doctest: +SKIP
        'qdq-a16w8'
    """
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output if o}
    dq_bits: dict[str, tuple[str, int]] = {}  # DQ output -> ("a" | "w", bits)
    for n in g.node:
        if n.op_type != "DequantizeLinear" or not n.input or not n.output:
            continue
        zp = inits.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        src = inits.get(n.input[0])
        elem = zp.data_type if zp is not None else src.data_type if src is not None else onnx.TensorProto.UINT8
        bits = _BITS.get(elem, 8)
        role = "w" if n.input[0] in inits else "a"
        q = producer.get(n.input[0])
        if role == "a" and (q is None or q.op_type != "QuantizeLinear"):
            continue
        dq_bits[n.output[0]] = (role, bits)
    float8 = any(v[1] == FLOAT8_BITS for v in dq_bits.values())
    if not float8 and not any(role == "a" and bits > 8 for role, bits in dq_bits.values()):
        return None
    nodes: dict[str, list[str]] = {}
    for i, n in enumerate(g.node):
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        a = [dq_bits[x][1] for x in n.input if x in dq_bits and dq_bits[x][0] == "a"]
        w = [dq_bits[x][1] for x in n.input if x in dq_bits and dq_bits[x][0] == "w"]
        if not a and not w:
            continue
        label = _label("a", a, "32") + (_label("w", w, "") if w else "")
        nodes.setdefault(label, []).append(node_id(n, i))
    if float8:
        kinds = {label for label in nodes if "f8" not in label.replace("a32", "")}
        return PrecisionBreakdown("qdq-fp8" if not kinds else "mixed", "qdq", dict(sorted(nodes.items())))
    act = {int(label[1:].split("w")[0]) for label in nodes} - {32}
    wts = {int(label.split("w")[1]) for label in nodes if "w" in label}
    # NOTE: with 16-bit activations onnxruntime also quantizes constant Add/Mul operands with the
    # activation type, so an A16W8 model holds 16-bit "weights" too: 8-bit weights anywhere = a16w8.
    kind: PrecisionKind = ("qdq-a16w8" if 8 in wts else "qdq16") if act == {16} else "mixed"
    return PrecisionBreakdown(kind, "qdq", dict(sorted(nodes.items())))


def precision_breakdown(model: onnx.ModelProto) -> dict[str, int]:
    """How many compute nodes run at which weight precision: ``{"int4 weights (MatMulNBits)": 3, ...}``.

    Counts MatMulNBits by ``bits``, MatMuls fed by a block-wise DequantizeLinear by the weight's
    type, and the float MatMul / Gemm / Conv nodes left (what a mixed plan kept in float).

    Example:
        >>> precision_breakdown(onnx.load("mixed.onnx"))  # doctest: +SKIP
        {'int4 weights (MatMulNBits)': 2, 'int8 weights (MatMulNBits)': 1}
    """
    counts: Counter[str] = Counter()
    blocked_out: dict[str, str] = {}
    dq_out: set[str] = set()
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            dq_out.update(node.output)
            if any(a.name == "block_size" and a.i > 0 for a in node.attribute) and node.input[0] in inits:
                t = inits[node.input[0]].data_type
                blocked_out[node.output[0]] = onnx.TensorProto.DataType.Name(t).lower()
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            bits = next((a.i for a in node.attribute if a.name == "bits"), 4)
            counts[f"int{bits} weights (MatMulNBits)"] += 1
        elif node.op_type == "GatherBlockQuantized":
            t = inits[node.input[0]].data_type if node.input[0] in inits else onnx.TensorProto.UINT8
            counts[f"{onnx.TensorProto.DataType.Name(t).lower()} table (GatherBlockQuantized)"] += 1
        elif node.op_type in ("MatMul", "Gemm", "Conv"):
            w = node.input[1] if len(node.input) > 1 else ""
            if w in blocked_out:
                counts[f"{blocked_out[w]} weights (block-wise DequantizeLinear)"] += 1
            elif w not in dq_out and node.input[0] not in dq_out:
                counts[f"float {node.op_type}"] += 1
    return dict(sorted(counts.items()))


def describe(nodes: dict[str, list[str]], limit: int = 3) -> str:
    """One line for ``diag inspect``: ``fp16 38 nodes; fp32 2 (Softmax_1, MatMul_3)``.

    Example:
        >>> describe({"fp16": ["a", "b"], "fp32": ["c"]})
        'fp16 2 nodes; fp32 1 (c)'
    """
    ranked = sorted(nodes.items(), key=lambda kv: -len(kv[1]))
    parts = []
    for i, (label, names) in enumerate(ranked):
        if i == 0:
            parts.append(f"{label} {len(names)} nodes")
            continue
        shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
        parts.append(f"{label} {len(names)} ({shown})")
    return "; ".join(parts)


def activation_overrides(
    graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], majority: int, names: dict[int, str]
) -> dict[str, list[dict[str, str]]]:
    """``TensorQuantOverrides`` that reproduce activations quantized with another type than most.

    A QDQ model whose few activations have 16-bit zero points among 8-bit ones was made with
    ``activation_type`` = the 8-bit type and a per-tensor ``quant_type`` override for those few.

    Example:
        >>> activation_overrides(mixed.graph, inits, onnx.TensorProto.UINT8, QUANT_TYPE_NAMES)  # doctest: +SKIP
        {'layer1/ffn_norm/LayerNormalization_out': [{'quant_type': 'QUInt16'}]}
    """
    out: dict[str, list[dict[str, str]]] = {}
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in inits or len(node.input) < 3:
            continue
        zp = inits.get(node.input[2])
        if zp is not None and zp.data_type != majority and zp.data_type in names:
            out.setdefault(node.input[0], [{"quant_type": names[zp.data_type]}])
    return out


def _label(role: str, bits: list[int], none: str) -> str:
    """``a16``, ``w8``, ``af8`` (float8) for one node's inputs; ``none`` when it has no such input."""
    if not bits:
        return f"{role}{none}"
    return f"{role}f8" if FLOAT8_BITS in bits and max(bits) <= 8 else f"{role}{max(bits)}"
