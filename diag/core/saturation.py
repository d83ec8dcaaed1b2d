"""What an INT8 model's u8s8 nodes do on an AVX2 CPU without VNNI, predicted on any CPU.

onnxruntime multiplies unsigned 8-bit activations by signed 8-bit weights (``QInt8``) with MLAS's
u8s8 kernels. With VNNI (``vpdpbusd``) every product is summed exactly in int32. With AVX2 only the
kernel packs four consecutive k of a row of A and of a column of B into one 32-bit lane and runs
``vpmaddubsw``: the two products of each *adjacent* k pair (k = 2j, 2j+1, counted from 0 after
zero-padding K) are added into a *saturating* int16; ``vpmaddwd`` with ones then sums two int16 into
int32 exactly. So the AVX2 result is ``sum_j sat16(a[2j]*b[2j] + a[2j+1]*b[2j+1])`` on the *raw* u8 A
and s8 B; the zero points are corrected separately with row/column sums (exact), so the saturation
error is the same whatever the zero points are.

This module replays that arithmetic in numpy on the captured u8 input of each such node (rows
sampled, batches streamed) so a user on a VNNI laptop learns which nodes saturate on their AVX2
server, and by how much the node's output SQNR drops there.

Core layer: runs onnxruntime (the INT8 model with the nodes' u8 inputs exposed) and numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from diag.core.metrics import sqnr_db
from diag.foundations.environment import session_options
from diag.foundations.ortfacts import QUANTIZED_OPS

#: Per node, at most this many rows of A (GEMM rows: tokens, output pixels) are simulated in total.
MAX_ROWS = 4096
#: Rows simulated at once (the pairwise products are rows x K/2 x N int32 values).
_CHUNK_ELEMENTS = 1 << 22

#: The u8s8 ops simulated here (DynamicQuantizeMatMul's A is float: quantized here like DynamicQuantizeLinear).
_SIMULATED = ("MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul")
#: op -> (index of the u8 activation, its zero point, the s8 weight, its zero point); -1: none.
_OPS: dict[str, tuple[int, int, int, int]] = {
    op: (a.index, -1 if a.zero_point is None else a.zero_point, w.index, -1 if w.zero_point is None else w.zero_point)
    for op in _SIMULATED
    for a, w in [(QUANTIZED_OPS[op].operand(0), QUANTIZED_OPS[op].operand(1))]
}


def u8s8_exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in int64: what VNNI (and every exact kernel) computes on raw u8 ``a`` [M,K], s8 ``b`` [K,N]."""
    return a.astype(np.int64) @ b.astype(np.int64)


def u8s8_avx2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The AVX2-without-VNNI u8s8 product of raw u8 ``a`` [M,K] and s8 ``b`` [K,N] (int64 [M,N]).

    Adjacent k pairs (2j, 2j+1) are summed into a saturating int16 (``vpmaddubsw``), the int16 sums
    are added exactly (``vpmaddwd`` with ones, then int32 adds). An odd K is zero-padded, as MLAS does.

    Example:
        >>> a = np.array([[255, 255]], np.uint8); b = np.array([[127], [127]], np.int8)
        >>> int(u8s8_avx2(a, b)[0, 0]), int(u8s8_exact(a, b)[0, 0])
        (32767, 64770)
    """
    return _avx2(a, b)[0]


def _avx2(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int, int]:
    """:func:`u8s8_avx2` plus how many int16 pair sums saturated, of how many."""
    m, k = a.shape
    n = b.shape[1]
    if k % 2:
        a = np.concatenate([a, np.zeros((m, 1), a.dtype)], axis=1)
        b = np.concatenate([b, np.zeros((1, n), b.dtype)], axis=0)
        k += 1
    bp = b.astype(np.int32).reshape(k // 2, 2, n)
    out = np.empty((m, n), np.int64)
    saturated = 0
    rows = max(1, _CHUNK_ELEMENTS // max(1, (k // 2) * n))
    for s in range(0, m, rows):
        ap = a[s : s + rows].astype(np.int32).reshape(-1, k // 2, 2)
        pairs = ap[:, :, 0, None] * bp[None, :, 0, :] + ap[:, :, 1, None] * bp[None, :, 1, :]
        saturated += int(np.count_nonzero((pairs > 32767) | (pairs < -32768)))
        np.clip(pairs, -32768, 32767, out=pairs)
        out[s : s + rows] = pairs.sum(axis=1, dtype=np.int64)
    return out, saturated, m * (k // 2) * n


def dynamic_quantize_u8(x: np.ndarray) -> tuple[np.ndarray, float, int]:
    """onnxruntime's DynamicQuantizeLinear: u8 values, scale and zero point of a float tensor."""
    lo = min(0.0, float(x.min())) if x.size else 0.0
    hi = max(0.0, float(x.max())) if x.size else 0.0
    scale = (hi - lo) / 255.0 or 1.0
    zp = int(np.clip(np.rint(-lo / scale), 0, 255))
    q = np.clip(np.rint(x / np.float32(scale)) + zp, 0, 255).astype(np.uint8)
    return q, scale, zp


