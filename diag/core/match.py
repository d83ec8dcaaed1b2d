"""Pair FP32 tensors and nodes with their INT8 counterparts, for dynamic, QDQ and QOperator models.

Matching is structural first and by name second: onnxruntime's quantizer keeps most names, but
fuses Relu/Clip into the producer's output quantization (QDQ), folds BatchNormalization into Conv,
renames weights and, in QOperator models, keeps activations only as ``<t>_quantized`` integers.
Anything that cannot be paired is listed with a reason; nothing is guessed.

Three INT8 names matter for an FP32 tensor ``t``:

* ``int8_name``: the INT8 value to compare with FP32 ``t`` (what consumers of ``t`` really read
  in the INT8 model, e.g. ``t_DequantizeLinear_Output`` in QDQ, ``t_quantized`` in QOperator).
* ``cut_name``: the INT8 tensor that, replaced by the FP32 value of ``t`` (quantized with the
  model's own scale when it is an integer tensor), isolates the consumers of ``t`` from upstream
  error. Local error is measured by cutting the INT8 graph at every ``cut_name`` at once.
* ``tail``: INT8 nodes between ``cut_name`` and ``int8_name`` (the output Q/DQ pair in QDQ):
  replayed on the locally computed value so local and accumulated error measure the same thing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper

from diag.core.load import DYNAMIC_OPS, NBITS_OPS, QDQ_OPS, QOPERATOR_OPS, outer_scope_inputs, subgraphs
from diag.core.protos import node_id, value_dtypes
from diag.foundations.ortfacts import QUANTIZED_OPS, QuantizedOp, families_where

QUANT_OPS = DYNAMIC_OPS | QDQ_OPS | QOPERATOR_OPS | NBITS_OPS

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}

#: Where QOperator ops keep the scale / zero point of their *output* (input indices).
_OUTPUT_QPARAMS = {name: grid for name, op in QUANTIZED_OPS.items() if (grid := op.output_grid) is not None}


def _input_grids(op: QuantizedOp) -> tuple[tuple[int, int, int], ...]:
    """(input, scale, zero point) indices of each operand of ``op`` whose grid is an input."""
    operands = [op.operand(i) for i in range(len(op.operands))]
    return tuple((g.index, g.scale, g.zero_point) for g in operands if g.scale is not None and g.zero_point is not None)


#: Ops that read a quantized input with its grid: (input, scale, zero point) indices (QLinearConcat apart).
_INPUT_QPARAM_INDICES = {
    name: _input_grids(op)
    for name, op in QUANTIZED_OPS.items()
    if op.family in families_where(lambda f: f.input_grids) and _input_grids(op)
}


@dataclass(frozen=True)
class QuantParams:
    """A quantization grid: ``real = (q - zero_point) * scale``, q in ``[qmin, qmax]``."""

    scale: np.ndarray
    zero_point: np.ndarray
    qmin: int
    qmax: int
    axis: int | None = None

    @property
    def per_tensor_scale(self) -> float:
        return float(np.max(self.scale))

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        scale, zp = self._broadcast(q.ndim)
        out: np.ndarray = ((q.astype(np.float32) - zp) * scale).astype(np.float32)
        return out

    def quantize(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        scale, zp = self._broadcast(x.ndim)
        q = np.rint(x / scale) + zp
        out: np.ndarray = np.clip(q, self.qmin, self.qmax).astype(dtype)
        return out

    def _broadcast(self, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        scale = self.scale.astype(np.float32)
        zp = self.zero_point.astype(np.float32)
        if self.axis is not None and scale.ndim == 1 and scale.size > 1:
            shape = [1] * ndim
            shape[self.axis] = scale.size
            return scale.reshape(shape), zp.reshape(shape)
        return scale, zp


@dataclass
class TensorPair:
    """One FP32 tensor and the INT8 tensor it is compared with.

    Attributes:
        fp_name: FP32 tensor name.
        int8_name: INT8 tensor compared with it (dequantized first when ``dequant`` is set).
        how: ``same-name``, ``qdq`` (Q/DQ pair after the float value), ``qoperator`` or ``fp16``
            (the same name holding a float16 value, compared cast back to float32).
        cut_name: INT8 tensor replaced by the FP32 value for local error.
        cut_quant: when the cut tensor is an integer tensor, the grid to quantize FP32 onto.
        tail: INT8 nodes from ``cut_name`` to ``int8_name`` (replayed for local error).
        dequant: grid to dequantize ``int8_name`` with (QOperator integer tensors).
        grid: the static quantization grid applied to this tensor, if any (for rmse/scale).
        dynamic_scale: INT8 tensor holding the per-batch scale of DynamicQuantizeLinear, if any.
        producer: FP32 node (id) that writes the tensor, None for graph inputs.
    """

    fp_name: str
    int8_name: str
    how: str
    cut_name: str
    cut_quant: QuantParams | None = None
    cut_dtype: int = onnx.TensorProto.FLOAT
    tail: list[onnx.NodeProto] = field(default_factory=list)
    dequant: QuantParams | None = None
    grid: QuantParams | None = None
    dynamic_scale: str | None = None
    producer: str | None = None


@dataclass
class NodeGroup:
    """FP32 node(s) and the INT8 nodes the quantizer made of them.

    Usually one FP32 node; several when the quantizer fused them (Conv+Relu in QDQ,
    Conv+BatchNormalization). ``fp_nodes`` are the names to put in ``nodes_to_exclude``.
    """

    key: str
    fp_nodes: list[str]
    op_types: list[str]
    int8_nodes: list[str]
    outputs: list[str]
    quantized: bool
    unnamed: bool = False

    @property
    def label(self) -> str:
        """The name a user reads: the main compute node, plus what was fused into it."""
        if len(self.fp_nodes) == 1:
            return self.fp_nodes[0]
        return f"{self.fp_nodes[0]} (+{', '.join(self.fp_nodes[1:])})"

    @property
    def op_type(self) -> str:
        return "+".join(self.op_types)


#: Why an FP32 tensor has no INT8 counterpart, as the summary groups them (one sentence per cause):
#:
#: * ``fused``: the node writing it and the Relu / Clip after it became one INT8 node;
#: * ``folded``: the node writing it and the BatchNormalization after it became one INT8 node;
#: * ``renamed``: the INT8 model still computes it, under another name (an exporter's renaming);
#: * ``identity``: the node writing it multiplies or divides by 1, or adds or subtracts 0 (a
#:   LayerNorm whose gamma is 1 and beta 0), and the quantizer removed it; or (``merged_with`` the
#:   identity's op type) it flows through such removed nodes into a tensor the INT8 model has;
#: * ``missing``: no INT8 tensor of that name or its quantized forms: removed or renamed;
#: * ``shape``: paired, but its shape differs between the models at run time (found while running).
UnmatchedKind = Literal["fused", "folded", "renamed", "identity", "missing", "shape"]


@dataclass(frozen=True)
class UnmatchedCause:
    """Why one FP32 tensor is unmatched, as typed data: its kind, the FP32 op that writes it
    (``""`` for a graph input) and, when fused or folded, the op it was merged with."""

    kind: UnmatchedKind
    op_type: str
    merged_with: str = ""


@dataclass
class Matching:
    """Everything the matcher decided, including what it could not pair and why."""

    pairs: dict[str, TensorPair]
    unmatched_tensors: dict[str, str]
    skipped_tensors: dict[str, str]
    groups: list[NodeGroup]
    unmatched_nodes: dict[str, str]
    int8_only_nodes: list[str]
    fp_float_tensors: list[str]
    #: The cause of each unmatched tensor (the key set of ``unmatched_tensors``), for the summary.
    unmatched_causes: dict[str, UnmatchedCause] = field(default_factory=dict)

    @property
    def fused_away(self) -> list[str]:
        """Unmatched FP32 tensors the quantizer fused or folded away (structurally explained)."""
        return [t for t, c in self.unmatched_causes.items() if c.kind in ("fused", "folded")]

    @property
    def coverage(self) -> float:
        """Fraction of FP32 float tensors that have an INT8 counterpart."""
        total = len(self.fp_float_tensors)
        return 1.0 if total == 0 else len(self.pairs) / total


class TopLevelIndex:
    """Nodes, their ids, and the producer / consumers of every tensor of a graph's top level.

    Consumers include nodes whose subgraphs read the tensor from the outer scope (If / Loop).
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.nodes = list(model.graph.node)
        self.ids = [node_id(n, i) for i, n in enumerate(self.nodes)]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, n in enumerate(self.nodes):
            for o in n.output:
                if o:
                    self.producer[o] = i
            for name in list(n.input) + outer_scope_inputs(n):
                if name:
                    self.consumers[name].append(i)


