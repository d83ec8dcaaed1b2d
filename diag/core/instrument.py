"""Copies of a model with chosen tensors exposed as outputs, and the cut model for local error.

Never mutates the caller's model: every function returns a new ``ModelProto``. Weights stored
as external data stay where they are (the copy still refers to them by location).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import onnx

from diag.core.match import QuantParams, TensorPair

#: Suffixes for names diag invents inside the cut model; chosen to never collide in practice.
_INT8_SUFFIX = "__diag_int8"
_LOCAL_SUFFIX = "__diag_local"
#: Prefix of the cut model's tensor and node names inside a :func:`merged_with_cut` model.
_MERGED_PREFIX = "diag_local::"


def exposed_model(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Return a copy of ``model`` whose graph outputs also include ``names``.

    Existing outputs are kept first and in order. Names are added without type information,
    which onnxruntime accepts and which avoids running shape inference on large models.

    Example:
        >>> from diag.fixtures.models import convnet
        >>> m2 = exposed_model(convnet().model, ["conv1_out"])
        >>> [o.name for o in m2.graph.output]
        ['logits', 'conv1_out']
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    for name in names:
        if name not in present:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
            present.add(name)
    return copy


@dataclass(frozen=True)
class CutInput:
    """A graph input of the cut model: fed with FP32 tensor ``fp_name`` (quantized if ``quant``)."""

    name: str
    fp_name: str
    quant: QuantParams | None
    dtype: int


@dataclass(frozen=True)
class LocalOutput:
    """Where the cut model writes the locally computed counterpart of FP32 tensor ``fp_name``."""

    name: str
    fp_name: str
    dequant: QuantParams | None


@dataclass
class CutModel:
    """The INT8 model cut at every matched tensor, each cut fed with FP32 values.

    One pass of this model gives, for every quantized node at once, its output when fed the
    FP32 model's inputs: that is the *local* error of every node, for the cost of about one
    INT8 forward pass (no per-node sessions).
    """

    model: onnx.ModelProto
    inputs: list[CutInput]
    outputs: list[LocalOutput]
    #: Graph inputs fed with a model input of the same batch: graph input name -> the feed's name
    #: (the names differ only inside a :func:`merged_with_cut` model).
    passthrough: dict[str, str] = field(default_factory=dict)


def cut_model(int8: onnx.ModelProto, pairs: Iterable[TensorPair]) -> CutModel:
    """Cut ``int8`` at the ``cut_name`` of every pair and expose each pair's local value.

    For a pair whose INT8 tensor is reached from the cut through a tail (the output Q/DQ in QDQ,
    the DequantizeLinear of a QOperator output), the tail is replayed on the locally computed
    value so local and accumulated error include the same output quantization.
    """
    model = onnx.ModelProto()
    model.CopyFrom(int8)
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    graph_inputs = {i.name for i in graph.input}
    inputs: list[CutInput] = []
    outputs: list[LocalOutput] = []
    cut_done: set[str] = set()
    new_nodes: list[onnx.NodeProto] = []
    for p in pairs:
        if p.cut_name in graph_inputs and p.cut_name not in cut_done:
            # Already a model input: it is fed with the FP32 value anyway.
            cut_done.add(p.cut_name)
            inputs.append(CutInput(p.cut_name, p.fp_name, p.cut_quant, p.cut_dtype))
            continue
        node = producer.get(p.cut_name)
        if node is None:
            continue
        if p.cut_name not in cut_done:
            cut_done.add(p.cut_name)
            for i, o in enumerate(node.output):
                if o == p.cut_name:
                    node.output[i] = p.cut_name + _INT8_SUFFIX
            graph.input.append(onnx.helper.make_tensor_value_info(p.cut_name, p.cut_dtype, None))
            inputs.append(CutInput(p.cut_name, p.fp_name, p.cut_quant, p.cut_dtype))
        local = p.cut_name + _INT8_SUFFIX
        rename = {p.cut_name: local}
        for t in p.tail:
            clone = onnx.NodeProto()
            clone.CopyFrom(t)
            clone.name = (t.name or t.op_type) + _LOCAL_SUFFIX + f"_{len(new_nodes)}"
            for i, name in enumerate(clone.input):
                if name in rename:
                    clone.input[i] = rename[name]
            for i, name in enumerate(clone.output):
                rename[name] = name + _LOCAL_SUFFIX + f"_{p.fp_name}"
                clone.output[i] = rename[name]
            new_nodes.append(clone)
        out_name = rename.get(p.int8_name, local)
        outputs.append(LocalOutput(out_name, p.fp_name, p.dequant))
    graph.node.extend(new_nodes)
    _set_outputs(graph, outputs)
    return CutModel(model, inputs, outputs)


def _set_outputs(graph: onnx.GraphProto, outputs: list[LocalOutput]) -> None:
    """Make the cut model's outputs the local values asked for, each name once, in order."""
    del graph.output[:]
    seen: set[str] = set()
    for o in outputs:
        if o.name not in seen:
            graph.output.append(onnx.ValueInfoProto(name=o.name))
            seen.add(o.name)


