"""One table of INT8 model producers: how each tool is recognised in a model, and how a verified
fix (FP32 nodes kept in float) is written in that tool's own vocabulary.

A user whose INT8 model came from NNCF cannot paste an onnxruntime ``nodes_to_exclude`` call: the
fix must be ``nncf.IgnoredScope(names=[...])``. :data:`PRODUCERS` holds one :class:`Producer` row
per tool (onnxruntime, Optimum, NNCF, ModelOpt, Quark, AIMET, the torch exporters, and ``unknown``),
so a new producer is one row: its marks (:class:`Mark`: what it writes into a model) and its fix
(:class:`FixTemplate`: the call that keeps nodes in float). :func:`detect_producer` reads the marks
off a ``ModelProto`` (and, given the model's path, the files beside it) and says which mark decided;
:func:`fix_call` renders the fix for any row.

Where each row's facts come from is its ``source``: the tools' own code as read (NNCF 3.x
``onnx/graph/model_transformer.py`` and ``smooth_quant/algorithm.py``; ModelOpt
``onnx/quantization/ort_utils.py`` and ``__main__.py``; Quark ``onnx/quantization/config/config.py``,
``maps.py``, ``quant_utils.py``; AIMET-ONNX ``quantsim.py``; Optimum ``onnxruntime/quantization.py``
and ``configuration.py``; torch ``onnx/_internal/exporter/_core.py``) or the installed onnxruntime.

NOTE: the marks are regular expressions over strings read from the proto's structure (producer
name, metadata keys, opset domains, node and tensor names, initializer element types), never its
weights: detection works on ``onnx.load(..., load_external_data=False)``. This module imports
neither onnx nor numpy at run time (the element types are onnx's enum numbers), so a verb that only
renders a fix does not pay for them.

A foundation module: it imports only the standard library, :mod:`diag.foundations.errors` and
:mod:`diag.foundations.untrusted`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from diag.foundations.errors import DiagError
from diag.foundations.untrusted import parse_json

if TYPE_CHECKING:
    import onnx

#: Where a mark is looked for. ``producer_name``: the model's ``producer_name``; ``metadata``:
#: ``key=value`` of the model's and the graph's ``metadata_props``, ``key=`` of each node's;
#: ``domain``: the opset imports' and the nodes' domains; ``node_name`` / ``tensor_name``: the main
#: graph's node names / node outputs and initializer names; ``structure``: the name of a check of
#: :data:`STRUCTURES`; ``file_beside``: a file next to the model (needs its path); ``file_name``:
#: the model file's own name (needs its path).
MarkKind = Literal[
    "producer_name", "metadata", "domain", "node_name", "tensor_name", "structure", "file_beside", "file_name"
]
#: How much one mark says. 3: only this tool writes it. 2: this tool, unless a stronger mark says
#: otherwise (a tool that wraps another writes the other's marks too). 1: a hint other tools share.
Strength = Literal[1, 2, 3]
DECISIVE: Strength = 3
LIKELY: Strength = 2
WEAK: Strength = 1


@dataclass(frozen=True)
class Mark:
    """One thing a producer writes into the models it makes.

    Attributes:
        kind: where it is looked for (:data:`MarkKind`).
        pattern: a regular expression searched (``re.search``) in each string of that kind; for
            ``structure`` the name of a check of :data:`STRUCTURES`; for ``file_beside`` the exact
            file name.
        strength: how much it says (:data:`Strength`).
        means: why it points at the producer, shown as the evidence.
        json_key: ``file_beside`` only: the file must be a JSON object with this key set (not null).
    """

    kind: MarkKind
    pattern: str
    strength: Strength
    means: str
    json_key: str | None = None


#: The placeholders a :class:`FixTemplate` may hold. ``$nodes``: the FP32 node names as a Python
#: list literal (one ``repr`` per line, indented like the placeholder's line). ``$regexes``: each
#: name as a regular expression matching exactly it (``re.escape`` + ``$``; ModelOpt's
#: ``--nodes_to_exclude`` takes patterns matched with ``re.match``), shell-quoted, space separated.
PLACEHOLDERS = ("nodes", "regexes")


@dataclass(frozen=True)
class FixTemplate:
    """The call that keeps FP32 nodes in float, in one tool's vocabulary.

    Attributes:
        language: ``python`` (the snippet compiles) or ``shell`` (a command line).
        text: the snippet with :data:`PLACEHOLDERS` (``$nodes``, ``$regexes``) where the names go.
    """

    language: Literal["python", "shell"]
    text: str


@dataclass(frozen=True)
class Producer:
    """One tool that makes INT8 ONNX models: how it is recognised, how a fix is written for it.

    Attributes:
        key: the row's key in :data:`PRODUCERS`.
        name: its display name.
        marks: what it writes into a model (:class:`Mark`); empty for ``unknown``.
        refines: the key of the producer it wraps (ModelOpt and Optimum run onnxruntime's quantizer
            and keep its marks): at equal strength, the wrapper wins.
        fix: its own call that keeps nodes in float; None when it has none.
        fix_with: the key whose :attr:`fix` applies when :attr:`fix` is None (an exporter writes
            FP32 models: they are quantized, and fixed, with onnxruntime).
        fix_note: a comment line printed above the fix.
        type_fix: its own switch that keeps every node of some op types in float, ``$types`` where
            the op types go (a list literal); None when diag knows none (onnxruntime's is
            ``op_types_to_quantize``, the complement, worded where the op types present are known).
        node_fix: :attr:`fix` in one line, ``$names`` where the node names go (a list literal;
            ``$patterns``: regular expressions matching exactly them), for a remedy's line; None:
            onnxruntime's ``nodes_to_exclude=[...]`` (the tools that call it, and :attr:`fix_with`).
        per_channel_fix: its own way to per-channel weights, in one line; None: onnxruntime's
            ``per_channel=True`` (NNCF has no switch: per channel is its default from opset 13).
        source: where the marks and the fix's vocabulary were read (a file of the tool's own code,
            or an assumption, said as such).
    """

    key: str
    name: str
    marks: tuple[Mark, ...]
    refines: str | None = None
    fix: FixTemplate | None = None
    fix_with: str | None = None
    fix_note: str | None = None
    type_fix: str | None = None
    node_fix: str | None = None
    per_channel_fix: str | None = None
    source: str = ""


_ORT_PRODUCER = "onnx.quantize"
# onnx's TensorProto.DataType numbers (kept here so the module needs no onnx at run time).
_FLOAT, _FLOAT16 = 1, 10
_Q_DQ = ("QuantizeLinear", "DequantizeLinear")


def _ort_float_weight_qdq(model: onnx.ModelProto) -> str | None:
    """A float initializer quantized in the graph, under onnxruntime's producer name."""
    if model.producer_name != _ORT_PRODUCER:
        return None
    floats = {t.name for t in model.graph.initializer if t.data_type == _FLOAT}
    quants = (n for n in model.graph.node if n.op_type == "QuantizeLinear" and len(n.input) > 0)
    node = next((n for n in quants if n.input[0] in floats), None)
    return None if node is None else f"QuantizeLinear {node.name!r} quantizes the float initializer {node.input[0]!r}"