class _GraphIndex(TopLevelIndex):
    """Producers, consumers, initializers and dtypes of one graph's top level."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        graph = model.graph
        self.initializers = {t.name: t for t in graph.initializer}
        for n in self.nodes:  # Constant nodes count as initializers for scale/zp lookup
            if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
                self.initializers.setdefault(n.output[0], n.attribute[0].t)
        self.graph_inputs = [i.name for i in graph.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in graph.output]
        self.dtypes = value_dtypes(model)

    def array(self, name: str) -> np.ndarray | None:
        t = self.initializers.get(name)
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        return numpy_helper.to_array(t)

    def exists(self, name: str) -> bool:
        return name in self.producer or name in self.graph_inputs


def _params(idx: _GraphIndex, scale_name: str, zp_name: str | None, axis: int | None) -> QuantParams | None:
    scale = idx.array(scale_name)
    if scale is None:
        return None
    zp = idx.array(zp_name) if zp_name else None
    if zp is not None and not np.issubdtype(zp.dtype, np.integer):
        return None  # a float8 grid (QFLOAT8E4M3FN) has no integer levels to count or round to
    if zp is None:
        zp = np.zeros_like(scale, dtype=np.uint8)
    info = np.iinfo(zp.dtype) if np.issubdtype(zp.dtype, np.integer) else np.iinfo(np.uint8)
    return QuantParams(scale.astype(np.float32), zp, int(info.min), int(info.max), axis)


def _node_params(idx: _GraphIndex, node: onnx.NodeProto, s: int, z: int) -> QuantParams | None:
    if len(node.input) <= s:
        return None
    zp = node.input[z] if len(node.input) > z and node.input[z] else None
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    return _params(idx, node.input[s], zp, axis if node.op_type in QDQ_OPS else None)


def _quantized_tensor_params(idx: _GraphIndex, name: str) -> QuantParams | None:
    """Find the grid of an integer activation in a QOperator graph: by name, producer, consumer."""
    base = name.removesuffix("_quantized")
    by_name = _params(idx, f"{base}_scale", f"{base}_zero_point", None)
    if by_name is not None:
        return by_name
    prod = idx.producer.get(name)
    if prod is not None:
        node = idx.nodes[prod]
        if node.op_type in _OUTPUT_QPARAMS:
            return _node_params(idx, node, *_OUTPUT_QPARAMS[node.op_type])
    for c in idx.consumers.get(name, []):
        node = idx.nodes[c]
        if node.op_type == "QLinearConcat":
            positions = [(i + 1, i + 2) for i in range(2, len(node.input), 3) if node.input[i] == name]
        else:
            positions = [
                (s, z)
                for i, s, z in _INPUT_QPARAM_INDICES.get(node.op_type, ())
                if i < len(node.input) and node.input[i] == name
            ]
        for s, z in positions:
            p = _node_params(idx, node, s, z)
            if p is not None:
                return p
    return None


#: Quantize / dequantize ops pairing reads: onnxruntime's (either domain: ``UseQDQContribOps``
#: writes com.microsoft ones under the same names) and AMD Quark's Extended ones (BF16, BFP, MX),
#: which pair the same way whether or not Quark's custom-op library is there to run them.
Q_OPS = frozenset({"QuantizeLinear", "ExtendedQuantizeLinear"})
DQ_OPS = frozenset({"DequantizeLinear", "ExtendedDequantizeLinear"})


def _qdq_chain_after(idx: _GraphIndex, name: str) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """A QuantizeLinear consuming ``name`` followed by a DequantizeLinear, if present."""
    candidates = []
    for c in idx.consumers.get(name, []):
        q = idx.nodes[c]
        if q.op_type not in Q_OPS or q.input[0] != name:
            continue
        for d in idx.consumers.get(q.output[0], []):
            dq = idx.nodes[d]
            if dq.op_type in DQ_OPS:
                candidates.append((q, dq))
    if not candidates:
        return None
    preferred = [c for c in candidates if c[1].output[0] == f"{name}_DequantizeLinear_Output"]
    return (preferred or candidates)[0]


def _dynamic_scale_of(idx: _GraphIndex, name: str) -> str | None:
    for c in idx.consumers.get(name, []):
        n = idx.nodes[c]
        if n.op_type == "DynamicQuantizeLinear" and len(n.output) > 1:
            return str(n.output[1])
    return None


def _qdq_pair(
    q: _GraphIndex,
    fp_name: str,
    int8_name: str,
    cut_name: str,
    tail: list[onnx.NodeProto],
    grid: QuantParams | None,
    producer: str | None,
) -> TensorPair:
    """A QDQ pair: the INT8 value is the Q/DQ ``tail`` replayed on ``cut_name``, fed at its own dtype."""
    dtype = _float_dtype(q, cut_name)
    return TensorPair(fp_name, int8_name, "qdq", cut_name, cut_dtype=dtype, tail=tail, grid=grid, producer=producer)


def _float_dtype(q: _GraphIndex, name: str) -> int:
    """Element type of a float tensor the cut model is fed at: float16 where the INT8 model computes
    in float16 (ModelOpt's default int8 QDQ with ``--high_precision_dtype fp16``), else float32."""
    return onnx.TensorProto.FLOAT16 if q.dtypes.get(name) == onnx.TensorProto.FLOAT16 else onnx.TensorProto.FLOAT


def _integer_dtype(q: _GraphIndex, name: str, grid: QuantParams | None) -> int:
    """Element type of a quantized tensor: declared, else its zero point's (QGemm outputs carry none)."""
    if name in q.dtypes:
        return q.dtypes[name]
    if grid is not None and grid.zero_point.dtype.kind in "iu":
        return onnx.helper.np_dtype_to_tensor_dtype(grid.zero_point.dtype)
    return onnx.TensorProto.UINT8


def _pair_for(fp_name: str, producer: str | None, q: _GraphIndex) -> TensorPair | None:
    """Find the INT8 counterpart of one FP32 tensor, or None."""
    if q.exists(fp_name):
        prod = q.producer.get(fp_name)
        pnode = q.nodes[prod] if prod is not None else None
        if pnode is not None and pnode.op_type in DQ_OPS:
            src = pnode.input[0]
            src_prod = q.producer.get(src)
            if src_prod is not None and q.nodes[src_prod].op_type in Q_OPS:
                qnode = q.nodes[src_prod]
                raw = qnode.input[0]
                grid = _node_params(q, qnode, 1, 2)
                return _qdq_pair(q, fp_name, fp_name, raw, [qnode, pnode], grid, producer)
            if src in q.producer:  # QOperator: an integer op's output dequantized to a float name
                grid = _node_params(q, pnode, 1, 2)
                return TensorPair(
                    fp_name,
                    fp_name,
                    "qoperator",
                    src,
                    cut_quant=grid,
                    cut_dtype=_integer_dtype(q, src, grid),
                    tail=[pnode],
                    grid=grid,
                    producer=producer,
                )
        chain = _qdq_chain_after(q, fp_name)
        if chain is not None:
            qnode, dq = chain
            grid = _node_params(q, qnode, 1, 2)
            return _qdq_pair(q, fp_name, dq.output[0], fp_name, [qnode, dq], grid, producer)
        grid = None
        for c in q.consumers.get(fp_name, []):
            if q.nodes[c].op_type in Q_OPS and q.nodes[c].input[0] == fp_name:
                grid = _node_params(q, q.nodes[c], 1, 2)
        fp16 = q.dtypes.get(fp_name) == onnx.TensorProto.FLOAT16
        return TensorPair(
            fp_name,
            fp_name,
            "fp16" if fp16 else "same-name",
            fp_name,
            cut_dtype=onnx.TensorProto.FLOAT16 if fp16 else onnx.TensorProto.FLOAT,
            grid=grid,
            dynamic_scale=_dynamic_scale_of(q, fp_name),
            producer=producer,
        )
    qname = f"{fp_name}_quantized"
    if qname in q.producer:
        params = _quantized_tensor_params(q, qname)
        if params is None:
            return None
        return TensorPair(
            fp_name,
            qname,
            "qoperator",
            qname,
            cut_quant=params,
            cut_dtype=_integer_dtype(q, qname, params),
            dequant=params,
            grid=params,
            producer=producer,
        )
    return None


def match_models(fp: onnx.ModelProto, int8: onnx.ModelProto) -> Matching:
    """Pair every FP32 tensor and node with its INT8 counterpart.

    Never modifies either model. Unmatched tensors and nodes carry a reason.

    Example:
        >>> m = match_models(fp_proto, int8_proto)  # doctest: +SKIP
        >>> m.pairs["relu2_out"].int8_name  # doctest: +SKIP
        'relu2_out_DequantizeLinear_Output'
    """
    f = _GraphIndex(fp)
    q = _GraphIndex(int8)
    pairs: dict[str, TensorPair] = {}
    unmatched: dict[str, str] = {}
    causes: dict[str, UnmatchedCause] = {}
    skipped: dict[str, str] = {}
    float_tensors: list[str] = []

    candidates: list[tuple[str, str | None]] = [(n, None) for n in f.graph_inputs]
    for i, node in enumerate(f.nodes):
        for o in node.output:
            if o:
                candidates.append((o, f.ids[i]))
    for name, producer in candidates:
        dtype = f.dtypes.get(name)
        if dtype is not None and dtype not in FLOAT_TYPES:
            skipped[name] = f"{onnx.TensorProto.DataType.Name(dtype).lower()} tensor: not quantized, not compared"
            continue
        if producer is not None and f.nodes[f.producer[name]].op_type == "Constant":
            skipped[name] = "Constant output: compared as a weight, not an activation"
            continue
        float_tensors.append(name)
        pair = _pair_for(name, producer, q)
        if pair is None:
            unmatched[name], causes[name] = _unmatched_reason(name, f, q)
        else:
            pairs[name] = pair

    _move_fused_activations(f, q, pairs, unmatched, causes)
    groups, unmatched_nodes, covered = _node_groups(f, q, pairs)
    int8_only = [q.ids[i] for i in range(len(q.nodes)) if i not in covered]
    return Matching(pairs, unmatched, skipped, groups, unmatched_nodes, int8_only, float_tensors, causes)


_FUSABLE_ACTIVATIONS = ("Relu", "Clip")


def _move_fused_activations(
    f: _GraphIndex,
    q: _GraphIndex,
    pairs: dict[str, TensorPair],
    unmatched: dict[str, str],
    causes: dict[str, UnmatchedCause],
) -> None:
    """QOperator fuses Relu/Clip into the producer's output range: ``t_quantized`` then holds
    the activation's output ``u``, not ``t``. Re-pair it with ``u`` instead of reporting a
    bogus huge error on ``t``."""
    for i, node in enumerate(f.nodes):
        if node.op_type not in _FUSABLE_ACTIVATIONS or not node.input or not node.output:
            continue
        t, u = node.input[0], node.output[0]
        pair = pairs.get(t)
        if pair is None or u in pairs or q.exists(u) or f"{u}_quantized" in q.producer:
            continue
        if len(f.consumers.get(t, [])) != 1:
            continue
        prod = q.producer.get(pair.cut_name)
        if prod is None or q.nodes[prod].op_type in Q_OPS | {"DynamicQuantizeLinear"}:
            continue
        del pairs[t]
        pair.fp_name = u
        pair.producer = f.ids[i]
        pairs[u] = pair
        unmatched.pop(u, None)
        causes.pop(u, None)
        writer = f.producer.get(t)
        causes[t] = UnmatchedCause("fused", f.nodes[writer].op_type if writer is not None else "", node.op_type)
        unmatched[t] = (
            f"fused away by the quantizer: {node.op_type} '{f.ids[i]}' was folded into "
            f"the output range of INT8 node '{q.ids[prod]}'; compared at '{u}'"
        )


def _unmatched_reason(name: str, f: _GraphIndex, q: _GraphIndex) -> tuple[str, UnmatchedCause]:
    """Why ``name`` has no INT8 counterpart: the sentence for this tensor and its typed cause."""
    prod = f.producer.get(name)
    writer = f.nodes[prod].op_type if prod is not None else ""
    consumers = f.consumers.get(name, [])
    if prod is not None and len(consumers) == 1:
        c = f.nodes[consumers[0]]
        p = f.nodes[prod]
        if c.op_type in ("Relu", "Clip", "BatchNormalization") and c.output and q.exists(c.output[0]):
            renamed = _still_computed(p.op_type, c, q)
            if renamed is not None:  # the INT8 model still has both nodes: nothing was fused
                return (
                    f"renamed, not fused: INT8 {p.op_type} '{q.ids[renamed]}' still computes it, as "
                    f"'{q.nodes[renamed].output[0]}' (the exporter or the quantizer named it differently)"
                ), UnmatchedCause("renamed", writer)
            how: UnmatchedKind = "folded" if c.op_type == "BatchNormalization" else "fused"
            return (
                f"{how} away by the quantizer: {p.op_type} '{f.ids[prod]}' + {c.op_type} "
                f"'{f.ids[consumers[0]]}' became one INT8 node; compared at '{c.output[0]}'"
            ), UnmatchedCause(how, writer, c.op_type)
    if prod is not None and _is_identity(f.nodes[prod], f):
        return (
            f"removed by the quantizer: {writer} '{f.ids[prod]}' "
            f"{'multiplies or divides by 1' if writer in ('Mul', 'Div') else 'adds or subtracts 0'}, an identity"
        ), UnmatchedCause("identity", writer)
    through = _through_identities(name, f, q)
    if through is not None:
        first, end = through
        return (
            f"passed on by identity node(s) the quantizer removed ({first} by 1 or 0 ...): compared as '{end}'"
        ), UnmatchedCause("identity", writer, first)
    return (
        f"no INT8 tensor named '{name}', '{name}_quantized' or "
        f"'{name}_DequantizeLinear_Output'; the quantizer removed or renamed it"
    ), UnmatchedCause("missing", writer)


def _through_identities(name: str, f: _GraphIndex, q: _GraphIndex) -> tuple[str, str] | None:
    """(the first identity's op type, the tensor the INT8 model has) when ``name`` flows, as the
    only input of a chain of identity nodes (:func:`_is_identity`), into a tensor the INT8 model
    computes; None otherwise."""
    first, t = "", name
    for _ in range(8):  # a LayerNorm's Mul by 1 then Add of 0; longer chains are not identities' work
        consumers = f.consumers.get(t, [])
        if len(consumers) != 1 or not _is_identity(f.nodes[consumers[0]], f):
            return None
        node = f.nodes[consumers[0]]
        first, t = first or node.op_type, node.output[0]
        if q.exists(t):
            return first, t
    return None


def _is_identity(node: onnx.NodeProto, f: _GraphIndex) -> bool:
    """Does ``node`` pass its computed input through unchanged: ``x * 1``, ``x / 1``, ``x + 0``,
    ``x - 0`` with a constant operand that does not broadcast ``x`` to a bigger shape? (Quark and
    onnxruntime's optimizer remove such nodes.)"""
    neutral = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}.get(node.op_type)
    if neutral is None or len(node.input) != 2:
        return False
    constants = [f.array(x) for x in node.input]
    sides = [i for i, c in enumerate(constants) if c is not None]
    if len(sides) != 1 or (node.op_type in ("Div", "Sub") and sides[0] != 1):
        return False
    c = constants[sides[0]]
    assert c is not None
    return bool(c.size) and c.ndim <= 1 and bool(np.all(c == neutral))


