"""Activation distributions: streaming histograms, quantization health and outlier channels.

Why a tensor quantizes badly is usually visible in its distribution: a few channels or hidden
dimensions with a huge range (one per-tensor scale then spends almost all 256 levels on them), a
heavy tail that wastes the grid, or values beyond the calibrated range that get clipped.

Everything here is a streaming, mergeable accumulator, like :mod:`diag.core.metrics`:

* :class:`Pow2Histogram` - a fixed number of bins over ``[-R, R]`` where ``R`` is a power of two
  that grows (by folding bin pairs) when a larger value arrives. Bin edges at every ``R`` are
  nested, so a value lands in the same final bin whatever the batch order or sharding: merging
  two shards gives exactly one run's histogram. Memory: ``BINS`` integers.
* :class:`DistributionAccumulator` - per tensor: the FP32 and INT8 histograms, values outside the
  quantization grid (clipped), the per-batch dynamic scale's spread, per-channel min / max / sum.

NOTE: histograms of tensors larger than ``SAMPLE_MAX`` elements per batch are built from a
deterministic strided subsample (counts are then a sample; figures derived from them are
fractions). Clip counts, maxima and per-channel statistics always use every element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from diag.core.match import QuantParams
from diag.core.state import State, array_from_state, array_to_state, float_from_state, float_to_state, int_from_state

#: Histogram bins (divisible by 4 so that folding keeps zero on a bin edge).
BINS = 2048
#: Above this many elements per batch, histograms use a strided subsample. 2^16 values per batch
#: keep percentile errors around 0.01 bits (one batch of a Gaussian) while cutting the histogram
#: cost of a 320x320 conv net by ~3x (PP-OCRv4 det: diag compare 5.2 s -> 4.3 s, floor 1.5 s).
SAMPLE_MAX = 1 << 16
#: The INT8 histogram is only drawn (FP32 / INT8 overlay), never measured: a smaller subsample of
#: 2^12 values per batch still shows every grid level a tensor uses (<= 256) and halves the
#: histogram cost of a pass.
DISPLAY_SAMPLE_MAX = 1 << 12
#: A channel is an outlier when its max |x| exceeds the median channel's by this factor
#: (LLM.int8 observed outlier features at ~6x and more; our fixtures inject 40x).
OUTLIER_FACTOR = 6.0
#: Per-channel analysis needs enough channels for a meaningful median.
MIN_CHANNELS = 8
#: Clipping below this fraction of values is not reported whatever its error.
CLIP_FRACTION = 1e-3
#: Percentiles that delimit the "bulk" of a distribution for effective bits.
BULK_LOW, BULK_HIGH = 0.1, 99.9
#: Ops whose outputs are laid out channel-first (NC...): their rank-3 outputs use axis 1.
CHANNEL_FIRST_OPS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "BatchNormalization",
        "InstanceNormalization",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "Resize",
        "Upsample",
        "DepthToSpace",
        "SpaceToDepth",
    }
)


#: The layout hint of a tensor computed from a channel-first one by an op that keeps its layout
#: (:func:`layout_hints`): a Relu after a Conv is NCHW too.
CHANNEL_FIRST = "channel-first"
#: The layout hint of attention scores and probabilities (``Q·Kᵀ`` and what follows it until ``P·V``):
#: their last axis is key positions, not hidden dimensions, so they have no channel axis.
POSITIONS = "positions"
#: Ops whose output keeps the layout of their inputs: elementwise, activations, Concat / Split /
#: Slice / Pad along the tensor, normalizations that do not move axes.
LAYOUT_KEEPING_OPS = frozenset(
    {
        "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
        "Gelu", "Mish", "Softplus", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Neg", "Abs", "Exp", "Erf",
        "Max", "Min", "Sum", "Mean", "Concat", "Split", "Slice", "Pad", "Dropout", "Identity", "Cast",
        "Where", "Softmax", "LpNormalization",
    }
)  # fmt: skip


def layout_hints(graph: onnx.GraphProto) -> dict[str, str]:
    """Tensor name -> the hint :func:`channel_axis` reads: :data:`CHANNEL_FIRST` for a tensor a
    channel-first op wrote or a layout-keeping op computed from one, :data:`POSITIONS` for attention
    scores (a MatMul of two activations, then what keeps its layout, until the MatMul that reads
    them as its first input: ``P·V`` is hidden again), else its producer's op type.

    A rank-4 tensor is NCHW only when a Conv (or pooling, BatchNormalization, Resize...) made it:
    an attention tensor ``[batch, heads, seq, seq]`` has heads on axis 1 and key positions last,
    and neither is a channel (issue 42 item 5: MiniLM's 12 heads were reported as outlier
    "channels").

    Example:
        >>> node = onnx.helper.make_node
        >>> nodes = [node("Conv", ["x", "w"], ["c"]), node("Relu", ["c"], ["r"]), node("Softmax", ["s"], ["p"])]
        >>> layout_hints(onnx.helper.make_graph(nodes, "g", [], []))
        {'c': 'channel-first', 'r': 'channel-first', 'p': 'Softmax'}
    """
    constants = {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    hints: dict[str, str] = {}
    for node in graph.node:
        seen = {hints.get(i) for i in node.input}
        if node.op_type in CHANNEL_FIRST_OPS:
            hint = CHANNEL_FIRST
        elif node.op_type == "MatMul" and len(node.input) == 2 and not set(node.input) & constants:
            hint = node.op_type if hints.get(node.input[0]) == POSITIONS else POSITIONS
        elif node.op_type in LAYOUT_KEEPING_OPS and POSITIONS in seen:
            hint = POSITIONS
        elif node.op_type in LAYOUT_KEEPING_OPS and CHANNEL_FIRST in seen:
            hint = CHANNEL_FIRST
        else:
            hint = node.op_type
        for out in node.output:
            if out:
                hints[out] = hint
    return hints


def channel_axis(rank: int, producer_op: str | None) -> int | None:
    """The axis that holds channels / hidden dimensions of an activation of ``rank``.

    ``producer_op``: the tensor's :func:`layout_hints` entry (its producer's op type, or
    :data:`CHANNEL_FIRST`); None for a model input. NCHW conv activations: axis 1;
    ``[batch, seq, hidden]`` and ``[batch, features]``: the last axis; a rank-3 channel-first
    tensor (NCL): axis 1. A rank-4 tensor no channel-first op made (attention's ``[batch, heads,
    seq, seq]``) has no channel axis, nor has attention's :data:`POSITIONS`. Scalars and vectors
    have none.

    Example:
        >>> channel_axis(4, CHANNEL_FIRST), channel_axis(3, "MatMul"), channel_axis(3, "Conv")
        (1, 2, 1)
        >>> channel_axis(4, "Softmax"), channel_axis(4, None)
        (None, 1)
    """
    if producer_op == POSITIONS or (producer_op == "Transpose" and rank >= 3):
        return None  # attention scores; a transposed tensor (Kᵀ: its hidden axis is no longer last)
    first = producer_op == CHANNEL_FIRST or producer_op in CHANNEL_FIRST_OPS
    if rank >= 4:
        return 1 if first or producer_op is None else None
    if rank == 3:
        return 1 if first else 2
    if rank == 2:
        return 1
    return None


class Pow2Histogram:
    """Histogram over ``[-2^k, 2^k]`` with ``BINS`` equal bins; ``k`` grows to cover every value.

    Implements :class:`diag.core.state.Accumulator`; memory ``BINS`` integers.

    Example:
        >>> h = Pow2Histogram()
        >>> h.update(np.array([0.5, -0.25, 3.0], np.float32))
        >>> h.total, h.limit
        (3, 4.0)
    """

    __slots__ = ("counts", "exponent")

    def __init__(self) -> None:
        self.counts = np.zeros(BINS, dtype=np.int64)
        self.exponent: int | None = None

    @property
    def limit(self) -> float:
        return 0.0 if self.exponent is None else math.ldexp(1.0, self.exponent)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def _grow_to(self, exponent: int) -> None:
        if self.exponent is None:
            self.exponent = exponent
            return
        # After log2(BINS) folds every count sits in the two middle bins and further folds
        # change nothing: fold at most that often (a hostile exponent must not loop forever).
        for _ in range(min(exponent - self.exponent, int(math.log2(BINS)) + 1)):
            # Old bin i covers half of new bin BINS/4 + i//2: fold pairs into the middle half.
            folded = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.zeros(BINS, dtype=np.int64)
            self.counts[BINS // 4 : BINS // 4 + BINS // 2] = folded
        self.exponent = max(self.exponent, exponent)

    def update(self, x: np.ndarray, peak: float | None = None) -> None:
        """Count the finite values of ``x``; ``peak`` = max |x| if the caller already knows it."""
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.size == 0:
            return
        if peak is None or not math.isfinite(peak):
            # NOTE: min and max are NaN / inf exactly when some value is: two passes without a
            # copy decide it, instead of an isfinite mask and a masked copy on every batch.
            lo, hi = float(x.min()), float(x.max())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                x = x[np.isfinite(x)]
                if x.size == 0:
                    return
                lo, hi = float(x.min()), float(x.max())
            peak = max(-lo, hi, 0.0)
        # Smallest k with 2^k > peak (strictly, so the top value stays inside the last bin).
        exponent = -40 if peak == 0.0 else max(-40, math.frexp(peak)[1])
        self._grow_to(max(exponent, self.exponent if self.exponent is not None else exponent))
        assert self.exponent is not None
        # x * 2^(log2(BINS/2) - k) is an exact power-of-two scaling, so floor() is exact and the
        # bin of a value does not depend on when it was counted (merge == one run, exactly).
        # NOTE: floor, clip and the shift run in place on one float32 buffer (small integers are
        # exact in float32): 5x faster than the same steps on int64 copies, same bins.
        factor = math.ldexp(1.0, int(math.log2(BINS // 2)) - self.exponent)
        t = x * np.float32(factor)
        np.floor(t, out=t)
        np.clip(t, -(BINS // 2), BINS // 2 - 1, out=t)
        t += BINS // 2
        self.counts += np.bincount(t.astype(np.intp), minlength=BINS)

    def merge(self, other: Pow2Histogram) -> Pow2Histogram:
        if other.exponent is None:
            return self
        theirs = Pow2Histogram()
        theirs.counts, theirs.exponent = other.counts.copy(), other.exponent
        target = max(other.exponent, self.exponent if self.exponent is not None else other.exponent)
        self._grow_to(target)
        theirs._grow_to(target)
        self.counts += theirs.counts
        return self

    def edges(self) -> np.ndarray:
        return np.linspace(-self.limit, self.limit, BINS + 1)

    def percentile(self, q: float) -> float:
        """Linear interpolation inside the bin that holds the q-th percentile."""
        total = self.total
        if total == 0:
            return math.nan
        cum = np.cumsum(self.counts)
        target = q / 100.0 * total
        i = int(np.searchsorted(cum, target, side="left"))
        i = min(i, BINS - 1)
        before = cum[i - 1] if i > 0 else 0
        inside = self.counts[i]
        frac = 0.0 if inside == 0 else (target - before) / inside
        width = 2 * self.limit / BINS
        return float(-self.limit + (i + min(max(frac, 0.0), 1.0)) * width)

    def moments(self) -> tuple[float, float, float]:
        """Mean, standard deviation and excess kurtosis from bin centres."""
        total = self.total
        if total == 0:
            return math.nan, math.nan, math.nan
        e = self.edges()
        centres = (e[:-1] + e[1:]) / 2
        p = self.counts / total
        mean = float(np.dot(p, centres))
        d = centres - mean
        var = float(np.dot(p, d * d))
        if var <= 0:
            return mean, 0.0, math.nan
        kurt = float(np.dot(p, d**4)) / (var * var) - 3.0
        return mean, math.sqrt(var), kurt

    def finalize(self) -> Pow2Histogram:
        """The histogram is its own result (percentiles and moments are read from it)."""
        return self

    def to_state(self) -> State:
        """JSON-ready state: the exponent and the non-empty bin range (shard files and diag.json)."""
        nz = np.nonzero(self.counts)[0]
        if self.exponent is None or nz.size == 0:
            return {"exponent": self.exponent, "first": 0, "counts": []}
        a, b = int(nz[0]), int(nz[-1]) + 1
        return {"exponent": self.exponent, "first": a, "counts": self.counts[a:b].tolist()}

    @classmethod
    def from_state(cls, state: State) -> Pow2Histogram:
        h = cls()
        h.exponent = None if state["exponent"] is None else int(state["exponent"])
        counts = state["counts"]
        first = int(state["first"])
        h.counts[first : first + len(counts)] = counts
        return h


#: Bins of the small histograms every tensor gets in diag.json (the report's graph panel draws them).
COMPACT_BINS = 32


def compact_histograms(fp: Pow2Histogram, int8: Pow2Histogram, bins: int = COMPACT_BINS) -> State | None:
    """Both histograms of a tensor on one axis, cut to the range holding values, in ``bins`` bins.

    The full histograms (:data:`BINS` bins over ``[-2^k, 2^k]``) are for the plotted tensors only;
    this small form is for every tensor: copies of both are grown to one exponent (counts are
    exact: bins only merge), the bins from the first to the last non-empty one in either are
    kept, and runs of them are summed into at most ``bins`` bars. Returns ``{"lo", "hi", "fp32",
    "int8"}`` (the bars' range and counts), or None when both are empty.

    Example:
        >>> a, b = Pow2Histogram(), Pow2Histogram()
        >>> a.update(np.array([0.1, 0.2, 0.3, 0.9], np.float32))
        >>> b.update(np.array([0.0, 0.25, 0.25, 1.0], np.float32))
        >>> h = compact_histograms(a, b, bins=4)  # 513 bins of 1/512 from 0 to 1: 4 bars of 129
        >>> h["lo"], round(h["hi"], 4), h["fp32"], h["int8"]
        (0.0, 1.0078, [2, 1, 0, 1], [3, 0, 0, 1])
        >>> empty = Pow2Histogram.from_state({"exponent": 3, "first": 0, "counts": []})  # a shard's, say
        >>> compact_histograms(empty, Pow2Histogram()) is None
        True
    """
    if fp.exponent is None and int8.exponent is None:
        return None
    exponent = max(e for e in (fp.exponent, int8.exponent) if e is not None)
    grown = []
    for h in (fp, int8):
        copy = Pow2Histogram()
        copy.counts, copy.exponent = h.counts.copy(), h.exponent
        if copy.exponent is not None:
            copy._grow_to(exponent)
        grown.append(copy.counts)
    nonzero = np.nonzero(grown[0] + grown[1])[0]
    if nonzero.size == 0:  # a shard's histogram can hold an exponent and no count
        return None
    first, span = int(nonzero[0]), int(nonzero[-1]) + 1 - int(nonzero[0])
    group = -(-span // bins)  # ceil: histogram bins per bar
    count = -(-span // group)
    width = math.ldexp(1.0, exponent) * 2 / BINS
    lo = -math.ldexp(1.0, exponent) + first * width
    bars = [np.pad(c[first : first + span], (0, group * count - span)).reshape(count, group).sum(axis=1) for c in grown]
    return {
        "lo": lo,
        "hi": lo + group * count * width,
        "fp32": [int(v) for v in bars[0]],
        "int8": [int(v) for v in bars[1]],
    }


def _sample(x: np.ndarray, limit: int = SAMPLE_MAX) -> np.ndarray:
    """A deterministic strided subsample of at most ``limit`` values of ``x``."""
    flat = x.reshape(-1)
    if flat.size <= limit:
        return flat
    stride = flat.size // limit + 1
    stride += 1 - stride % 2  # odd, so the sample does not lock onto an even channel period
    return flat[::stride]


@dataclass
class GridInfo:
    """The quantization grid of a tensor, as needed for clipping and effective bits."""

    scale: float
    zero_point: float
    qmin: int
    qmax: int

    @property
    def low(self) -> float:
        """Smallest real value that does not clip (half a step below the lowest level)."""
        return (self.qmin - self.zero_point - 0.5) * self.scale

    @property
    def high(self) -> float:
        return (self.qmax - self.zero_point + 0.5) * self.scale

    @property
    def bits(self) -> float:
        return math.log2(self.qmax - self.qmin + 1)

    @classmethod
    def from_params(cls, q: QuantParams) -> GridInfo | None:
        if q.scale.size != 1:
            return None  # per-channel activation grids are not produced by onnxruntime
        return cls(float(q.scale.reshape(-1)[0]), float(q.zero_point.reshape(-1)[0]), q.qmin, q.qmax)


@dataclass(frozen=True)
class BatchSummary:
    """One batch of a tensor as its statistics, computed inside onnxruntime by :mod:`diag.core.diagraph`.

    Attributes:
        size: values in the batch; ``rank``: its rank.
        lo, hi: the smallest and largest FP32 value.
        channels: per-channel min / max / sum over every axis but :func:`channel_axis`'s (None
            when the graph did not reduce per channel).
        sample, display_sample: the strided subsamples :func:`_sample` takes of the FP32 and INT8
            values (for the histograms).
        clipped_low, clipped_high: values beyond the grid (counted only when the batch leaves it).
        dynamic_scale: the batch's DynamicQuantizeLinear scale, if any.
    """

    size: int
    rank: int
    lo: float
    hi: float
    channels: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    sample: np.ndarray
    display_sample: np.ndarray
    clipped_low: int = 0
    clipped_high: int = 0
    dynamic_scale: float | None = None


class DistributionAccumulator:
    """Distribution of one matched tensor, FP32 and INT8 side by side. O(BINS + channels) memory.

    Implements :class:`diag.core.state.Accumulator`. The per-batch dynamic scales of
    DynamicQuantizeLinear are kept as their count, sum, minimum and maximum (all the report shows:
    the mean scale, the spread, the batches), never as a list.

    Example:
        >>> acc = DistributionAccumulator(channel_hint="MatMul")
        >>> acc.update(np.ones((2, 4, 16), np.float32), np.ones((2, 4, 16), np.float32))
        >>> acc.channels
        16
    """

    def __init__(self, grid: GridInfo | None = None, channel_hint: str | None = None, axis: int | None = None) -> None:
        self.grid = grid
        self.channel_hint = channel_hint
        #: The channel axis when the graph says which it is (a detector output's part axis, not
        #: its anchor axis); otherwise :func:`channel_axis` guesses from rank and producer.
        self.axis_override = axis
        self.fp = Pow2Histogram()
        self.int8 = Pow2Histogram()
        self.count = 0
        self.clipped_low = 0
        self.clipped_high = 0
        self.fp_min = math.inf
        self.fp_max = -math.inf
        self.axis: int | None = None
        self.rank: int | None = None
        self.ch_min: np.ndarray | None = None
        self.ch_max: np.ndarray | None = None
        self.ch_sum: np.ndarray | None = None
        self.ch_count = 0
        self.channel_consistent = True
        #: Batches with a dynamic scale, and those scales' sum, minimum and maximum.
        self.dyn_batches = 0
        self.dyn_sum = 0.0
        self.dyn_min = math.inf
        self.dyn_max = -math.inf

    @property
    def channels(self) -> int:
        return 0 if self.ch_max is None else int(self.ch_max.size)

    @property
    def dynamic_scale_mean(self) -> float | None:
        """The mean of the batches' dynamic scales (None without any)."""
        return self.dyn_sum / self.dyn_batches if self.dyn_batches else None

    def axis_for(self, rank: int) -> int | None:
        """The channel axis of a tensor of this rank: the graph's proof (``axis_override``, a
        detector output's parts) when there is one, else :func:`channel_axis`'s guess. The one rule
        for :meth:`update`, :meth:`update_from_sums` and the diagnostic graph."""
        return self.axis_override if self.axis_override is not None else channel_axis(rank, self.channel_hint)

    def update(self, fp: np.ndarray, q: np.ndarray, dynamic_scale: float | None = None) -> None:
        """Add one batch of the FP32 tensor and the INT8 model's (dequantized) value of it."""
        if self.update_fp(fp):
            self.update_int8(q, dynamic_scale)

    def update_fp(self, fp: np.ndarray) -> bool:
        """The FP32 half of :meth:`update`: ranges, channels, clipping, the FP32 histogram.

        Why apart: the FP32 values exist before the INT8 model has run, so this half can be
        reduced while it runs. It touches no field :meth:`update_int8` touches. Returns whether
        the batch counted (a floating, non-empty tensor): only then does its INT8 half follow.
        """
        x = np.asarray(fp)
        if x.size == 0 or not np.issubdtype(x.dtype, np.floating):
            return False
        if self.rank is None:
            self.rank, self.axis = x.ndim, self.axis_for(x.ndim)
        # Per-channel min / max double as the tensor's (one pass each instead of two more).
        stats = self._channel_stats(x)
        if stats is not None:
            lo, hi = float(stats[0].min()), float(stats[1].max())
        else:
            lo, hi = float(x.min()), float(x.max())
        xf = x
        if not (math.isfinite(lo) and math.isfinite(hi)):  # min / max are NaN or inf iff a value is
            xf = np.where(np.isfinite(x), x, 0).astype(x.dtype)
            stats = self._channel_stats(xf)
            lo, hi = float(xf.min()), float(xf.max())
        self.fp_min = min(self.fp_min, lo)
        self.fp_max = max(self.fp_max, hi)
        self.count += x.size
        if stats is not None:
            self._add_channels(*stats, x.size)
        peak = max(abs(lo), abs(hi))
        self.fp.update(_sample(xf), peak)
        # Nothing can clip when the batch's range lies inside the grid (the usual case): skip the passes.
        if self.grid is not None and lo < self.grid.low:
            self.clipped_low += int(np.count_nonzero(xf < self.grid.low))
        if self.grid is not None and hi > self.grid.high:
            self.clipped_high += int(np.count_nonzero(xf > self.grid.high))
        return True

    def update_int8(self, q: np.ndarray, dynamic_scale: float | None = None) -> None:
        """The INT8 half of :meth:`update`, for a batch whose FP32 half counted."""
        self.int8.update(_sample(np.asarray(q), DISPLAY_SAMPLE_MAX))
        self._add_scale(dynamic_scale)

    def update_from_sums(self, batch: BatchSummary) -> None:
        """Add one batch given as its statistics (computed inside onnxruntime by :mod:`diag.core.diagraph`).

        Same state as :meth:`update` on a batch of finite values (histograms bit-identical), so
        ``merge`` and shard files are unchanged.
        """
        if batch.size == 0:
            return
        if self.rank is None:
            self.rank, self.axis = batch.rank, self.axis_for(batch.rank)
        stats = None
        channels = batch.channels
        if channels is not None and self.axis is not None and self.channel_consistent and batch.rank == self.rank:
            c = channels[1].size
            if self.ch_max is not None and self.ch_max.size != c:
                self._drop_channels()
            else:
                mn, mx, sm = (np.asarray(a, dtype=np.float64).reshape(-1) for a in channels)
                stats = (mn, mx, sm)
        self.fp_min = min(self.fp_min, batch.lo)
        self.fp_max = max(self.fp_max, batch.hi)
        self.count += batch.size
        if stats is not None:
            self._add_channels(*stats, batch.size)
        self.fp.update(batch.sample, max(abs(batch.lo), abs(batch.hi)))
        self.int8.update(batch.display_sample)
        if self.grid is not None and batch.lo < self.grid.low:
            self.clipped_low += batch.clipped_low
        if self.grid is not None and batch.hi > self.grid.high:
            self.clipped_high += batch.clipped_high
        self._add_scale(batch.dynamic_scale)

    def _add_scale(self, scale: float | None) -> None:
        if scale is not None and math.isfinite(scale) and scale > 0:
            self.dyn_batches += 1
            self.dyn_sum += float(scale)
            self.dyn_min = min(self.dyn_min, float(scale))
            self.dyn_max = max(self.dyn_max, float(scale))

    def _drop_channels(self) -> None:
        """Channel counts changed between batches: per-channel statistics mean nothing any more."""
        self.channel_consistent = False
        self.ch_min = self.ch_max = self.ch_sum = None

    def _channel_stats(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Per-channel min, max and sum of one batch (None when channels are not tracked)."""
        if self.axis is None or not self.channel_consistent or x.ndim != self.rank:
            return None
        c = x.shape[self.axis]
        if self.ch_max is not None and self.ch_max.size != c:
            self._drop_channels()
            return None
        # Bring channels to axis 1 of a 3-d view [before, C, after] without copying.
        before = int(np.prod(x.shape[: self.axis], dtype=np.int64))
        v = x.reshape(before, c, -1)
        mn = v.min(axis=(0, 2)).astype(np.float64)
        mx = v.max(axis=(0, 2)).astype(np.float64)
        sm = v.sum(axis=(0, 2)).astype(np.float64)  # float32 sums: a channel mean for display
        return mn, mx, sm

    def _add_channels(self, mn: np.ndarray, mx: np.ndarray, sm: np.ndarray, size: int) -> None:
        c = mx.size
        if self.ch_min is None or self.ch_max is None or self.ch_sum is None:
            self.ch_min, self.ch_max, self.ch_sum = mn, mx, sm
        else:
            np.minimum(self.ch_min, mn, out=self.ch_min)
            np.maximum(self.ch_max, mx, out=self.ch_max)
            self.ch_sum += sm
        self.ch_count += size // c

    def merge(self, other: DistributionAccumulator) -> DistributionAccumulator:
        """Combine with another shard in place (same tensor); returns self."""
        self.fp.merge(other.fp)
        self.int8.merge(other.int8)
        self.count += other.count
        self.clipped_low += other.clipped_low
        self.clipped_high += other.clipped_high
        self.fp_min = min(self.fp_min, other.fp_min)
        self.fp_max = max(self.fp_max, other.fp_max)
        self.dyn_batches += other.dyn_batches
        self.dyn_sum += other.dyn_sum
        self.dyn_min = min(self.dyn_min, other.dyn_min)
        self.dyn_max = max(self.dyn_max, other.dyn_max)
        if self.rank is None:
            self.rank, self.axis = other.rank, other.axis
        self._merge_channels(other)
        return self

    def _merge_channels(self, other: DistributionAccumulator) -> None:
        if other.ch_min is None or other.ch_max is None or other.ch_sum is None or not other.channel_consistent:
            self.channel_consistent = self.channel_consistent and (other.ch_max is None and other.channel_consistent)
            if not self.channel_consistent:
                self._drop_channels()
            return
        if self.ch_min is None or self.ch_max is None or self.ch_sum is None:
            if self.channel_consistent:
                self.ch_min, self.ch_max = other.ch_min.copy(), other.ch_max.copy()
                self.ch_sum = other.ch_sum.copy()
                self.ch_count = other.ch_count
            return
        if self.ch_max.size != other.ch_max.size:
            self._drop_channels()
            return
        np.minimum(self.ch_min, other.ch_min, out=self.ch_min)
        np.maximum(self.ch_max, other.ch_max, out=self.ch_max)
        self.ch_sum += other.ch_sum
        self.ch_count += other.ch_count

    def finalize(self, factor: float = OUTLIER_FACTOR) -> TensorHealth:
        return health_from(self, factor)

    def to_state(self) -> State:
        """Everything but the tensors: histograms, counts, extremes, per-channel arrays, the grid."""
        g = self.grid
        return {
            "grid": None
            if g is None
            else {"scale": g.scale, "zero_point": g.zero_point, "qmin": g.qmin, "qmax": g.qmax},
            "channel_hint": self.channel_hint,
            "axis_override": self.axis_override,
            "fp": self.fp.to_state(),
            "int8": self.int8.to_state(),
            "count": self.count,
            "clipped_low": self.clipped_low,
            "clipped_high": self.clipped_high,
            "fp_min": float_to_state(self.fp_min),
            "fp_max": float_to_state(self.fp_max),
            "axis": self.axis,
            "rank": self.rank,
            "ch_min": array_to_state(self.ch_min),
            "ch_max": array_to_state(self.ch_max),
            "ch_sum": array_to_state(self.ch_sum),
            "ch_count": self.ch_count,
            "channel_consistent": self.channel_consistent,
            "dynamic_scales": {
                "batches": self.dyn_batches,
                "sum": float_to_state(self.dyn_sum),
                "min": float_to_state(self.dyn_min),
                "max": float_to_state(self.dyn_max),
            },
        }

    @classmethod
    def from_state(cls, state: State) -> DistributionAccumulator:
        """The inverse of :meth:`to_state`; also reads shard state version 1 (a ``dyn_scales`` list)."""
        g = state["grid"]
        grid = None if g is None else GridInfo(**g)
        override = state.get("axis_override")
        acc = cls(grid, state["channel_hint"], None if override is None else int(override))
        acc.fp = Pow2Histogram.from_state(state["fp"])
        acc.int8 = Pow2Histogram.from_state(state["int8"])
        acc.count = int_from_state(state["count"])
        acc.clipped_low = int_from_state(state["clipped_low"])
        acc.clipped_high = int_from_state(state["clipped_high"])
        acc.ch_count = int_from_state(state["ch_count"])
        acc.fp_min, acc.fp_max = float_from_state(state["fp_min"]), float_from_state(state["fp_max"])
        acc.axis, acc.rank = state["axis"], state["rank"]
        acc.ch_min = array_from_state(state["ch_min"])
        acc.ch_max = array_from_state(state["ch_max"])
        acc.ch_sum = array_from_state(state["ch_sum"])
        acc.channel_consistent = bool(state["channel_consistent"])
        if "dyn_scales" in state:  # version 1: one scale per batch, folded in that order
            for v in state["dyn_scales"]:
                acc._add_scale(float_from_state(v))
        else:
            dyn = state["dynamic_scales"]
            acc.dyn_batches = int_from_state(dyn["batches"])
            acc.dyn_sum = float_from_state(dyn["sum"])
            acc.dyn_min, acc.dyn_max = float_from_state(dyn["min"]), float_from_state(dyn["max"])
        return acc


@dataclass(frozen=True)
class OutlierChannel:
    """One channel / hidden dimension whose range dwarfs the typical channel's."""

    index: int
    max_abs: float
    mean: float
    times_median: float
    #: Share of the tensor's per-tensor range this channel alone needs (1.0 = it sets the scale).
    scale_share: float


@dataclass
class TensorHealth:
    """How well one tensor fits its quantization grid (see docs/what-the-report-shows.md, "Quantization health")."""

    count: int
    fp_min: float
    fp_max: float
    mean: float
    std: float
    kurtosis: float
    bulk_low: float
    bulk_high: float
    #: (max - min) / (P99.9 - P0.1): how much of the range the tails take (1-2 for a uniform bulk).
    range_over_bulk: float
    grid: str
    scale: float | None
    zero_point: float | None
    zero_point_position: float | None
    clip_fraction: float | None
    #: Error energy clipping adds, relative to the grid's rounding noise (scale^2 / 12 per value).
    clip_noise_ratio: float | None
    effective_bits: float | None
    grid_bits: float | None
    dynamic_scale_min: float | None
    dynamic_scale_max: float | None
    dynamic_batches: int
    axis: int | None
    channels: int
    median_channel_max: float | None
    outliers: list[OutlierChannel] = field(default_factory=list)
    #: Levels of the grid a median channel actually spans (of ``2^grid_bits``).
    median_channel_levels: float | None = None
    #: Real values a static grid represents without clipping.
    grid_range: tuple[float, float] | None = None
    fp_hist: Pow2Histogram | None = None
    int8_hist: Pow2Histogram | None = None
    channel_max: list[float] = field(default_factory=list)

    @property
    def clips(self) -> bool:
        """Clipping matters when it adds more error than rounding does (and is not a rare stray)."""
        return bool(self.clip_fraction and self.clip_fraction > CLIP_FRACTION and (self.clip_noise_ratio or 0) > 1.0)

    @property
    def unhealthy_reasons(self) -> list[str]:
        reasons = []
        if self.outliers:
            dims = ", ".join(str(o.index) for o in self.outliers[:5])
            reasons.append(f"outlier channel(s) {dims}")
        if self.clips:
            reasons.append(f"{self.clip_fraction:.2%} of values clipped")
        if self.effective_bits is not None and self.grid_bits is not None and self.effective_bits < self.grid_bits - 3:
            reasons.append(f"bulk uses {self.effective_bits:.1f} of {self.grid_bits:.0f} bits")
        return reasons


def health_from(acc: DistributionAccumulator, factor: float = OUTLIER_FACTOR) -> TensorHealth:
    """Finalize an accumulator: moments, bulk, clipping, effective bits and outlier channels."""
    mean, std, kurt = acc.fp.moments()
    p_lo, p_hi = acc.fp.percentile(BULK_LOW), acc.fp.percentile(BULK_HIGH)
    bulk = p_hi - p_lo
    full = acc.fp_max - acc.fp_min
    range_over_bulk = full / bulk if bulk > 0 else (1.0 if full == 0 else math.inf)
    scale = zp = zp_pos = clip = eff = bits = clip_ratio = None
    kind = "none"
    if acc.grid is not None:
        kind = "static"
        g = acc.grid
        scale, zp, bits = g.scale, g.zero_point, g.bits
        zp_pos = (g.zero_point - g.qmin) / max(g.qmax - g.qmin, 1)
        clip = (acc.clipped_low + acc.clipped_high) / acc.count if acc.count else 0.0
        clip_ratio = _clip_noise_ratio(acc.fp, g)
    elif acc.dyn_batches:
        kind = "dynamic"
        scale = acc.dynamic_scale_mean
        bits = 8.0
        clip = 0.0  # DynamicQuantizeLinear covers each batch's [min, max] by construction
    if scale is not None and scale > 0 and bits is not None and math.isfinite(bulk):
        eff = min(bits, math.log2(1.0 + max(bulk, 0.0) / scale))
    outliers: list[OutlierChannel] = []
    median = None
    median_levels = None
    ch_abs: np.ndarray | None = None
    if acc.ch_max is not None and acc.ch_min is not None and acc.channels >= MIN_CHANNELS:
        ch_abs = np.maximum(np.abs(acc.ch_max), np.abs(acc.ch_min))
        median = float(np.median(ch_abs))
        tensor_abs = float(ch_abs.max())
        if median > 0:
            means = acc.ch_sum / max(acc.ch_count, 1) if acc.ch_sum is not None else np.zeros_like(ch_abs)
            for i in np.argsort(-ch_abs):
                ratio = float(ch_abs[i] / median)
                if ratio <= factor:
                    break
                outliers.append(
                    OutlierChannel(int(i), float(ch_abs[i]), float(means[i]), ratio, float(ch_abs[i] / tensor_abs))
                )
            if scale is not None and scale > 0:
                median_levels = median / scale
    return TensorHealth(
        count=acc.count,
        fp_min=acc.fp_min,
        fp_max=acc.fp_max,
        mean=mean,
        std=std,
        kurtosis=kurt,
        bulk_low=p_lo,
        bulk_high=p_hi,
        range_over_bulk=range_over_bulk,
        grid=kind,
        scale=scale,
        zero_point=zp,
        zero_point_position=zp_pos,
        clip_fraction=clip,
        clip_noise_ratio=clip_ratio,
        effective_bits=eff,
        grid_bits=bits,
        dynamic_scale_min=acc.dyn_min if acc.dyn_batches else None,
        dynamic_scale_max=acc.dyn_max if acc.dyn_batches else None,
        dynamic_batches=acc.dyn_batches,
        axis=acc.axis if acc.ch_max is not None else None,
        channels=acc.channels,
        median_channel_max=median,
        outliers=outliers,
        median_channel_levels=median_levels,
        fp_hist=acc.fp,
        int8_hist=acc.int8,
        channel_max=[] if ch_abs is None else ch_abs.tolist(),
        grid_range=(acc.grid.low, acc.grid.high) if acc.grid is not None else None,
    )


def _clip_noise_ratio(hist: Pow2Histogram, grid: GridInfo) -> float:
    """Mean squared clipping error (from bin centres beyond the grid) over rounding noise s^2/12."""
    total = hist.total
    if total == 0 or grid.scale <= 0:
        return 0.0
    e = hist.edges()
    centres = (e[:-1] + e[1:]) / 2
    beyond = np.maximum(centres - grid.high, 0.0) + np.maximum(grid.low - centres, 0.0)
    energy = float(np.dot(hist.counts, beyond * beyond)) / total
    return energy / (grid.scale * grid.scale / 12.0)


@dataclass(frozen=True)
class PersistentOutlier:
    """A hidden dimension that is an outlier in several tensors of the same width."""

    index: int
    channels: int
    tensors: list[str]
    of_tensors: int


def persistent_outliers(health: dict[str, TensorHealth], min_tensors: int = 2) -> list[PersistentOutlier]:
    """Channel indices flagged in at least ``min_tensors`` tensors of the same channel count.

    In transformers the same hidden dimension is usually an outlier in layer after layer (it rides
    the residual stream); saying so turns a dozen findings into one.

    Example:
        >>> persistent_outliers({})
        []
    """
    by_width: dict[int, list[str]] = {}
    for name, h in health.items():
        if h.channels:
            by_width.setdefault(h.channels, []).append(name)
    found: list[PersistentOutlier] = []
    for width, names in sorted(by_width.items()):
        hits: dict[int, list[str]] = {}
        for name in names:
            for o in health[name].outliers:
                hits.setdefault(o.index, []).append(name)
        for index, tensors in sorted(hits.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            if len(tensors) >= min_tensors:
                found.append(PersistentOutlier(index, width, tensors, len(names)))
    return found


def worst_tensors(health: dict[str, TensorHealth], n: int) -> list[str]:
    """The ``n`` flagged tensors most worth a plot: quantized outliers, clipping, other outliers, wasted bits.

    Example:
        >>> worst_tensors({}, 3)
        []
    """

    def badness(item: tuple[str, TensorHealth]) -> tuple[int, float]:
        h = item[1]
        if h.outliers and h.grid != "none":
            return (0, -h.outliers[0].times_median)
        if h.clips and h.clip_fraction is not None:
            return (1, -h.clip_fraction)
        if h.outliers:
            return (2, -h.outliers[0].times_median)
        if h.effective_bits is not None:
            return (3, h.effective_bits)
        return (4, 0.0)

    flagged = [(k, h) for k, h in health.items() if h.outliers or h.unhealthy_reasons]
    return [name for name, _ in sorted(flagged, key=badness)[:n]]