def pruned_cut(cut: CutModel, fp_names: Iterable[str]) -> CutModel:
    """The part of ``cut`` that computes the local values of ``fp_names`` only.

    Used when a memory budget splits the tensors into passes: each pass's cut model keeps the
    nodes those outputs need (walking back to the cut inputs) and asks only for the cut inputs
    it reads, so a pass never needs the FP32 values of other passes' tensors. Every kept node
    computes exactly what it computes in the full cut model (same inputs, same kernel).

    Example:
        >>> part = pruned_cut(cut, ["conv1_out"])  # doctest: +SKIP
        >>> [o.fp_name for o in part.outputs]  # doctest: +SKIP
        ['conv1_out']
    """
    wanted = set(fp_names)
    outputs = [o for o in cut.outputs if o.fp_name in wanted]
    graph = cut.model.graph
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    needed: set[str] = set()
    keep: set[int] = set()
    stack = [o.name for o in outputs]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        i = producer.get(name)
        if i is not None and i not in keep:
            keep.add(i)
            stack.extend(x for x in graph.node[i].input if x)
            for sub in _subgraph_inputs(graph.node[i]):
                stack.append(sub)
    model = onnx.ModelProto()
    # NOTE: copy everything but the nodes, inputs and outputs (initializers included: onnxruntime
    # drops the ones no kept node reads), then add back only what the kept nodes need.
    model.CopyFrom(cut.model)
    g = model.graph
    del g.node[:]
    g.node.extend(n for i, n in enumerate(graph.node) if i in keep)
    initializers = {t.name for t in g.initializer}
    del g.input[:]
    g.input.extend(vi for vi in graph.input if vi.name in needed or vi.name in initializers)
    _set_outputs(g, outputs)
    inputs = [ci for ci in cut.inputs if ci.name in needed]
    return CutModel(model, inputs, outputs)