def _still_computed(op_type: str, consumer: onnx.NodeProto, q: _GraphIndex) -> int | None:
    """The INT8 node of ``op_type`` that feeds the INT8 copy of ``consumer`` (through Q/DQ), if the
    INT8 model still runs ``consumer`` as its own node; None when the two became one node."""
    at = q.producer.get(consumer.output[0])
    if at is None or q.nodes[at].op_type != consumer.op_type or not q.nodes[at].input:
        return None
    x = q.nodes[at].input[0]
    for _ in range(3):  # DequantizeLinear <- QuantizeLinear <- the producer
        node = q.producer.get(x)
        if node is None:
            return None
        if q.nodes[node].op_type == op_type:
            return node
        if q.nodes[node].op_type not in Q_OPS | DQ_OPS or not q.nodes[node].input:
            return None
        x = q.nodes[node].input[0]
    return None


def _node_groups(
    f: _GraphIndex, q: _GraphIndex, pairs: dict[str, TensorPair]
) -> tuple[list[NodeGroup], dict[str, str], set[int]]:
    """Walk the INT8 graph back from each matched FP32 output to the boundary of its inputs."""
    boundary: set[str] = set(q.initializers) | set(q.graph_inputs)
    for p in pairs.values():
        boundary.update({p.int8_name, p.cut_name})
    own: dict[str, set[str]] = defaultdict(set)
    for p in pairs.values():
        if p.producer is not None:
            own[p.producer].update({p.int8_name, p.cut_name})
            own[p.producer].update(o for n in p.tail for o in n.output)

    groups: dict[str, NodeGroup] = {}
    covered: set[int] = set()
    unmatched_nodes: dict[str, str] = {}
    fused_into: dict[str, tuple[str, str]] = {}
    for i, node in enumerate(f.nodes):
        nid = f.ids[i]
        if node.op_type == "Constant":
            continue
        outs = [o for o in node.output if o in pairs]
        if not outs:
            continue
        found = _walk_back(q, [pairs[o].int8_name for o in outs], boundary, own[nid])
        covered.update(found)
        # An FP16 model has no quantization op: a node counts as low-precision when it writes float16.
        quantized = any(
            q.nodes[j].op_type in QUANT_OPS
            or any(q.dtypes.get(o) == onnx.TensorProto.FLOAT16 for o in q.nodes[j].output)
            for j in found
        )
        groups[nid] = NodeGroup(
            nid, [nid], [node.op_type], [q.ids[j] for j in found], outs, quantized, unnamed=not node.name
        )

    # FP32 nodes with no matched output: fused into the consumer that has one, else unmatched.
    for i, node in enumerate(f.nodes):
        nid = f.ids[i]
        if nid in groups or node.op_type == "Constant":
            continue
        float_outs = [o for o in node.output if o and f.dtypes.get(o, onnx.TensorProto.FLOAT) in FLOAT_TYPES]
        if not float_outs:
            continue  # integer-only node (shapes, indices): nothing to compare
        consumers = {f.ids[c] for o in float_outs for c in f.consumers.get(o, [])}
        target = next((c for c in consumers if c in groups), None) if len(consumers) == 1 else None
        if target is not None:
            fused_into[nid] = (target, node.op_type)
        else:
            unmatched_nodes[nid] = "none of its outputs has an INT8 counterpart (see unmatched tensors)"
    for nid, (target, op_type) in fused_into.items():
        g = groups[target]
        g.fp_nodes.insert(0, nid)
        g.op_types.insert(0, op_type)
    unmatched_nodes.update(_subgraph_nodes(f))
    ordered = [groups[f.ids[i]] for i in range(len(f.nodes)) if f.ids[i] in groups]
    return ordered, unmatched_nodes, covered


