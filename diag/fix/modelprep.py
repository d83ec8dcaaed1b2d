"""The model edits around every quantizer call, and the guarded writing of its result.

``quantize`` (onnxruntime's static / dynamic quantizer), ``weightonly`` (MatMulNBitsQuantizer) and
``fp16convert`` (the float16 converter) all need the same things around the call: Constant nodes
lifted to initializers, the opset raised for per-channel Q/DQ, the output path checked before any
work, the result verified to load in onnxruntime and moved into place all or nothing, and one
:class:`QuantizeReport` of what was done. They live here, below the three, so none imports another.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from diag.core.protos import default_opset
from diag.foundations.environment import session_options
from diag.foundations.errors import DiagError
from diag.foundations.files import is_input, out_dir, output_file, write_set

#: Above this many bytes of weights a model cannot be one protobuf: quantize with external data.
EXTERNAL_DATA_BYTES = 2**31 - 2**26  # 2 GiB minus headroom for the graph itself
#: Above this many bytes of weights, ``upgrade_opset`` converts the graph without them.
STRIP_WEIGHTS_BYTES = EXTERNAL_DATA_BYTES
#: Opset that first allows per-axis (per-channel) QuantizeLinear / DequantizeLinear.
PER_AXIS_OPSET = 13


#: The replayable steps a :class:`QuantizeReport` records (``steps``), by name: what diag did to the
#: FP32 model before onnxruntime's quantizer saw it. ``reproduce.py`` (:mod:`diag.fix.fixcode`) replays
#: each, so the quantizer and the generator use these names, never a spelled-out string.
STEP_LIFT_CONSTANTS = "lift_constants"
STEP_UPGRADE_OPSET = "upgrade_opset"
STEP_PREPROCESS = "quant_pre_process"
STEP_PREPROCESS_SKIP_SYMBOLIC = "quant_pre_process_skip_symbolic_shape"
STEP_EXTERNAL_DATA = "external_data"
#: The first INT8 model did not load (DequantizeLinear axis on opset < 13): upgraded and quantized again.
STEP_UPGRADE_AFTER_LOAD_ERROR = "upgrade_opset_after_load_error"
STEPS = (
    STEP_LIFT_CONSTANTS,
    STEP_UPGRADE_OPSET,
    STEP_PREPROCESS,
    STEP_PREPROCESS_SKIP_SYMBOLIC,
    STEP_EXTERNAL_DATA,
    STEP_UPGRADE_AFTER_LOAD_ERROR,
)


@dataclass
class QuantizeReport:
    """What ``quantize_model`` wrote and what its guards did.

    Attributes:
        output: the INT8 model (verified to load in onnxruntime).
        actions: plain sentences, one per thing diag did on the user's behalf or noticed.
        seconds: wall time of the whole call.
        format: the output's detected format (``dynamic``, ``qdq``, ``qoperator``, ``mixed``, ``fp32``).
        log: onnxruntime's own warnings and messages, captured instead of printed.
    """

    output: Path
    actions: list[str]
    seconds: float
    format: str = ""
    log: list[str] = field(default_factory=list)
    #: What was done to the FP32 model before onnxruntime's quantizer saw it, in order, as
    #: replayable step names (:data:`STEPS`; see ``diag exclude``'s reproduce.py).
    steps: list[str] = field(default_factory=list)
    #: Calibration passes run (0 for dynamic recipes and when a calibration cache was reused).
    calibrations: int = 0


def lift_constants(model: onnx.ModelProto, only: set[str] | None = None) -> tuple[onnx.ModelProto, int]:
    """Return the model with its tensor ``Constant`` nodes as initializers, and how many were lifted.

    ``only``: lift just these outputs (:func:`diag.core.load.constant_weights`, what the quantizer
    needs as initializers); None lifts every tensor Constant.

    paddle2onnx stores weights as Constant nodes; onnxruntime's quantizer only treats initializers
    as weights ("Expected <w> to be an initializer" in ``quantize_dynamic``). Lifting is exact:
    the same tensor under the same name. Never modifies ``model``: the result is a copy when
    anything was lifted, ``model`` itself otherwise.

    Example:
        >>> lifted, n = lift_constants(onnx.load("det.onnx"))  # doctest: +SKIP
        >>> n  # doctest: +SKIP
        342
    """
    if not any(n.op_type == "Constant" and (only is None or n.output[0] in only) for n in model.graph.node):
        return model, 0  # nothing to lift: no copy of a possibly huge model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = []
    lifted = 0
    for node in out.graph.node:
        wanted = only is None or (bool(node.output) and node.output[0] in only)
        if node.op_type == "Constant" and wanted and len(node.attribute) == 1 and node.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(node.attribute[0].t)
            t.name = node.output[0]
            out.graph.initializer.append(t)
            lifted += 1
        else:
            keep.append(node)
    if lifted:
        del out.graph.node[:]
        out.graph.node.extend(keep)
    return out, lifted


def upgrade_opset(model: onnx.ModelProto, target: int = PER_AXIS_OPSET) -> onnx.ModelProto:
    """Convert ``model`` to ``ai.onnx`` opset ``target`` with ``onnx.version_converter``.

    Models whose weights would not fit one protobuf (> 2 GB) are converted without their weights,
    which are put back by name afterwards: the converter serializes the model, and the 12 -> 13
    adapters only add new constants, they do not read existing initializers. Raises
    ``quantize-failed`` when the converter has no adapter for one of the model's ops.

    Example:
        >>> default_opset(upgrade_opset(onnx.load("det.onnx")))  # doctest: +SKIP
        13
    """
    weights: dict[str, bytes] = {}
    if weight_bytes(model) > STRIP_WEIGHTS_BYTES:
        stripped = onnx.ModelProto()
        stripped.CopyFrom(model)
        for t in stripped.graph.initializer:
            if t.raw_data:
                weights[t.name] = t.raw_data
                t.ClearField("raw_data")
        model = stripped
    try:
        converted = onnx.version_converter.convert_version(model, target)
        onnx.checker.check_model(converted)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].rstrip(".")
        raise DiagError(
            "quantize-failed",
            "FP32 model",
            f"cannot be upgraded from opset {default_opset(model)} to {target} ({first})",
            "re-export the model with opset >= 13, or set per_channel to false",
        ) from e
    for t in converted.graph.initializer:
        if t.name in weights:
            t.raw_data = weights.pop(t.name)
    if weights:
        raise DiagError(
            "quantize-failed",
            "FP32 model",
            f"lost {len(weights)} weight(s) in the opset {target} conversion (e.g. '{next(iter(weights))}')",
            "re-export the model with opset >= 13, or set per_channel to false",
        )
    return converted


def checked_out(out_path: str | os.PathLike[str], source: Path) -> Path:
    """The output path; its folder is created; it may not be the input model."""
    out = Path(out_path)
    if out.suffix.lower() != ".onnx":
        raise DiagError("bad-option", f"-o '{out}'", "does not end in .onnx", "name the output e.g. model.int8.onnx")
    if is_input(out) == source:
        raise DiagError("bad-out", f"-o '{out}'", "is the FP32 model itself", "write the INT8 model to another file")

    out_dir(out.parent if str(out.parent) else ".", "-o folder")
    output_file(out, "-o")
    if not out.name.endswith(".data"):
        output_file(out.parent / (out.name + ".data"), "-o external data")
    if not os.access(out.parent, os.W_OK):
        raise DiagError("bad-out", f"-o '{out}'", "folder is not writable", "choose a writable folder")
    return out


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def load_error(path: Path) -> str | None:
    """None when onnxruntime can build a session for the model, else the first line of its error."""
    import onnxruntime as ort

    opts = session_options()
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        text = str(e).strip().splitlines() or [type(e).__name__]
        return text[0][:300]
    return None


def publish(staged: Path, out: Path) -> None:
    """Rename the verified model into place: its external data first, the ``.onnx`` last.

    ``staged`` sits in a temp folder inside the output's folder, so each step is an atomic rename
    and a reader never sees a half-written ``.onnx``.
    """
    parts = [p for p in staged.parent.iterdir() if p != staged] + [staged]
    write_set({out.parent / p.name: p for p in parts}, "-o")


def copy_model(src: Path, dst: Path) -> list[Path]:
    """Copy a model file and its external data so the copy is whole on its own; the files written.

    A model saved with external data names its weight file by location (``step057.onnx.data``):
    copying the ``.onnx`` alone leaves a model whose weights are elsewhere or gone. The copy's
    weights go to ``<dst name>.data`` beside it (one file per original file), its locations
    rewritten; the bytes are streamed, never loaded.

    Example:
        >>> copy_model(Path("work/step057.onnx"), Path("work/mixed.onnx"))  # doctest: +SKIP
        [PosixPath('work/mixed.onnx'), PosixPath('work/mixed.onnx.data')]
    """
    proto = onnx.load(str(src), load_external_data=False)
    renamed: dict[str, str] = {}
    for tensor in _external_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location":
                if entry.value not in renamed:
                    suffix = ".data" if not renamed else f".{len(renamed)}.data"
                    renamed[entry.value] = dst.name + suffix
                entry.value = renamed[entry.value]
    if not renamed:
        shutil.copyfile(src, dst)
        return [dst]
    written = []
    for old, new in renamed.items():
        shutil.copyfile(src.parent / old, dst.parent / new)
        written.append(dst.parent / new)
    onnx.save(proto, str(dst))
    return [dst, *written]


def _external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Every tensor of the model kept in external data: initializers and attribute tensors, subgraphs included."""
    out: list[onnx.TensorProto] = []
    graphs = [proto.graph]
    while graphs:
        g = graphs.pop()
        out += list(g.initializer)
        for node in g.node:
            for a in node.attribute:
                out += [a.t] if a.HasField("t") else []
                out += list(a.tensors)
                graphs += ([a.g] if a.HasField("g") else []) + list(a.graphs)
    return [t for t in out if t.data_location == onnx.TensorProto.EXTERNAL]