def _ort_qdq_with_float16(model: onnx.ModelProto) -> str | None:
    """float16 initializers next to QDQ nodes, under onnxruntime's producer name."""
    if model.producer_name != _ORT_PRODUCER or not any(n.op_type in _Q_DQ for n in model.graph.node):
        return None
    half = next((t.name for t in model.graph.initializer if t.data_type == _FLOAT16), None)
    return None if half is None else f"float16 initializer {half!r} next to QuantizeLinear/DequantizeLinear"


#: The structural checks a ``structure`` mark names: model -> what was found, or None.
STRUCTURES: dict[str, Callable[[onnx.ModelProto], str | None]] = {
    "ort-float-weight-qdq": _ort_float_weight_qdq,
    "ort-qdq-with-float16": _ort_qdq_with_float16,
}

_ORT_CALL = FixTemplate(
    "python",
    """from onnxruntime.quantization import QuantFormat, quantize_static

# Your quantize_static (or quantize_dynamic) call as before, plus nodes_to_exclude:
quantize_static(
    "model.onnx",
    "model.int8.onnx",
    calibration_data_reader,  # your CalibrationDataReader
    quant_format=QuantFormat.QDQ,
    nodes_to_exclude=$nodes,
)
""",
)

#: Every producer diag recognises, by key; ``unknown`` last (no marks: the fallback).
PRODUCERS: dict[str, Producer] = {
    p.key: p
    for p in (
        Producer(
            "onnxruntime",
            "onnxruntime",
            (
                Mark(
                    "producer_name",
                    r"^onnx\.quantize$",
                    LIKELY,
                    "onnxruntime's quantizers write producer_name 'onnx.quantize' (ModelOpt and Optimum run "
                    "them and keep it)",
                ),
                Mark(
                    "tensor_name",
                    r"_(QuantizeLinear_Output|DequantizeLinear_Output|quantized)$",
                    WEAK,
                    "onnxruntime's quantized tensor names (tools built on its quantizer write them too)",
                ),
            ),
            fix=_ORT_CALL,
            source="the installed onnxruntime 1.32: quantization/qdq_quantizer.py and onnx_quantizer.py set "
            "producer_name = __producer__ ('onnx.quantize'); quantize_static/quantize_dynamic(nodes_to_exclude=...)",
        ),
        Producer(
            "optimum",
            "Optimum (ORTQuantizer)",
            (
                Mark(
                    "file_beside",
                    "ort_config.json",
                    DECISIVE,
                    "ORTQuantizer.quantize saves ORTConfig (ort_config.json, a 'quantization' section) beside "
                    "the model",
                    json_key="quantization",
                ),
                Mark(
                    "file_name",
                    r"_quantized\.onnx$",
                    WEAK,
                    "ORTQuantizer.quantize names its output <model>_quantized.onnx (file_suffix='quantized')",
                ),
            ),
            refines="onnxruntime",
            fix=FixTemplate(
                "python",
                """from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig

# Your configuration as before (is_static, per_channel, ... as in ort_config.json), plus nodes_to_exclude;
# QuantizationConfig(..., nodes_to_exclude=...) takes it alike.
qconfig = AutoQuantizationConfig.avx512_vnni(
    is_static=False,
    nodes_to_exclude=$nodes,
)
quantizer = ORTQuantizer.from_pretrained("path/to/onnx_model_dir")
quantizer.quantize(save_dir="path/to/quantized", quantization_config=qconfig)
""",
            ),
            source="huggingface/optimum: onnxruntime/quantization.py (ORTQuantizer.quantize writes "
            "<stem>_quantized.onnx and ORTConfig.save_pretrained), onnxruntime/configuration.py "
            "(CONFIG_NAME 'ort_config.json'; AutoQuantizationConfig.avx512_vnni(..., nodes_to_exclude=...))",
        ),
        Producer(
            "nncf",
            "NNCF",
            (
                Mark(
                    "tensor_name",
                    r"^dq_output_.+_\d+$",
                    DECISIVE,
                    "NNCF names DequantizeLinear outputs dq_output_<tensor>_<n>",
                ),
                Mark(
                    "node_name",
                    r"/nncf_smooth_quant$",
                    DECISIVE,
                    "NNCF's SmoothQuant (ModelType.TRANSFORMER) inserts Mul nodes "
                    "<source>_<port>_<n>/nncf_smooth_quant",
                ),
                Mark(
                    "node_name",
                    r"^(QuantizeLinear|DequantizeLinear)_.+_\d+$",
                    LIKELY,
                    "NNCF names its quantizer nodes QuantizeLinear_<tensor>_<n> / DequantizeLinear_<tensor>_<n>",
                ),
            ),
            fix=FixTemplate(
                "python",
                """import nncf

# Your nncf.quantize call as before (model: the FP32 onnx.ModelProto), plus ignored_scope:
quantized_model = nncf.quantize(
    model,
    calibration_dataset,  # your nncf.Dataset
    ignored_scope=nncf.IgnoredScope(names=$nodes),
)
""",
            ),
            type_fix="nncf.IgnoredScope(types=$types) in your nncf.quantize call",
            node_fix="nncf.IgnoredScope(names=$names) in your nncf.quantize call",
            per_channel_fix="model = onnx.version_converter.convert_version(model, 13)  "
            "# then nncf.quantize(model, ...)",
            source="openvinotoolkit/nncf: src/nncf/onnx/graph/model_transformer.py (q_output_/dq_output_ "
            "<edge>_<n>, QuantizeLinear_/DequantizeLinear_ node names, scale_/zero_point_ initializers, "
            "<mul>_scale / <mul>_output of inserted Mul nodes), quantization/algorithms/smooth_quant/"
            "algorithm.py (<source>_<port>_<n>/nncf_smooth_quant), onnx/graph/passes.py (weights folded to "
            "integer initializers named after the QuantizeLinear output); NNCF keeps the input model's "
            "producer_name; nncf.IgnoredScope(names=...) takes exact node names",
        ),
        Producer(
            "modelopt",
            "NVIDIA ModelOpt (TensorRT Model Optimizer)",
            (
                Mark(
                    "structure",
                    "ort-float-weight-qdq",
                    LIKELY,
                    "weights stored in float and quantized in the graph under producer 'onnx.quantize': "
                    "onnxruntime with AddQDQPairToWeight=True, which ModelOpt always sets (a plain onnxruntime "
                    "call with that option writes the same)",
                ),
                Mark(
                    "structure",
                    "ort-qdq-with-float16",
                    LIKELY,
                    "int8 QDQ with float16 elsewhere under producer 'onnx.quantize': ModelOpt's default "
                    "--high_precision_dtype fp16",
                ),
                Mark(
                    "file_name",
                    r"\.quant\.onnx$",
                    WEAK,
                    "ModelOpt's default output name is <model>.quant.onnx",
                ),
            ),
            refines="onnxruntime",
            fix=FixTemplate(
                "shell",
                """python -m modelopt.onnx.quantization \\
    --onnx_path model.onnx \\
    --quantize_mode int8 \\
    --nodes_to_exclude $regexes
""",
            ),
            type_fix="op_types_to_exclude=$types in your modelopt.onnx.quantization.quantize call",
            node_fix="nodes_to_exclude=$patterns in your modelopt.onnx.quantization.quantize call",
            source="NVIDIA/Model-Optimizer: modelopt/onnx/quantization/int8.py (onnxruntime's quantize_static; "
            "producer_name stays 'onnx.quantize'), ort_utils.py configure_ort (AddQDQPairToWeight=True, "
            "ActivationSymmetric=True, DedicatedQDQPair=False), quantize.py (<model>.quant.onnx, fp16 by "
            "default), __main__.py and graph_utils.py (--nodes_to_exclude: patterns, re.match)",
        ),
        Producer(
            "quark",
            "AMD Quark",
            (
                Mark(
                    "producer_name",
                    r"^quark\.onnx$",
                    DECISIVE,
                    "Quark's quantizers write producer_name 'quark.onnx'",
                ),
                Mark(
                    "domain",
                    r"^com\.(amd\.quark|vai\.quantize)$",
                    DECISIVE,
                    "Quark imports its custom-op domain com.amd.quark (formerly com.vai.quantize) in every "
                    "model it quantizes",
                ),
            ),
            fix=FixTemplate(
                "python",
                """from quark.onnx import Int8Spec, ModelQuantizer, QConfig, QLayerConfig

# Your QConfig as before (global_config, algo_config, ...), plus exclude:
config = QConfig(
    global_config=QLayerConfig(activation=Int8Spec(), weight=Int8Spec()),
    exclude=$nodes,
)
ModelQuantizer(config).quantize_model("model.onnx", "model.quant.onnx", calibration_data_reader)
""",
            ),
            node_fix="exclude=$names in your quark.onnx QConfig",
            per_channel_fix="QLayerConfig(weight=Int8Spec(quant_granularity=QuantGranularity.Channel)) in your QConfig",
            source="amd/Quark: quark/onnx/quantization/config/config.py (QConfig(global_config, ..., exclude)), "
            "config/maps.py (_map_q_config: each str of exclude -> nodes_to_exclude), quant_utils.py "
            "(__producer__ = 'quark.onnx'), quantizers' set_parameters_and_domain (com.microsoft and "
            "com.amd.quark opset imports); exclude takes exact node names (an assumption beyond maps.py)",
        ),
        Producer(
            "aimet",
            "Qualcomm AIMET (aimet-onnx)",
            (
                Mark(
                    "metadata",
                    r"^producer=aimet-onnx",
                    DECISIVE,
                    "QuantizationSimModel.to_onnx_qdq() writes the metadata property producer='aimet-onnx <version>'",
                ),
                Mark(
                    "domain",
                    r"^aimet\.customop\.(cpu|cuda)$",
                    DECISIVE,
                    "a QuantizationSimModel's QcQuantizeOp nodes (the simulation graph saved as is)",
                ),
                Mark(
                    "tensor_name",
                    r"_updated$",
                    LIKELY,
                    "AIMET's quantizer outputs are named <tensor>_updated",
                ),
            ),
            fix=FixTemplate(
                "python",
                """# sim: your aimet_onnx QuantizationSimModel, before sim.compute_encodings(...)
for name in $nodes:
    op = sim.connected_graph.get_all_ops()[name]
    input_quantizers, output_quantizers, param_quantizers = sim.get_op_quantizers(op)
    for quantizer in [*input_quantizers, *output_quantizers, *param_quantizers.values()]:
        quantizer.enabled = False
""",
            ),
            node_fix="the quantizers of $names disabled (sim.get_op_quantizers(op), enabled = False) before "
            "sim.compute_encodings",
            per_channel_fix='"per_channel_quantization": "True" in the defaults of your quantsim config '
            "(QuantizationSimModel(..., config_file=...))",
            source="quic/aimet: aimet_onnx/quantsim.py (_to_onnx_qdq: metadata producer='aimet-onnx <version>', "
            "<tensor>_updated / <tensor>_qdq names, get_op_quantizers(op)), aimet_onnx/meta/connectedgraph.py "
            "(ops keyed by ONNX node name), qc_quantize_op.py (enabled setter); aimet_common/onnx/_utils.py "
            "(_add_onnx_qdq_nodes: <input>_q, <prefix>_q / <prefix>_dq)",
        ),
        Producer(
            "torch",
            "torch exporter (dynamo / TorchScript)",
            (
                Mark(
                    "producer_name",
                    r"^pytorch$",
                    WEAK,
                    "torch.onnx.export writes producer_name 'pytorch' (both exporters; a quantizer that keeps "
                    "the exporter's name, like NNCF, outranks it)",
                ),
                Mark(
                    "metadata",
                    r"^pkg\.torch\.(export|onnx)\.",
                    WEAK,
                    "the dynamo exporter's metadata (pkg.torch.export.ExportedProgram.*, per-node "
                    "pkg.torch.onnx.name_scopes)",
                ),
            ),
            fix_with="onnxruntime",
            fix_note="torch.onnx.export writes the FP32 model: quantize it with onnxruntime, these nodes kept in float",
            source="pytorch: torch/onnx/_internal/exporter/_core.py (producer_name='pytorch', graph metadata "
            "pkg.torch.export.ExportedProgram.*); the TorchScript exporter writes producer_name 'pytorch' too",
        ),
        Producer(
            "unknown",
            "unknown producer",
            (),
            fix_with="onnxruntime",
            fix_note="the producer is unknown: onnxruntime's own call, these nodes kept in float",
            source="the fallback when no mark is found or two unrelated producers' marks tie",
        ),
    )
}


