"""Weight error: every quantized weight of an INT8 model, dequantized and compared with its FP32 weight.

Activation error tells *where* a model breaks; weight error tells whether the weights alone already
explain it (one huge output channel that a per-tensor scale spreads over every other channel, a
folded BatchNorm with a tiny variance, ...). It needs no inputs and runs in milliseconds.

What counts as a quantized weight (measured on onnxruntime 1.32 graphs, see the tests):

* QDQ: an integer initializer read by ``DequantizeLinear`` (``axis`` for per-channel). That covers
  Conv/MatMul/Gemm weights, constant operands of Mul/Add (often 0-d or 1-d) and int32 biases
  (scale = input scale x weight scale).
* QOperator: the weight inputs of ``QLinearConv`` / ``QLinearMatMul`` / ``QGemm`` / ``QLinearAdd`` /
  ``QLinearMul`` with their scale / zero point at fixed input indices, and the int32 bias of
  ``QLinearConv`` / ``QGemm`` (zero point 0, scale = input scale x weight scale).
* Dynamic: the weight input of ``MatMulInteger`` / ``ConvInteger`` (its scale is found where the
  output is rescaled: ``Mul(Cast(out), Mul(input_scale, weight_scale))``), ``DynamicQuantizeMatMul``
  and ``MatMulIntegerToFloat`` (com.microsoft; onnxruntime's optimizer makes them from the dynamic
  graph at the "extended" level) and ``Gather`` of an integer table followed by ``DequantizeLinear``.

Which FP32 weight an INT8 weight is compared with is decided structurally:

* onnxruntime names a quantized weight ``<w>_quantized``; when the FP32 model has an initializer
  ``<w>`` of the same shape, that is it.
* Otherwise the weight was *folded* (``quant_pre_process`` runs onnxruntime's optimizer, which folds
  BatchNormalization, a constant Mul and a constant Add into the Conv and renames the weight to
  ``ConvBnFusion_W_...``). The INT8 consumer's output is followed to the FP32 tensor it computes,
  the FP32 chain that produced that tensor is walked back to the compute node with the original
  weight, and the fold is replayed in float64 (``W * gamma / sqrt(var + eps)`` per output channel,
  bias ``(b - mean) * gamma / sqrt(var + eps) + beta``, constant Mul / Add / Sub / Div). A weight
  that cannot be explained this way is listed in :attr:`WeightReport.unmatched` with the reason;
  nothing is paired by a similar-looking name.

NOTE: onnxruntime's own ``create_weight_matching`` + ``compute_weight_error`` crash on 0-d weights
(``len()`` of a numpy scalar); here 0-d and 1-d weights get tensor metrics and no channel list.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from diag.core.match import DQ_OPS, Q_OPS
from diag.core.metrics import cosine, sqnr_db
from diag.core.nbits import (
    CHUNK_COLUMNS,
    WORST_BLOCKS,
    BlockedWeight,
    BlockError,
    block_errors,
    block_figures,
    blocked_weights,
    fp32_weight_of,
)
from diag.foundations.errors import DiagError
from diag.foundations.jsonnum import json_number as _num
from diag.foundations.ortfacts import QUANTIZED_OPS, Operand, families_where

#: Ops that compute with a weight: the float op in QDQ / FP32 and the integer ops made of it.
_CONV_OPS = {"Conv", "ConvInteger", "QLinearConv"}
_MATMUL_OPS = {
    "MatMul",
    "MatMulInteger",
    "QLinearMatMul",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "Gemm",
    "QGemm",
}
#: FP32 ops onnxruntime's optimizer folds into a preceding Conv (ConvBNFusion, ConvMulFusion, ConvAddFusion).
_FOLDABLE = {"BatchNormalization", "Mul", "Add", "Sub", "Div"}
#: Ops a quantized compute node's result flows through before it is the FP32 tensor again.
_INT8_TAIL = {*Q_OPS, *DQ_OPS, "Cast", "Mul", "Add", "Relu", "Clip"}
#: FP32 activations the quantizer fuses into the producer's output range (no effect on weights).
_FUSED_ACTIVATIONS = {"Relu", "Clip"}
#: Initializers up to this size (scales, zero points, BN parameters) are converted once and cached.
_CACHED_ELEMENTS = 4096

#: Float ops whose quantized forms (:data:`diag.foundations.ortfacts.QUANTIZED_OPS`) have their weights measured.
_MEASURED_FLOAT_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul"}
#: Quantized op -> its operands as (FP32 input index, where the operand and its grid are).
_OPERANDS: dict[str, list[tuple[int, Operand]]] = {
    name: [(fp_idx, op.operand(fp_idx)) for fp_idx in range(len(op.operands))]
    for name, op in QUANTIZED_OPS.items()
    if op.family in families_where(lambda f: f.integer_weights) and op.float_op in _MEASURED_FLOAT_OPS
}
#: QOperator / dynamic ops: quantized input index -> (scale index, zero point index, FP32 input index).
_QOP_INPUTS: dict[str, dict[int, tuple[int, int, int]]] = {
    name: {
        g.index: (g.scale, g.zero_point, fp_idx)
        for fp_idx, g in operands
        if g.scale is not None and g.zero_point is not None
    }
    for name, operands in _OPERANDS.items()
    if any(g.scale is not None for _, g in operands)
}
#: Dynamic integer ops: weight index -> (zero point index, FP32 input index); the scale is found downstream.
_INTEGER_INPUTS: dict[str, dict[int, tuple[int, int]]] = {
    name: {g.index: (g.zero_point, fp_idx) for fp_idx, g in operands if g.zero_point is not None}
    for name, operands in _OPERANDS.items()
    if name not in _QOP_INPUTS
}
#: QOperator int32 bias inputs: bias index -> (input scale index, weight scale index, FP32 input index).
_QOP_BIAS: dict[str, tuple[int, int, int, int]] = {
    name: (bias, x.scale, w.scale, 2)
    for name in _QOP_INPUTS
    if (bias := QUANTIZED_OPS[name].bias_index) is not None
    and (x := _OPERANDS[name][0][1]).scale is not None
    and (w := _OPERANDS[name][1][1]).scale is not None
}
_FLOAT_OP_OF = {name: str(QUANTIZED_OPS[name].float_op) for name in _OPERANDS}


@dataclass(frozen=True)
class ChannelError:
    """Error of one output channel of a weight.

    Attributes:
        channel: index along the op's output-channel axis.
        sqnr_db: ``10·log10(Σx² / Σe²)`` over the channel; inf when identical.
        max_abs: largest ``|dequantized - fp32|`` in the channel.
        rmse_over_scale: ``√mean(e² / scale²)`` with the channel's scale (None when the scale is 0).
    """

    channel: int
    sqnr_db: float
    max_abs: float
    rmse_over_scale: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; non-finite floats as "inf"/"-inf"/"nan" strings.

        Example:
            >>> ChannelError(0, math.inf, 0.0, 0.0).to_dict()["sqnr_db"]
            'inf'
        """
        return {
            "channel": self.channel,
            "sqnr_db": _num(self.sqnr_db),
            "max_abs": _num(self.max_abs),
            "rmse_over_scale": _num(self.rmse_over_scale),
        }