def _walk_back(q: _GraphIndex, starts: list[str], boundary: set[str], mine: set[str]) -> list[int]:
    """INT8 node indices (sorted) between ``starts`` and the boundary: weights, inputs, other FP32 tensors.

    ``mine`` are boundary tensors of the group itself (its own cut and tail), walked through.
    """
    walked: set[int] = set()
    seen: set[str] = set()
    stack = list(starts)
    while stack and len(walked) < 500:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in boundary and t not in mine:  # another FP32 tensor, a weight or a model input
            continue
        prod = q.producer.get(t)
        if prod is None or prod in walked:
            continue
        walked.add(prod)
        pn = q.nodes[prod]
        stack.extend(x for x in list(pn.input) + outer_scope_inputs(pn) if x)
    return sorted(walked)


def _subgraph_nodes(f: _GraphIndex) -> dict[str, str]:
    """Every node inside an If / Loop / Scan body of the FP32 graph, with why it is not measured."""
    out: dict[str, str] = {}
    for i, node in enumerate(f.nodes):
        for sub in subgraphs(node):
            for j, sn in enumerate(sub.node):
                out[node_id(sn, j) if sn.name else f"{f.ids[i]}/{sn.op_type}#{j}"] = (
                    f"inside a subgraph of {node.op_type} '{f.ids[i]}': onnxruntime cannot return "
                    "subgraph values as model outputs; its error is measured at the "
                    f"{node.op_type}'s outputs"
                )
    return out