def _im2col(x: np.ndarray, w_shape: tuple[int, ...], attrs: dict[str, Any], nhwc: bool) -> np.ndarray:
    """Rows of a 2-D convolution's GEMM: [N*OH*OW, C*KH*KW] with ``x`` zero-point padded by the caller.

    ``nhwc``: k ordered (kh, kw, c) as QLinearConv's NHWC kernels pack it; else (c, kh, kw) as
    ConvInteger's NCHW im2col does. The order decides which k are adjacent, hence which pairs saturate.
    """
    n, c, h, w = x.shape
    kh, kw = w_shape[2], w_shape[3]
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    oh = (h - dh * (kh - 1) - 1) // sh + 1
    ow = (w - dw * (kw - 1) - 1) // sw + 1
    cols = np.empty((n, oh, ow, c, kh, kw), x.dtype)
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, i * dh : i * dh + sh * (oh - 1) + 1 : sh, j * dw : j * dw + sw * (ow - 1) + 1 : sw]
            cols[:, :, :, :, i, j] = patch.transpose(0, 2, 3, 1)
    if nhwc:
        cols = cols.transpose(0, 1, 2, 4, 5, 3)
    return cols.reshape(n * oh * ow, -1)


def _conv_weight(w: np.ndarray, nhwc: bool) -> np.ndarray:
    """The conv weight [M, C, KH, KW] as the GEMM's B [K, M], k in the same order as :func:`_im2col`."""
    return (w.transpose(2, 3, 1, 0) if nhwc else w.transpose(1, 2, 3, 0)).reshape(-1, w.shape[0])


@dataclass
class NodePrediction:
    """One u8s8 node on AVX2 without VNNI: how often its int16 pairs saturate and its output error."""

    node: str
    op_type: str
    rows: int = 0
    saturated_pairs: int = 0
    pairs: int = 0
    signal: float = 0.0  # sum of the exact integer output squared (zero points applied)
    error: float = 0.0  # sum of (AVX2 - exact) squared
    note: str = ""
    #: the node's output SQNR as measured (exact kernels), filled in by the caller when known.
    measured_sqnr_db: float | None = None

    @property
    def saturation_sqnr_db(self) -> float:
        """SQNR of the AVX2 output against the exact integer output (inf: no saturation)."""
        return sqnr_db(self.signal, self.error)

    def predicted_sqnr_db(self) -> float | None:
        """The node's output SQNR on AVX2: the measured error and the saturation error add (independent)."""
        if self.measured_sqnr_db is None:
            return None
        if self.error == 0:
            return self.measured_sqnr_db
        noise = 10 ** (-self.measured_sqnr_db / 10) + 10 ** (-self.saturation_sqnr_db / 10)
        return -10 * math.log10(noise)

    def sentence(self, label: str | None = None) -> str:
        """``on AVX2 without VNNI this node's output SQNR drops from X to Y dB (...)``.

        ``label``: the FP32 node the INT8 node was made from, named first when known.
        """
        share = f"{self.saturated_pairs / self.pairs:.2%}" if self.pairs else "0%"
        y = self.predicted_sqnr_db()
        if self.note:
            return f"{label or self.node}: {self.note}"
        if y is None or self.measured_sqnr_db is None:
            drop = f"AVX2 output vs exact integer output {_db(self.saturation_sqnr_db)} dB"
        elif self.error == 0:
            drop = f"output SQNR stays {_db(self.measured_sqnr_db)} dB"
        else:
            drop = f"output SQNR drops from {_db(self.measured_sqnr_db)} to {_db(y)} dB"
        who = f"{label} ({self.node})" if label and label != self.node else self.node
        return f"{who}: on AVX2 without VNNI this node's {drop} ({share} of int16 pairs saturate)"

    def to_dict(self) -> dict[str, Any]:
        """diag.json ``deploy_isa.nodes`` entry (non-finite numbers as strings)."""
        return {
            "node": self.node,
            "op_type": self.op_type,
            "rows": self.rows,
            "saturated_pairs": self.saturated_pairs,
            "pairs": self.pairs,
            "saturation_sqnr_db": _json_db(self.saturation_sqnr_db),
            "measured_sqnr_db": _json_db(self.measured_sqnr_db),
            "predicted_sqnr_db": _json_db(self.predicted_sqnr_db()),
            "note": self.note,
        }


def _db(v: float) -> str:
    return "inf" if v == math.inf else "-inf" if v == -math.inf else f"{v:.1f}"