@dataclass(frozen=True)
class Evidence:
    """One mark found in a model: which producer's, and what exactly matched."""

    producer: str
    mark: Mark
    found: str


@dataclass(frozen=True)
class Detection:
    """Which tool made a model, with the marks that decided it.

    Attributes:
        producer: the row of :data:`PRODUCERS` (``unknown`` when nothing, or a tie, decides).
        evidence: the marks of that producer found in the model, strongest first (empty for unknown).
        outranked: the other producers' marks found, strongest first (a wrapped tool's, a tie's).
        note: what a path would have added (files beside the model), or why it is unknown.
    """

    producer: Producer
    evidence: tuple[Evidence, ...] = ()
    outranked: tuple[Evidence, ...] = ()
    note: str | None = None

    @property
    def key(self) -> str:
        return self.producer.key

    @property
    def decided_by(self) -> Evidence | None:
        """The strongest mark of the winning producer (None for unknown)."""
        return self.evidence[0] if self.evidence else None

    def seen(self, marks: int = 2) -> str:
        """The producer with the first ``marks`` marks that decided it, for one line (``inspect``).

        Example:
            >>> import onnx
            >>> detect_producer(onnx.ModelProto(producer_name="quark.onnx")).seen()
            "AMD Quark (producer name 'quark.onnx')"
        """
        if not self.evidence:
            return self.producer.name
        return f"{self.producer.name} ({', '.join(e.found for e in self.evidence[:marks])})"


