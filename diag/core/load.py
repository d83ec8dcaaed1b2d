"""Open FP32 / INT8 models safely and tell which quantization format an INT8 model uses.

Models are untrusted files: paths are checked before parsing, external data may only live inside
the model's own folder, and weights are not read unless a caller needs them.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from diag.core.precision import fp16_breakdown, has_float16, precision_breakdown, qdq_breakdown
from diag.foundations.environment import custom_op_libraries, session_options
from diag.foundations.errors import DiagError
from diag.foundations.files import input_file, remember_input
from diag.foundations.ortfacts import FORMATS, FormatKind, ops_where
from diag.foundations.producers import detect_producer

#: op types that only exist in quantized graphs, by the format that produces them (:mod:`diag.foundations.ortfacts`).
DYNAMIC_OPS = ops_where(lambda op: op.family == "dynamic")
QOPERATOR_OPS = ops_where(lambda op: op.family == "qoperator")
QDQ_OPS = ops_where(lambda op: op.family == "qdq")
#: weight-only block-quantized ops (``MatMulNBitsQuantizer``, QOperator format; com.microsoft).
NBITS_OPS = ops_where(lambda op: op.family == "nbits")

#: Refuse to parse files larger than this without external data (protobuf's own hard limit).
MAX_PROTO_BYTES = 2**31 - 1


@dataclass
class ModelFormat:
    """The quantization format of a model and the evidence for it.

    Attributes:
        kind: ``fp32``, ``dynamic``, ``qdq``, ``qoperator``, ``fp16``, ``qdq-a16w8``, ``qdq16``,
            ``qdq-fp8``, ``matmulnbits`` (weight-only ``MatMulNBits``), ``qdq-int4-blocked``
            (weight-only block-wise ``DequantizeLinear``) or ``mixed``.
        evidence: op type -> count of the quantization-specific ops that decided ``kind``.
        precisions: precision label -> node names, when nodes run at other than 8 bits / FP32
            (see :mod:`diag.core.precision`).
        family_name: the tool behind a ``mixed`` or 16-bit kind (``fp16``, ``qdq``); empty = ``kind``.
    """

    kind: FormatKind
    evidence: dict[str, int] = field(default_factory=dict)
    precisions: dict[str, list[str]] = field(default_factory=dict)
    family_name: str = ""

    @property
    def is_quantized(self) -> bool:
        return self.kind != "fp32"

    @property
    def family(self) -> str:
        """``qdq`` for ``qdq-a16w8`` / ``qdq16`` / ``qdq-fp8`` / a mixed-precision QDQ model, ``fp16`` for FP16."""
        return self.family_name or self.kind


@dataclass
class LoadedModel:
    """A parsed model without its external weights, plus where it came from."""

    path: Path
    proto: onnx.ModelProto
    format: ModelFormat
    has_external_data: bool
    #: Findings that did not stop diag, e.g. an onnx.checker failure on a model onnxruntime runs.
    warnings: list[str] = field(default_factory=list)
    #: The user's file this model was built from (AIMET's FP32 export plus its encodings:
    #: :mod:`diag.core.encodings`), and the sentence that says how; None / "" for the file itself.
    source: Path | None = None
    origin: str = ""

    @property
    def shown_path(self) -> Path:
        """The path reports and commands name: the user's file, never a model diag built in a temp folder."""
        return self.source or self.path

    def producer_key(self) -> str:
        """The tool that made the model (a :data:`diag.foundations.producers.PRODUCERS` key), by its
        marks; ``aimet`` for a model diag built from AIMET encodings (onnxruntime's layout, AIMET's model)."""
        return "aimet" if self.source is not None else detect_producer(self.proto, self.shown_path).key

    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph

    @property
    def external_dir(self) -> Path | None:
        """The folder onnxruntime reads this model's external data from (None: its weights are inline)."""
        return self.path.resolve().parent if self.has_external_data else None

    @property
    def external_files(self) -> list[Path]:
        """The files of this model's external data (checked to exist, inside its folder, at load)."""
        folder = self.external_dir
        if folder is None:
            return []
        tensors = _all_tensors_with_data(self.graph)
        return sorted({folder / external_location(t) for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL})

    @property
    def weight_bytes(self) -> int:
        """Bytes of this model's initializers, inline or external (:func:`initializer_bytes`)."""
        return initializer_bytes(self.proto)