def _json_db(v: float | None) -> float | str | None:
    if v is None:
        return None
    return _db(v) if not math.isfinite(v) else round(v, 2)


@dataclass
class _Target:
    node: onnx.NodeProto
    a_name: str
    a_zp: int
    b: np.ndarray  # raw s8 weight as stored (MatMul: [K,N]; conv: [M,C,KH,KW])
    b_zp: np.ndarray
    pred: NodePrediction
    attrs: dict[str, Any] = field(default_factory=dict)
    a_zp_name: str = ""  # the A zero point's tensor when it is computed at run time
    #: a float Conv / MatMul of a QDQ model reading DequantizeLinear(u8) and DequantizeLinear(s8
    #: weight): onnxruntime fuses it into QLinearConv / QLinearMatMul at its default level
    qdq: bool = False

    @property
    def conv(self) -> bool:
        return self.node.op_type in ("ConvInteger", "QLinearConv", "Conv")


def u8s8_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes whose s8 weight initializer onnxruntime multiplies with u8s8 kernels."""
    inits = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in _OPS and len(n.input) > _OPS[n.op_type][2] and n.input[_OPS[n.op_type][2]] in inits
    ]


def _qdq_targets(model: onnx.ModelProto, inits: dict[str, np.ndarray]) -> list[_Target]:
    """Float Conv / MatMul nodes of a QDQ model whose input is DequantizeLinear of a u8 tensor and
    whose weight is DequantizeLinear of an s8 initializer: the u8s8 kernels onnxruntime fuses them into."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found: list[_Target] = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "MatMul") or len(node.input) < 2:
            continue
        a_dq, b_dq = producer.get(node.input[0]), producer.get(node.input[1])
        if a_dq is None or b_dq is None or a_dq.op_type != "DequantizeLinear" or b_dq.op_type != "DequantizeLinear":
            continue
        b = inits.get(b_dq.input[0])
        a_zp = inits.get(a_dq.input[2]) if len(a_dq.input) > 2 and a_dq.input[2] else None
        if b is None or b.dtype != np.int8 or a_zp is None or a_zp.dtype != np.uint8 or a_zp.size != 1:
            continue
        b_zp = inits.get(b_dq.input[2]) if len(b_dq.input) > 2 and b_dq.input[2] else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pred = NodePrediction(node.name or node.output[0], f"{node.op_type} (QDQ)")
        if node.op_type == "Conv" and (b.ndim != 4 or int(attrs.get("group", 1)) != 1):
            pred.note = "not simulated: only 2-D convolutions with group=1"
        elif node.op_type == "MatMul" and b.ndim != 2:
            pred.note = "not simulated: the weight is not a 2-D matrix"
        zp = np.zeros(1, np.int64) if b_zp is None else b_zp.astype(np.int64).reshape(-1)
        found.append(_Target(node, a_dq.input[0], int(a_zp.reshape(-1)[0]), b, zp, pred, attrs, qdq=True))
    return found


def _targets(model: onnx.ModelProto) -> list[_Target]:
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found: list[_Target] = _qdq_targets(model, inits)
    for node in model.graph.node:
        spec = _OPS.get(node.op_type)
        if spec is None:
            continue
        ia, iza, ib, izb = spec
        b = inits.get(node.input[ib]) if len(node.input) > ib else None
        if b is None or b.dtype != np.int8:
            continue
        a_zp_arr = inits.get(node.input[iza]) if iza >= 0 and len(node.input) > iza and node.input[iza] else None
        if a_zp_arr is not None and a_zp_arr.dtype != np.uint8:
            continue  # s8 activations: u8s8 kernels do not run
        # a zero point computed at run time (DynamicQuantizeLinear's) is captured with A
        has_zp = iza >= 0 and len(node.input) > iza and bool(node.input[iza])
        zp_name = node.input[iza] if has_zp and a_zp_arr is None else ""
        b_zp = inits.get(node.input[izb]) if len(node.input) > izb and node.input[izb] else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pred = NodePrediction(node.name or node.output[0], node.op_type)
        conv = node.op_type in ("ConvInteger", "QLinearConv")
        if conv and (b.ndim != 4 or int(attrs.get("group", 1)) != 1):
            pred.note = "not simulated: only 2-D convolutions with group=1"
        elif not conv and b.ndim != 2:
            pred.note = "not simulated: the weight is not a 2-D matrix"
        zp = np.zeros(1, np.int64) if b_zp is None else b_zp.astype(np.int64).reshape(-1)
        found.append(
            _Target(
                node,
                node.input[ia],
                int(a_zp_arr.reshape(-1)[0]) if a_zp_arr is not None else 0,
                b,
                zp,
                pred,
                attrs,
                zp_name,
            )
        )
    return found