#: Longest text of a matched name kept in the evidence (a hostile model may hold huge names).
_SHOWN = 160
#: Largest file beside the model read for a ``file_beside`` mark.
_MAX_BESIDE_BYTES = 1 << 20


def _strings(model: onnx.ModelProto, kind: MarkKind) -> Iterable[str]:
    graph = model.graph
    if kind == "producer_name":
        yield model.producer_name
    elif kind == "metadata":
        yield from (f"{p.key}={p.value}" for p in (*model.metadata_props, *graph.metadata_props))
        yield from (f"{p.key}=" for n in graph.node for p in n.metadata_props)
    elif kind == "domain":
        yield from (o.domain for o in model.opset_import)
        yield from (n.domain for n in graph.node)
    elif kind == "node_name":
        yield from (n.name for n in graph.node)
    elif kind == "tensor_name":
        yield from (t.name for t in graph.initializer)
        yield from (o for n in graph.node for o in n.output)


def _beside(mark: Mark, path: Path) -> str | None:
    """The ``file_beside`` mark's file next to ``path``, when it holds ``mark.json_key``."""
    other = path.parent / mark.pattern
    try:
        if not other.is_file() or other.stat().st_size > _MAX_BESIDE_BYTES:
            return None
        text = other.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    if mark.json_key is None:
        return f"{other.name} beside the model"
    try:
        doc = parse_json(text, other)
    except DiagError:  # an unreadable file says nothing either way
        return None
    if isinstance(doc, dict) and doc.get(mark.json_key) is not None:
        return f"{other.name} beside the model has a {mark.json_key!r} section"
    return None


