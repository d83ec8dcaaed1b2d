"""Recognise the usual subgraph patterns of the FP32 graph and total the error per pattern.

A node id such as ``node_Add_213`` means little to the person who has to fix the model; "LayerNorm
in layer1 (ffn_norm)" or "Conv+HardSwish #12" does. This module finds LayerNorm (decomposed or
fused), RMSNorm, GELU (Erf, Tanh and Sigmoid forms, or fused), Softmax (op or Exp/ReduceSum/Div), attention
(MatMul-Softmax-MatMul), linear layers (MatMul/Gemm on a constant weight, + bias), residual Adds,
Conv+activation blocks, squeeze-and-excitation blocks and the heads feeding each graph output, and
sums local / accumulated error over each instance and each kind.

Matching looks only at op types, graph structure (producer / consumer edges) and constant operands
(the 0.5, sqrt(2) and 1 of GELU, the pow 2 and eps of LayerNorm, the 3 and 6 of HardSwish), never at
node names: exporters name nodes however they like, and many (paddle2onnx) leave them empty. Names
are only used afterwards, to write a label a user recognises.

Patterns may nest (an attention instance contains its softmax, an SE block contains two Conv+act
blocks). A node can therefore belong to several instances of different kinds; per-kind totals
count every node once.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from diag.core.graph import fp_graph
from diag.core.match import TopLevelIndex
from diag.core.metrics import ErrorStats

#: Display names of the kinds; also the order kinds are reported in when positions tie.
KIND_NAMES = {
    "layernorm": "LayerNorm",
    "rmsnorm": "RMSNorm",
    "gelu": "GELU",
    "softmax": "Softmax",
    "attention": "Attention",
    "linear": "Linear",
    "residual": "Residual Add",
    "conv-act": "Conv+activation",
    "se": "SE block",
    "head": "Head",
}

_FUSED = {
    "LayerNormalization": "layernorm",
    "SkipLayerNormalization": "layernorm",
    "SimplifiedLayerNormalization": "rmsnorm",
    "SkipSimplifiedLayerNormalization": "rmsnorm",
    "RMSNormalization": "rmsnorm",
    "Gelu": "gelu",
    "FastGelu": "gelu",
    "BiasGelu": "gelu",
    "Softmax": "softmax",
    "Attention": "attention",
    "MultiHeadAttention": "attention",
    "GroupQueryAttention": "attention",
}
_CONV = {"Conv", "ConvTranspose"}
_LINEAR = {"Conv", "ConvTranspose", "Gemm", "MatMul"}
#: Single-op activations and how a label names them (Clip is refined to ReLU6 when it is one).
_ACTIVATIONS = {
    "Relu": "ReLU",
    "Clip": "Clip",
    "LeakyRelu": "LeakyReLU",
    "PRelu": "PReLU",
    "Sigmoid": "Sigmoid",
    "HardSigmoid": "HardSigmoid",
    "HardSwish": "HardSwish",
    "Tanh": "Tanh",
    "Elu": "ELU",
    "Selu": "SELU",
    "Celu": "CELU",
    "Softplus": "Softplus",
    "Mish": "Mish",
    "Gelu": "GELU",
}
#: Ops whose only "data" input is the first one; the others are shapes, scales, indices.
_DATA_INPUT0 = {"Reshape", "Expand", "Tile", "Slice", "Resize", "Upsample", "Pad", "Squeeze", "Unsqueeze", "Clip"}
#: Ops that compute a constant from constants (shape plumbing around Constant nodes).
_FOLDABLE = {"Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Transpose", "Expand", "Concat", "Neg", "Sqrt"}
#: Ops that read only a tensor's shape: they do not make it a branch point.
_SHAPE_ONLY = {"Shape", "Size"}
_GLOBAL_POOL = {"GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax"}
_RESHAPE_LIKE = {"Flatten", "Reshape", "Squeeze", "Transpose", "Identity", "Dropout", "Cast"}
_AFTER_CLASSIFIER = {"Add", "Sub", "Mul", "Div", "Softmax", "LogSoftmax", "Sigmoid", "Identity", "Flatten"}
_AFTER_CLASSIFIER |= {"Reshape", "Squeeze", "Cast"}
#: A dense head is cut after this many linear (Conv/ConvTranspose/Gemm/MatMul) ops from the output.
DENSE_HEAD_MAX_LINEAR = 3

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


@dataclass(frozen=True)
class PatternInstance:
    """One occurrence of a pattern in the FP32 graph.

    Attributes:
        kind: one of :data:`KIND_NAMES` (``"layernorm"``, ``"gelu"``, ``"conv-act"``, ...).
        label: what a user reads, unique within one model: ``"LayerNorm in layer1 (ffn_norm)"``,
            ``"Conv+HardSwish #12"``.
        nodes: FP32 node ids (:func:`diag.core.match.node_id`) in graph order; Constant nodes excluded.
        output: the tensor the pattern produces (its last node's output).
    """

    kind: str
    label: str
    nodes: tuple[str, ...]
    output: str


@dataclass(frozen=True)
class PatternTotal:
    """Error totalled over one pattern instance, or over every instance of one kind.

    Energies are sums of squared error (``mse * count``) over the distinct tensors of the nodes
    (nodes fused into one group share a tensor and count once); ``local_share`` is that energy over
    the local error energy of every measured tensor of the model, so shares of disjoint instances
    add up and say how much of the damage a pattern explains. Energy is absolute: a tensor with a
    large range (an outlier channel) weighs more than a small one at the same SQNR, which is why
    the scale-free worst local SQNR is reported next to it.

    Attributes:
        kind: pattern kind.
        label: the instance label, or the kind's display name for per-kind rows.
        instances: 1 for an instance row, the number of instances for a kind row.
        nodes: FP32 nodes covered.
        measured: of those, nodes with local or accumulated error figures.
        worst_local_sqnr_db: lowest local SQNR over the nodes (None when nothing was measured).
        worst_local_node: the node with that SQNR.
        worst_accumulated_sqnr_db: lowest accumulated SQNR over the nodes.
        output_accumulated_sqnr_db: accumulated SQNR of the instance's output tensor (instance rows).
        local_energy: summed local squared error.
        local_share: ``local_energy`` / total local error energy of the model (0 when that is 0).
    """

    kind: str
    label: str
    instances: int
    nodes: int
    measured: int
    worst_local_sqnr_db: float | None
    worst_local_node: str | None
    worst_accumulated_sqnr_db: float | None
    output_accumulated_sqnr_db: float | None
    local_energy: float
    local_share: float


class _Index(TopLevelIndex):
    """Producers, consumers and constants of the top-level graph, by tensor name."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        graph = model.graph
        self.outputs = [o.name for o in graph.output]
        self.output_set = set(self.outputs)
        self._protos: dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
        self._values: dict[str, np.ndarray | None] = {}
        self.const: set[str] = set(self._protos)
        for n in self.nodes:
            if n.op_type in ("Constant", "ConstantOfShape"):
                self.const.update(o for o in n.output if o)
                for a in n.attribute:
                    if n.op_type == "Constant" and a.name == "value":
                        self._protos[n.output[0]] = a.t
                    elif n.op_type == "Constant" and a.name in ("value_float", "value_floats", "value_int"):
                        self._values[n.output[0]] = np.asarray(helper.get_attribute_value(a))
            elif n.op_type in _FOLDABLE and all(t in self.const for t in n.input if t):
                self.const.update(o for o in n.output if o)
        self._graph: nx.DiGraph | None = None
        self._model = model

    @property
    def graph(self) -> nx.DiGraph:
        if self._graph is None:
            self._graph = fp_graph(self._model)
        return self._graph

    def op(self, i: int) -> str:
        return self.nodes[i].op_type

    def scalar(self, t: str) -> float | None:
        """The value of a constant whose elements are all equal, else None (weights, external data)."""
        if t not in self._values:
            value: np.ndarray | None = None
            proto = self._protos.get(t)
            if proto is not None and math.prod(proto.dims) <= 4096:  # never decode a weight matrix
                try:
                    value = numpy_helper.to_array(proto)
                except (ValueError, TypeError, OSError):  # external data not loaded, odd dtypes
                    value = None
            self._values[t] = value
        arr = self._values[t]
        if arr is None or arr.size == 0 or arr.size > 4096 or not np.issubdtype(arr.dtype, np.number):
            return None
        flat = arr.reshape(-1).astype(np.float64)
        return float(flat[0]) if np.all(flat == flat[0]) else None

    def is_scalar(self, t: str, value: float, rel: float = 1e-3) -> bool:
        v = self.scalar(t)
        return v is not None and math.isclose(v, value, rel_tol=rel, abs_tol=1e-6)

    def data_inputs(self, i: int) -> list[str]:
        """Non-constant inputs of node ``i`` (only the first for shape-taking ops such as Reshape)."""
        n = self.nodes[i]
        ins = list(n.input[:1]) if n.op_type in _DATA_INPUT0 else list(n.input)
        return [t for t in ins if t and t not in self.const]

    def only_consumer(self, t: str) -> int | None:
        """The single node reading ``t``, or None when several read it or it is a graph output."""
        cons = self.consumers.get(t, [])
        return cons[0] if len(cons) == 1 and t not in self.output_set else None

    def consumers_of(self, t: str, op: str) -> list[int]:
        return [c for c in self.consumers.get(t, []) if self.op(c) == op]

    def other_input(self, i: int, t: str) -> str | None:
        """For a binary node reading ``t``, its other operand."""
        ins = list(self.nodes[i].input)
        if len(ins) != 2 or t not in ins:
            return None
        return ins[1] if ins[0] == t else ins[0]

    def has_subgraph(self, i: int) -> bool:
        return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in self.nodes[i].attribute)

    def has_const_weight(self, i: int) -> bool:
        ins = self.nodes[i].input
        return len(ins) > 1 and ins[1] in self.const

    def out(self, i: int) -> str:
        outs = self.nodes[i].output
        return outs[0] if outs else ""


