"""Block-wise and packed 4/8-bit weights: ``MatMulNBits`` and block-wise ``DequantizeLinear``.

onnxruntime's weight-only quantizer (``MatMulNBitsQuantizer``) writes two formats:

* **QOperator** (``matmulnbits``): ``MatMul`` becomes ``MatMulNBits`` (com.microsoft) named
  ``<node>_Q<bits>``, with the same output name. Its weight ``B`` is ``uint8 [N, K/block, block·bits/8]``:
  column ``n`` of the FP32 ``[K, N]`` weight, cut into blocks of ``block_size`` rows (the last one
  zero-padded), two 4-bit values per byte (low nibble first). ``scales`` is ``[N, K/block]`` (or
  flat); ``zero_points`` is packed the same way (``uint8 [N, ceil(K/block · bits/8)]``) or float,
  and when absent the zero point is ``2^(bits-1)`` (symmetric).
* **QDQ** (``qdq-int4-blocked``): ``DequantizeLinear`` of an ``int4`` / ``uint4`` initializer with
  ``axis`` and ``block_size`` (opset 21) feeding the float ``MatMul``; scales and zero points have
  ``ceil(K/block)`` entries along ``axis``.

Both are unpacked here into the ``[K, N]`` float weight they stand for and compared with the FP32
weight per tensor, per output channel and **per block**: one stray value in a block stretches that
block's scale so every other value in it rounds to a few levels (or to zero), which per-tensor and
per-channel figures dilute. Blocks are ranked by ``rmse / rms(tensor)``: comparable across
tensors, and largest where the grid was wasted.

NOTE: this module only reads graphs; the FP32 weight is found structurally (the FP32 node that
writes the same output name), never by a similar-looking name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from diag.core.feeds import Batch
from diag.core.metrics import sqnr_db
from diag.core.run import run_batch, session_from_model
from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_number
from diag.foundations.ortfacts import DEPLOY_LEVEL

#: Reads one initializer as numpy by name (None when the name is no initializer).
ArrayReader = Callable[[str], np.ndarray | None]

#: Blocks kept per weight (worst first) in a finding; the JSON and report list these.
WORST_BLOCKS = 10
#: Columns of a block-wise weight compared at a time (:func:`block_errors`, the weight report): the
#: float64 temporaries (dequantized weight, error) stay a chunk, not a whole lm_head (32000 x 4096).
CHUNK_COLUMNS = 1024


@dataclass(frozen=True)
class BlockError:
    """Error of one quantization block of a block-wise weight.

    Attributes:
        weight: the FP32 weight name.
        channel: output channel (column ``n`` of a ``[K, N]`` MatMul weight).
        block: block index along K (rows ``block*block_size`` ..).
        rows: first and last+1 row of the block in the FP32 weight (the last block may be short).
        rmse: root mean square of ``dequantized - fp32`` over the block.
        rel_rmse: ``rmse / rms(whole FP32 weight)``: ≈ 1 means the block's values are lost.
        max_abs: largest ``|dequantized - fp32|`` in the block.
        levels: distinct integer levels the block uses (of ``2^bits``): few levels = wasted grid.
        peak_ratio: ``max|x| / median|x|`` of the FP32 block: a stray value shows as a large ratio.
        transposed: a ``GatherBlockQuantized`` table blocked along axis 1: ``channel`` is a row of
            the table and ``rows`` are its columns.
    """

    weight: str
    channel: int
    block: int
    rows: tuple[int, int]
    rmse: float
    rel_rmse: float
    max_abs: float
    levels: int
    peak_ratio: float
    transposed: bool = False

    def where(self) -> str:
        """``column 3 rows 32-63`` (``row 3 columns 32-63`` for a transposed Gather table).

        Example:
            >>> BlockError("w", 3, 1, (32, 64), 0.1, 1.0, 0.2, 2, 40.0).where()
            'column 3 rows 32-63'
        """
        a, b = ("row", "columns") if self.transposed else ("column", "rows")
        return f"{a} {self.channel} {b} {self.rows[0]}-{self.rows[1] - 1}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready.

        Example:
            >>> BlockError("w", 3, 1, (32, 64), 0.1, 1.0, 0.2, 2, 40.0).to_dict()["rows"]
            [32, 64]
        """
        return {
            "weight": self.weight,
            "channel": self.channel,
            "block": self.block,
            "rows": list(self.rows),
            "rmse": json_number(self.rmse),
            "rel_rmse": json_number(self.rel_rmse),
            "max_abs": json_number(self.max_abs),
            "levels": self.levels,
            "peak_ratio": json_number(self.peak_ratio),
            "where": self.where(),
        }