def _find(mark: Mark, model: onnx.ModelProto, path: Path | None) -> str | None:
    """What in ``model`` (or beside ``path``) matches ``mark``, said in a few words; None if nothing."""
    if mark.kind == "structure":
        return STRUCTURES[mark.pattern](model)
    if mark.kind in ("file_beside", "file_name"):
        if path is None:
            return None
        if mark.kind == "file_beside":
            return _beside(mark, path)
        return f"file name {path.name!r}" if re.search(mark.pattern, path.name) else None
    rx = re.compile(mark.pattern)
    hit = next((s for s in _strings(model, mark.kind) if rx.search(s)), None)
    if hit is None:
        return None
    shown = hit if len(hit) <= _SHOWN else hit[:_SHOWN] + "..."
    return f"{mark.kind.replace('_', ' ')} {shown!r}"


def _rank(found: Sequence[Evidence]) -> tuple[int, int]:
    return (max(e.mark.strength for e in found), len(found)) if found else (0, 0)


def detect_producer(model: onnx.ModelProto, path: str | os.PathLike[str] | None = None) -> Detection:
    """Which tool made ``model``: the producer whose strongest mark is strongest, with the evidence.

    A wrapper (ModelOpt, Optimum) wins a tie against the tool it wraps; a tie between unrelated
    producers is ``unknown`` (both listed in ``outranked``). Marks read from files (Optimum's
    ``ort_config.json``, the output names) need ``path``, the model file's path; without it the
    note says which producer could not be seen. Reads the structure only, never the weights.

    Example:
        >>> import onnx
        >>> m = onnx.ModelProto(producer_name="quark.onnx")
        >>> d = detect_producer(m)
        >>> d.key, d.decided_by.found
        ('quark', "producer name 'quark.onnx'")
        >>> detect_producer(onnx.ModelProto(producer_name="my-exporter")).key
        'unknown'
    """
    where = None if path is None else Path(path)
    found: dict[str, list[Evidence]] = {}
    for p in PRODUCERS.values():
        for mark in p.marks:
            what = _find(mark, model, where)
            if what is not None:
                found.setdefault(p.key, []).append(Evidence(p.key, mark, what))
    for ev in found.values():
        ev.sort(key=lambda e: -e.mark.strength)
    best = _best(found)
    every = sorted((e for ev in found.values() for e in ev), key=lambda e: -e.mark.strength)
    outranked = tuple(e for e in every if e.producer != best)
    if best is None:
        why = "two unrelated producers' marks tie" if found else "no producer's mark was found"
        return Detection(PRODUCERS["unknown"], (), outranked, why)
    return Detection(PRODUCERS[best], tuple(found[best]), outranked, _unseen(best, _rank(found[best])[0], where))