# --------------------------------------------------------------------------------------------
# Matchers. Each returns node indices (graph order is restored later) plus the output tensor.
# --------------------------------------------------------------------------------------------

_Match = tuple[list[int], str]


def _affine_tail(ix: _Index, t: str, nodes: list[int], limit: int = 2) -> str:
    """Follow Mul / Add / Sub / Div nodes with a constant operand after ``t`` (scale, bias)."""
    for _ in range(limit):
        c = ix.only_consumer(t)
        if c is None or ix.op(c) not in ("Mul", "Add", "Sub", "Div"):
            break
        other = ix.other_input(c, t)
        if other is None or other not in ix.const or (ix.op(c) in ("Sub", "Div") and ix.nodes[c].input[0] != t):
            break
        nodes.append(c)
        t = ix.out(c)
    return t


def _variance_tail(ix: _Index, d: str) -> _Match | None:
    """``d / sqrt(mean(d²) + eps)`` starting from ``d``: the part LayerNorm and RMSNorm share."""
    for sq in ix.consumers.get(d, []):
        n = ix.nodes[sq]
        pow2 = n.op_type == "Pow" and len(n.input) == 2 and n.input[0] == d and ix.is_scalar(n.input[1], 2.0)
        if not (pow2 or (n.op_type == "Mul" and list(n.input) == [d, d])):
            continue
        r = ix.only_consumer(ix.out(sq))
        if r is None or ix.op(r) != "ReduceMean":
            continue
        a = ix.only_consumer(ix.out(r))
        if a is None or ix.op(a) != "Add":
            continue
        eps = ix.other_input(a, ix.out(r))
        v = ix.scalar(eps) if eps is not None else None
        if v is None or not 0.0 < v < 1e-2:
            continue
        s = ix.only_consumer(ix.out(a))
        if s is None or ix.op(s) != "Sqrt":
            continue
        nodes = [sq, r, a, s]
        std = ix.out(s)
        for c in ix.consumers.get(std, []):
            if ix.op(c) == "Div" and list(ix.nodes[c].input) == [d, std]:
                return [*nodes, c], ix.out(c)
            if ix.op(c) == "Reciprocal":
                for m in ix.consumers_of(ix.out(c), "Mul"):
                    if ix.other_input(m, ix.out(c)) == d:
                        return [*nodes, c, m], ix.out(m)
    return None