@dataclass(frozen=True)
class WeightFinding:
    """One quantized weight of the INT8 model compared with the FP32 weight it stands for.

    Attributes:
        fp_name: FP32 initializer name, or ``"<w> folded with <bn>"`` when the INT8 weight is a fold.
        int8_name: the quantized initializer in the INT8 model.
        fp_nodes: FP32 nodes that consume it (what ``nodes_to_exclude`` takes; every folded node too).
        op_type: FP32 op type of the consumer (``Conv``, ``MatMul``, ``Mul``, ...).
        shape: shape of the weight.
        dtype: element type of the quantized weight (``int8``, ``uint8``, ``int32``, ...).
        axis: per-channel quantization axis, None for per-tensor.
        symmetric: every zero point is the middle of the range (0 for signed, 128 for uint8).
        folded: FP32 nodes folded into this weight (comma-separated), None when not folded.
        is_bias: an int32 bias (scale = input scale x weight scale); its error is normally negligible.
        sqnr_db: ``10·log10(Σx² / Σe²)`` over the whole weight; inf when identical.
        max_abs: largest ``|dequantized - fp32|``.
        rmse_over_scale: ``√mean(e² / scale²)`` with the (per-channel) scale; rounding alone gives ≈ 0.289.
        cosine: ``Σxy / √(Σx²·Σy²)``.
        channels: per output channel of the op (axis 0 of a Conv weight, the output axis of a
            MatMul/Gemm weight); empty for 0-d and 1-d weights.
    """

    fp_name: str
    int8_name: str
    fp_nodes: list[str]
    op_type: str
    shape: tuple[int, ...]
    dtype: str
    axis: int | None
    symmetric: bool
    folded: str | None
    sqnr_db: float
    max_abs: float
    rmse_over_scale: float
    cosine: float
    channels: list[ChannelError] = field(default_factory=list)
    is_bias: bool = False
    #: Block-wise weights (MatMulNBits, int4 QDQ): rows per block and the worst blocks (see diag.core.nbits).
    block_size: int | None = None
    blocks: list[BlockError] = field(default_factory=list)

    @property
    def worst_sqnr_db(self) -> float:
        """The lower of the tensor SQNR and its worst channel's SQNR (what the ranking uses).

        A per-tensor SQNR looks fine on a weight whose one huge channel carries the energy while
        every other channel rounds to a few levels; the worst channel does not hide that.
        """
        values = [v for v in [self.sqnr_db] + [c.sqnr_db for c in self.channels] if not math.isnan(v)]
        return min(values) if values else math.nan

    @property
    def worst_channel(self) -> ChannelError | None:
        """The channel with the lowest SQNR, None for 0-d / 1-d weights."""
        return min(self.channels, key=lambda c: c.sqnr_db) if self.channels else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; non-finite floats as "inf"/"-inf"/"nan" strings (like report/view.py).

        Example:
            >>> f = weight_errors(fp_proto, int8_proto)[0]  # doctest: +SKIP
            >>> json.dumps(f.to_dict())  # doctest: +SKIP
        """
        return {
            "fp_name": self.fp_name,
            "int8_name": self.int8_name,
            "fp_nodes": list(self.fp_nodes),
            "op_type": self.op_type,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "axis": self.axis,
            "symmetric": self.symmetric,
            "folded": self.folded,
            "is_bias": self.is_bias,
            "sqnr_db": _num(self.sqnr_db),
            "worst_sqnr_db": _num(self.worst_sqnr_db),
            "max_abs": _num(self.max_abs),
            "rmse_over_scale": _num(self.rmse_over_scale),
            "cosine": _num(self.cosine),
            "channels": [c.to_dict() for c in self.channels],
        } | ({"block_size": self.block_size, "blocks": [b.to_dict() for b in self.blocks]} if self.block_size else {})


@dataclass(frozen=True)
class Smoothing:
    """A SmoothQuant Mul the producer inserted (NNCF's ``nncf_smooth_quant``): the activation it
    multiplies per channel by ``v`` and the weights whose input rows it divided by ``v``.

    The channel it scales down most is where the activation had an outlier: SmoothQuant moved that
    channel's range into the weights (a finding about the model, not an error of the quantizer).
    """

    mul: str
    #: The FP32 tensor it multiplies.
    tensor: str
    channels: int
    #: The channel with the smallest factor, and ``1 / v`` there (how much that channel shrank).
    strongest_channel: int
    divided_by: float
    weights: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mul": self.mul,
            "tensor": self.tensor,
            "channels": self.channels,
            "strongest_channel": self.strongest_channel,
            "divided_by": _num(self.divided_by),
            "weights": list(self.weights),
        }


@dataclass(frozen=True)
class BiasCorrection:
    """A float bias the producer changed on purpose (NNCF's fast bias correction): the INT8 model's
    bias of the same name as the FP32 one, with other values. Not quantization error: the producer
    moved the bias to cancel the mean shift quantization causes."""

    name: str
    fp_nodes: tuple[str, ...]
    #: The largest |change|, and it over the FP32 bias's largest |value|.
    max_change: float
    relative: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fp_nodes": list(self.fp_nodes),
            "max_change": _num(self.max_change),
            "relative": _num(self.relative),
        }


@dataclass(frozen=True)
class WeightReport:
    """All weight findings (worst first) and the quantized weights that could not be paired, with why."""

    findings: list[WeightFinding]
    unmatched: dict[str, str]
    #: SmoothQuant Muls the producer inserted, strongest first (their weights are measured rescaled).
    smoothing: list[Smoothing] = field(default_factory=list)
    #: Float biases the producer corrected, largest relative change first.
    bias_corrections: list[BiasCorrection] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready.

        Example:
            >>> WeightReport([], {"w_quantized": "why"}).to_dict()["unmatched"]
            {'w_quantized': 'why'}
        """
        blocks = self.worst_blocks()
        return (
            {"findings": [f.to_dict() for f in self.findings], "unmatched": dict(self.unmatched)}
            | ({"blocks": [b.to_dict() for b in blocks]} if blocks else {})
            | ({"smoothing": [s.to_dict() for s in self.smoothing]} if self.smoothing else {})
            | ({"bias_corrections": [b.to_dict() for b in self.bias_corrections]} if self.bias_corrections else {})
        )

    def worst_blocks(self, top: int = 10) -> list[BlockError]:
        """The worst quantization blocks over every block-wise weight (largest ``rel_rmse`` first).

        Example:
            >>> report.worst_blocks()[0].weight  # doctest: +SKIP
            'fc2.weight'
        """
        blocks = [b for f in self.findings for b in f.blocks]
        return sorted(blocks, key=lambda b: (-b.rel_rmse, b.weight, b.channel, b.block))[:top]


def weight_errors(fp32: onnx.ModelProto, int8: onnx.ModelProto) -> list[WeightFinding]:
    """Every quantized weight of ``int8`` against its FP32 weight, worst first.

    Ranked by :attr:`WeightFinding.worst_sqnr_db` (the lower of tensor and worst-channel SQNR), so
    a weight with one ruined channel ranks above a weight with uniform rounding noise. Weights that
    cannot be paired are left out here; :func:`weight_report` lists them with the reason.
    Never modifies either model. Needs the weights (``onnx.load(path)``, external data loaded).

    Example:
        >>> findings = weight_errors(onnx.load("m.fp32.onnx"), onnx.load("m.qdq.onnx"))  # doctest: +SKIP
        >>> findings[0].fp_name, round(findings[0].worst_sqnr_db, 1)  # doctest: +SKIP
        ('conv2.weight', 3.1)
    """
    return weight_report(fp32, int8).findings


def weight_report(
    fp32: onnx.ModelProto,
    int8: onnx.ModelProto,
    fp32_dir: Path | None = None,
    int8_dir: Path | None = None,
) -> WeightReport:
    """Like :func:`weight_errors`, plus the quantized weights that could not be paired and why.

    ``fp32_dir`` / ``int8_dir``: the folders of models loaded without their external data; the
    weights this report needs are then read from the files one at a time (the large tensors
    nobody quantized are never read).

    Example:
        >>> r = weight_report(onnx.load("m.fp32.onnx"), onnx.load("m.qdq.onnx"))  # doctest: +SKIP
        >>> r.unmatched  # doctest: +SKIP
        {}
    """
    f = _Graph(fp32.graph, fp32_dir)
    q = _Graph(int8.graph, int8_dir)
    findings: list[WeightFinding] = []
    unmatched: dict[str, str] = {}
    smoothing: dict[str, tuple[str, np.ndarray, list[str]]] = {}
    for qw in _quantized_weights(q):
        if qw.name in unmatched or any(x.int8_name == qw.name for x in findings):
            continue
        try:
            found = _finding(qw, f, q)
        except _Unmatched as e:
            unmatched[qw.name] = str(e)
            continue
        findings.append(found)
        smoothed = _smoothing_of(qw, f, q, found.shape)
        if smoothed is not None:
            mul, v = smoothed
            smoothing.setdefault(mul, (_data_input(q, mul), v, []))[2].append(found.fp_name)
    _blocked_findings(f, q, int8, findings, unmatched)
    findings.sort(key=lambda x: (math.isnan(x.worst_sqnr_db), x.worst_sqnr_db, x.sqnr_db, x.int8_name))
    muls = [
        Smoothing(mul, tensor, v.size, int(np.argmin(v)), float(1.0 / v.min()), tuple(weights))
        for mul, (tensor, v, weights) in smoothing.items()
    ]
    strongest_first = sorted(muls, key=lambda s: (-s.divided_by, s.mul))
    return WeightReport(findings, unmatched, strongest_first, _bias_corrections(f, q))


#: Ops whose third input is a bias, and Add (a bias added after a MatMul).
_BIAS_READERS = {"Conv": 2, "Gemm": 2, "ConvTranspose": 2}


def _bias_corrections(f: _Graph, q: _Graph) -> list[BiasCorrection]:
    """Float 1-D biases both models hold under one name whose values differ (module doc of BiasCorrection)."""
    out = []
    for name, t in q.inits.items():
        if len(t.dims) != 1 or t.data_type != onnx.TensorProto.FLOAT or name not in f.inits:
            continue
        readers = q.consumers.get(name, [])
        if not readers or not all(n.op_type == "Add" or _BIAS_READERS.get(n.op_type) == i for n, i in readers):
            continue
        mine, theirs = q.const(name), f.const(name)
        if mine is None or theirs is None or mine.shape != theirs.shape or np.array_equal(mine, theirs):
            continue
        change = float(np.abs(mine.astype(np.float64) - theirs).max())
        peak = float(np.abs(theirs).max())
        nodes = tuple(n.name for n, _ in f.consumers.get(name, []))
        out.append(BiasCorrection(name, nodes, change, change / peak if peak > 0 else math.inf))
    return sorted(out, key=lambda b: (-b.relative, b.name))


def _data_input(q: _Graph, mul: str) -> str:
    """The non-constant input of node ``mul`` (the activation a SmoothQuant Mul rescales)."""
    node = next(n for n in q.nodes if n.name == mul)
    return next((i for i in node.input if q.const(i) is None), node.input[0])


def _blocked_findings(
    f: _Graph, q: _Graph, int8: onnx.ModelProto, findings: list[WeightFinding], unmatched: dict[str, str]
) -> None:
    """MatMulNBits and block-wise DequantizeLinear weights (:mod:`diag.core.nbits`), with their worst blocks.

    NOTE: a pipeline, in graph order: this thread unpacks weight k + 1 (reading its file) while a
    worker reduces weight k, at most :data:`BLOCKED_IN_FLIGHT` weights ahead (an unpacked weight
    and its FP32 weight: ~250 MB for a 1280 x 32000 lm_head). numpy releases the GIL in both.
    Measured on the 120M int4 decoder (71 weights, 2 cores): 3.4 -> 2.0 s.
    """
    fp_graph = onnx.GraphProto()
    fp_graph.node.extend(f.nodes)
    pending: deque[Future[WeightFinding | str]] = deque()
    names: deque[str] = deque()

    def collect() -> None:
        got, name = pending.popleft().result(), names.popleft()
        if isinstance(got, str):
            unmatched[name] = got
        else:
            findings.append(got)

    with ThreadPoolExecutor(1, thread_name_prefix="diag-weights") as pool:
        for w, name, why in blocked_weights(int8, q.array):
            if w is None:
                unmatched[name] = why
                continue
            pair = fp32_weight_of(fp_graph, w.output)
            ref_arr = f.const(pair[1]) if pair else None
            if pair is None or ref_arr is None:
                unmatched[name] = f"no FP32 MatMul with a constant weight writes '{w.output}'"
                continue
            pending.append(pool.submit(_blocked_finding, w, name, pair[0], pair[1], ref_arr))
            names.append(name)
            if len(pending) > BLOCKED_IN_FLIGHT:
                collect()
        while pending:
            collect()


#: Block-wise weights reduced while the next one is unpacked (see :func:`_blocked_findings`).
BLOCKED_IN_FLIGHT = 1


def _blocked_finding(
    w: BlockedWeight, name: str, node: onnx.NodeProto, fp_name: str, ref_arr: np.ndarray
) -> WeightFinding | str:
    """One block-wise weight against its FP32 weight ``ref_arr``; a string says why they cannot be paired."""
    if w.transposed and ref_arr.ndim == 2:
        ref_arr = ref_arr.T  # blocks along the table's axis 1 (GatherBlockQuantized): rows here
    if ref_arr.size != w.levels.size:
        return f"FP32 weight '{fp_name}' has shape {ref_arr.shape}, the quantized one {w.levels.shape}"
    # float64 a chunk of columns at a time (_BlockedStats, block_errors), not here
    ref: np.ndarray = ref_arr.reshape(w.levels.shape)
    stats = _BlockedStats.of(ref, w)
    channels = [
        ChannelError(
            c,
            sqnr_db(float(stats.signal[c]), float(stats.noise[c])),
            float(stats.peak[c]),
            math.sqrt(float(stats.scaled[c]) / ref.shape[0]),
        )
        for c in range(ref.shape[1])
    ]
    return WeightFinding(
        fp_name=fp_name,
        int8_name=name,
        fp_nodes=[node.name],
        op_type=node.op_type,
        shape=tuple(int(d) for d in (ref.shape[::-1] if w.transposed else ref.shape)),
        dtype=w.dtype,
        axis=1 if w.transposed else 0,
        symmetric=w.symmetric,
        folded=None,
        sqnr_db=sqnr_db(float(stats.signal.sum()), float(stats.noise.sum())),
        max_abs=float(stats.peak.max()) if stats.peak.size else 0.0,
        rmse_over_scale=math.sqrt(float(stats.scaled.sum()) / max(ref.size, 1)),
        cosine=stats.cosine(),
        channels=channels,
        block_size=w.block_size,
        blocks=block_errors(fp_name, ref, w, WORST_BLOCKS, stats.block_figures(ref.size)),
    )


@dataclass(frozen=True)
class _BlockedStats:
    """Per-column sums of one block-wise weight against its FP32 weight, computed a chunk of
    columns at a time (:data:`CHUNK_COLUMNS`)."""

    signal: np.ndarray
    noise: np.ndarray
    peak: np.ndarray
    #: sum over rows of (error / scale)^2
    scaled: np.ndarray
    dot: float
    deq_energy: float
    #: per block of rows (``[blocks, N]``): RMS and largest |error| (:func:`diag.core.nbits.block_figures`)
    block_rmse: np.ndarray
    block_peak: np.ndarray

    @classmethod
    def of(cls, ref: np.ndarray, w: BlockedWeight) -> _BlockedStats:
        n = ref.shape[1]
        signal, noise, peak, scaled = (np.zeros(n) for _ in range(4))
        blocks = (ref.shape[0] + w.block_size - 1) // w.block_size
        block_rmse, block_peak = np.empty((blocks, n)), np.empty((blocks, n))
        dot = deq_energy = 0.0
        for a in range(0, n, CHUNK_COLUMNS):
            b = min(a + CHUNK_COLUMNS, n)
            r = ref[:, a:b].astype(np.float64)
            scale, zero = w.grid(slice(a, b))
            deq = (w.levels[:, a:b].astype(np.float64) - zero) * scale
            e = deq - r
            block_rmse[:, a:b], block_peak[:, a:b] = block_figures(e, w.block_size)
            signal[a:b] = np.einsum("ij,ij->j", r, r)
            noise[a:b] = np.einsum("ij,ij->j", e, e)
            peak[a:b] = np.abs(e).max(axis=0) if e.shape[0] else 0.0
            se = e / np.where(scale > 0, scale, 1.0)
            scaled[a:b] = np.einsum("ij,ij->j", se, se)
            dot += float(np.einsum("ij,ij->", r, deq))
            deq_energy += float(np.einsum("ij,ij->", deq, deq))
        return cls(signal, noise, peak, scaled, dot, deq_energy, block_rmse, block_peak)

    def block_figures(self, size: int) -> tuple[np.ndarray, np.ndarray, float]:
        """What :func:`diag.core.nbits.block_errors` takes as ``figures`` for a weight of ``size`` values:
        block rmse, block peak and the weight's rms (as block_errors computes it)."""
        return self.block_rmse, self.block_peak, math.sqrt(float(self.signal.sum()) / max(size, 1)) or 1.0

    def cosine(self) -> float:
        """Cosine of the whole weight and its dequantized copy (as :func:`_cosine`)."""
        return cosine(self.dot, float(self.signal.sum()), self.deq_energy)


# --- reading the graphs -------------------------------------------------------------------------


class _Unmatched(Exception):
    """A quantized weight whose FP32 counterpart cannot be determined structurally."""


class _Graph:
    """Nodes, producers, consumers and initializers (Constant outputs included) of one graph."""

    def __init__(self, graph: onnx.GraphProto, base_dir: Path | None = None) -> None:
        self.base_dir = base_dir
        self.nodes = list(graph.node)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for n in self.nodes:
            for o in n.output:
                if o:
                    self.producer[o] = n
            for i, name in enumerate(n.input):
                if name:
                    self.consumers[name].append((n, i))
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
        for n in self.nodes:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
                self.inits.setdefault(n.output[0], n.attribute[0].t)
        self._small: dict[str, np.ndarray] = {}

    def array(self, name: str) -> np.ndarray | None:
        """The value of an initializer; scales and zero points are cached, weights are not.

        NOTE: weights are converted on demand and dropped after use, so peak memory is one
        weight (and its float64 reference), not a second copy of the model.
        """
        if name not in self.inits:
            return None
        if name in self._small:
            return self._small[name]
        t = self.inits[name]
        if t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data") and self.base_dir is not None:
            # NOTE: only this tensor's bytes are read (diag.core.load checked the location stays inside
            # the model's folder); the model proto keeps its references, no weight is rewritten.
            info = {e.key: e.value for e in t.external_data}
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
            count = int(np.prod(t.dims, dtype=np.int64))
            path = self.base_dir / info["location"]
            value = np.fromfile(path, dtype=dtype.newbyteorder("<"), count=count, offset=int(info.get("offset", 0)))
            value = value.astype(dtype, copy=False).reshape(tuple(t.dims))
        elif t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data"):
            raise DiagError(
                "missing-external-data",
                f"initializer '{name}'",
                "has its data in an external file that was not loaded",
                "load the model with onnx.load(path) from its own folder so the weights are read",
            )
        else:
            value = numpy_helper.to_array(t)
        if value.size <= _CACHED_ELEMENTS:
            self._small[name] = value
        return value

    def const(self, name: str) -> np.ndarray | None:
        """An initializer or Constant value, None for computed tensors."""
        return self.array(name) if name and name in self.inits else None


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


@dataclass
class _QuantizedWeight:
    """An integer initializer and how the INT8 graph turns it back into real numbers."""

    name: str
    consumer: onnx.NodeProto  # the compute node that reads the weight (float op in QDQ)
    fp_index: int  # index of the weight among the inputs of the equivalent FP32 op
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None
    is_bias: bool = False
    unsupported: str | None = None  # why it cannot be measured (listed as unmatched)
    #: The QuantizeLinear that quantizes this *float* initializer at run time (ModelOpt, AIMET's
    #: ``to_onnx_qdq()``, NNCF on Constant weights, onnxruntime's ``AddQDQPairToWeight``): the
    #: integer weight is what that node computes; None for an integer initializer.
    quantized_by: onnx.NodeProto | None = None

    def integer(self, q: _Graph) -> np.ndarray:
        """The integer weight: the initializer itself, or what ``quantized_by`` makes of the float one
        (round half to even, saturated to the zero point's type, as QuantizeLinear does)."""
        value = q.array(self.name)
        assert value is not None
        if self.quantized_by is None:
            return value
        qn = self.quantized_by
        scale = q.array(qn.input[1])
        zp_name = qn.input[2] if len(qn.input) > 2 else ""
        zp = q.array(zp_name) if zp_name else np.zeros(1, dtype=np.uint8)
        assert scale is not None and zp is not None
        axis = None
        if scale.size > 1:
            axis = int(_attr(qn, "axis", 1))
            axis = axis + value.ndim if axis < 0 else axis
        s, z = _grid(scale, zp, axis, value.ndim)
        info = np.iinfo(zp.dtype)
        rounded = np.rint(value.astype(np.float64) / s) + z
        return np.clip(rounded, info.min, info.max).astype(zp.dtype)


def _quantized_weights(q: _Graph) -> Iterable[_QuantizedWeight]:
    """Every integer initializer the INT8 graph dequantizes, with its grid and compute consumer.

    Only scales and zero points are converted here; the weights themselves are read one at a time
    when they are measured.
    """
    for node in q.nodes:
        op = node.op_type
        inputs = list(node.input) + [""] * 9  # optional inputs read as ""
        # Quark's com.amd.quark Extended(De)QuantizeLinear compute the same affine grid (match.DQ_OPS)
        if op in DQ_OPS and node.input[0] in q.inits:
            yield from _qdq_weight(q, node, node.input[0])
        elif op in DQ_OPS and node.input[0] in q.producer:
            before = q.producer[node.input[0]]
            if before.op_type == "Gather" and before.input[0] in q.inits:
                yield from _qdq_weight(q, node, before.input[0], via=before)
            elif before.op_type in Q_OPS and _float_init(q, before.input[0]):
                # A float weight quantized at run time (ModelOpt, AIMET, NNCF on Constant weights).
                yield from _qdq_weight(q, node, before.input[0], quantized_by=before)
        elif op in _QOP_INPUTS or op in _INTEGER_INPUTS:
            for idx, (s, z, fp_idx) in _weight_inputs(op).items():
                name = inputs[idx]
                if name not in q.inits:
                    continue
                scale = q.array(inputs[s]) if s >= 0 else _dynamic_weight_scale(q, node, name)
                if scale is None:
                    continue
                zp = _zero_point(q, inputs[z], name)
                axis = _output_axis(_FLOAT_OP_OF[op], fp_idx, len(q.inits[name].dims), node) if scale.size > 1 else None
                yield _QuantizedWeight(name, node, fp_idx, scale, zp, axis)
            if op in _QOP_BIAS:
                b_idx, in_s, w_s, fp_idx = _QOP_BIAS[op]
                x_scale, w_scale = q.array(inputs[in_s]), q.array(inputs[w_s])
                if inputs[b_idx] in q.inits and x_scale is not None and w_scale is not None:
                    # onnxruntime quantizes the bias with scale = input scale x weight scale, zero point 0.
                    scale = (x_scale.astype(np.float64) * w_scale.astype(np.float64)).reshape(-1)
                    axis = 0 if scale.size > 1 else None
                    zp = np.zeros(1, dtype=np.int32)
                    yield _QuantizedWeight(inputs[b_idx], node, fp_idx, scale, zp, axis, is_bias=True)


def _weight_inputs(op: str) -> dict[int, tuple[int, int, int]]:
    """Weight input index -> (scale index or -1 when found downstream, zero point index, FP32 index)."""
    if op in _QOP_INPUTS:
        return _QOP_INPUTS[op]
    return {idx: (-1, z, fp_idx) for idx, (z, fp_idx) in _INTEGER_INPUTS[op].items()}


def _zero_point(q: _Graph, zp_name: str, weight: str) -> np.ndarray:
    """The zero point (0 of the weight's type when the input is omitted, as the ONNX spec says)."""
    zp = q.array(zp_name) if zp_name else None
    if zp is not None:
        return zp
    return np.zeros(1, dtype=onnx.helper.tensor_dtype_to_np_dtype(q.inits[weight].data_type))


def _float_init(q: _Graph, name: str) -> bool:
    """Is ``name`` a float initializer (or Constant) of the INT8 graph?"""
    t = q.inits.get(name)
    return t is not None and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def _qdq_weight(
    q: _Graph,
    dq: onnx.NodeProto,
    name: str,
    via: onnx.NodeProto | None = None,
    quantized_by: onnx.NodeProto | None = None,
) -> Iterable[_QuantizedWeight]:
    """A DequantizeLinear of an initializer (or of a Gather over one, or of a QuantizeLinear of a float
    one: ``quantized_by``); the first consumer is the op."""
    scale = q.array(dq.input[1])
    if scale is None:
        return
    zp_name = dq.input[2] if len(dq.input) > 2 else ""
    if quantized_by is not None:
        # The float initializer has no integer type: the zero point is the grid's (uint8 when omitted).
        zp = q.array(zp_name) if zp_name else np.zeros(1, dtype=np.uint8)
        assert zp is not None
    else:
        zp = _zero_point(q, zp_name, name)
    if dq.op_type != "DequantizeLinear" and zp.dtype.name in ("bfloat16", "float16", "float32"):
        return  # Quark's BF16 Extended Q/DQ: a float "grid", not a quantized weight to compare
    ndim = len(q.inits[name].dims)
    if _attr(dq, "block_size", 0):
        return  # block-wise weights: see _blocked_findings
    axis = None
    if scale.size > 1:
        axis = int(_attr(dq, "axis", 1))
        axis = axis + ndim if axis < 0 else axis
    if via is not None:  # Gather of a quantized table: the table is the FP32 Gather's input 0
        yield _QuantizedWeight(name, via, 0, scale, zp, axis)
        return
    consumers = q.consumers.get(dq.output[0], [])
    if not consumers:
        return
    node, idx = consumers[0]
    is_bias = q.inits[name].data_type == onnx.TensorProto.INT32  # onnxruntime quantizes only biases to int32
    if quantized_by is not None:
        is_bias = zp.dtype == np.int32
    yield _QuantizedWeight(name, node, idx, scale, zp, axis, is_bias=is_bias, quantized_by=quantized_by)


def _dynamic_weight_scale(q: _Graph, node: onnx.NodeProto, weight: str) -> np.ndarray | None:
    """The weight scale of a dynamic integer op, read where its output is rescaled.

    onnxruntime writes ``Mul(Cast(out), Mul(input_scale, weight_scale))``; the weight scale is the
    constant operand of the inner Mul. Falls back to the ``<w>_scale`` initializer it also writes.
    """
    for cast, _ in q.consumers.get(node.output[0], []):
        if cast.op_type != "Cast":
            continue
        for mul, i in q.consumers.get(cast.output[0], []):
            if mul.op_type != "Mul":
                continue
            scales = q.producer.get(mul.input[1 - i])
            if scales is not None and scales.op_type == "Mul":
                consts = [q.const(x) for x in scales.input]
                found = [c for c in consts if c is not None]
                if len(found) == 1:
                    return found[0]
            direct = q.const(mul.input[1 - i])
            if direct is not None:
                return direct
    base = weight.removesuffix("_quantized")
    return q.const(f"{base}_scale") if base != weight else None


def _output_axis(fp_op: str, fp_idx: int, ndim: int, node: onnx.NodeProto | None) -> int | None:
    """The axis of a weight that indexes the op's output channels (None when it has none)."""
    if ndim < 2:
        return None
    if fp_op == "Conv":
        return 0
    if fp_op == "ConvTranspose":
        return 1
    if fp_op in ("MatMul", "MatMulInteger", "DynamicQuantizeMatMul"):
        return ndim - 1 if fp_idx == 1 else None
    if fp_op in ("Gemm", "QGemm"):
        if fp_idx != 1 or node is None:
            return None
        return 0 if _attr(node, "transB", 0) else 1
    return None


# --- pairing with the FP32 weight ---------------------------------------------------------------


def _finding(qw: _QuantizedWeight, f: _Graph, q: _Graph) -> WeightFinding:
    if qw.unsupported:
        raise _Unmatched(f"{qw.unsupported} is not supported")
    qarr = qw.integer(q)
    fp_op = _FLOAT_OP_OF.get(qw.consumer.op_type, qw.consumer.op_type)
    base = qw.name.removesuffix("_quantized")
    # A float weight quantized at run time keeps its FP32 name (ModelOpt, AIMET, NNCF).
    direct = f.const(base) if base != qw.name or qw.quantized_by is not None else None
    if direct is not None and direct.shape == qarr.shape:
        fp_node = f.consumers[base][0][0] if f.consumers.get(base) else None
        op_type = fp_node.op_type if fp_node is not None else fp_op
        ref = _Reference(
            value=direct.astype(np.float64),
            fp_name=base,
            fp_nodes=[n.name for n, _ in f.consumers.get(base, [])],
            op_type=op_type,
            folded=None,
            out_axis=None if qw.is_bias else _output_axis(op_type, qw.fp_index, qarr.ndim, fp_node),
        )
    else:
        ref = _folded_reference(qw, f, q, qarr.shape)
    smoothing = _smoothing_of(qw, f, q, qarr.shape)
    if smoothing is not None:
        ref = _smoothed(ref, *smoothing)
    deq = _dequantize(qarr, qw.scale, qw.zero_point, qw.axis)
    # NOTE: only weights of ops with output channels (Conv, MatMul, Gemm) get a channel list. A
    # (C, 1, 1) operand of Mul/Add is a 1-d weight in disguise: one value per "channel" gives an
    # SQNR of 0 dB whenever that value rounds to zero, which is noise, not a finding.
    return _measure(ref, qw, qarr, deq)


def _smoothing_of(qw: _QuantizedWeight, f: _Graph, q: _Graph, shape: tuple[int, ...]) -> tuple[str, np.ndarray] | None:
    """The SmoothQuant Mul before a MatMul's activation (NNCF's ``nncf_smooth_quant``), and its factors.

    SmoothQuant multiplies an activation by ``v`` per channel (a Mul the FP32 model does not
    have) and the next weight's input rows by ``1 / v``, so the function is unchanged but the
    quantized weight is ``W / v``, not ``W``. Found from the graph, not the name: a Mul between
    an FP32 tensor and a constant vector as long as the weight's input axis, whose output exists
    only in the INT8 model, reached from the consumer's activation input through Q/DQ.
    """
    if qw.is_bias or qw.fp_index != 1 or len(shape) != 2 or qw.consumer.op_type not in ("MatMul", "MatMulInteger"):
        return None
    x = qw.consumer.input[0]
    for _ in range(3):  # DequantizeLinear <- QuantizeLinear <- the Mul
        node = q.producer.get(x)
        if node is None:
            return None
        if node.op_type == "Mul":
            break
        if node.op_type not in Q_OPS | DQ_OPS | {"DynamicQuantizeLinear"}:
            return None
        x = node.input[0]
    else:
        return None
    if node.output[0] in f.producer or node.output[0] in f.inits:
        return None  # the FP32 model computes it: a Mul of the model, not an inserted one
    data = [i for i in node.input if q.const(i) is None]
    consts = [q.const(i) for i in node.input if q.const(i) is not None]
    if len(data) != 1 or len(consts) != 1 or (data[0] not in f.producer and data[0] not in f.consumers):
        return None
    v = np.asarray(consts[0], np.float64).reshape(-1)
    if v.size != shape[0] or not np.all(np.isfinite(v)) or np.any(v == 0):
        return None
    return node.name, v


def _smoothed(ref: _Reference, mul: str, v: np.ndarray) -> _Reference:
    """The FP32 weight as SmoothQuant rescaled it before quantizing: its input rows divided by ``v``."""
    note = f"SmoothQuant's {mul} (input rows divided by its factors)"
    return dataclasses.replace(
        ref, value=ref.value / v[:, None], folded=f"{ref.folded}, {note}" if ref.folded else note
    )


@dataclass
class _Reference:
    """The FP32 side of a quantized weight: its float value and where it comes from."""

    #: the FP32 value (float64), in the INT8 weight's orientation
    value: np.ndarray
    #: its FP32 name (``"<w> folded with <bn>"`` for a folded weight)
    fp_name: str
    fp_nodes: list[str]
    #: the FP32 op that reads it
    op_type: str
    #: the FP32 nodes folded into it, comma-separated (None: read as is)
    folded: str | None
    #: its output-channel axis in that orientation (None: no channel list)
    out_axis: int | None


def _folded_reference(qw: _QuantizedWeight, f: _Graph, q: _Graph, shape: tuple[int, ...]) -> _Reference:
    """Rebuild the FP32 value of a weight the optimizer folded (Conv+BN, Conv+Mul, Conv+Add).

    The INT8 consumer's result is followed to the FP32 tensor it computes; the FP32 nodes that
    produced that tensor are walked back to a compute node of the same kind with an initializer
    weight, and the fold is replayed forward in float64. Also covers a ``Gemm(transB=1)`` that
    dynamic quantization turns into ``MatMulInteger`` over a transposed copy of the weight
    (``<w>_Transposed_quantized``). Returns the reference in the INT8 weight's orientation and
    the output-channel axis in that orientation.
    """
    fp_op = _FLOAT_OP_OF.get(qw.consumer.op_type, qw.consumer.op_type)
    compute, chain = _fold_chain(qw, f, q, fp_op)
    w_name = compute.input[1] if len(compute.input) > 1 else ""
    b_name = compute.input[2] if len(compute.input) > 2 else ""
    folds = _replay_folds(compute, chain, f)
    out_axis: int | None = folds.out_axis
    if qw.fp_index == 1:
        ref, src, names = folds.weight, w_name, folds.w_folds
        if compute.op_type == "Gemm" and _attr(compute, "transB", 0) and fp_op != "Gemm":
            ref, src, out_axis = ref.T, f"{w_name} transposed", 1  # MatMul(Integer) reads W^T
    elif qw.fp_index == 2:
        ref, src, names = folds.bias, b_name or f"bias of {compute.name}", folds.b_folds
    else:
        raise _Unmatched(f"input {qw.fp_index} of {compute.op_type} '{compute.name}' is not a weight or bias")
    if ref.shape != tuple(shape):
        raise _Unmatched(f"FP32 value of '{src}' has shape {ref.shape}, INT8 weight has {tuple(shape)}")
    name = f"{src} folded with {', '.join(names)}" if names else src
    return _Reference(
        ref, name, folds.fp_nodes, compute.op_type, ", ".join(names) or None, out_axis if qw.fp_index == 1 else None
    )


def _fold_chain(qw: _QuantizedWeight, f: _Graph, q: _Graph, fp_op: str) -> tuple[onnx.NodeProto, list[onnx.NodeProto]]:
    """The FP32 compute node the INT8 weight stands for, and the foldable nodes after it, in order.

    Walks back from the FP32 tensor the INT8 consumer computes through single-input foldable
    ops (BatchNormalization, Mul, Add, fused activations); raises _Unmatched when it meets
    anything else first.
    """
    target = _fp_tensor_of(qw.consumer, f, q)
    if target is None:
        raise _Unmatched(
            f"no FP32 initializer '{qw.name.removesuffix('_quantized')}' and the output of "
            f"{qw.consumer.op_type} '{qw.consumer.name}' has no FP32 counterpart"
        )
    chain: list[onnx.NodeProto] = []
    node = f.producer.get(target)
    family = _CONV_OPS if fp_op in _CONV_OPS else _MATMUL_OPS if fp_op in _MATMUL_OPS else {fp_op}
    while node is not None and node.op_type not in family:
        if node.op_type not in _FOLDABLE | _FUSED_ACTIVATIONS or len(chain) > 8:
            node = None
            break
        chain.append(node)
        data_in = [x for x in node.input if x and f.const(x) is None]
        if len(data_in) != 1:
            node = None
            break
        node = f.producer.get(data_in[0])
    if node is None:
        raise _Unmatched(
            f"FP32 tensor '{target}' (computed by INT8 {qw.consumer.op_type} '{qw.consumer.name}') is not "
            f"a {fp_op} followed by foldable ops"
        )
    chain.reverse()
    return node, chain


@dataclass
class _Folds:
    """A compute node's weight and bias with the chain after it folded in (float64)."""

    weight: np.ndarray
    bias: np.ndarray
    #: nodes folded into the weight / into the bias
    w_folds: list[str]
    b_folds: list[str]
    fp_nodes: list[str]
    out_axis: int


def _replay_folds(compute: onnx.NodeProto, chain: list[onnx.NodeProto], f: _Graph) -> _Folds:
    """Fold ``chain`` into ``compute``'s weight and bias as the optimizer did, per output channel."""
    w_name = compute.input[1] if len(compute.input) > 1 else ""
    w = f.const(w_name)
    if w is None:
        raise _Unmatched(f"FP32 {compute.op_type} '{compute.name}' has no initializer weight")
    b_name = compute.input[2] if len(compute.input) > 2 else ""
    b0 = f.const(b_name)
    out_axis = _output_axis(compute.op_type, 1, w.ndim, compute)
    if out_axis is None:
        raise _Unmatched(f"FP32 {compute.op_type} '{compute.name}' has no output-channel axis to fold along")
    channels = w.shape[out_axis]
    weight = w.astype(np.float64)
    bias = np.zeros(channels) if b0 is None else b0.astype(np.float64).reshape(channels)
    w_folds: list[str] = []
    b_folds: list[str] = []
    fp_nodes = [compute.name]
    for n in chain:
        if n.op_type in _FUSED_ACTIVATIONS:  # fused into the output range, not into the weight
            continue
        fp_nodes.append(n.name)
        per_channel = _per_channel_operand(n, f, channels, compute.op_type)
        if n.op_type == "BatchNormalization":
            gamma, beta, mean, var = per_channel
            factor = gamma / np.sqrt(var + float(_attr(n, "epsilon", 1e-5)))
            weight = weight * _along(factor, out_axis, weight.ndim)
            bias = (bias - mean) * factor + beta
            w_folds.append(n.name)
        elif n.op_type in ("Mul", "Div"):
            (c,) = per_channel
            factor = c if n.op_type == "Mul" else 1.0 / c
            weight = weight * _along(factor, out_axis, weight.ndim)
            bias = bias * factor
            w_folds.append(n.name)
        else:  # Add / Sub: only the bias moves
            (c,) = per_channel
            bias = bias + c if n.op_type == "Add" else bias - c
        b_folds.append(n.name)
    return _Folds(weight, bias, w_folds, b_folds, fp_nodes, out_axis)


def _per_channel_operand(n: onnx.NodeProto, f: _Graph, channels: int, compute_op: str) -> list[np.ndarray]:
    """The constant operands of a foldable node as per-output-channel float64 vectors.

    Raises _Unmatched when an operand does not broadcast per output channel (then the optimizer
    could not have folded it either): Conv outputs are NCHW, so a per-channel operand is shaped
    ``(C, 1, 1)``; MatMul/Gemm outputs have their channels last.
    """
    if n.op_type == "BatchNormalization":
        raw = [f.const(x) for x in n.input[1:5]]
    else:
        if f.const(n.input[0]) is not None and n.op_type in ("Sub", "Div"):
            raise _Unmatched(f"{n.op_type} '{n.name}' has its constant first: not foldable into a weight")
        raw = [c for c in (f.const(x) for x in n.input) if c is not None]
    out: list[np.ndarray] = []
    for c in raw:
        if c is None:
            raise _Unmatched(f"{n.op_type} '{n.name}' has a non-constant parameter")
        c = c.astype(np.float64)
        if c.size == 1:
            out.append(np.full(channels, float(c.reshape(-1)[0])))
            continue
        if n.op_type != "BatchNormalization":
            want_from_right = 3 if compute_op in ("Conv", "ConvTranspose") else 1
            big = [c.ndim - i for i, d in enumerate(c.shape) if d > 1]  # position counted from the right
            if c.size != channels or big != [want_from_right]:
                raise _Unmatched(f"{n.op_type} '{n.name}' has an operand of shape {c.shape} that is not per-channel")
        elif c.size != channels:
            raise _Unmatched(f"BatchNormalization '{n.name}' has {c.size} parameters for {channels} channels")
        out.append(c.reshape(-1))
    return out


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = v.size
    return v.reshape(shape)


def _fp_tensor_of(node: onnx.NodeProto, f: _Graph, q: _Graph) -> str | None:
    """The FP32 tensor an INT8 compute node's result stands for, following Q/DQ, Cast and rescale ops."""
    frontier = [o for o in node.output if o]
    for _ in range(6):
        nxt: list[str] = []
        for t in frontier:
            if t in f.producer:
                return t
            base = t.removesuffix("_quantized")
            if base != t and base in f.producer:
                return base
            consumers = q.consumers.get(t, [])
            if len(consumers) == 1 and consumers[0][0].op_type in _INT8_TAIL:
                nxt.extend(o for o in consumers[0][0].output[:1] if o)
        frontier = nxt
    return None


# --- metrics ------------------------------------------------------------------------------------


def _dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int | None) -> np.ndarray:
    s, z = _grid(scale, zp, axis, q.ndim)
    return (q.astype(np.float64) - z) * s


def _grid(
    scale: np.ndarray, zp: np.ndarray, axis: int | None, ndim: int
) -> tuple[np.ndarray | np.float64, np.ndarray | np.float64]:
    """Scale and zero point broadcastable against the weight (scalars for a per-tensor grid)."""
    s = scale.astype(np.float64)
    z = zp.astype(np.float64)
    if axis is not None and s.size > 1:
        return _along(s.reshape(-1), axis, ndim), _along(z.reshape(-1), axis, ndim) if z.size > 1 else z.reshape(-1)[0]
    return np.float64(s.reshape(-1)[0]), np.float64(z.reshape(-1)[0]) if z.size else np.float64(0)


def _sqnr(x: np.ndarray, e: np.ndarray) -> float:
    return sqnr_db(float(np.sum(x * x)), float(np.sum(e * e)))


def _cosine(x: np.ndarray, y: np.ndarray) -> float:
    return cosine(float(np.sum(x * y)), float(np.sum(x * x)), float(np.sum(y * y)))


def _rmse_over_scale(e: np.ndarray, scale: np.ndarray | np.float64) -> float | None:
    s = np.broadcast_to(scale, e.shape)
    ok = s > 0
    if not ok.any():
        return None
    return math.sqrt(float(np.mean((e[ok] / s[ok]) ** 2)))


def _is_symmetric(zp: np.ndarray, dtype: np.dtype) -> bool:
    if str(dtype) in ("int4", "uint4"):  # ml_dtypes' 4-bit types (QuantType.QInt4 / QUInt4): no np.iinfo
        middle = 0 if str(dtype) == "int4" else 8
        return bool(np.all(zp.astype(np.int64) == middle))
    if not np.issubdtype(dtype, np.integer):  # float8 weights: symmetric means a zero point of 0
        return bool(np.all(zp.astype(np.float32) == 0))
    middle = 0 if np.issubdtype(dtype, np.signedinteger) else (int(np.iinfo(dtype).max) + 1) // 2
    return bool(np.all(zp.astype(np.int64) == middle))


def _measure(ref: _Reference, qw: _QuantizedWeight, qarr: np.ndarray, deq: np.ndarray) -> WeightFinding:
    """The weight's error against its FP32 reference: whole-tensor numbers and one row per output channel."""
    out_axis = ref.out_axis
    e = deq - ref.value
    s, _ = _grid(qw.scale, qw.zero_point, qw.axis, qarr.ndim)
    channels: list[ChannelError] = []
    if out_axis is not None and qarr.ndim >= 2:
        xs = np.moveaxis(ref.value, out_axis, 0).reshape(qarr.shape[out_axis], -1)
        es = np.moveaxis(e, out_axis, 0).reshape(qarr.shape[out_axis], -1)
        ss = np.moveaxis(np.broadcast_to(s, e.shape), out_axis, 0).reshape(qarr.shape[out_axis], -1)
        # One vectorised pass over all channels (a loop per channel cost ~0.5 s on a real conv net).
        signal = np.einsum("ij,ij->i", xs, xs, dtype=np.float64)
        noise = np.einsum("ij,ij->i", es, es, dtype=np.float64)
        peak = np.abs(es).max(axis=1) if es.shape[1] else np.zeros(es.shape[0])
        ok = ss > 0
        scaled = np.where(ok, es / np.where(ok, ss, 1.0), 0.0)
        n_ok = ok.sum(axis=1)
        r2 = np.einsum("ij,ij->i", scaled, scaled, dtype=np.float64)
        for c in range(xs.shape[0]):
            ros_c = math.sqrt(float(r2[c]) / int(n_ok[c])) if n_ok[c] else None
            channels.append(ChannelError(c, sqnr_db(float(signal[c]), float(noise[c])), float(peak[c]), ros_c))
    ros = _rmse_over_scale(e, s)
    return WeightFinding(
        fp_name=ref.fp_name,
        int8_name=qw.name,
        fp_nodes=ref.fp_nodes,
        op_type=ref.op_type,
        shape=tuple(int(d) for d in qarr.shape),
        dtype=str(qarr.dtype),
        axis=qw.axis,
        symmetric=_is_symmetric(qw.zero_point, qarr.dtype),
        folded=ref.folded,
        sqnr_db=_sqnr(ref.value, e),
        max_abs=float(np.max(np.abs(e))) if e.size else 0.0,
        rmse_over_scale=math.nan if ros is None else ros,
        cosine=_cosine(ref.value, deq),
        channels=channels,
        is_bias=qw.is_bias,
    )