def _best(found: dict[str, list[Evidence]]) -> str | None:
    """The producer whose marks rank highest; a wrapper beats what it wraps; None on a true tie."""
    if not found:
        return None
    top = max(_rank(ev)[0] for ev in found.values())
    tied = [k for k, ev in found.items() if _rank(ev)[0] == top]
    wrapped = {PRODUCERS[k].refines for k in tied}
    tied = [k for k in tied if k not in wrapped]
    if len(tied) > 1:
        most = max(_rank(found[k])[1] for k in tied)
        tied = [k for k in tied if _rank(found[k])[1] == most]
    return tied[0] if len(tied) == 1 else None


def _unseen(best: str, strength: int, path: Path | None) -> str | None:
    """The wrappers of ``best`` that only a file mark could reveal (one as strong as ``best``'s
    marks), when no path was given to look for it."""
    if path is not None:
        return None
    hidden = [
        p.name
        for p in PRODUCERS.values()
        if p.refines == best and any(m.kind in ("file_beside", "file_name") and m.strength >= strength for m in p.marks)
    ]
    if not hidden:
        return None
    return f"{' and '.join(hidden)} write the same graph; give the model's path to look for their files beside it"


def _render_line(line: str, names: Sequence[str]) -> str:
    indent = line[: len(line) - len(line.lstrip())]

    def value(m: re.Match[str]) -> str:
        if m.group(1) == "nodes":
            return "[\n" + "".join(f"{indent}    {n!r},\n" for n in names) + indent + "]"
        return " ".join(shlex.quote(re.escape(n) + "$") for n in names)

    # One pass: a name holding "$regexes" is never substituted again.
    return re.sub(r"\$(" + "|".join(PLACEHOLDERS) + r")\b", value, line)