def _layernorm_at(ix: _Index, i: int) -> _Match | None:
    """Decomposed LayerNorm anchored at its first ``ReduceMean(x)``: (x - mean) / std * g + b."""
    x = ix.nodes[i].input[0]
    for sub in ix.consumers_of(ix.out(i), "Sub"):
        if list(ix.nodes[sub].input) != [x, ix.out(i)]:
            continue
        tail = _variance_tail(ix, ix.out(sub))
        if tail is None:
            continue
        nodes = [i, sub, *tail[0]]
        return nodes, _affine_tail(ix, tail[1], nodes)
    return None


def _rmsnorm_at(ix: _Index, i: int, taken: set[int]) -> _Match | None:
    """Decomposed RMSNorm anchored at ``Pow(x, 2)``: x / sqrt(mean(x²) + eps) * g."""
    n = ix.nodes[i]
    if i in taken or len(n.input) != 2 or not ix.is_scalar(n.input[1], 2.0):
        return None
    tail = _variance_tail(ix, n.input[0])
    if tail is None or tail[0][0] != i:
        return None
    nodes = list(tail[0])
    return nodes, _affine_tail(ix, tail[1], nodes, limit=1)


def _gelu_outer(ix: _Index, plus: str) -> tuple[list[int], str, str] | None:
    """The ``0.5 * x * (1 + core)`` products after ``plus`` = 1 + core; returns nodes, x, output."""

    def half(i: int, t: str) -> bool:
        o = ix.other_input(i, t)
        return o is not None and (
            (ix.op(i) == "Mul" and ix.is_scalar(o, 0.5)) or (ix.op(i) == "Div" and ix.is_scalar(o, 2.0))
        )

    m1 = ix.only_consumer(plus)
    if m1 is None or ix.op(m1) not in ("Mul", "Div"):
        return None
    other = ix.other_input(m1, plus)
    if other is None:
        return None
    if half(m1, plus):  # ((1 + core) * 0.5) * x
        m2 = ix.only_consumer(ix.out(m1))
        if m2 is None or ix.op(m2) != "Mul":
            return None
        x = ix.other_input(m2, ix.out(m1))
        return ([m1, m2], x, ix.out(m2)) if x is not None else None
    if ix.op(m1) != "Mul":
        return None
    p = ix.producer.get(other)
    if p is not None and ix.op(p) in ("Mul", "Div") and ix.only_consumer(other) == m1:
        x = ix.nodes[p].input[0] if ix.op(p) == "Div" else next(iter(ix.data_inputs(p)), "")
        if half(p, x):  # (x * 0.5) * (1 + core)
            return [p, m1], x, ix.out(m1)
    m2 = ix.only_consumer(ix.out(m1))  # (x * (1 + core)) * 0.5
    if m2 is not None and half(m2, ix.out(m1)):
        return [m1, m2], other, ix.out(m2)
    return None


