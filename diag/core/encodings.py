"""AIMET's standard export, an FP32 ``.onnx`` plus a ``.encodings`` JSON, as the QDQ model it describes.

AIMET's ``QuantizationSimModel.export()`` (the path to Qualcomm's QNN) writes the float graph and,
beside it, every quantizer's encoding: scale and offset per tensor or per channel, bit width and
symmetry. The INT8 model the user ships is what QNN builds from the pair, so diag builds the same
quantization as ONNX QuantizeLinear / DequantizeLinear nodes (onnxruntime runs them) and diagnoses
that model, saying so. Three versions of the file are read:

* ``0.6.1``: ``activation_encodings`` / ``param_encodings`` are dicts keyed by tensor name, each a
  list of encodings (one per channel for per-channel) with ``scale``, ``offset``, ``bitwidth``,
  ``is_symmetric`` (the string ``"True"`` / ``"False"``), ``dtype`` (``int`` / ``float``);
* ``1.0.0``: both are lists of ``{"name", "enc_type", "dtype", "bw", "is_sym", "scale": [...],
  "offset": [...]}``;
* ``2.0.0``: one ``encodings`` list of ``{"name", "output_dtype": "uint8", "y_scale",
  "y_zero_point" (absent = 0), "axis"}``, already in ONNX's terms.

AIMET quantizes ``q = clamp(round(x / scale) - offset, 0, 2^bw - 1)`` (``offset`` on the unsigned
grid); its own ONNX export writes ``zero_point = -offset`` for an unsigned grid and ``-offset -
2^(bw-1)`` for a signed one (a symmetric encoding is signed). The per-channel axis is not in the
files before 2.0.0: it is the output channel of the consuming op (Conv: 0, ConvTranspose: 1,
Gemm: 0 with ``transB``, else 1, MatMul: the last axis), as AIMET itself uses.

A fix of such a model is made in its encodings (:class:`AimetExport`): `diag exclude --int8` takes
out the encodings of the float nodes' quantizers, measures the model the edited document describes,
and writes that document (:func:`document_without`) as the user's file, edited.

Names in the file are untrusted: an encoding for a tensor the model does not have is counted and
reported, never applied. 4-bit grids (a w4a8 or w4a16 export) are written as ``com.microsoft``
Q/DQ of INT4 / UINT4 tensors, as onnxruntime's own ``weight_type=QInt4`` QDQ model holds them.
Per-block weights (1.0.0 ``PER_BLOCK``, 2.0.0 ``block_size``) and LPBQ weights (integer block
scales times a float scale per channel, their float32 product the block scale) become a blocked
DequantizeLinear (opset 21's ``block_size``; the model is converted to opset 21 when older). The
blocks run along the consumer's input channels (AIMET's ``_get_quantization_axes``); 1.0.0 lists
them channel-major, as AIMET's current ``_encoding.py`` writes them (older releases wrote a
MatMul's block-major, which the file does not say).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from diag.core.load import LoadedModel, checked_path, model_from_path, outer_scope_inputs
from diag.foundations.errors import DiagError

#: Suffixes AIMET's export uses beside ``<stem>.onnx``.
SUFFIXES = (".encodings", ".encodings.json")
#: Encodings files read, and the versions each key layout belongs to.
VERSIONS = ("0.6.1", "1.0.0", "2.0.0")

#: Integer grid of each (bit width, signed) pair diag can write as Q/DQ, and the domain its ops need.
_GRIDS: dict[tuple[int, bool], tuple[int, str]] = {
    (4, False): (onnx.TensorProto.UINT4, "com.microsoft"),
    (4, True): (onnx.TensorProto.INT4, "com.microsoft"),
    (8, False): (onnx.TensorProto.UINT8, ""),
    (8, True): (onnx.TensorProto.INT8, ""),
    (16, False): (onnx.TensorProto.UINT16, "com.microsoft"),
    (16, True): (onnx.TensorProto.INT16, "com.microsoft"),
    (32, True): (onnx.TensorProto.INT32, ""),
}


@dataclass(frozen=True)
class TensorEncoding:
    """One quantizer of the file, in ONNX's terms (QuantizeLinear's scale and zero point)."""

    name: str
    bitwidth: int
    signed: bool
    #: One value per tensor (length 1) or per channel; per block, as the file lays them out: 1.0.0
    #: flat, channel-major (``C * blocks``), 2.0.0 in the weight's rank with the blocks on ``axis``.
    scale: np.ndarray
    zero_point: np.ndarray
    #: The axis the file states (2.0.0: the channel axis, or the block axis of a per-block
    #: encoding), else None: implied by the consuming op.
    axis: int | None = None
    #: A float quantizer (fp16 simulation): the tensor stays float.
    is_float: bool = False
    #: Per-block (and LPBQ) weights: values per block along the block axis; None otherwise.
    block_size: int | None = None


@dataclass(frozen=True)
class Encodings:
    """An AIMET encodings file, read and checked."""

    path: Path
    version: str
    #: 0.6.1 / 1.0.0 say which encodings are activations and which parameters; 2.0.0 does not
    #: (the model decides: an initializer is a parameter).
    activations: dict[str, TensorEncoding]
    params: dict[str, TensorEncoding]


@dataclass(frozen=True)
class BuiltModel:
    """The QDQ model an encodings file describes, and what was applied."""

    model: onnx.ModelProto
    encodings: Encodings
    activations: int
    params: int
    #: Encodings left out, and why (a tensor the model does not have, a float quantizer).
    skipped: dict[str, str]

    def sentence(self) -> str:
        """The one wording of where the INT8 model came from (terminal, report, diag.json)."""
        left = f"; {len(self.skipped)} left out (diag.json lists why)" if self.skipped else ""
        return (
            f"built by diag from AIMET encodings '{self.encodings.path.name}' (version {self.encodings.version}): "
            f"{self.activations} activation and {self.params} parameter encodings as QuantizeLinear/DequantizeLinear"
            f"{left}; the figures are this model's, what QNN builds from the same encodings up to its kernels"
        )


def encodings_beside(model_path: Path) -> Path | None:
    """The encodings file AIMET wrote beside ``model_path`` (``model.encodings``), if any."""
    for suffix in SUFFIXES:
        candidate = model_path.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    return None


def _bad(path: Path, problem: str) -> DiagError:
    return DiagError(
        "bad-encodings",
        f"encodings file '{path}'",
        problem,
        "pass the .encodings JSON AIMET's QuantizationSimModel.export() wrote (versions 0.6.1, 1.0.0, 2.0.0)",
    )


def read_encodings(path: str | Path) -> Encodings:
    """Read an AIMET encodings file (any of :data:`VERSIONS`); a malformed one is ``bad-encodings``.

    Example:
        >>> enc = read_encodings("model.encodings")  # doctest: +SKIP
        >>> enc.version, len(enc.activations), len(enc.params)  # doctest: +SKIP
        ('1.0.0', 40, 12)
    """
    p = checked_path(path, "encodings file")
    return encodings_from_document(_document(p), p)


def _document(p: Path) -> dict[str, Any]:
    """The JSON object of encodings file ``p``, as written (the layout an edited copy keeps)."""
    try:
        doc = json.loads(p.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _bad(p, f"is not readable JSON ({type(e).__name__})") from e
    if not isinstance(doc, dict):
        raise _bad(p, "is not a JSON object")
    return doc


def encodings_from_document(doc: dict[str, Any], p: Path) -> Encodings:
    """The encodings of an already parsed file (``p`` names it in errors): the one reader of a
    document, so a fix written as an edited document is read exactly as it was measured."""
    version = str(doc.get("version", ""))
    try:
        if "encodings" in doc and version.startswith("2."):
            entries = {e["name"]: _from_2(e) for e in _list(doc["encodings"])}
            return Encodings(p, version, entries, {})
        if "activation_encodings" not in doc or "param_encodings" not in doc:
            raise _bad(p, "has neither activation_encodings / param_encodings nor a 2.x encodings list")
        read = _section_1 if isinstance(doc["activation_encodings"], list) else _section_0
        return Encodings(p, version or "0.6.1", read(doc["activation_encodings"]), read(doc["param_encodings"]))
    except DiagError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _bad(p, f"has an entry diag cannot read ({type(e).__name__}: {str(e)[:80]})") from e


def _list(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
        raise TypeError("expected a list of objects with a 'name'")
    return value


def _zero_point(offset: np.ndarray, bitwidth: int, signed: bool) -> np.ndarray:
    """AIMET's offset (unsigned grid) as QuantizeLinear's zero point (AIMET's own ONNX export rule)."""
    zp = -np.round(offset).astype(np.int64)
    return zp - (1 << (bitwidth - 1)) if signed else zp


def _encoding(name: str, bw: int, signed: bool, scale: Any, offset: Any, is_float: bool) -> TensorEncoding:
    if is_float:
        return TensorEncoding(name, bw, signed, np.ones(1), np.zeros(1, np.int64), is_float=True)
    scales = np.asarray(scale, np.float64).reshape(-1)
    if scales.size == 0 or not np.all(np.isfinite(scales)) or np.any(scales <= 0):
        raise ValueError(f"'{name[:80]}' has a scale that is not positive and finite")
    zp = _zero_point(np.asarray(offset, np.float64).reshape(-1), bw, signed)
    if zp.size != scales.size:
        raise ValueError(f"'{name[:80]}' has {scales.size} scales and {zp.size} offsets")
    return TensorEncoding(name, bw, signed, scales.astype(np.float32), zp)


def _section_0(section: Any) -> dict[str, TensorEncoding]:
    """0.6.1: ``{name: [ {scale, offset, bitwidth, is_symmetric, dtype}, ... one per channel ]}``."""
    if not isinstance(section, dict):
        raise TypeError("expected an object keyed by tensor name")
    out = {}
    for name, entries in section.items():
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise TypeError(f"'{str(name)[:80]}' is not a list of encodings")
        first = entries[0]
        is_float = str(first.get("dtype", "int")).lower() == "float"
        bw = int(first["bitwidth"])
        signed = str(first.get("is_symmetric", "False")).lower() == "true"
        scales = [] if is_float else [e["scale"] for e in entries]
        offsets = [] if is_float else [e["offset"] for e in entries]
        out[str(name)] = _encoding(str(name), bw, signed, scales, offsets, is_float)
    return out


def _section_1(section: Any) -> dict[str, TensorEncoding]:
    """1.0.0: ``[{name, enc_type, dtype, bw, is_sym, scale: [...], offset: [...]}]``; ``PER_BLOCK`` adds
    ``block_size`` (``scale`` / ``offset`` flat, channel-major), ``LPBQ`` also ``compressed_bw`` and
    ``per_block_int_scale`` (module doc)."""
    out = {}
    for e in _list(section):
        kind = str(e.get("enc_type", "PER_TENSOR"))
        if kind not in ("PER_TENSOR", "PER_CHANNEL", "PER_BLOCK", "LPBQ"):
            raise ValueError(f"'{e['name'][:80]}' is {kind[:20]}; diag reads per-tensor, per-channel, per-block, LPBQ")
        is_float = str(e.get("dtype", "INT")).upper() == "FLOAT"
        if kind == "LPBQ":
            out[e["name"]] = _lpbq_1(e)
            continue
        enc = _encoding(e["name"], int(e["bw"]), bool(e.get("is_sym")), e.get("scale"), e.get("offset"), is_float)
        out[e["name"]] = replace(enc, block_size=_block_size(e)) if kind == "PER_BLOCK" else enc
    return out


def _block_size(e: dict[str, Any]) -> int:
    size = int(e["block_size"])
    if size < 1:
        raise ValueError(f"'{e['name'][:80]}' has block_size {size}")
    return size


def _lpbq_1(e: dict[str, Any]) -> TensorEncoding:
    """1.0.0 LPBQ: a weight on a ``compressed_bw`` grid whose block scales are small integers times a
    float scale per channel (``scale``); ``bw`` is the width those integers decompress to, ``offset``
    its symmetric ``-2^(bw-1)``. The block scale is their product in float32, as AIMET computes it."""
    name, bw, narrow = e["name"], int(e["bw"]), int(e["compressed_bw"])
    channel = np.asarray(e["scale"], np.float32).reshape(-1)
    ints = np.asarray(e["per_block_int_scale"], np.float32).reshape(-1)
    offsets = np.asarray(e.get("offset", [-(1 << (bw - 1))] * channel.size), np.float64).reshape(-1)
    if channel.size == 0 or ints.size % channel.size:
        raise ValueError(f"'{name[:80]}' has {ints.size} block scales for {channel.size} channels")
    if np.any(offsets != -(1 << (bw - 1))):
        raise ValueError(f"'{name[:80]}' is LPBQ with an offset other than {-(1 << (bw - 1))} (LPBQ is symmetric)")
    scales = (ints.reshape(channel.size, -1) * channel.reshape(-1, 1)).reshape(-1)
    enc = _encoding(name, narrow, True, scales, np.full(scales.size, -(1 << (narrow - 1))), False)
    return replace(enc, block_size=_block_size(e))


def _from_2(e: dict[str, Any]) -> TensorEncoding:
    """2.0.0: ``{name, output_dtype, y_scale, y_zero_point, axis}`` (already QuantizeLinear's terms); a
    per-block weight adds ``block_size`` (``y_scale`` in the weight's rank, ``axis`` the block axis);
    LPBQ has ``per_block_int_scale`` and ``per_channel_float_scale`` instead of ``y_scale`` (2.1.0:
    ``y_scale: {x, x_scale, axis}``), their float32 product the block scale."""
    dtype = str(e["output_dtype"])
    signed = dtype.startswith("int")
    bw = int(dtype.removeprefix("u").removeprefix("int"))
    blocked = "block_size" in e
    if "per_block_int_scale" in e:  # LPBQ 2.0.0
        shaped = np.asarray(e["per_block_int_scale"], np.float32) * np.asarray(e["per_channel_float_scale"], np.float32)
    elif isinstance(e["y_scale"], dict):  # LPBQ 2.1.0: integers x, the float scale per channel along its axis
        ints = np.asarray(e["y_scale"]["x"], np.float32)
        channel = np.asarray(e["y_scale"]["x_scale"], np.float32).reshape(-1)
        along = [1] * ints.ndim
        along[int(e["y_scale"]["axis"]) % max(ints.ndim, 1)] = channel.size
        shaped = ints * channel.reshape(along)
    else:
        shaped = np.asarray(e["y_scale"], np.float64)
    scales = shaped.reshape(-1)
    zp = np.asarray(e.get("y_zero_point", 0), np.int64)
    zp = np.broadcast_to(zp, shaped.shape).reshape(-1) if zp.size == 1 else zp.reshape(-1)
    enc = _encoding(e["name"], bw, signed, scales, np.zeros(scales.size), False)
    if zp.size != scales.size:
        raise ValueError(f"'{e['name'][:80]}' has {scales.size} scales and {zp.size} zero points")
    axis = e.get("axis")
    keep = shaped.shape if blocked else (-1,)
    return TensorEncoding(
        enc.name,
        bw,
        signed,
        enc.scale.reshape(keep),
        zp.reshape(keep),
        None if axis is None else int(axis),
        block_size=_block_size(e) if blocked else None,
    )


def _grid(enc: TensorEncoding, where: str) -> tuple[int, str]:
    grid = _GRIDS.get((enc.bitwidth, enc.signed if enc.bitwidth != 32 else True))
    if grid is None:
        raise DiagError(
            "bad-encodings",
            f"encoding of '{enc.name[:200]}' in {where}",
            f"has {'a signed' if enc.signed else 'an unsigned'} {enc.bitwidth}-bit grid",
            "diag builds 4-, 8- and 16-bit activations, 4-, 8-, 16- and 32-bit (bias) parameters",
        )
    return grid


def _implied_axis(consumers: list[onnx.NodeProto], w: str, rank: int) -> int:
    """The output-channel axis of weight ``w`` for its consumer (AIMET's rule; module doc)."""
    for node in consumers:
        if node.op_type == "Conv":
            return 0
        if node.op_type == "ConvTranspose":
            return 1
        if node.op_type == "Gemm" and list(node.input).index(w) == 1:
            trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
            return 0 if trans else 1
        if node.op_type == "MatMul":
            return rank - 1
    return 0


def qdq_from_encodings(fp: onnx.ModelProto, enc: Encodings) -> BuiltModel:
    """The FP32 model with every encoding applied as QuantizeLinear / DequantizeLinear (a new model).

    Parameters become integer initializers ``<w>_quantized`` with ``<w>_scale`` / ``<w>_zero_point``
    and a DequantizeLinear (onnxruntime's layout for weights); an activation ``t`` gets
    ``t_QuantizeLinear_Output`` -> ``t_DequantizeLinear_Output`` feeding its consumers (a graph
    output keeps its name: the DequantizeLinear writes it). Never modifies ``fp``.

    Example:
        >>> built = qdq_from_encodings(onnx.load("model.onnx"), read_encodings("model.encodings"))  # doctest: +SKIP
        >>> built.activations, built.params  # doctest: +SKIP
        (40, 12)
    """
    model = onnx.ModelProto()
    model.CopyFrom(fp)
    if any(e.block_size for e in (*enc.params.values(), *enc.activations.values())):
        model = _at_opset_21(model, enc.path)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    tensors = set(inits) | {i.name for i in g.input} | {o for n in g.node for o in n.output}
    skipped: dict[str, str] = {}
    params = dict(enc.params)
    activations = dict(enc.activations)
    if not params:  # 2.0.0: an initializer's encoding is a parameter's
        params = {k: v for k, v in activations.items() if k in inits}
        activations = {k: v for k, v in activations.items() if k not in inits}
    domains: set[str] = set()
    per_channel = False
    new_nodes: list[onnx.NodeProto] = []
    nested = _read_in_subgraphs(g)
    for name, e in params.items():
        if name not in inits or e.is_float or name in nested:
            skipped[name] = (
                "a float quantizer: stays float"
                if e.is_float
                else "read inside a subgraph: kept float"
                if name in nested
                else "no initializer of that name"
            )
            continue
        node, channels = _quantized_param(g, inits[name], e, enc.path.name)
        per_channel |= channels
        domains.add(node.domain)
        new_nodes.append(node)
    applied_acts = 0
    for name, e in activations.items():
        if name not in tensors or e.is_float or name in inits:
            skipped[name] = "a float quantizer: stays float" if e.is_float else "no tensor of that name"
            continue
        grid, domain = _grid(e, enc.path.name)
        _on_grid(e, grid, enc.path.name)
        if e.scale.size != 1:
            skipped[name] = "a per-channel activation encoding"
            continue
        new_nodes += _activation_qdq(g, name, e, grid, domain)
        domains.add(domain)
        applied_acts += 1
    _insert_in_order(g, new_nodes)
    _opsets(model, domains, per_channel, enc.path)
    return BuiltModel(model, enc, applied_acts, len(params) - sum(k in params for k in skipped), skipped)


def _read_in_subgraphs(g: onnx.GraphProto) -> set[str]:
    """Names If / Loop / Scan bodies read from the main graph (a rewiring of the main graph would miss them)."""
    return {name for node in g.node for name in outer_scope_inputs(node)}


def _quantized_param(
    g: onnx.GraphProto, init: onnx.TensorProto, e: TensorEncoding, where: str
) -> tuple[onnx.NodeProto, bool]:
    """Replace initializer ``init`` by its integer form and a DequantizeLinear; returns the node."""
    if e.block_size:
        return _blocked_param(g, init, e, where), False
    grid, domain = _grid(e, where)
    # Weights in float32 arithmetic, as QuantizeLinear and onnxruntime's quantizer divide (in float64
    # a value exactly halfway between two levels in float32, -7.5, can land a hair off and round the
    # other way); a 32-bit bias in float64, as onnxruntime's quantize_bias_static_impl divides it.
    arithmetic: type[np.floating[Any]] = np.float64 if grid == onnx.TensorProto.INT32 else np.float32
    w = numpy_helper.to_array(init).astype(arithmetic)
    consumers = [n for n in g.node if init.name in n.input]
    channels = e.scale.size > 1
    axis = 0
    shape = [1] * w.ndim  # a 0-d weight (a scalar constant) stays 0-d
    if channels:
        axis = e.axis if e.axis is not None else _implied_axis(consumers, init.name, w.ndim)
        axis %= w.ndim
        if w.shape[axis] != e.scale.size:
            raise DiagError(
                "bad-encodings",
                f"encoding of '{init.name[:200]}' in {where}",
                f"has {e.scale.size} channels but the weight has {w.shape[axis]} on axis {axis}",
                "export the encodings with the model they were computed for",
            )
        shape[axis] = e.scale.size
    low, high = _on_grid(e, grid, where)
    scale = e.scale.astype(arithmetic).reshape(shape)
    zp = e.zero_point.reshape(shape)
    q = np.clip(np.rint(w / scale) + zp, low, high).astype(np.int64)
    name = init.name
    g.initializer.remove(init)
    g.initializer.extend(
        [
            _integer_tensor(q, grid, f"{name}_quantized"),
            numpy_helper.from_array(e.scale.reshape(-1) if channels else e.scale.reshape(()), f"{name}_scale"),
            _integer_tensor(
                e.zero_point.reshape(-1) if channels else e.zero_point.reshape(()), grid, f"{name}_zero_point"
            ),
        ]
    )
    for consumer in consumers:  # onnxruntime's layout: consumers read <w>_DequantizeLinear_Output
        for i, x in enumerate(consumer.input):
            if x == name:
                consumer.input[i] = f"{name}_DequantizeLinear_Output"
    node = helper.make_node(
        "DequantizeLinear",
        [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
        [f"{name}_DequantizeLinear_Output"],
        name=f"{name}_DequantizeLinear",
        domain=domain,
    )
    if channels:
        node.attribute.append(helper.make_attribute("axis", axis))
    return node, channels


def _blocked_param(g: onnx.GraphProto, init: onnx.TensorProto, e: TensorEncoding, where: str) -> onnx.NodeProto:
    """A per-block (or LPBQ) weight as a blocked DequantizeLinear (opset 21's ``block_size``): the
    scale and zero point hold one value per block along the block axis, repeated along the others
    (a Conv kernel's spatial axes), as ONNX wants them shaped like the weight."""
    grid, _ = _grid(e, where)
    assert e.block_size is not None
    w = numpy_helper.to_array(init).astype(np.float32)  # float32 arithmetic, as QuantizeLinear divides
    consumers = [n for n in g.node if init.name in n.input]
    bad = f"encoding of '{init.name[:200]}' in {where}"
    if w.ndim < 2:
        raise DiagError("bad-encodings", bad, f"is per-block on a {w.ndim}-d tensor", "export it per channel")
    if e.axis is not None:  # 2.0.0: the file's own shape, the blocks on `axis`
        block_axis = e.axis % w.ndim
        scale, zp = e.scale, e.zero_point
        if scale.ndim != w.ndim:
            raise DiagError("bad-encodings", bad, f"has {scale.ndim}-d block scales for a {w.ndim}-d weight", _EXPORT)
    else:  # 1.0.0: flat, channel-major; the axes are the consumer's (AIMET's rule)
        channel_axis, block_axis = _implied_block_axes(consumers, init.name, w.ndim)
        blocks = -(-w.shape[block_axis] // e.block_size)
        channels = w.shape[channel_axis]
        if e.scale.size != channels * blocks:
            raise DiagError(
                "bad-encodings",
                bad,
                f"has {e.scale.size} block scales; the weight has {channels} channels x {blocks} blocks",
                _EXPORT,
            )
        shape = [1] * w.ndim
        shape[channel_axis], shape[block_axis] = channels, blocks
        order = (0, 1) if channel_axis < block_axis else (1, 0)
        scale = e.scale.reshape(channels, blocks).transpose(order).reshape(shape)
        zp = e.zero_point.reshape(channels, blocks).transpose(order).reshape(shape)
    full = list(w.shape)
    full[block_axis] = -(-w.shape[block_axis] // e.block_size)
    try:
        scale, zp = np.broadcast_to(scale, full), np.broadcast_to(zp, full)
    except ValueError:
        shapes = f"has block scales of shape {list(e.scale.shape)} for a weight of {list(w.shape)}"
        raise DiagError("bad-encodings", bad, shapes, _EXPORT) from None
    low, high = _on_grid(e, grid, where)
    take = np.arange(w.shape[block_axis]) // e.block_size  # each element's block
    q = np.clip(np.rint(w / np.take(scale, take, block_axis)) + np.take(zp, take, block_axis), low, high)
    name = init.name
    g.initializer.remove(init)
    g.initializer.extend(
        [
            _integer_tensor(q.astype(np.int64), grid, f"{name}_quantized"),
            numpy_helper.from_array(np.ascontiguousarray(scale, np.float32), f"{name}_scale"),
            _integer_tensor(np.ascontiguousarray(zp), grid, f"{name}_zero_point"),
        ]
    )
    for consumer in consumers:
        for i, x in enumerate(consumer.input):
            if x == name:
                consumer.input[i] = f"{name}_DequantizeLinear_Output"
    return helper.make_node(
        "DequantizeLinear",
        [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
        [f"{name}_DequantizeLinear_Output"],
        name=f"{name}_DequantizeLinear",
        axis=block_axis,
        block_size=e.block_size,
    )


#: The hint of a per-block encoding that does not fit its weight.
_EXPORT = "export the encodings with the model they were computed for"


def _implied_block_axes(consumers: list[onnx.NodeProto], w: str, rank: int) -> tuple[int, int]:
    """(channel axis, block axis) of per-block weight ``w`` for its consumer, as AIMET picks them:
    blocks run along the input channels (Conv 1, ConvTranspose 0, MatMul the second-to-last axis)."""
    for node in consumers:
        if node.op_type == "Conv":
            return 0, 1
        if node.op_type == "ConvTranspose":
            return 1, 0
        if node.op_type == "Gemm" and list(node.input).index(w) == 1:
            trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
            return (0, 1) if trans else (1, 0)
        if node.op_type == "MatMul":
            return rank - 1, rank - 2
    return 0, 1


def _at_opset_21(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """The model at opset 21, where DequantizeLinear takes ``block_size`` (converted when older)."""
    default = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if default is not None and default.version >= 21:
        return model
    try:
        return version_converter.convert_version(model, 21)
    except Exception as e:  # the converter's own errors name no type worth catching one by one
        raise DiagError(
            "bad-encodings",
            f"encodings file '{path}'",
            f"has per-block encodings (DequantizeLinear takes block_size from opset 21), and the model (opset "
            f"{default.version if default else '?'}) does not convert to 21 ({type(e).__name__})",
            "convert the FP32 model first: onnx.version_converter.convert_version(model, 21)",
        ) from e


def _on_grid(e: TensorEncoding, grid: int, where: str) -> tuple[int, int]:
    """The grid's integer range, once ``e``'s zero points are checked to lie in it (stored as they
    are, an out-of-range zero point would wrap: 9 as INT4 reads back as -7)."""
    low, high = _limits(grid)
    if np.any(e.zero_point < low) or np.any(e.zero_point > high):
        raise DiagError(
            "bad-encodings",
            f"encoding of '{e.name[:200]}' in {where}",
            f"has an offset outside its {e.bitwidth}-bit grid (zero point {int(e.zero_point.min())}.."
            f"{int(e.zero_point.max())}, the grid {low}..{high})",
            "export the encodings again from AIMET: its offsets lie on the grid",
        )
    return low, high


def _limits(grid: int) -> tuple[int, int]:
    """The integer range of a grid's element type (numpy has no 4-bit integers).

    Example:
        >>> _limits(onnx.TensorProto.INT4), _limits(onnx.TensorProto.UINT8)
        ((-8, 7), (0, 255))
    """
    if grid in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (-8, 7) if grid == onnx.TensorProto.INT4 else (0, 15)
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(grid))
    return int(info.min), int(info.max)


def _integer_tensor(values: np.ndarray, grid: int, name: str) -> onnx.TensorProto:
    """An initializer of element type ``grid``; 4-bit values packed two to a byte, as ONNX stores them."""
    if grid in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return helper.make_tensor(name, grid, list(values.shape), values.reshape(-1).astype(np.int64).tolist())
    return numpy_helper.from_array(values.astype(helper.tensor_dtype_to_np_dtype(grid)), name)


def _activation_qdq(g: onnx.GraphProto, name: str, e: TensorEncoding, grid: int, domain: str) -> list[onnx.NodeProto]:
    """Q -> DQ on activation ``name``; its consumers read the DequantizeLinear's output."""
    scale, zp = f"{name}_scale", f"{name}_zero_point"
    g.initializer.extend(
        [numpy_helper.from_array(e.scale.reshape(()), scale), _integer_tensor(e.zero_point.reshape(()), grid, zp)]
    )
    outputs = {o.name for o in g.output}
    source, result = name, f"{name}_DequantizeLinear_Output"
    if name in outputs:  # the DequantizeLinear writes the graph output; its producer a new name
        source, result = f"{name}_QuantizeLinear_Input", name
        for node in g.node:
            for i, o in enumerate(node.output):
                if o == name:
                    node.output[i] = source
    else:
        for node in g.node:
            for i, x in enumerate(node.input):
                if x == name:
                    node.input[i] = result
    q_out = f"{name}_QuantizeLinear_Output"
    return [
        helper.make_node("QuantizeLinear", [source, scale, zp], [q_out], name=f"{name}_QuantizeLinear", domain=domain),
        helper.make_node(
            "DequantizeLinear", [q_out, scale, zp], [result], name=f"{name}_DequantizeLinear", domain=domain
        ),
    ]


def _insert_in_order(g: onnx.GraphProto, new: list[onnx.NodeProto]) -> None:
    """Put the new Q/DQ nodes where their inputs exist (a topological order onnxruntime accepts)."""
    nodes = list(g.node) + new
    produced = {i.name for i in g.input} | {i.name for i in g.initializer}
    ordered: list[onnx.NodeProto] = []
    pending = nodes
    while pending:
        rest = []
        for n in pending:
            if all(not i or i in produced for i in n.input):
                ordered.append(n)
                produced.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):  # inputs from outer scopes or unknown: keep their order
            ordered += rest
            break
        pending = rest
    del g.node[:]
    g.node.extend(ordered)


def _opsets(model: onnx.ModelProto, domains: set[str], per_channel: bool, path: Path) -> None:
    """Opset imports the new nodes need: com.microsoft for 16-bit grids; ai.onnx >= 13 for an axis."""
    opsets = {o.domain: o for o in model.opset_import}
    if "com.microsoft" in domains and "com.microsoft" not in opsets:
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    default = opsets.get("") or opsets.get("ai.onnx")
    if per_channel and default is not None and default.version < 13:
        raise DiagError(
            "bad-encodings",
            f"encodings file '{path}'",
            f"has per-channel encodings (DequantizeLinear takes an axis from opset 13); the model is opset "
            f"{default.version}",
            "convert the FP32 model first: onnx.version_converter.convert_version(model, 13)",
        )


#: The sections of an encodings document that hold encodings (0.6.1 / 1.0.0: the first two; 2.0.0: the last).
SECTIONS = ("activation_encodings", "param_encodings", "encodings")


def document_without(doc: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    """A copy of encodings document ``doc`` without the encodings of ``names``, in any version's layout;
    every other key and entry stays as written (AIMET's ``quantizer_args``, ``excluded_layers``...).

    Example:
        >>> document_without({"version": "2.0.0", "encodings": [{"name": "a"}, {"name": "b"}]}, ["a"])
        {'version': '2.0.0', 'encodings': [{'name': 'b'}]}
    """
    drop = set(names)
    out = dict(doc)
    for key in SECTIONS:
        section = doc.get(key)
        if isinstance(section, dict):
            out[key] = {k: v for k, v in section.items() if k not in drop}
        elif isinstance(section, list):
            out[key] = [e for e in section if not (isinstance(e, dict) and e.get("name") in drop)]
    return out


@dataclass(frozen=True)
class AimetExport:
    """AIMET's export (the FP32 ``.onnx`` and its ``.encodings``), the model the user ships to QNN.

    A fix of such a model is made in its encodings: keeping a node in float is taking out of the
    file the encodings its op's quantizers own (what disabling the quantizers of AIMET's
    ``get_op_quantizers(op)`` leaves in an export), and the model measured is the one built from
    the edited document (:meth:`build`), so the file diag writes is exactly the model it verified.
    """

    #: The user's files: AIMET's FP32 graph and the encodings beside it (or ``--encodings``).
    model: Path
    encodings: Path
    #: The encodings file as written (edited copies keep its layout).
    document: dict[str, Any]
    #: The FP32 graph with its weights (each build quantizes them); never modified.
    proto: onnx.ModelProto

    def build(self, document: dict[str, Any] | None = None) -> BuiltModel:
        """The QDQ model ``document`` (default: the user's) describes; ``bad-encodings`` when it
        quantizes nothing (a "not quantized" error would name diag's temporary copy)."""
        built = qdq_from_encodings(self.proto, encodings_from_document(document or self.document, self.encodings))
        if document is None and not built.activations and not built.params:
            name, why = next(iter(built.skipped.items()), ("", "the file holds no encoding"))
            raise DiagError(
                "bad-encodings",
                f"encodings file '{self.encodings}'",
                f"quantize no tensor of '{self.model.name}' ({len(built.skipped)} left out; '{name[:80]}': {why})",
                "export the encodings with the model they were computed for",
            )
        return built

    def owned(self, nodes: Collection[str]) -> list[str]:
        """The encodings the quantizers of ``nodes`` (node names of the export) own, in graph order:
        their outputs', their parameters' (an initializer only they read), and a graph input's
        that only they read (AIMET's input quantizers sit on model inputs only).

        Example:
            >>> export.owned(["/fc1/MatMul"])  # doctest: +SKIP
            ['/fc1/MatMul_output_0', 'fc1.weight']
        """
        enc = encodings_from_document(self.document, self.encodings)
        names = set(enc.activations) | set(enc.params)
        g = self.proto.graph
        region = set(nodes)
        produced = {o for n in g.node for o in n.output}
        readers: dict[str, set[str]] = {}
        for n in g.node:
            for x in n.input:
                readers.setdefault(x, set()).add(n.name)
        owned = []
        for n in g.node:
            if n.name not in region:
                continue
            owned += [t for t in n.output if t in names]
            owned += [t for t in n.input if t in names and t not in produced and readers[t] <= region]
        return list(dict.fromkeys(owned))

    def without(self, nodes: Collection[str]) -> dict[str, Any]:
        """The user's encodings document with ``nodes`` in float: the fix, as AIMET's file."""
        return document_without(self.document, self.owned(nodes))


def encodings_of(q: LoadedModel, encodings: str | Path | None = None) -> Path | None:
    """The encodings file of second model ``q``: ``--encodings`` (refused for a model already
    quantized), else the one AIMET wrote beside an FP32 ``q``; None when there is none."""
    if encodings is not None and q.format.kind != "fp32":
        raise DiagError(
            "bad-option",
            f"--encodings {encodings}",
            f"applies to AIMET's FP32 export, and '{q.path.name}' is already quantized ({q.format.kind})",
            "drop --encodings, or pass the .onnx AIMET's export wrote beside the encodings",
        )
    if encodings is not None:
        return Path(encodings)
    return encodings_beside(q.path) if q.format.kind == "fp32" else None


def aimet_export(q: LoadedModel, path: Path) -> AimetExport:
    """AIMET's FP32 export ``q`` (loaded for its structure) with its encodings file at ``path``,
    read and checked: the weights loaded, the encodings readable and quantizing some tensor."""
    p = checked_path(path, "encodings file")
    document = _document(p)
    encodings_from_document(document, p)  # a malformed file fails here, before the weights load
    try:
        full = onnx.load(str(q.path))  # the weights too: they are quantized here
    except Exception as e:  # read before, so only external data can fail here
        raise DiagError(
            "not-onnx",
            f"INT8 model '{q.path}'",
            f"has weights diag cannot read ({type(e).__name__})",
            "check the model's external data files",
        ) from e
    export = AimetExport(q.path, p, document, full)
    export.build()  # quantizes some tensor, or says so in the user's terms
    return export


def aimet_export_at(path: str | Path, encodings: str | Path | None = None) -> AimetExport | None:
    """``--int8 PATH`` as AIMET's export: an FP32 graph with its encodings beside it (or at
    ``encodings``); None for a quantized model or an FP32 one with no encodings.

    Example:
        >>> aimet_export_at("aimet.onnx").encodings.name  # doctest: +SKIP
        'aimet.encodings'
    """
    q = model_from_path(path, "INT8 model")
    where = encodings_of(q, encodings)
    return None if where is None else aimet_export(q, where)


def model_from_encodings(q: LoadedModel, path: Path) -> LoadedModel:
    """The QDQ model AIMET's FP32 export ``q`` and its encodings file at ``path`` describe, loaded.

    The model is written to a temporary folder removed at exit (sessions need a file); reports
    and commands name the user's file (:attr:`LoadedModel.shown_path`), and
    :attr:`LoadedModel.origin` says how the model was built. Never modifies the user's files.

    Example:
        >>> q = model_from_encodings(model_from_path("aimet.onnx"), Path("aimet.encodings"))  # doctest: +SKIP
        >>> q.format.kind, q.shown_path.name  # doctest: +SKIP
        ('qdq', 'aimet.onnx')
    """
    built = aimet_export(q, path).build()
    folder = Path(tempfile.mkdtemp(prefix="diag-aimet-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    target = folder / q.path.name
    onnx.save(built.model, str(target), save_as_external_data=built.model.ByteSize() > (1 << 30))
    loaded = model_from_path(target, "INT8 model")
    loaded.source, loaded.origin = q.path, built.sentence()
    return loaded


def not_quantized(q: LoadedModel) -> DiagError:
    """The ``not-quantized`` error for an FP32 second model, naming AIMET encodings beside it if any."""
    beside = encodings_beside(q.path)
    if beside is None:
        return DiagError(
            "not-quantized",
            f"INT8 model '{q.path}'",
            "contains no quantized operators",
            "pass the output of quantize_dynamic / quantize_static as the second model",
        )
    return DiagError(
        "not-quantized",
        f"INT8 model '{q.path}'",
        f"contains no quantized operators (AIMET encodings '{beside.name}' are beside it)",
        "diag compare and diag exclude --int8 read AIMET encodings beside the model (or --encodings); this verb "
        "does not",
    )