def _gemm_operands(t: _Target, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """(A rows u8 [M,K], B s8 [K,N], A zero point, B zero point per column) of one node's run."""
    a_zp = t.a_zp
    if t.node.op_type == "DynamicQuantizeMatMul":
        a, _, a_zp = dynamic_quantize_u8(a)
    if t.conv:
        # a QDQ Conv runs as the QLinearConv onnxruntime fuses it into (NHWC kernels, like a written one)
        nhwc = t.node.op_type == "QLinearConv" or t.qdq
        pads = list(t.attrs.get("pads", [0, 0, 0, 0]))
        if t.attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise ValueError("auto_pad")
        a = np.pad(a, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])), constant_values=a_zp)
        return _im2col(a, t.b.shape, t.attrs, nhwc), _conv_weight(t.b, nhwc), a_zp, t.b_zp
    return a.reshape(-1, a.shape[-1]), t.b, a_zp, t.b_zp


def _accumulate(t: _Target, a_rows: np.ndarray, b: np.ndarray, a_zp: int, b_zp: np.ndarray) -> None:
    p = t.pred
    left = MAX_ROWS - p.rows
    if left <= 0:
        return
    if a_rows.shape[0] > left:  # evenly spaced rows, so a long sequence is sampled along its length
        a_rows = a_rows[np.linspace(0, a_rows.shape[0] - 1, left).astype(np.int64)]
    exact = u8s8_exact(a_rows, b)
    avx2, saturated, pairs = _avx2(a_rows, b)
    # the node's integer output (A - za)(B - zb): the zero-point terms are exact on both CPUs
    zb = np.broadcast_to(b_zp, (b.shape[1],))
    y = (a_rows.astype(np.int64) - a_zp) @ (b.astype(np.int64) - zb[None, :])
    p.signal += float(np.square(y.astype(np.float64)).sum())
    p.error += float(np.square((avx2 - exact).astype(np.float64)).sum())
    p.saturated_pairs += saturated
    p.pairs += pairs
    p.rows += int(a_rows.shape[0])


def predict_avx2(model_path: str, feeds: Iterable[dict[str, np.ndarray]]) -> list[NodePrediction]:
    """Per u8s8 node of the INT8 model: its predicted AVX2-without-VNNI saturation (streamed over ``feeds``).

    Example:
        >>> [p.sentence() for p in predict_avx2("int8.onnx", [feed])][:1]  # doctest: +SKIP
        ["fc1/MatMul_quant: on AVX2 without VNNI this node's AVX2 output vs exact integer output 21.3 dB ..."]
    """
    import onnxruntime as ort

    model = onnx.load(model_path)
    targets = _targets(model)
    live = [t for t in targets if not t.pred.note]
    if not live:
        return [t.pred for t in targets]
    have = {o.name for o in model.graph.output}
    for name in dict.fromkeys([t.a_name for t in live] + [t.a_zp_name for t in live if t.a_zp_name]):
        if name not in have:
            model.graph.output.append(helper.make_empty_tensor_value_info(name))
    so = session_options()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = list(dict.fromkeys([t.a_name for t in live] + [t.a_zp_name for t in live if t.a_zp_name]))
    for feed in feeds:
        values = dict(zip(names, sess.run(names, feed), strict=True))
        for t in live:
            if t.a_zp_name:
                t.a_zp = int(np.asarray(values[t.a_zp_name]).reshape(-1)[0])
            try:
                a_rows, b, a_zp, b_zp = _gemm_operands(t, np.asarray(values[t.a_name]))
            except ValueError:
                t.pred.note = "not simulated: auto_pad convolutions"
                continue
            _accumulate(t, a_rows, b, a_zp, b_zp)
        if all(t.pred.rows >= MAX_ROWS for t in live):
            break
    return [t.pred for t in targets]


def prediction_sentence(isa: dict[str, Any]) -> str:
    """What ``--deploy-isa avx2`` predicts, in one sentence the terminal and the report both print.

    ``isa``: the ``deploy_isa`` record of diag.json (``u8s8_nodes``, ``saturating_nodes``, ``nodes``).

    Example:
        >>> prediction_sentence({"u8s8_nodes": 0, "saturating_nodes": 0, "nodes": []})
        'on AVX2 without VNNI: no u8s8 node (no QInt8 weight meets u8 activations): nothing saturates on any x86 CPU'
    """
    if not isa["u8s8_nodes"]:
        return (
            "on AVX2 without VNNI: no u8s8 node (no QInt8 weight meets u8 activations): nothing saturates on any "
            "x86 CPU"
        )
    return (
        f"on AVX2 without VNNI (predicted, u8s8 int16 pairs simulated): {isa['saturating_nodes']} of "
        f"{isa['u8s8_nodes']} u8s8 node(s) saturate"
    )