def _gelu_at(ix: _Index, core: int) -> _Match | None:
    """Decomposed GELU around its ``Erf`` or ``Tanh`` node.

    The outer products (with x and 0.5) name x; the inner part is every elementwise node between x
    and the core, whose constants must be GELU's: 1/sqrt(2) (Erf form) or 0.044715 and sqrt(2/pi)
    (Tanh form). Checking constants rather than one node order accepts the many equivalent
    exports (``x/sqrt2`` or ``x*0.7071``, ``Pow(x,3)`` or ``x*x*x``, FastGelu's factored form).
    """
    a = ix.only_consumer(ix.out(core))
    if a is None or ix.op(a) != "Add":
        return None
    one = ix.other_input(a, ix.out(core))
    if one is None or not ix.is_scalar(one, 1.0):
        return None
    outer = _gelu_outer(ix, ix.out(a))
    if outer is None:
        return None
    outer_nodes, x, output = outer
    if x in ix.const:
        return None
    inner: list[int] = []
    consts: list[float] = []
    reached_x = False
    stack = [ix.nodes[core].input[0]]
    while stack:
        t = stack.pop()
        if t == x:
            reached_x = True
            continue
        if t in ix.const:
            v = ix.scalar(t)
            if v is None:
                return None
            consts.append(v)
            continue
        p = ix.producer.get(t)
        if p is None or ix.op(p) not in ("Mul", "Div", "Add", "Pow") or len(inner) >= 6:
            return None
        if p not in inner:
            inner.append(p)
            stack.extend(ix.nodes[p].input)
    if not inner or not reached_x:
        return None

    def has(value: float) -> bool:
        return any(math.isclose(c, value, rel_tol=1e-3) for c in consts)

    if ix.op(core) == "Erf":
        ok = has(_SQRT2) or has(1.0 / _SQRT2)
    else:
        ok = has(_GELU_CUBIC) and (has(_SQRT_2_OVER_PI) or has(_GELU_CUBIC * _SQRT_2_OVER_PI))
    if not ok:
        return None
    return [*inner, core, a, *outer_nodes], output


def _any_gelu_at(ix: _Index, i: int, op: str) -> _Match | None:
    """A GELU around node ``i``: decomposed around its ``Erf`` / ``Tanh``, or QuickGELU around its ``Sigmoid``."""
    return _quick_gelu_at(ix, i) if op == "Sigmoid" else _gelu_at(ix, i)


def _quick_gelu_at(ix: _Index, sig: int) -> _Match | None:
    """Sigmoid-approximated GELU (CLIP's QuickGELU): x * Sigmoid(1.702 * x)."""
    p = ix.producer.get(ix.nodes[sig].input[0])
    if p is None or ix.op(p) != "Mul" or ix.only_consumer(ix.out(p)) != sig:
        return None
    ins = list(ix.nodes[p].input)
    k = next((t for t in ins if ix.is_scalar(t, 1.702)), None)
    if k is None:
        return None
    x = ins[1] if ins[0] == k else ins[0]
    m = ix.only_consumer(ix.out(sig))
    if m is None or ix.op(m) != "Mul" or ix.other_input(m, ix.out(sig)) != x:
        return None
    return [p, sig, m], ix.out(m)


def _softmax_at(ix: _Index, e: int) -> _Match | None:
    """Decomposed softmax anchored at ``Exp``: [x - max(x)] -> Exp -> ReduceSum -> Div."""
    ex = ix.out(e)
    for rs in ix.consumers_of(ex, "ReduceSum"):
        for d in ix.consumers_of(ix.out(rs), "Div"):
            if list(ix.nodes[d].input) != [ex, ix.out(rs)]:
                continue
            nodes = [e, rs, d]
            p = ix.producer.get(ix.nodes[e].input[0])
            if p is not None and ix.op(p) == "Sub":
                y, m = ix.nodes[p].input
                mp = ix.producer.get(m)
                if mp is not None and ix.op(mp) == "ReduceMax" and ix.nodes[mp].input[0] == y:
                    nodes += [mp, p]
            return nodes, ix.out(d)
    return None