def external_location(tensor: onnx.TensorProto) -> str:
    """Where an external tensor's data is, as written in the model (relative to its folder)."""
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of ``model``'s initializers, inline or in external data (read off the references).

    Example:
        >>> from diag.fixtures.models import convnet
        >>> initializer_bytes(convnet().model) > 0
        True
    """
    total = 0
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += next((int(e.value) for e in t.external_data if e.key == "length"), 0)
        else:
            total += len(t.raw_data) or t.ByteSize()
    return total


def checked_path(path: str | os.PathLike[str], role: str) -> Path:
    """Return ``path`` as a Path after checking it names a readable, non-empty file.

    Example:
        >>> checked_path("/nonexistent.onnx", "FP32 model")
        Traceback (most recent call last):
        ...
        diag.foundations.errors.DiagError: FP32 model '/nonexistent.onnx' | does not exist. Hint: check the path
    """
    p = input_file(path, role, "pass a .onnx file")
    if p.stat().st_size == 0:
        raise DiagError("empty-file", f"{role} '{p}'", "is empty (0 bytes)", "re-export or re-copy the model")
    return p


def model_from_path(path: str | os.PathLike[str], role: str = "model") -> LoadedModel:
    """Parse an ONNX file without loading external weights; validate it and detect its format.

    Never modifies the file. External data locations are checked to stay inside the model's
    folder (symlinks resolved) and to exist.

    Example:
        >>> m = model_from_path("int8.onnx", "INT8 model")  # doctest: +SKIP
        >>> m.format.kind  # doctest: +SKIP
        'dynamic'
    """
    p = checked_path(path, role)
    obj = f"{role} '{p}'"
    if p.stat().st_size > MAX_PROTO_BYTES:
        raise DiagError(
            "not-onnx",
            obj,
            "is larger than 2 GB, which a single ONNX protobuf cannot be",
            "save weights as external data (onnx.save(..., save_as_external_data=True))",
        )
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning, ValueError...
        raise DiagError(
            "not-onnx",
            obj,
            f"is not a readable ONNX model ({type(e).__name__})",
            "check that the file is a complete .onnx export (not truncated, not a checkpoint)",
        ) from e
    if not proto.HasField("graph") or (len(proto.graph.node) == 0 and len(proto.graph.output) == 0):
        raise DiagError(
            "not-onnx",
            obj,
            "parses but contains no graph",
            "check that the file is an .onnx model, not another protobuf",
        )
    has_external = _check_external_data(proto, p, obj)
    warnings: list[str] = []
    try:
        # NOTE: the checker resolves external data relative to the current folder when given a
        # proto; given the path it resolves next to the model (and does not load the weights).
        onnx.checker.check_model(str(p) if has_external else proto, full_check=False)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # NOTE: onnx.checker is stricter than onnxruntime (e.g. quantize_dynamic with
        # EnableSubgraph writes com.microsoft ops into If bodies without the model importing that
        # domain). The model the user deploys is the one onnxruntime runs: refuse only when
        # onnxruntime cannot load it either, else carry the checker's finding as a warning.
        loads, why = _onnxruntime_loads(p)
        if not loads:
            raise DiagError(
                "invalid-model",
                obj,
                f"fails onnx.checker ({first[:300]}) and onnxruntime cannot load it ({why[:300]})",
                "re-export the model or fix the reported node",
            ) from e
        warnings.append(
            f"onnx.checker rejects {role} '{p.name}' ({first[:300]}); onnxruntime loads it, so diag goes on"
        )
    return LoadedModel(p, proto, detect_format(proto), has_external, warnings)


def _onnxruntime_loads(path: Path) -> tuple[bool, str]:
    """Whether onnxruntime creates a session for the model file (no optimizations); else why not."""
    import onnxruntime as ort

    so = session_options()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        text = str(e).strip()
        return False, text.splitlines()[0] if text else type(e).__name__
    return True, ""


def float_model_from_path(path: str | os.PathLike[str], role: str = "FP32 model") -> LoadedModel:
    """:func:`model_from_path` for the float model a command quantizes, sweeps or measures against.

    Refuses (``fp32-is-quantized``) a model that already contains quantized operators: recipes,
    exclusion lists and sweeps name the nodes of the float graph.

    Example:
        >>> float_model_from_path("model.int8.onnx")  # doctest: +SKIP
        diag: error[fp32-is-quantized]: FP32 model 'model.int8.onnx' already contains quantized operators ...
    """
    loaded = model_from_path(path, role)
    if loaded.format.is_quantized:
        evidence = ", ".join(f"{k} x{v}" for k, v in loaded.format.evidence.items())
        raise DiagError(
            "fp32-is-quantized",
            f"{role} '{loaded.path}'",
            f"already contains quantized operators ({loaded.format.kind}: {evidence})",
            "pass the float model that was exported, not a quantized one",
        )
    return loaded


def _all_tensors_with_data(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    tensors = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                tensors.append(attr.t)
            elif attr.type == onnx.AttributeProto.GRAPH:
                tensors.extend(_all_tensors_with_data(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    tensors.extend(_all_tensors_with_data(g))
    return tensors


def _check_external_data(proto: onnx.ModelProto, path: Path, obj: str) -> bool:
    """Refuse external data that escapes the model folder or is missing. Returns whether any."""
    folder = path.resolve().parent
    found = False
    for tensor in _all_tensors_with_data(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        found = True
        location = external_location(tensor)
        target = (folder / location).resolve()
        if Path(location).is_absolute() or not target.is_relative_to(folder):
            raise DiagError(
                "unsafe-external-data",
                obj,
                f"initializer '{tensor.name}' points outside the model's folder ({location!r})",
                "external data must sit next to the model; refusing to read other files",
            )
        if not target.is_file():
            raise DiagError(
                "missing-external-data",
                obj,
                f"initializer '{tensor.name}' needs external data file {location!r}, which is missing",
                "copy the .data file next to the model",
            )
        remember_input(target)  # an output over the weights would destroy the model too
    return found


def detect_format(proto: onnx.ModelProto) -> ModelFormat:
    """Classify a model as fp32, dynamic, qdq, qoperator or mixed from the ops it contains.

    QDQ is only claimed when a QuantizeLinear feeds a DequantizeLinear: a DequantizeLinear of a
    weight (dynamic models quantize Gather tables that way) or at the output of a QOperator graph
    does not make a model QDQ.
    """
    ops = Counter(n.op_type for n in iter_nodes(proto.graph))
    dynamic = {op: ops[op] for op in DYNAMIC_OPS if ops[op]}
    qop = {op: ops[op] for op in QOPERATOR_OPS if ops[op]}
    qdq = {op: ops[op] for op in QDQ_OPS if ops[op]}
    qdq_pairs = _qdq_activation_pairs(proto.graph)
    kinds: list[FormatKind] = []
    if dynamic:
        kinds.append("dynamic")
    if qop:
        kinds.append("qoperator")
    if qdq_pairs:
        kinds.append("qdq")
        qdq = {"QuantizeLinear->DequantizeLinear": qdq_pairs}
    nbits = {op: ops[op] for op in NBITS_OPS if ops[op]}
    if nbits:
        kinds.append("matmulnbits")
    foreign = Counter(f"{n.domain}:{n.op_type}" for n in iter_nodes(proto.graph) if n.op_type in FOREIGN_QDQ_OPS)
    if foreign and "qdq" not in kinds:
        kinds.append("qdq")
        qdq = dict(foreign)
    blocked = _blocked_dequantize_count(proto.graph)
    if blocked:
        kinds.append("qdq-int4-blocked")
        nbits["DequantizeLinear(block_size)"] = blocked
    if not kinds:
        return _float_format(proto)
    evidence = {**dynamic, **qop, **(qdq if "qdq" in kinds else {}), **nbits}
    if kinds == ["qdq"]:
        wide = qdq_breakdown(proto)
        if wide is not None:
            return ModelFormat(wide.kind, dict(sorted(evidence.items())), wide.nodes, "qdq")
        half = fp16_breakdown(proto) if has_float16(proto) else None
        if half is not None and half.nodes.get("fp16"):
            # int8 QDQ around float16 compute (ModelOpt's default --high_precision_dtype fp16):
            # QDQ, with the nodes that compute in float16 named as a precision.
            evidence["float16 nodes"] = len(half.nodes["fp16"])
            return ModelFormat("qdq", dict(sorted(evidence.items())), {"fp16": half.nodes["fp16"]})
    return ModelFormat(kinds[0] if len(kinds) == 1 else "mixed", dict(sorted(evidence.items())))


def _float_format(proto: onnx.ModelProto) -> ModelFormat:
    """``fp32``, or ``fp16`` / ``mixed`` for a float16 model (see :mod:`diag.core.precision`)."""
    if not has_float16(proto):
        return ModelFormat("fp32")
    b = fp16_breakdown(proto)
    if b is None:
        return ModelFormat("fp32")
    return ModelFormat(b.kind, {f"{k} nodes": len(v) for k, v in b.nodes.items()}, b.nodes, "fp16")


def _qdq_activation_pairs(graph: onnx.GraphProto) -> int:
    """Count QuantizeLinear nodes whose output feeds a DequantizeLinear: the QDQ signature.

    A DequantizeLinear on a weight (dynamic Gather) or on a QOperator output does not count.
    """
    dq_inputs = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input}
    return sum(1 for n in graph.node if n.op_type == "QuantizeLinear" and n.output and n.output[0] in dq_inputs)


def _blocked_dequantize_count(graph: onnx.GraphProto) -> int:
    """Count block-wise DequantizeLinear nodes (``block_size`` > 0) on weights: 4-bit weight-only QDQ.

    A block-wise DequantizeLinear fed by a QuantizeLinear is an activation pair (counted as QDQ).
    """
    q_outputs = {o for n in graph.node if n.op_type == "QuantizeLinear" for o in n.output}
    return sum(
        1
        for n in graph.node
        if n.op_type == "DequantizeLinear"
        and n.input
        and n.input[0] not in q_outputs
        and any(a.name == "block_size" and a.i > 0 for a in n.attribute)
    )


def iter_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """All nodes of ``graph`` including those inside If/Loop/Scan subgraphs, parents first."""
    out: list[onnx.NodeProto] = []
    for node in graph.node:
        out.append(node)
        for sub in subgraphs(node):
            out.extend(iter_nodes(sub))
    return out


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The subgraphs held by a node's attributes (If branches, Loop/Scan bodies)."""
    graphs: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