#: Producers whose INT8 models come from onnxruntime's own quantizer calls: its recipe keys
#: (``op_types_to_quantize``, ``MatMulConstBOnly``) are switches their users have.
ORT_RECIPE_PRODUCERS = ("onnxruntime", "optimum", "torch", "unknown")


def op_types_change(producer: str, excluded: Sequence[str], keep: Sequence[str]) -> str:
    """The change that keeps every node of the ``excluded`` op types in float, in ``producer``'s terms.

    onnxruntime (and the tools that call it) quantize the op types listed, so its change is
    ``op_types_to_quantize`` with the ``keep`` list; NNCF and ModelOpt name the types to leave out
    (:attr:`Producer.type_fix`); a tool without such a switch gets the nodes in its own exclusion list.

    Example:
        >>> op_types_change("onnxruntime", ["Div"], ["Conv", "Mul"])
        'op_types_to_quantize=["Conv", "Mul"]'
        >>> op_types_change("nncf", ["Div"], ["Conv", "Mul"])
        "nncf.IgnoredScope(types=['Div']) in your nncf.quantize call"
        >>> op_types_change("aimet", ["Div"], ["Conv"])
        "every Div node in float with Qualcomm AIMET (aimet-onnx)'s own exclusion list"
    """
    if producer in ORT_RECIPE_PRODUCERS or producer not in PRODUCERS:
        return f"op_types_to_quantize={json.dumps(list(keep), ensure_ascii=False)}"
    own = type_fix_call(producer, excluded)
    return own or f"every {'/'.join(excluded)} node in float with {PRODUCERS[producer].name}'s own exclusion list"