def _attention_at(ix: _Index, softmax: _Match) -> _Match | None:
    """MatMul(q, k) -> [scale, mask] -> softmax -> MatMul(probs, v), both MatMuls on activations."""
    # The scores enter the softmax at its earliest node (Softmax, Exp, or ReduceMax / Sub of x - max(x)).
    t = ix.nodes[min(softmax[0])].input[0]
    inner: list[int] = []
    qk = None
    for step in range(4):
        p = ix.producer.get(t)
        if p is None or (step > 0 and ix.only_consumer(t) is None):
            return None
        if ix.op(p) == "MatMul":
            qk = p
            break
        if ix.op(p) not in ("Mul", "Div", "Add", "Sub", "Where", "Cast"):
            return None
        inner.append(p)
        # Scale and mask ops carry the scores in their first operand (Where: the second), by export convention.
        t = ix.nodes[p].input[1] if ix.op(p) == "Where" else ix.nodes[p].input[0]
        if t in ix.const:
            return None
    if qk is None or len(ix.data_inputs(qk)) != 2:
        return None
    probs = softmax[1]
    passthrough: list[int] = []  # Dropout / Cast / Identity some exporters leave after the softmax
    while (c := ix.only_consumer(probs)) is not None and ix.op(c) in ("Dropout", "Cast", "Identity"):
        passthrough.append(c)
        probs = ix.out(c)
    for pv in ix.consumers_of(probs, "MatMul"):
        if ix.nodes[pv].input[0] == probs and len(ix.data_inputs(pv)) == 2:
            nodes = [qk, *inner, *softmax[0], *passthrough, pv]
            kt = ix.producer.get(ix.nodes[qk].input[1])
            if kt is not None and ix.op(kt) == "Transpose" and ix.only_consumer(ix.out(kt)) == qk:
                nodes.append(kt)
            return nodes, ix.out(pv)
    return None


def _activation_after(ix: _Index, t: str) -> tuple[list[int], str, str] | None:
    """An activation applied to ``t``: single op, x*HardSigmoid(x), x*Sigmoid(x), or x*Clip(x+3,0,6)/6."""
    cons = ix.consumers.get(t, [])
    if t in ix.output_set or not cons:
        return None
    if len(cons) == 1 and ix.op(cons[0]) in _ACTIVATIONS:
        c = cons[0]
        name = _ACTIVATIONS[ix.op(c)]
        if ix.op(c) == "Clip":
            n = ix.nodes[c]
            lo = n.input[1] if len(n.input) > 1 else ""
            hi = n.input[2] if len(n.input) > 2 else ""
            if ix.is_scalar(lo, 0.0) and ix.is_scalar(hi, 6.0):
                name = "ReLU6"
        return [c], name, ix.out(c)
    if len(cons) != 2:
        return None
    ops = {ix.op(c): c for c in cons}
    mul = ops.get("Mul")
    if mul is None or len(ops) != 2:
        return None
    gate_op = next(o for o in ops if o != "Mul")
    gate = ops[gate_op]
    if gate_op in ("Sigmoid", "HardSigmoid"):
        if ix.other_input(mul, t) != ix.out(gate):
            return None
        return [gate, mul], "Swish" if gate_op == "Sigmoid" else "HardSwish", ix.out(mul)
    if gate_op != "Add" or not ix.is_scalar(ix.other_input(gate, t) or "", 3.0):
        return None
    clip = ix.only_consumer(ix.out(gate))
    if clip is None or ix.op(clip) != "Clip" or ix.other_input(mul, t) != ix.out(clip):
        return None
    n = ix.nodes[clip]
    if len(n.input) < 3 or not (ix.is_scalar(n.input[1], 0.0) and ix.is_scalar(n.input[2], 6.0)):
        return None
    d = ix.only_consumer(ix.out(mul))
    if d is None:
        return None
    six = ix.other_input(d, ix.out(mul)) or ""
    if not ((ix.op(d) == "Div" and ix.is_scalar(six, 6.0)) or (ix.op(d) == "Mul" and ix.is_scalar(six, 1.0 / 6.0))):
        return None
    return [gate, clip, mul, d], "HardSwish", ix.out(d)


def _conv_act_at(ix: _Index, conv: int) -> tuple[list[int], str, str] | None:
    """Conv [+ BatchNorm] [+ constant scale / bias] + activation [+ constant scale / bias]."""
    nodes = [conv]
    t = ix.out(conv)
    for _ in range(3):  # ConvTranspose -> Add(bias) -> BatchNorm is as common as Conv -> BatchNorm -> Mul
        c = ix.only_consumer(t)
        if c is not None and ix.op(c) == "BatchNormalization":
            nodes.append(c)
            t = ix.out(c)
        else:
            t2 = _affine_tail(ix, t, nodes, limit=1)
            if t2 == t:
                break
            t = t2
    act = _activation_after(ix, t)
    if act is None:
        return None
    act_nodes, name, out = act
    nodes += act_nodes
    # NOTE: a learnable scale and bias right after the activation (PP-LCNetV3's LearnableAffineBlock)
    # belongs to the block; leaving it out would leave those nodes unattributed.
    out = _affine_tail(ix, out, nodes)
    conv_name = "ConvTranspose" if ix.op(conv) == "ConvTranspose" else "Conv"
    return nodes, f"{conv_name}+{name}", out