def outer_scope_inputs(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs read from the enclosing graph (implicit inputs)."""
    names: list[str] = []
    for g in subgraphs(node):
        local = {i.name for i in g.input} | {t.name for t in g.initializer}
        for sub_node in g.node:
            local.update(sub_node.output)
        for sub_node in iter_nodes(g):
            for name in list(sub_node.input) + outer_scope_inputs(sub_node):
                if name and name not in local and name not in names:
                    names.append(name)
        for o in g.output:
            if o.name not in local and o.name not in names:
                names.append(o.name)
    return names


@dataclass
class ModelSummary:
    """What `diag inspect` prints about one model."""

    path: str
    format: ModelFormat
    ir_version: int
    opsets: dict[str, int]
    producer: str
    inputs: list[str]
    outputs: list[str]
    node_count: int
    op_counts: dict[str, int]
    quantized_nodes: int
    float_nodes: int
    subgraph_nodes: list[str]
    unnamed_nodes: int
    external_data: bool
    problems: list[str]
    #: Findings that did not stop diag (see :attr:`LoadedModel.warnings`).
    warnings: list[str] = field(default_factory=list)
    #: Weight precision -> node count for block-wise / weight-only formats
    #: (:func:`diag.core.precision.precision_breakdown`).
    precision: dict[str, int] = field(default_factory=dict)
    #: Which tool quantized the model, by the marks it left (:func:`diag.foundations.producers.detect_producer`):
    #: its name and the marks, or "" for an FP32 model or when no producer's marks decide.
    made_by: str = ""


#: Quantization ops of other tools' domains, which onnxruntime runs only with their custom-op
#: library (AMD Quark's BF16 / BFP / MX formats): read as QDQ, named with their domain.
FOREIGN_QDQ_OPS = frozenset({"ExtendedQuantizeLinear", "ExtendedDequantizeLinear"})
_QUANT_OP_TYPES = DYNAMIC_OPS | QOPERATOR_OPS | QDQ_OPS | NBITS_OPS | FOREIGN_QDQ_OPS


def model_summary(path: str | os.PathLike[str]) -> ModelSummary:
    """Format, opsets, op counts, quantized vs float nodes, subgraphs and visible problems.

    Example:
        >>> s = model_summary("int8.onnx")  # doctest: +SKIP
        >>> s.format.kind, s.quantized_nodes  # doctest: +SKIP
        ('dynamic', 12)
    """
    m = model_from_path(path)
    proto = m.proto
    nodes = iter_nodes(proto.graph)
    ops = Counter(n.op_type for n in nodes)
    problems: list[str] = []
    opsets = {(o.domain or "ai.onnx"): int(o.version) for o in proto.opset_import}
    default_opset = opsets.get("ai.onnx", 0)
    if m.format.family in ("qdq", "mixed") and default_opset < 13:
        axis_dq = [n for n in nodes if n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute)]
        if axis_dq:
            problems.append(
                f"per-channel DequantizeLinear with 'axis' on opset {default_opset} (< 13): "
                "onnxruntime refuses it; convert the FP32 model to opset >= 13 first"
            )
    # Only domains that nodes use and onnxruntime has no kernels for need a library: exporters
    # import domains they never use, and com.microsoft / ai.onnx.ml ship with onnxruntime.
    used = {n.domain or "ai.onnx" for n in nodes}
    custom = sorted(used - onnxruntime_domains())
    if custom:
        custom_ops = sorted({n.op_type for n in nodes if (n.domain or "ai.onnx") in custom})
        registered = len(custom_op_libraries())
        problems.append(
            f"custom op domains {custom} (ops {', '.join(custom_ops)}): onnxruntime needs their library to run "
            f"the model ({registered} registered; pass it with diag --custom-op-library PATH VERB ...)"
        )
    # Unnamed nodes matter only where nodes_to_exclude would have to name them: quantizable ones.
    # (Unnamed Constant, Shape, Reshape... nodes are common in exports and harmless.)
    quantizable = _quantizable_op_types(m.format.family)
    unnamed_nodes = [n for n in proto.graph.node if not n.name and n.op_type in quantizable]
    unnamed = len(unnamed_nodes)
    if unnamed:
        unnamed_ops = sorted({n.op_type for n in unnamed_nodes})
        problems.append(
            f"{unnamed} quantizable node(s) without a name ({', '.join(unnamed_ops)}): nodes_to_exclude cannot "
            "refer to them"
        )
    # NOTE: only a Constant that holds a quantizable node's weight matters (quantize_dynamic raises
    # "Expected ... to be an initializer" on it); a standard export's shape and scalar Constants do not.
    weights = constant_weights(proto, "dynamic") if m.format.kind == "fp32" else []
    if weights:
        problems.append(
            f"{len(weights)} Constant node(s) hold weights of quantizable nodes (e.g. '{weights[0]}'): "
            "quantize_dynamic fails with 'Expected ... to be an initializer' on them; diag quantize lifts "
            "them to initializers (or run onnxruntime's quant_pre_process first)"
        )
    if m.format.kind == "fp32" and default_opset < 13:
        problems.append(
            f"opset {default_opset} < 13: per-channel QDQ quantization will produce a model "
            "onnxruntime cannot load; upgrade with onnx.version_converter first"
        )
    sub_nodes = [f"{n.name or n.op_type} ({n.op_type})" for n in proto.graph.node if subgraphs(n)]
    quantized = sum(c for op, c in ops.items() if op in _QUANT_OP_TYPES)
    return ModelSummary(
        path=str(m.path),
        format=m.format,
        ir_version=int(proto.ir_version),
        opsets=opsets,
        producer=f"{proto.producer_name} {proto.producer_version}".strip(),
        inputs=[i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}],
        outputs=[o.name for o in proto.graph.output],
        node_count=len(nodes),
        op_counts=dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        quantized_nodes=quantized,
        float_nodes=len(nodes) - quantized,
        subgraph_nodes=sub_nodes,
        unnamed_nodes=unnamed,
        external_data=m.has_external_data,
        problems=problems,
        warnings=list(m.warnings),
        precision=_precision(proto, m.format),
        made_by=_made_by(proto, m),
    )


def _made_by(proto: onnx.ModelProto, m: LoadedModel) -> str:
    """Who quantized the model, by its marks ("" for FP32 models, or when no producer's marks decide)."""
    if m.format.kind == "fp32":
        return ""
    detection = detect_producer(proto, m.path)
    return "" if detection.key == "unknown" else detection.seen()


def _precision(proto: onnx.ModelProto, fmt: ModelFormat) -> dict[str, int]:
    """Weight precision per compute node, for models with weight-only block-quantized parts."""
    if not any(k in NBITS_OPS or k == "DequantizeLinear(block_size)" for k in fmt.evidence):
        return {}
    return precision_breakdown(proto)


def onnxruntime_domains() -> set[str]:
    """Operator domains the installed onnxruntime has CPU kernels for (``ai.onnx`` for the default)."""
    from onnxruntime.capi import _pybind_state as C

    return {k.domain or "ai.onnx" for k in C.get_all_opkernel_def()}


#: The inputs onnxruntime's dynamic quantizer reads as weights (initializers only), by op type.
WEIGHT_INPUTS: dict[str, tuple[int, ...]] = {
    "MatMul": (1,),
    "Gemm": (1,),
    "Conv": (1,),
    "ConvTranspose": (1,),
    "Gather": (0,),
    "Attention": (1,),
    "LSTM": (1, 2),
    "EmbedLayerNormalization": (2, 3, 4),
}


def constant_weights(proto: onnx.ModelProto, mode: str) -> list[str]:
    """The ``Constant`` node outputs onnxruntime's quantizer would need as initializers, in ``mode``.

    ``dynamic``: those read at a weight input (:data:`WEIGHT_INPUTS`) of a node quantize_dynamic
    quantizes (it raises "Expected ... to be an initializer" on them). ``static``: every float
    Constant read by a node quantize_static quantizes (it would quantize it like an activation, at
    run time, ignoring ``weight_type`` and ``per_channel``).

    Example:
        >>> constant_weights(onnx.load("paddle_det.onnx"), "dynamic")[:1]  # doctest: +SKIP
        ['conv2d_0.w_0']
    """
    consts = {
        n.output[0]: n
        for n in proto.graph.node
        if n.op_type == "Constant" and n.output and len(n.attribute) == 1 and n.attribute[0].name == "value"
    }
    if not consts:
        return []
    quantizable = _quantizable_op_types("dynamic" if mode == "dynamic" else "qdq")
    found: dict[str, None] = {}
    for n in proto.graph.node:
        if n.op_type not in quantizable:
            continue
        if mode == "dynamic":
            read = [n.input[i] for i in WEIGHT_INPUTS.get(n.op_type, ()) if i < len(n.input)]
        else:
            read = [t for t in n.input if t in consts and consts[t].attribute[0].t.data_type == onnx.TensorProto.FLOAT]
        found.update({t: None for t in read if t in consts})
    return list(found)


def _quantizable_op_types(kind: str) -> set[str]:
    """Op types onnxruntime's quantizer quantizes by default for a model of format ``kind``.

    By the kind's recipe mode (:data:`diag.foundations.ortfacts.FORMATS`): dynamic, IntegerOpsRegistry;
    static (QDQ / QOperator), QDQRegistry | QLinearOpsRegistry; an FP32 (or mixed) model may go
    either way, so both.
    """
    from onnxruntime.quantization import registry

    dynamic = set(registry.IntegerOpsRegistry)
    static = set(registry.QDQRegistry) | set(registry.QLinearOpsRegistry)
    mode = FORMATS[kind].mode
    return dynamic if mode == "dynamic" else static if mode == "static" else dynamic | static