def type_fix_call(producer: str | Producer, op_types: Sequence[str]) -> str | None:
    """``producer``'s own switch that keeps every node of ``op_types`` in float, or None without one.

    Example:
        >>> type_fix_call("nncf", ["Conv"])
        "nncf.IgnoredScope(types=['Conv']) in your nncf.quantize call"
        >>> type_fix_call("aimet", ["Conv"]) is None
        True
    """
    row = PRODUCERS[producer] if isinstance(producer, str) else producer
    return None if row.type_fix is None else string.Template(row.type_fix).substitute(types=repr(list(op_types)))


def node_fix_call(producer: str, nodes: Sequence[str]) -> str:
    """``producer``'s own switch that keeps ``nodes`` in float, in one line (a remedy's line; the
    full call is :func:`fix_call`). Names are list literals (``repr``), never pasted raw.

    Example:
        >>> node_fix_call("nncf", ["conv3"])
        "nncf.IgnoredScope(names=['conv3']) in your nncf.quantize call"
        >>> node_fix_call("modelopt", ["conv3"])
        "nodes_to_exclude=['conv3$'] in your modelopt.onnx.quantization.quantize call"
        >>> node_fix_call("onnxruntime", ["conv3"])
        'nodes_to_exclude=["conv3"]'
    """
    row = PRODUCERS.get(producer)
    if row is None or row.node_fix is None:
        return f"nodes_to_exclude={json.dumps(list(nodes), ensure_ascii=False)}"
    patterns = [re.escape(n) + "$" for n in nodes]
    return string.Template(row.node_fix).substitute(names=repr(list(nodes)), patterns=repr(patterns))


def fix_call(producer: str | Producer, nodes: Sequence[str]) -> str:
    """The snippet that keeps ``nodes`` (FP32 node names) in float, in ``producer``'s vocabulary.

    Every name is written as a Python string literal (``repr``) or, in a shell command, a quoted
    regular expression matching exactly it: a name is never pasted raw into code. A producer
    without a quantizer of its own (the exporters, ``unknown``) gets its ``fix_with`` row's call
    under its note.

    Example:
        >>> print(fix_call("nncf", ["conv3", "it's"]), end="")
        import nncf
        <BLANKLINE>
        # Your nncf.quantize call as before (model: the FP32 onnx.ModelProto), plus ignored_scope:
        quantized_model = nncf.quantize(
            model,
            calibration_dataset,  # your nncf.Dataset
            ignored_scope=nncf.IgnoredScope(names=[
                'conv3',
                "it's",
            ]),
        )
    """
    row = PRODUCERS[producer] if isinstance(producer, str) else producer
    if not nodes:
        raise ValueError("fix_call needs at least one node name")
    target = row if row.fix is not None else PRODUCERS[str(row.fix_with)]
    assert target.fix is not None, f"{row.key}: neither fix nor fix_with's fix"
    body = "\n".join(_render_line(line, nodes) for line in target.fix.text.split("\n"))
    return f"# {row.fix_note}\n{body}" if row.fix_note else body