def _linear_at(ix: _Index, i: int) -> _Match | None:
    """MatMul / Gemm with a constant weight, plus its constant bias Add when separate."""
    if len(ix.data_inputs(i)) != 1 or len([t for t in ix.nodes[i].input if t]) < 2:
        return None
    nodes = [i]
    t = ix.out(i)
    c = ix.only_consumer(t)
    if c is not None and ix.op(c) == "Add" and ix.other_input(c, t) in ix.const:
        nodes.append(c)
        t = ix.out(c)
    return nodes, t


def _se_at(ix: _Index, pool: int) -> _Match | None:
    """Squeeze-and-excitation: GlobalAveragePool(x) -> Conv -> act -> Conv -> gate -> Mul(x, gate)."""
    x = ix.nodes[pool].input[0]
    nodes = [pool]
    t = ix.out(pool)
    for _ in range(8):
        c = ix.only_consumer(t)
        if c is None:
            return None
        if ix.op(c) == "Mul" and ix.other_input(c, t) == x:
            if not any(ix.op(i) in _LINEAR for i in nodes):
                return None
            return [*nodes, c], ix.out(c)
        if len(ix.data_inputs(c)) != 1:
            return None
        nodes.append(c)
        t = ix.out(c)
    return None


def _depends_on(g: nx.DiGraph, later: str, earlier: str) -> bool:
    """Whether node ``earlier`` is an ancestor of node ``later``.

    NOTE: walks up from ``later`` and never below ``earlier``'s position in the (topologically
    sorted) file, so a skip connection costs the size of its branch, not of the whole graph.
    """
    floor = g.nodes[earlier]["index"]
    if g.nodes[later]["index"] <= floor:
        return False
    seen = {later}
    stack = [later]
    while stack:
        n = stack.pop()
        for p in g.predecessors(n):
            if p == earlier:
                return True
            if p not in seen and g.nodes[p]["index"] > floor:
                seen.add(p)
                stack.append(p)
    return False


def _residual_adds(ix: _Index, taken: set[int]) -> list[int]:
    """Adds of two activations where one operand is computed from the other (a skip connection)."""
    found = []
    g = ix.graph
    for i, n in enumerate(ix.nodes):
        if n.op_type != "Add" or i in taken or len(ix.data_inputs(i)) != 2:
            continue
        a, b = n.input
        pa, pb = ix.producer.get(a), ix.producer.get(b)
        if pa is not None and pb is not None:
            first, second = sorted((pa, pb))
            if _depends_on(g, ix.ids[second], ix.ids[first]):
                found.append(i)
        elif (pa is None) != (pb is None):  # one operand is a graph input: does the other depend on it?
            src, other = (a, pb) if pa is None else (b, pa)
            assert other is not None
            if any(c != i and (c == other or _depends_on(g, ix.ids[other], ix.ids[c])) for c in ix.consumers[src]):
                found.append(i)
    return found


def _tail(ix: _Index, output: str) -> list[int]:
    """The linear chain of nodes ending at a graph output (stops at joins and branches)."""
    p = ix.producer.get(output)
    if p is None or ix.has_subgraph(p):
        return []
    chain = [p]
    while True:
        ins = ix.data_inputs(chain[0])
        if len(ins) != 1:
            break
        q = ix.producer.get(ins[0])
        readers = [c for c in ix.consumers.get(ins[0], []) if ix.op(c) not in _SHAPE_ONLY]
        if q is None or readers != [chain[0]] or ins[0] in ix.output_set or q in chain or ix.has_subgraph(q):
            break  # NOTE: If/Loop bodies read outer-scope values their inputs do not list: not a chain
        chain.insert(0, q)
    return chain


def _head_for(ix: _Index, output: str) -> tuple[list[int], str] | None:
    """Classification head (pool -> flatten -> Gemm/MatMul -> [softmax]) or dense head (last convs)."""
    chain = _tail(ix, output)
    ops = [ix.op(i) for i in chain]
    # Only layers with a constant weight count: a MatMul of two activations (attention) is no head.
    lin = [k for k, i in enumerate(chain) if ops[k] in _LINEAR and ix.has_const_weight(i)]
    if not lin:
        return None
    last = next((k for k in reversed(lin) if all(o in _AFTER_CLASSIFIER for o in ops[k + 1 :])), None)
    if last is not None and ops[last] in ("Gemm", "MatMul"):
        k = last - 1
        while k >= 0 and (ops[k] in _RESHAPE_LIKE or ops[k] in ("Gemm", "MatMul", "Relu", "Add")):
            k -= 1
        if k >= 0 and ops[k] in _GLOBAL_POOL:
            return chain[k:], "Classification head"
    start = lin[-DENSE_HEAD_MAX_LINEAR] if len(lin) >= DENSE_HEAD_MAX_LINEAR else lin[0]
    if any(ops[k] in _CONV for k in lin if k >= start):
        return chain[start:], "Detection/segmentation head"
    return chain[start:], "Output head"  # e.g. a language-model or token-classification projection