@dataclass(frozen=True)
class BlockedWeight:
    """A block-wise quantized weight unpacked to the ``[K, N]`` layout of the FP32 MatMul weight.

    Attributes:
        int8_name: the packed / int4 initializer.
        node: the quantized node that reads it (``MatMulNBits``, or the block-wise ``DequantizeLinear``).
        output: the tensor the compute node writes (same name as the FP32 MatMul's output).
        bits: 2, 4 or 8.
        block_size: rows per block.
        symmetric: no zero point given (``2^(bits-1)`` implied) or every zero point at mid-range.
        levels: integer levels ``[K, N]`` (unpacked, padding removed; int16).
        block_scale: the scale of each block ``[ceil(K / block_size), N]``.
        block_zero: the zero point of each block, same shape (float, in the level domain).
        dtype: element type as onnxruntime stores it (``uint4``, ``int4``, ``uint8``...).
        transposed: the stored weight has its blocks along axis 1 (a ``GatherBlockQuantized`` table,
            ``[vocab, hidden]`` blocked along hidden): the arrays here are its transpose, so blocks
            always run along rows; compare with the FP32 weight transposed too.
    """

    int8_name: str
    node: str
    output: str
    bits: int
    block_size: int
    symmetric: bool
    levels: np.ndarray
    block_scale: np.ndarray
    block_zero: np.ndarray
    dtype: str
    transposed: bool = False

    def grid(self, columns: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Per-element (scale, zero point) ``[K, n]`` of ``columns``, expanded from the blocks.

        NOTE: kept per block and expanded a chunk of columns at a time: per element in float64
        they are 16 bytes per 4-bit weight, 800 MB for one Llama lm_head.
        """
        k = self.levels.shape[0]
        scale = np.repeat(self.block_scale[:, columns], self.block_size, axis=0)[:k]
        zero = np.repeat(self.block_zero[:, columns], self.block_size, axis=0)[:k]
        return scale, zero

    @property
    def scale(self) -> np.ndarray:
        """Per-element scale ``[K, N]`` (the whole weight: prefer :meth:`grid` on a chunk)."""
        return self.grid()[0]

    @property
    def zero_point(self) -> np.ndarray:
        """Per-element zero point ``[K, N]`` (the whole weight: prefer :meth:`grid` on a chunk)."""
        return self.grid()[1]

    def dequantized(self, columns: slice = slice(None)) -> np.ndarray:
        """``(levels - zero_point) * scale`` in float64, ``[K, n]`` for ``columns``."""
        scale, zero = self.grid(columns)
        out: np.ndarray = (self.levels[:, columns].astype(np.float64) - zero) * scale
        return out


def unpack_bits(packed: np.ndarray, bits: int, count: int, dtype: Any = np.int64) -> np.ndarray:
    """Unpack the last axis of ``packed`` (uint8) into ``count`` values of ``bits`` bits, low bits first.

    This is how ``MatMulNBits`` stores weights and zero points (two 4-bit values per byte, the
    first in the low nibble).

    Example:
        >>> unpack_bits(np.array([[0x21, 0x03]], dtype=np.uint8), 4, 3).tolist()
        [[1, 2, 3]]
    """
    per_byte = 8 // bits
    if bits == 4:
        # NOTE: the common case, in uint8 throughout: two nibble planes written in place (the
        # general path widens every byte to uint16, then every value to int64: on the 500M int4
        # decoder that was a tenth of the weight report).
        nibbles = np.empty((*packed.shape, 2), dtype=np.uint8)
        np.bitwise_and(packed, 0x0F, out=nibbles[..., 0])
        np.right_shift(packed, 4, out=nibbles[..., 1])
        values = nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
        return values[..., :count].astype(dtype)
    mask = (1 << bits) - 1
    b = packed.astype(np.uint16)[..., :, None]
    shifts = (np.arange(per_byte, dtype=np.uint16) * bits)[None, :]
    values = (b >> shifts) & mask
    values = values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    return values[..., :count].astype(dtype)


def unpack_matmulnbits(node: onnx.NodeProto, array: ArrayReader) -> BlockedWeight:
    """Unpack a ``MatMulNBits`` node's weight, scales and zero points into ``[K, N]`` arrays.

    ``array(name)`` returns an initializer as numpy (None when it is not one).

    Raises:
        ValueError: a layout this function does not know (``g_idx`` act-order, a computed weight).

    Example:
        >>> w = unpack_matmulnbits(node, lambda n: arrays.get(n))  # doctest: +SKIP
        >>> w.dequantized().shape  # doctest: +SKIP
        (64, 8)
    """
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = int(attrs["K"]), int(attrs["N"]), int(attrs.get("bits", 4)), int(attrs["block_size"])
    inputs = list(node.input) + [""] * 6
    if inputs[4]:
        raise ValueError("g_idx (act-order) is not supported")
    packed = array(inputs[1])
    scales = array(inputs[2])
    if packed is None or scales is None:
        raise ValueError("the weight or its scales are computed, not initializers")
    blocks = (k + block - 1) // block
    q = unpack_bits(packed.reshape(n, blocks, -1), bits, block, np.int16).reshape(n, blocks * block)
    s = scales.astype(np.float64).reshape(n, blocks)
    zp_arr = array(inputs[3]) if inputs[3] else None
    if zp_arr is None:
        z = np.full((n, blocks), float(1 << (bits - 1)))
        symmetric = True
    elif zp_arr.dtype == np.uint8:
        z = unpack_bits(zp_arr.reshape(n, -1), bits, blocks).astype(np.float64)
        symmetric = bool(np.all(z == (1 << (bits - 1))))
    else:  # float zero points (HQQ): value = (q - zp) * scale with zp in the level domain
        z = zp_arr.astype(np.float64).reshape(n, blocks)
        symmetric = False
    levels = np.ascontiguousarray(q[:, :k].T, dtype=np.int16)
    return BlockedWeight(
        inputs[1], node.name, node.output[0], bits, block, symmetric, levels, s.T, z.T, f"uint{bits} (packed)"
    )


def unpack_blocked_dequantize(node: onnx.NodeProto, array: ArrayReader, output: str) -> BlockedWeight:
    """A block-wise ``DequantizeLinear`` (``block_size`` > 0) or ``GatherBlockQuantized`` of a 2-D initializer.

    ``output`` is the tensor written by the node that computes with the weight (the MatMul after
    the DequantizeLinear; the GatherBlockQuantized itself). The zero point defaults to 0, or to 8
    for a ``uint4`` GatherBlockQuantized table (the contrib op's default).

    Example:
        >>> w = unpack_blocked_dequantize(dq, lambda n: arrays.get(n), "fc0_out")  # doctest: +SKIP
    """
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    block = int(attrs["block_size"])
    gather = node.op_type == "GatherBlockQuantized"
    data, s_name = node.input[0], node.input[2 if gather else 1]
    z_name = (
        (node.input[3] if len(node.input) > 3 else "") if gather else (node.input[2] if len(node.input) > 2 else "")
    )
    q = array(data)
    s = array(s_name)
    if q is None or s is None or q.ndim != 2:
        raise ValueError("only 2-D initializer weights are supported")
    if gather and q.dtype == np.uint8 and int(attrs.get("bits", 4)) != 8:
        raise ValueError("packed uint8 GatherBlockQuantized data is not supported")
    axis = int(attrs.get("quantize_axis" if gather else "axis", 1)) % 2
    z_arr = array(z_name) if z_name else None
    dtype = str(q.dtype)
    levels = q.astype(np.int16)
    default_zero = 8.0 if gather and dtype == "uint4" else 0.0
    zero = z_arr.astype(np.int64).astype(np.float64) if z_arr is not None else np.full(s.shape, default_zero)
    scale = s.astype(np.float64)
    signed = dtype.startswith("int")
    bits = 4 if "4" in dtype else 8
    symmetric = bool(np.all(zero == (0 if signed else 1 << (bits - 1))))
    if axis == 1:  # blocks along axis 1: transpose so that blocks run along rows like MatMulNBits
        levels, scale, zero = np.ascontiguousarray(levels.T), scale.T, zero.T
    return BlockedWeight(data, node.name, output, bits, block, symmetric, levels, scale, zero, dtype, axis == 1)


def block_figures(e: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of rows of an error ``e`` ``[K, n]`` (float64): its RMS and its largest |e|, ``[blocks, n]``.

    Example:
        >>> rmse, peak = block_figures(np.array([[3.0], [4.0], [0.0]]), 2)
        >>> rmse.ravel().tolist(), peak.ravel().tolist()
        ([3.5355339059327378, 0.0], [4.0, 0.0])
    """
    k = e.shape[0]
    nb = (k + block - 1) // block
    rows = np.diff([*range(0, k, block), k]).astype(np.float64)[:, None]  # the last block may be short
    if k < nb * block:  # pad to whole blocks: zeros add nothing to a sum of squares or a max |e|
        e = np.concatenate([e, np.zeros((nb * block - k, e.shape[1]))])
    eb = e.reshape(nb, block, -1)
    return np.sqrt(np.einsum("bij,bij->bj", eb, eb) / rows), np.abs(eb).max(axis=1)


def block_errors(
    name: str,
    ref: np.ndarray,
    w: BlockedWeight,
    worst: int | None = None,
    figures: tuple[np.ndarray, np.ndarray, float] | None = None,
) -> list[BlockError]:
    """The blocks of ``w`` against the FP32 weight ``ref`` ``[K, N]``, worst (largest ``rel_rmse``) first.

    ``worst``: keep only that many (what a report shows). ``figures``: the blocks' (rmse, peak)
    from :func:`block_figures` and the weight's rms, when the caller computed them on its own pass
    over the weight (the weight report does: one dequantization instead of two). NOTE: the
    per-block figures are computed as arrays over all blocks at once and objects are made for
    the kept ones only: an LLM's weights hold millions of blocks (500 M parameters / 32), far
    too many for one object each.

    Example:
        >>> block_errors("fc2.weight", ref, w)[0].channel  # doctest: +SKIP
        3
    """
    k, n = ref.shape
    block = w.block_size
    starts = list(range(0, k, block))
    if figures is None:
        energy = 0.0
        rmse = np.empty((len(starts), n))
        peak = np.empty((len(starts), n))
        for a in range(0, n, CHUNK_COLUMNS):  # float64 temporaries one chunk of columns at a time
            cols = slice(a, min(a + CHUNK_COLUMNS, n))
            c = ref[:, cols].astype(np.float64)
            energy += float(np.einsum("ij,ij->", c, c))
            rmse[:, cols], peak[:, cols] = block_figures(w.dequantized(cols) - c, block)
        tensor_rms = math.sqrt(energy / max(ref.size, 1)) or 1.0
    else:
        rmse, peak, tensor_rms = figures
    flat = rmse.ravel()
    count = flat.size if worst is None else min(worst, flat.size)
    # order: largest rmse first, then channel, then block (the order a full sort gives)
    keys = np.lexsort((np.repeat(np.arange(len(starts)), n), np.tile(np.arange(n), len(starts)), -flat))
    out: list[BlockError] = []
    for idx in keys[:count]:
        i, c = divmod(int(idx), n)
        b = starts[i]
        # NOTE: max / median of the block's |w| only for the blocks kept (medians of every block
        # were a third of the weight analysis on an LLM)
        xb = np.abs(ref[b : b + block, c])
        med = float(np.median(xb))
        ratio = float(xb.max()) / med if med > 0 else math.inf
        out.append(
            BlockError(
                name,
                c,
                i,
                (b, min(b + block, k)),
                float(rmse[i, c]),
                float(rmse[i, c]) / tensor_rms,
                float(peak[i, c]),
                len(np.unique(w.levels[b : b + block, c])),
                ratio,
                w.transposed,
            )
        )
    return out


def blocked_weights(model: onnx.ModelProto, array: ArrayReader) -> Iterator[tuple[BlockedWeight | None, str, str]]:
    """Every block-wise weight of a quantized graph, one at a time: ``(weight or None, initializer, why not)``.

    ``array(name)`` reads an initializer (None when it is not one). A weight that cannot be
    unpacked comes back as ``(None, name, reason)``. NOTE: a generator, unpacked on demand: an
    unpacked weight is levels, scale and zero point per element (24 bytes per 4-bit weight), so
    a list of them all was six times the FP32 model.
    """
    producers_of_consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            producers_of_consumers.setdefault(i, []).append(node)
    q_outputs = {o for n in model.graph.node if n.op_type == "QuantizeLinear" for o in n.output}
    for node in model.graph.node:
        item: tuple[BlockedWeight | None, str, str] | None = None
        try:
            if node.op_type == "MatMulNBits":
                item = (unpack_matmulnbits(node, array), node.input[1], "")
            elif node.op_type == "GatherBlockQuantized":
                item = (unpack_blocked_dequantize(node, array, node.output[0]), node.input[0], "")
            elif (
                node.op_type == "DequantizeLinear"
                and node.input[0] not in q_outputs
                and any(a.name == "block_size" and a.i > 0 for a in node.attribute)
            ):
                consumers = producers_of_consumers.get(node.output[0], [])
                if not consumers or not consumers[0].output:
                    continue
                item = (unpack_blocked_dequantize(node, array, consumers[0].output[0]), node.input[0], "")
        except ValueError as e:
            item = (None, node.input[1] if node.op_type == "MatMulNBits" else node.input[0], str(e))
        if item is not None:
            yield item


def fp32_weight_of(fp: onnx.GraphProto, output: str) -> tuple[onnx.NodeProto, str] | None:
    """The FP32 MatMul / Gemm / Gather that writes ``output`` and its weight input (structural pairing).

    Example:
        >>> fp32_weight_of(fp32.graph, "y")  # doctest: +SKIP
        (<MatMul fc2>, 'fc2.weight')
    """
    for node in fp.node:
        if output in node.output and node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            return node, node.input[1]
        if output in node.output and node.op_type == "Gather":
            return node, node.input[0]
    return None


# ---------------------------------------------------------------- accuracy_level


@dataclass
class AccuracyLevelCheck:
    """What a ``MatMulNBits`` ``accuracy_level`` costs, measured: the model run at ``level`` against level 0.

    ``accuracy_level`` 4 quantizes each MatMulNBits *input* to int8 inside the kernel (block-wise,
    per row); level 0 computes with float inputs. An activation outlier that a float input carries
    is rounded away there, invisibly: no node of the graph shows it. Both runs use the same 4-bit
    weights, so the difference is that input quantization alone, accumulated along the graph.
    """

    level: int
    samples: int
    #: MatMulNBits node -> worst model-output SQNR (dB) with that node alone at ``level``, worst first.
    nodes: dict[str, float]
    #: Model output -> SQNR (dB) at ``level`` against level 0.
    outputs: dict[str, float]

    def worst_node(self) -> tuple[str, float] | None:
        return next(iter(self.nodes.items()), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "samples": self.samples,
            "nodes": {k: json_number(v) for k, v in self.nodes.items()},
            "outputs": {k: json_number(v) for k, v in self.outputs.items()},
        }


def accuracy_level_nodes(q: onnx.ModelProto, level: int) -> list[str]:
    """The output tensors of ``q``'s MatMulNBits nodes; ``bad-option`` when there are none or ``level`` is not 1-4."""
    if level not in (1, 2, 3, 4):
        raise DiagError("bad-option", f"--accuracy-level-check {level}", "is not an accuracy_level", "use 1-4")
    names = [n.output[0] for n in q.graph.node if n.op_type == "MatMulNBits" and n.output]
    if not names:
        raise DiagError(
            "bad-option",
            "--accuracy-level-check",
            "needs MatMulNBits nodes; the quantized model has none",
            "drop the flag (accuracy_level only exists on MatMulNBits)",
        )
    return names


def check_accuracy_level(
    q: onnx.ModelProto,
    feeds: Iterable[Batch],
    level: int,
    samples: int = 8,
    threads: int | None = None,
    fp: onnx.ModelProto | None = None,
    external_dir: Path | None = None,
) -> AccuracyLevelCheck:
    """Run the MatMulNBits nodes of ``q`` at ``accuracy_level`` ``level`` against level 0, on the first ``samples``.

    The model outputs are measured with every node at ``level``; each node is then measured on its
    own, the only one at ``level`` (one session per node): its worst output SQNR is what that node's
    int8 inputs cost — a per-node figure a user can act on (keep that node at level 0, or in float),
    where a node's own output error would mostly repeat what it inherits.

    Nodes are named as in ``fp`` (the FP32 node writing the same output: what ``nodes_to_exclude``
    takes) when it is given, else by their own MatMulNBits names. ``external_dir``: the folder
    of ``q``'s external data (:attr:`diag.core.load.LoadedModel.external_dir`). Raises ``bad-option`` when the
    model has no MatMulNBits node or ``level`` is not 1-4.

    Example:
        >>> check_accuracy_level(q.proto, source, 4).worst_node()  # doctest: +SKIP
        ('fc2', 31.4)
    """
    names = accuracy_level_nodes(q, level)
    outputs = [o.name for o in q.graph.output]
    feeds_used: list[dict[str, np.ndarray]] = []
    done = 0
    for batch in feeds:
        if done >= samples:
            break
        feeds_used.append(batch.feeds)
        done += batch.size

    # One copy of the model (weights included) for every run: each run only rewrites the
    # MatMulNBits nodes' accuracy_level attribute before its session is built.
    m = onnx.ModelProto()
    m.CopyFrom(q)

    def run(at_level: set[str]) -> list[dict[str, np.ndarray]]:
        for n in m.graph.node:
            if n.op_type == "MatMulNBits":
                kept = [a for a in n.attribute if a.name != "accuracy_level"]
                del n.attribute[:]
                lv = level if n.output[0] in at_level else 0
                n.attribute.extend([*kept, onnx.helper.make_attribute("accuracy_level", lv)])
        role = f"quantized model with {len(at_level)} MatMulNBits node(s) at accuracy_level {level}"
        sess = session_from_model(m, role, DEPLOY_LEVEL, threads, external_dir)
        return [{k: v for k, v in run_batch(sess, f, role).items() if k in outputs} for f in feeds_used]

    reference = run(set())

    def sqnr(got: list[dict[str, np.ndarray]], name: str) -> float:
        signal = noise = 0.0
        for ref, out in zip(reference, got, strict=True):
            x, y = np.asarray(ref[name], np.float64), np.asarray(out[name], np.float64)
            signal += float((x * x).sum())
            noise += float(((y - x) ** 2).sum())
        return sqnr_db(signal, noise)

    everything = run(set(names))
    producers = {n.output[0]: (n.name or n.output[0]) for n in q.graph.node if n.op_type == "MatMulNBits"}
    if fp is not None:
        fp_names = {o: n.name for n in fp.graph.node for o in n.output if n.name}
        producers = {t: fp_names.get(t, name) for t, name in producers.items()}
    per_node = []
    for t in names:
        alone = run({t})
        per_node.append((producers[t], min(sqnr(alone, o) for o in outputs)))
    per_node.sort(key=lambda kv: kv[1])
    return AccuracyLevelCheck(level, done, dict(per_node), {o: sqnr(everything, o) for o in outputs})