def merged_with_cut(exposed: onnx.ModelProto, cut: CutModel) -> tuple[onnx.ModelProto, CutModel] | None:
    """``exposed`` (the INT8 model with its tensors exposed) and ``cut`` as one graph that holds
    the INT8 weights once, and the cut model as it is named inside it.

    The cut's nodes, inputs and outputs are renamed with a prefix; its initializers are the
    INT8 model's own (same names, same values: a cut model is a copy of the INT8 graph) and are
    not renamed, so onnxruntime loads and prepacks each weight once for both. One run of the
    merged model, fed the batch and the cut inputs, gives the INT8 values and the local values.
    Returns None when a cut node has subgraphs (their outer-scope names would need renaming too).

    NOTE: why merge at all: two sessions of the same INT8 model hold two copies of its weights
    (onnxruntime prepacks MatMulNBits per session, and maps external data per session); on the
    500M int4 decoder that is ~420 MB of peak RSS, while two nodes of one session reading the
    same initializer share it (measured: one 32 MB MatMulNBits weight read by one or two nodes,
    41 MB of session memory either way).

    Example:
        >>> merged, local = merged_with_cut(exposed_model(q.proto, names), cut)  # doctest: +SKIP
        >>> [ci.name for ci in local.inputs][:1]  # doctest: +SKIP
        ['diag_local::relu1_out']
    """
    g_cut = cut.model.graph
    if any(a.HasField("g") or len(a.graphs) for n in g_cut.node for a in n.attribute):
        return None
    weights = {t.name for t in exposed.graph.initializer}
    cut_weights = {t.name for t in g_cut.initializer}
    if cut_weights - weights:
        return None  # not a cut of this INT8 model

    def renamed(name: str) -> str:
        return name if not name or name in weights else _MERGED_PREFIX + name

    model = onnx.ModelProto()
    model.CopyFrom(exposed)
    g = model.graph
    for n in g_cut.node:
        clone = onnx.NodeProto()
        clone.CopyFrom(n)
        clone.name = _MERGED_PREFIX + n.name if n.name else ""
        del clone.input[:]
        clone.input.extend(renamed(x) for x in n.input)
        del clone.output[:]
        clone.output.extend(renamed(x) for x in n.output)
        g.node.append(clone)
    feeds = {i.name for i in exposed.graph.input}
    passthrough: dict[str, str] = {}
    cut_inputs = {ci.name for ci in cut.inputs}
    for vi in g_cut.input:
        if vi.name in cut_weights:
            continue
        new = onnx.ValueInfoProto()
        new.CopyFrom(vi)
        new.name = renamed(vi.name)
        g.input.append(new)
        if vi.name not in cut_inputs and vi.name in feeds:
            passthrough[new.name] = vi.name
    seen = {o.name for o in g.output}
    for o in cut.outputs:
        name = renamed(o.name)
        if name not in seen:
            g.output.append(onnx.ValueInfoProto(name=name))
            seen.add(name)
    inputs = [replace(ci, name=renamed(ci.name)) for ci in cut.inputs]
    outputs = [replace(lo, name=renamed(lo.name)) for lo in cut.outputs]
    return model, CutModel(model, inputs, outputs, passthrough)


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs (If / Loop / Scan bodies) read from the outer scope."""
    names: list[str] = []
    for attr in node.attribute:
        graphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for sub in graphs:
            produced = {o for n in sub.node for o in n.output} | {i.name for i in sub.input}
            produced |= {t.name for t in sub.initializer}
            for n in sub.node:
                names.extend(x for x in n.input if x and x not in produced)
                names.extend(_subgraph_inputs(n))
    return names


@dataclass(frozen=True)
class FusedKernel:
    """A kernel onnxruntime runs in place of several nodes of the model as written.

    ``hidden`` are the original nodes it replaced (their outputs no longer exist, so exact mode
    cannot be reproduced at that optimization level); ``fp_nodes`` the FP32 nodes behind them.
    """

    name: str
    op_type: str
    hidden: list[str]
    fp_nodes: list[str]


def fused_kernels(
    original: onnx.ModelProto, optimized: onnx.ModelProto, fp_nodes_of: dict[str, list[str]] | None = None
) -> list[FusedKernel]:
    """Which nodes of ``original`` each new kernel of ``optimized`` (onnxruntime's saved graph) hides.

    A node of ``optimized`` that is not in ``original`` under the same name and op type is a
    fused (or rewritten) kernel. Walking back from its outputs through ``original``, every node
    whose output no longer exists in ``optimized`` was absorbed by it; the walk stops at tensors
    that still exist (the kernel's inputs, other kernels' outputs). ``fp_nodes_of`` maps original
    (INT8) node names to the FP32 node names behind them (from :mod:`diag.core.match`).

    Example:
        >>> [k.op_type for k in fused_kernels(qdq_model, onnx.load("qdq.opt.onnx"))]  # doctest: +SKIP
        ['QLinearConv', 'QLinearConv']
    """
    g = original.graph
    by_name = {n.name: n for n in g.node if n.name}
    producer = {o: n for n in g.node for o in n.output if o}
    og = optimized.graph
    alive = {i.name for i in og.input} | {t.name for t in og.initializer}
    alive |= {t for n in og.node for t in list(n.input) + list(n.output) if t}
    kernels: list[FusedKernel] = []
    for node in og.node:
        same = by_name.get(node.name)
        if same is not None and same.op_type == node.op_type:
            continue
        hidden: list[str] = []
        seen: set[int] = set()
        stack = [o for o in node.output if o in producer]
        while stack:
            src = producer[stack.pop()]
            if id(src) in seen:
                continue
            seen.add(id(src))
            hidden.append(src.name or src.op_type)
            stack.extend(i for i in src.input if i and i not in alive and i in producer)
        if not hidden or hidden == [node.name]:
            continue
        fp: list[str] = []
        for h in hidden:
            for f in (fp_nodes_of or {}).get(h, []):
                if f not in fp:
                    fp.append(f)
        kernels.append(FusedKernel(node.name or node.op_type, node.op_type, hidden, fp))
    return kernels


#: Initializers above this many bytes are not compared byte for byte: a node reading one is recomputed.
_COMPARED_INITIALIZER_BYTES = 1 << 20


def exact_locally(fp: onnx.ModelProto, int8: onnx.ModelProto, pairs: Iterable[TensorPair]) -> set[str]:
    """FP32 tensors whose local value is the FP32 value itself, by construction.

    A pair is exact when the INT8 node writing it is the FP32 node as written (same op, domain and
    attributes, no subgraph) and every input it reads is fed with an FP32 value as it is: a cut
    whose FP32 value is passed unquantized in float32, the same model input, or the same small
    initializer. The cut model would run the same kernel on the same bytes (both in exact mode),
    so its output is the FP32 value bit for bit; diag skips recomputing it. In a weight-only
    model (MatMulNBits) that is every node but the quantized MatMuls: the norms, rotary,
    attention and activations of a decoder are not run a second time, and their values are
    neither exposed nor reduced twice.

    Example:
        >>> sorted(exact_locally(fp.proto, q.proto, pairs.values()))[:2]  # doctest: +SKIP
        ['/model/layers.0/input_layernorm/Mul_output_0', '/model/layers.0/self_attn/Softmax_output_0']
    """
    pairs = [p for p in pairs if p.producer is not None]
    same = _SameValues(fp, int8, pairs)
    fp_nodes = {(n.name or f"{n.op_type}#{i}"): n for i, n in enumerate(fp.graph.node)}
    exact: set[str] = set()
    for p in pairs:
        node, ref = same.q_writer.get(p.cut_name), fp_nodes.get(p.producer or "")
        if p.cut_name not in same.fed or p.int8_name != p.cut_name or node is None or ref is None:
            continue
        if _same_node(node, ref) and all(
            same(a, b)
            for a, b in zip(node.input, ref.input, strict=True)  # same arity: _same_node
        ):
            exact.add(p.fp_name)
    return exact


class _SameValues:
    """Whether a value of the cut model is, bit for bit, a value of the FP32 model (memoized).

    True for a cut fed with that FP32 value unquantized, the same model input, the same small
    initializer, or the output of the same node on such values (shape arithmetic, constants).
    A cut fed with a quantized value, a large or external initializer, or a walk deeper than
    :data:`_WALK_DEPTH` nodes is not (conservative: the node is recomputed).
    """

    def __init__(self, fp: onnx.ModelProto, int8: onnx.ModelProto, pairs: list[TensorPair]) -> None:
        self.fed = {
            p.cut_name: p.fp_name
            for p in pairs
            if p.cut_quant is None and p.cut_dtype == onnx.TensorProto.FLOAT and not p.tail and p.dequant is None
        }
        self.cuts = {p.cut_name for p in pairs}
        self.q_writer = {o: n for n in int8.graph.node for o in n.output if o}
        self.fp_writer = {o: n for n in fp.graph.node for o in n.output if o}
        self.shared = {i.name for i in fp.graph.input} & {i.name for i in int8.graph.input}
        self.fp_inits = {t.name: t for t in fp.graph.initializer}
        self.q_inits = {t.name: t for t in int8.graph.initializer}
        self.known: dict[tuple[str, str], bool] = {}

    def __call__(self, q_name: str, fp_name: str, depth: int = 0) -> bool:
        if not q_name or not fp_name:
            return q_name == fp_name
        key = (q_name, fp_name)
        if key not in self.known:
            self.known[key] = self._same(q_name, fp_name, depth)
        return self.known[key]

    def _same(self, q_name: str, fp_name: str, depth: int) -> bool:
        if q_name in self.fed:
            return self.fed[q_name] == fp_name
        if q_name in self.cuts:
            return False  # fed with a quantized value
        if q_name in self.q_inits or fp_name in self.fp_inits:
            return _same_initializer(self.q_inits.get(q_name), self.fp_inits.get(fp_name))
        if q_name in self.shared:
            return q_name == fp_name
        node, ref = self.q_writer.get(q_name), self.fp_writer.get(fp_name)
        if node is None or ref is None or depth >= _WALK_DEPTH or not _same_node(node, ref):
            return False
        if list(node.output).index(q_name) != list(ref.output).index(fp_name):
            return False
        return all(self(a, b, depth + 1) for a, b in zip(node.input, ref.input, strict=True))


#: How many nodes back :class:`_SameValues` walks through values no cut feeds.
_WALK_DEPTH = 16


def _same_node(node: onnx.NodeProto, ref: onnx.NodeProto) -> bool:
    """Same kernel: op type, domain, attributes and arity equal, and no subgraph."""
    if (node.op_type, node.domain or "", len(node.input), len(node.output)) != (
        ref.op_type,
        ref.domain or "",
        len(ref.input),
        len(ref.output),
    ):
        return False
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    ours = sorted(a.SerializeToString(deterministic=True) for a in node.attribute)
    theirs = sorted(a.SerializeToString(deterministic=True) for a in ref.attribute)
    return ours == theirs


def _same_initializer(a: onnx.TensorProto | None, b: onnx.TensorProto | None) -> bool:
    """Both present, in memory, small, and equal but for their names."""
    if a is None or b is None or onnx.TensorProto.EXTERNAL in (a.data_location, b.data_location):
        return False
    if a.ByteSize() > _COMPARED_INITIALIZER_BYTES:
        return False
    a_copy, b_copy = onnx.TensorProto(), onnx.TensorProto()
    a_copy.CopyFrom(a)
    b_copy.CopyFrom(b)
    a_copy.name = b_copy.name = ""
    return bool(a_copy.SerializeToString(deterministic=True) == b_copy.SerializeToString(deterministic=True))