# --------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------


def _where(names: Iterable[str]) -> str | None:
    """Where a group of nodes lives, from the common ``/``-separated prefix of their names.

    The outermost prefix component carrying an index (``layer1``, ``layer.3``, ``blocks.2``) is the
    block (inner indexed parts such as ``fc1`` name a layer, not a block); what follows it is added
    in parentheses so two LayerNorms of one layer stay apart:
    ``layer1/ffn_norm/Add`` -> ``layer1 (ffn_norm)``; ``/encoder/layer.3/attention/self/Softmax``
    -> ``layer.3 (attention/self)``. None when the nodes are unnamed or share no prefix.
    """
    dirs = [[p for p in n.split("/") if p][:-1] for n in names if n]
    if not dirs:
        return None
    common: list[str] = []
    for parts in zip(*dirs, strict=False):  # stops at the shortest name
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    if not common:
        return None
    indexed = [k for k, p in enumerate(common) if re.search(r"\d", p)]
    if not indexed:
        return "/".join(common)
    k = indexed[0]
    rest = "/".join(common[k + 1 :])
    return f"{common[k]} ({rest})" if rest else common[k]


def _label_all(ix: _Index, raw: list[tuple[str, str, list[int], str]]) -> list[PatternInstance]:
    """Turn (kind, display name, node indices, output) into instances with unique labels."""
    ordinal: dict[str, int] = defaultdict(int)
    labelled: list[tuple[str, str, tuple[str, ...], str]] = []
    for kind, name, idx, output in raw:
        ordinal[kind] += 1
        nodes = tuple(ix.ids[i] for i in sorted(set(idx)))
        where = _where(ix.nodes[i].name for i in idx)
        if kind == "head":
            label = f"{name} ({output})"
        elif where is None:
            label = f"{name} #{ordinal[kind]}"
        else:
            label = f"{name} in {where}"
        labelled.append((kind, label, nodes, output))
    counts: dict[str, int] = defaultdict(int)
    for _, label, _, _ in labelled:
        counts[label] += 1
    seen: dict[str, int] = defaultdict(int)
    out = []
    for kind, label, nodes, output in labelled:
        if counts[label] > 1:
            seen[label] += 1
            label = f"{label} #{seen[label]}"
        out.append(PatternInstance(kind, label, nodes, output))
    return out


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def find_patterns(model: onnx.ModelProto) -> list[PatternInstance]:
    """Every recognised pattern instance of the model's top-level graph, in graph order.

    Never modifies the model. Constant nodes are never part of an instance. Subgraphs (If/Loop
    bodies) are not searched. Instances of different kinds may share nodes (nesting).

    Example:
        >>> from diag.fixtures.models import transformer
        >>> [p.label for p in find_patterns(transformer().model) if p.kind == "gelu"]
        ['GELU in layer0 (ffn/gelu)', 'GELU in layer1 (ffn/gelu)']
    """
    ix = _Index(model)
    raw: list[tuple[str, str, list[int], str]] = []
    by_kind: dict[str, set[int]] = defaultdict(set)

    def add(kind: str, name: str, nodes: list[int], output: str) -> None:
        raw.append((kind, name, nodes, output))
        by_kind[kind].update(nodes)

    softmaxes: list[_Match] = []
    for i, n in enumerate(ix.nodes):
        op = n.op_type
        kind = _FUSED.get(op)
        if kind is not None:
            add(kind, KIND_NAMES[kind], [i], ix.out(i))
            if kind == "softmax":
                softmaxes.append(([i], ix.out(i)))
        elif op == "ReduceMean" and (m := _layernorm_at(ix, i)) is not None:
            add("layernorm", "LayerNorm", *m)
        elif op in ("Erf", "Tanh", "Sigmoid") and (m := _any_gelu_at(ix, i, op)) is not None:
            add("gelu", "GELU", *m)
        elif op == "Exp" and (m := _softmax_at(ix, i)) is not None:
            add("softmax", "Softmax", *m)
            softmaxes.append(m)
    for i, n in enumerate(ix.nodes):
        if n.op_type == "Pow" and (m := _rmsnorm_at(ix, i, by_kind["layernorm"])) is not None:
            add("rmsnorm", "RMSNorm", *m)
    for sm in softmaxes:
        if (m := _attention_at(ix, sm)) is not None:
            add("attention", "Attention", *m)
    for i, n in enumerate(ix.nodes):
        if n.op_type in _CONV and (ca := _conv_act_at(ix, i)) is not None:
            add("conv-act", ca[1], ca[0], ca[2])
        elif n.op_type in ("MatMul", "Gemm") and (m := _linear_at(ix, i)) is not None:
            add("linear", "Linear", *m)
        elif n.op_type == "GlobalAveragePool" and (m := _se_at(ix, i)) is not None:
            add("se", "SE block", *m)
    taken = by_kind["layernorm"] | by_kind["rmsnorm"] | by_kind["gelu"] | by_kind["softmax"] | by_kind["attention"]
    for i in _residual_adds(ix, taken):
        add("residual", "Residual Add", [i], ix.out(i))
    for o in ix.outputs:
        if (h := _head_for(ix, o)) is not None:
            add("head", h[1], h[0], o)
    order = list(KIND_NAMES)
    raw.sort(key=lambda r: (max(r[2]), order.index(r[0])))
    return _label_all(ix, raw)


def node_patterns(instances: Iterable[PatternInstance]) -> dict[str, list[PatternInstance]]:
    """Node id -> the instances containing it (outermost, i.e. largest, first).

    Example:
        >>> from diag.fixtures.models import transformer
        >>> by_node = node_patterns(find_patterns(transformer().model))
        >>> [p.kind for p in by_node["layer0/attn/Softmax"]]
        ['attention', 'softmax']
    """
    out: dict[str, list[PatternInstance]] = defaultdict(list)
    for p in instances:
        for n in p.nodes:
            out[n].append(p)
    for lst in out.values():
        lst.sort(key=lambda p: -len(p.nodes))
    return dict(out)


def _energy(s: ErrorStats) -> float:
    e = s.mse * s.count
    return e if math.isfinite(e) else 0.0


@dataclass(frozen=True)
class _Measured:
    """The run's error per FP32 tensor, which tensor each node is measured on, and the model's total local energy."""

    accumulated: dict[str, ErrorStats]
    local: dict[str, ErrorStats]
    tensor_of_node: dict[str, str]
    #: the share's denominator: the local error energy of every tensor in ``local``
    model_energy: float


def _total(kind: str, label: str, count: int, nodes: Iterable[str], output: str | None, m: _Measured) -> PatternTotal:
    """One pattern's (or one kind's) error: worst local and accumulated SQNR, local energy and its share."""
    accumulated, local, tensor_of_node, model_energy = m.accumulated, m.local, m.tensor_of_node, m.model_energy
    node_list = list(dict.fromkeys(nodes))
    tensors = {n: tensor_of_node[n] for n in node_list if n in tensor_of_node}
    measured = [n for n, t in tensors.items() if t in local or t in accumulated]
    loc = [(local[t].sqnr_db, n) for n, t in tensors.items() if t in local]
    acc = [accumulated[t].sqnr_db for t in tensors.values() if t in accumulated]
    worst_local = min(loc, default=None)
    energy = sum(_energy(local[t]) for t in set(tensors.values()) if t in local)
    out_acc = accumulated[output].sqnr_db if output is not None and output in accumulated else None
    return PatternTotal(
        kind=kind,
        label=label,
        instances=count,
        nodes=len(node_list),
        measured=len(measured),
        worst_local_sqnr_db=worst_local[0] if worst_local else None,
        worst_local_node=worst_local[1] if worst_local else None,
        worst_accumulated_sqnr_db=min(acc, default=None),
        output_accumulated_sqnr_db=out_acc,
        local_energy=energy,
        local_share=energy / model_energy if model_energy > 0 else 0.0,
    )


def pattern_totals(
    instances: Iterable[PatternInstance],
    accumulated: dict[str, ErrorStats],
    local: dict[str, ErrorStats],
    tensor_of_node: dict[str, str],
) -> tuple[list[PatternTotal], list[PatternTotal]]:
    """Error per pattern instance and per kind, largest local error energy first.

    ``accumulated`` and ``local`` are keyed by FP32 tensor (as in ``CompareResult``);
    ``tensor_of_node`` maps an FP32 node id to the tensor its error is measured on (a
    ``NodeFinding``'s ``tensor`` for every node of its group). Nodes missing from it count as
    unmeasured. The share's denominator is the local error energy of every tensor in ``local``,
    so it says how much of the model's damage the pattern explains.

    Example:
        >>> per_instance, per_kind = pattern_totals(find_patterns(model), r.accumulated, r.local,
        ...     {n: f.tensor for f in r.findings for n in f.group.fp_nodes})  # doctest: +SKIP
        >>> per_kind[0].label, round(per_kind[0].local_share, 2)  # doctest: +SKIP
        ('LayerNorm', 0.83)
    """
    instances = list(instances)
    measured = _Measured(accumulated, local, tensor_of_node, sum(_energy(s) for s in local.values()))
    per_instance = [_total(p.kind, p.label, 1, p.nodes, p.output, measured) for p in instances]
    nodes_by_kind: dict[str, list[str]] = defaultdict(list)
    count_by_kind: dict[str, int] = defaultdict(int)
    for p in instances:
        nodes_by_kind[p.kind].extend(p.nodes)
        count_by_kind[p.kind] += 1
    per_kind = [
        _total(k, KIND_NAMES.get(k, k), count_by_kind[k], nodes_by_kind[k], None, measured) for k in nodes_by_kind
    ]
    per_instance.sort(key=lambda t: -t.local_energy)
    per_kind.sort(key=lambda t: -t.local_energy)
    return per_instance, per_kind
