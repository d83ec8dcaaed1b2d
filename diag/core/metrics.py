"""Pure-numpy error metrics as streaming, mergeable accumulators.

An accumulator keeps a handful of running sums per tensor, never the tensors: ``update()`` once
per batch, ``merge()`` two shards (equal to one run over both, to float tolerance), ``finalize()``
into plain numbers. Memory is O(1) per tensor whatever the number of samples.

Definitions (FP32 value ``x``, INT8 value ``y``, error ``e = y - x``, sums over all elements of
all samples):

* ``sqnr_db = 10 log10(sum x^2 / sum e^2)``  (inf when e == 0; :func:`sqnr_db`)
* ``cosine  = sum x*y / sqrt(sum x^2 * sum y^2)``  (1 when both are zero; :func:`cosine`)
* ``mse = mean e^2``, ``rmse = sqrt(mse)``, ``max_abs = max |e|``, ``mean_abs = mean |e|``
* ``rel_error = ||e|| / ||x||``
* ``rmse_over_scale = sqrt(mean(e^2 / scale^2))`` where a quantization scale exists (static scale,
  or the per-batch scale of dynamic quantization). Pure rounding noise gives 1/sqrt(12) = 0.289.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from diag.core.state import State, float_from_state, float_to_state, int_from_state
from diag.foundations.errors import DiagError

ROUNDING_NOISE = 1.0 / math.sqrt(12.0)


# NOTE: every SQNR and cosine diag prints goes through sqnr_db / cosines (weights, nbits'
# accuracy_level check, saturation's AVX2 prediction, the accumulators below): one edge rule for a
# zero, infinite or NaN sum, not one per copy (tests/test_metric_rules.py holds the copies to it).


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` in dB from the energies ``sum x^2`` and ``sum e^2``.

    The edges, decided once: no noise is ``inf`` (identical, whatever the signal); a zero signal
    with noise is ``-inf``; so is any ratio that is not a positive number (the noise sum
    overflowed to inf, or a sum is NaN): never NaN, never an exception.

    Example:
        >>> sqnr_db(100.0, 1.0), sqnr_db(0.0, 0.0), sqnr_db(0.0, 1.0), sqnr_db(1.0, math.inf)
        (20.0, inf, -inf, -inf)
    """
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    ratio = signal / noise
    return 10.0 * math.log10(ratio) if ratio > 0 else -math.inf


def cosines(dot: npt.ArrayLike, xx: npt.ArrayLike, yy: npt.ArrayLike) -> np.ndarray:
    """``dot / sqrt(xx * yy)`` element by element, from the sums ``x*y``, ``x^2`` and ``y^2``.

    The edges, decided once: two zero vectors are identical (1); one zero vector against a
    non-zero one, or a NaN energy, is 0; a quotient above 1 (rounding) is 1, and so is a NaN
    quotient (both energies overflowed to inf, as masks at float32's lowest value do on both
    sides). ``yy`` below 0 (a sum derived by subtraction, rounded) counts as 0.

    Example:
        >>> cosines(np.array([2.0, 0.0, 0.0]), np.array([4.0, 0.0, 0.0]), np.array([1.0, 0.0, 3.0])).tolist()
        [1.0, 1.0, 0.0]
    """
    d, x, y = (np.asarray(a, dtype=np.float64) for a in (dot, xx, yy))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        den = np.sqrt(x * np.maximum(y, 0.0))
        has = den > 0
        cos = np.where(has, d / np.where(has, den, 1.0), np.where((x == 0) & (y == 0), 1.0, 0.0))
    out: np.ndarray = np.where(cos < 1.0, cos, 1.0)
    return out


def cosine(dot: float, xx: float, yy: float) -> float:
    """:func:`cosines` of one vector pair's sums.

    Example:
        >>> cosine(3.0, 9.0, 1.0), cosine(0.0, 0.0, 0.0), cosine(0.0, 0.0, 1.0), cosine(1.0, math.nan, 1.0)
        (1.0, 1.0, 0.0, 0.0)
    """
    return float(cosines(dot, xx, yy))


@dataclass(frozen=True)
class ErrorStats:
    """Final error figures for one tensor (see module docstring for definitions)."""

    count: int
    sqnr_db: float
    cosine: float
    mse: float
    rmse: float
    max_abs: float
    mean_abs: float
    rel_error: float
    rmse_over_scale: float | None
    fp_rms: float
    nonfinite_fp: int
    nonfinite_int8: int

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


#: ``OutputAccumulator.part_errors`` key of a KV cache present's error over its new positions.
NEW_POSITIONS = "new positions"

#: Values per block when a whole output is reduced in float64 (8 MB per temporary).
_CHUNK_VALUES = 1 << 20


@dataclass
class _RowProducts:
    """Per row of two float32 arrays: sums xy, x^2, y^2 (float64) and the largest |y - x|, |x|."""

    num: np.ndarray
    sxx: np.ndarray
    syy: np.ndarray
    max_abs_e: float
    max_abs_x: float


def _row_products(x: np.ndarray, y: np.ndarray) -> _RowProducts:
    """:class:`_RowProducts` of ``x`` and ``y`` ([rows, values], float32, finite, not empty).

    In column blocks of :data:`_CHUNK_VALUES` values, so no float64 copy of a whole batch exists.
    """
    rows, cols = x.shape
    p = _RowProducts(np.zeros(rows), np.zeros(rows), np.zeros(rows), 0.0, 0.0)
    step = max(1, _CHUNK_VALUES // max(1, rows))
    for start in range(0, cols, step):
        a = x[:, start : start + step].astype(np.float64)
        b = y[:, start : start + step].astype(np.float64)
        p.num += np.einsum("ij,ij->i", a, b)
        p.sxx += np.einsum("ij,ij->i", a, a)
        p.syy += np.einsum("ij,ij->i", b, b)
        p.max_abs_x = max(p.max_abs_x, float(np.abs(a).max()))
        b -= a
        p.max_abs_e = max(p.max_abs_e, float(np.abs(b).max()))
    return p


def sum_of_squares(fp: np.ndarray) -> float:
    """Σx² of a tensor's values, as :meth:`ErrorAccumulator.update` sums them (a float32 dot, again in
    float64 when that overflows: an attention mask's -3.4e38 squared is not representable in float32)."""
    x = _as_float(fp)
    with np.errstate(over="ignore"):
        total = float(np.dot(x, x))
    if math.isinf(total) and np.isfinite(x).all():
        x64 = x.astype(np.float64)
        total = float(np.dot(x64, x64))
    return total


def _as_float(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return a.reshape(-1)


@dataclass(slots=True)
class ErrorAccumulator:
    """Running sums for the error between one FP32 tensor and its INT8 counterpart. O(1) memory.

    Implements :class:`diag.core.state.Accumulator`: ``update`` (or :meth:`update_from_sums`) per
    batch, ``merge``, ``finalize`` into :class:`ErrorStats`, ``to_state`` / ``from_state``.

    Example:
        >>> acc = ErrorAccumulator()
        >>> acc.update(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
        >>> round(acc.finalize().max_abs, 3)
        0.5
    """

    #: Finite value pairs counted.
    n: int = 0
    #: Sums over those pairs (float64): x^2, y^2, x*y, e^2, |e|.
    s_xx: float = 0.0
    s_yy: float = 0.0
    s_xy: float = 0.0
    s_ee: float = 0.0
    s_abs_e: float = 0.0
    max_abs: float = 0.0
    #: Values seen with a quantization scale, and their sum e^2 / scale^2.
    n_scaled: int = 0
    s_ee_scaled: float = 0.0
    #: NaN / Inf values of the FP32 and INT8 tensors (left out of every sum).
    nonfinite_x: int = 0
    nonfinite_y: int = 0

    def update(self, fp: np.ndarray, q: np.ndarray, scale: float | None = None, s_xx: float | None = None) -> None:
        """Add one batch. ``scale``: the quantization step in force for this batch, if any.

        ``s_xx``: :func:`sum_of_squares` of ``fp`` when the caller has it already (computed
        while the INT8 model ran; shared by a tensor's accumulated and local error). The sums
        are the same bit for bit either way.
        """
        x = _as_float(fp)
        y = _as_float(q)
        if x.shape != y.shape:
            raise ValueError(f"shape mismatch {np.shape(fp)} vs {np.shape(q)}")
        if x.size == 0:
            return
        with np.errstate(invalid="ignore", over="ignore"):  # -inf - -inf: a causal mask, counted below
            e = y - x
            s_ee = float(np.dot(e, e))
        if not math.isfinite(s_ee):
            fin_x = np.isfinite(x)
            fin_y = np.isfinite(y)
            self.nonfinite_x += int(x.size - fin_x.sum())
            self.nonfinite_y += int(y.size - fin_y.sum())
            keep = fin_x & fin_y
            x, y = x[keep], y[keep]
            e = y - x
            with np.errstate(over="ignore"):
                s_ee = float(np.dot(e, e))
            if x.size == 0:
                return
            s_xx = None  # the caller's sum counted the values just dropped
        # NOTE: y = x + e, so sum y^2 and sum xy follow from sum x^2, sum xe and sum e^2 in float64:
        # one pass fewer than four dot products, and more precise than a float32 dot(x, y).
        with np.errstate(over="ignore", invalid="ignore"):
            if s_xx is None:
                s_xx = float(np.dot(x, x))
            s_xe = float(np.dot(x, e))
        if not (math.isfinite(s_ee) and math.isfinite(s_xx) and math.isfinite(s_xe)):
            # Finite values whose squares overflow float32 (a quantized attention mask at -3.4e38
            # read as -inf dB): the same sums in float64, for this batch only.
            x = x.astype(np.float64)
            e = y.astype(np.float64) - x
            s_ee, s_xx, s_xe = float(np.dot(e, e)), float(np.dot(x, x)), float(np.dot(x, e))
        self.n += x.size
        self.s_xx += s_xx
        self.s_yy += s_xx + 2.0 * s_xe + s_ee
        self.s_xy += s_xx + s_xe
        self.s_ee += s_ee
        np.abs(e, out=e)  # e is our own temporary
        self.s_abs_e += float(e.sum())
        self.max_abs = max(self.max_abs, float(e.max()))
        if scale is not None and scale > 0 and math.isfinite(scale):
            self.n_scaled += x.size
            self.s_ee_scaled += s_ee / (scale * scale)

    def update_from_sums(
        self, n: int, s_xx: float, s_xe: float, s_ee: float, s_abs_e: float, max_abs: float, scale: float | None = None
    ) -> None:
        """Add one batch given as its sums (computed elsewhere, e.g. inside onnxruntime, in float64).

        Same effect as :meth:`update` on a batch of ``n`` finite values with those sums: the state,
        and so ``merge`` and shard files, are unchanged. Non-finite batches go through :meth:`update`.

        Example:
            >>> acc = ErrorAccumulator()
            >>> acc.update_from_sums(2, 5.0, 1.0, 0.25, 0.5, 0.5)
            >>> acc.finalize().max_abs
            0.5
        """
        if n == 0:
            return
        self.n += n
        self.s_xx += s_xx
        self.s_yy += s_xx + 2.0 * s_xe + s_ee
        self.s_xy += s_xx + s_xe
        self.s_ee += s_ee
        self.s_abs_e += s_abs_e
        self.max_abs = max(self.max_abs, max_abs)
        if scale is not None and scale > 0 and math.isfinite(scale):
            self.n_scaled += n
            self.s_ee_scaled += s_ee / (scale * scale)

    @classmethod
    def of_unchanged(cls, accumulated: ErrorAccumulator) -> ErrorAccumulator:
        """The sums of a value compared with itself, from the sums ``accumulated`` holds for it.

        The local error of a node diag does not recompute (its local value is the FP32 value bit
        for bit, :func:`diag.core.instrument.exact_locally`): zero error over the same FP32 values.

        Example:
            >>> acc = ErrorAccumulator()
            >>> acc.update(np.array([3.0, 4.0]), np.array([3.5, 4.0]))
            >>> same = ErrorAccumulator.of_unchanged(acc).finalize()
            >>> same.max_abs, same.sqnr_db
            (0.0, inf)
        """
        a = accumulated
        return cls(
            n=a.n,
            s_xx=a.s_xx,
            s_yy=a.s_xx,
            s_xy=a.s_xx,
            n_scaled=a.n_scaled,
            nonfinite_x=a.nonfinite_x,
            nonfinite_y=a.nonfinite_x,
        )

    def merge(self, other: ErrorAccumulator) -> ErrorAccumulator:
        """Combine with another shard in place; returns self. Every sum adds; ``max_abs`` maxes."""
        self.n += other.n
        self.s_xx += other.s_xx
        self.s_yy += other.s_yy
        self.s_xy += other.s_xy
        self.s_ee += other.s_ee
        self.s_abs_e += other.s_abs_e
        self.max_abs = max(self.max_abs, other.max_abs)
        self.n_scaled += other.n_scaled
        self.s_ee_scaled += other.s_ee_scaled
        self.nonfinite_x += other.nonfinite_x
        self.nonfinite_y += other.nonfinite_y
        return self

    def to_state(self) -> State:
        """Counts as ints, sums as exact floats (the shard file layout of every version)."""
        return {
            "n": self.n,
            "s_xx": float_to_state(self.s_xx),
            "s_yy": float_to_state(self.s_yy),
            "s_xy": float_to_state(self.s_xy),
            "s_ee": float_to_state(self.s_ee),
            "s_abs_e": float_to_state(self.s_abs_e),
            "max_abs": float_to_state(self.max_abs),
            "n_scaled": self.n_scaled,
            "s_ee_scaled": float_to_state(self.s_ee_scaled),
            "nonfinite_x": self.nonfinite_x,
            "nonfinite_y": self.nonfinite_y,
        }

    @classmethod
    def from_state(cls, state: State) -> ErrorAccumulator:
        return cls(
            n=int_from_state(state["n"]),
            s_xx=float_from_state(state["s_xx"]),
            s_yy=float_from_state(state["s_yy"]),
            s_xy=float_from_state(state["s_xy"]),
            s_ee=float_from_state(state["s_ee"]),
            s_abs_e=float_from_state(state["s_abs_e"]),
            max_abs=float_from_state(state["max_abs"]),
            n_scaled=int_from_state(state["n_scaled"]),
            s_ee_scaled=float_from_state(state["s_ee_scaled"]),
            nonfinite_x=int_from_state(state["nonfinite_x"]),
            nonfinite_y=int_from_state(state["nonfinite_y"]),
        )

    def finalize(self) -> ErrorStats:
        n = max(self.n, 1)
        mse = self.s_ee / n
        rel = math.sqrt(self.s_ee / self.s_xx) if self.s_xx > 0 else (0.0 if self.s_ee == 0 else math.inf)
        ros = math.sqrt(self.s_ee_scaled / self.n_scaled) if self.n_scaled else None
        return ErrorStats(
            count=self.n,
            sqnr_db=sqnr_db(self.s_xx, self.s_ee),
            cosine=cosine(self.s_xy, self.s_xx, self.s_yy),  # s_yy is derived: may round below 0
            mse=mse,
            rmse=math.sqrt(mse),
            max_abs=self.max_abs,
            mean_abs=self.s_abs_e / n,
            rel_error=rel,
            rmse_over_scale=ros,
            fp_rms=math.sqrt(self.s_xx / n),
            nonfinite_fp=self.nonfinite_x,
            nonfinite_int8=self.nonfinite_y,
        )


@dataclass(frozen=True)
class OutputPart:
    """A slice ``[start:stop]`` along an output's part axis that a Concat wrote from ``source``."""

    label: str
    kind: str
    start: int
    stop: int
    source: str = ""


@dataclass(frozen=True)
class OutputSpec:
    """How one model output is measured: its kind and the axes that give its metrics meaning.

    Built by :func:`diag.core.outputs.output_specs` from graph evidence; the default (kind None) is the
    old guess: classes on the last axis of any output of rank >= 2.
    """

    kind: str | None = None
    #: Axis whose argmax is the prediction (top-1 agreement); None: no agreement.
    class_axis: int | None = None
    #: Probability maps: masks are ``value > mask_threshold`` (IoU of FP32 vs INT8 masks).
    mask_threshold: float | None = None
    #: Axis along which a Concat laid ``parts`` side by side.
    part_axis: int | None = None
    #: The same axis as the Concat node sees it (in its inputs' axes, before any Transpose).
    concat_axis: int | None = None
    parts: tuple[OutputPart, ...] = ()
    concat_node: str | None = None
    evidence: str = ""
    #: A KV cache's present: the graph input (the past) this output starts with, copied, and the
    #: axis the new positions follow it on (in the output's axes, and in the past input's).
    appended_to: str | None = None
    appended_axis: int | None = None
    appended_input_axis: int | None = None

    def new_values(self, value: np.ndarray, feeds: dict[str, np.ndarray] | None) -> np.ndarray:
        """``value`` without the positions copied from the past input (a KV cache's present).

        Those positions are the fed past, bit for bit the same in both models: graded with
        them, a present whose 16 new positions of 80 are off by 16 dB reads 7 dB better
        (10 log10(80 / 16)) and passes. Any other output is returned as it is.

        Example:
            >>> spec = OutputSpec(appended_to="past", appended_axis=1, appended_input_axis=1)
            >>> spec.new_values(np.arange(5.0).reshape(1, 5), {"past": np.zeros((1, 3))}).tolist()
            [[3.0, 4.0]]
        """
        if self.appended_to is None or feeds is None or self.appended_to not in feeds:
            return value
        if self.appended_axis is None or self.appended_input_axis is None or self.appended_axis >= value.ndim:
            return value
        past = np.shape(feeds[self.appended_to])[self.appended_input_axis]
        index: list[slice] = [slice(None)] * value.ndim
        index[self.appended_axis] = slice(past, None)
        return value[tuple(index)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["parts"] = [asdict(p) for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OutputSpec:
        parts = tuple(OutputPart(**p) for p in d.get("parts") or [])
        return cls(**{**d, "parts": parts})


@dataclass(frozen=True)
class OutputStats:
    """Per-sample figures for a model output, on top of the whole-tensor :class:`ErrorStats`.

    ``nonfinite_samples`` counts samples whose INT8 output holds NaN/Inf where the FP32 output is
    finite. A NaN has no cosine and an infinite error: while any exists, ``cosine_min`` /
    ``cosine_mean`` are NaN and ``max_abs`` is inf (every gate and band on them fails), and their
    rows count as disagreeing. ``nonfinite_fp_samples``: samples the FP32 model itself outputs
    NaN/Inf for (left out: they say nothing about quantization).
    """

    samples: int
    cosine_min: float
    cosine_mean: float
    max_abs: float
    top1_agreement: float | None
    nonfinite_samples: int = 0
    nonfinite_fp_samples: int = 0
    #: Every sample seen, finite or not (``samples`` counts only the finite ones compared).
    total_samples: int = 0
    kind: str | None = None
    #: Probability maps: IoU of the FP32 and INT8 masks over all samples (None when both are empty).
    mask_iou: float | None = None
    #: ``max |e| / max |x|``: the largest error relative to the output's largest FP32 magnitude.
    rel_max_abs: float | None = None
    #: Concat parts: label -> (per-sample figures, accumulated error, local error).
    parts: dict[str, tuple[OutputStats, ErrorStats, ErrorStats | None]] = field(default_factory=dict)
    #: Sequence outputs (``[N, T, classes]``, CTC/OCR heads, token logits): the positions compared
    #: in all (N x T); ``top1_agreement`` is then per position. None for one prediction per sample.
    positions: int | None = None
    #: Sequence outputs: the share of samples whose argmax agrees at every position.
    sequence_agreement: float | None = None
    #: Logits / probabilities: mean and largest KL(FP32 || INT8) of the softmax per prediction, in
    #: nats (the token-level divergence LLM users check). None for other kinds.
    kl_mean: float | None = None
    kl_max: float | None = None
    #: Sequence outputs: samples counted by the first position whose argmax differs (index =
    #: position; samples agreeing everywhere are not counted): where greedy tokens first diverge.
    first_divergence: tuple[int, ...] = ()
    #: A KV cache's present (:attr:`OutputSpec.appended_to`): the past input it appends to. Graded
    #: on the new positions only, and reported as one of the cache outputs, not as the model's answer.
    cache_of: str | None = None

    @property
    def diverged_samples(self) -> int:
        """Sequence outputs: samples whose argmax differs at some position."""
        return sum(self.first_divergence)

    @property
    def earliest_divergence(self) -> int | None:
        """The earliest position any sample's argmax differs at (None: every sample agrees everywhere)."""
        return next((i for i, c in enumerate(self.first_divergence) if c), None)

    @property
    def median_divergence(self) -> int | None:
        """The median first-divergence position over the samples that diverge."""
        half, seen = (self.diverged_samples + 1) // 2, 0
        for i, c in enumerate(self.first_divergence):
            seen += c
            if c and seen >= half:
                return i
        return None


#: The counts and floats of :class:`OutputAccumulator` in its state, in shard-file order.
_OUTPUT_INTS = (
    "samples",
    "nonfinite",
    "nonfinite_fp",
    "total",
    "rows",
    "agree",
    "mask_inter",
    "mask_union",
    "seq_samples",
    "seq_agree",
    "kl_rows",
)
_OUTPUT_FLOATS = ("cos_min", "cos_sum", "max_abs", "fp_absmax", "kl_sum", "kl_max")
#: Output kinds whose class axis holds scores a softmax makes a distribution of (KL divergence).
_DISTRIBUTION_KINDS = ("logits", "probabilities")


class OutputAccumulator:
    """Per-sample cosine, top-1 agreement, mask IoU and per-part errors of a model output (axis 0 = samples).

    What is measured follows ``spec`` (see :class:`OutputSpec`): top-1 agreement only over a class
    axis, mask IoU only for probability maps, and every Concat part on its own (its per-sample
    cosine, its accumulated error, and — fed by :meth:`update_local` — its local error).
    Implements :class:`diag.core.state.Accumulator`; memory O(parts).
    """

    def __init__(self, spec: OutputSpec | None = None, whole: bool = False) -> None:
        self.spec = spec if spec is not None else OutputSpec()
        #: The whole output's error too (``whole``): what the deployed run's grade and SQNR are read
        #: from (the exact run's come from the matched-tensor accumulators instead).
        self.errors: ErrorAccumulator | None = ErrorAccumulator() if whole else None
        self.samples = 0
        self.nonfinite = 0
        self.nonfinite_fp = 0
        self.total = 0
        self.cos_min = math.inf
        self.cos_sum = 0.0
        self.max_abs = 0.0
        self.fp_absmax = 0.0
        self.rows = 0
        self.agree = 0
        #: Sequence outputs: samples measured, and those agreeing at every position.
        self.seq_samples = 0
        self.seq_agree = 0
        #: Logits / probabilities: predictions whose KL was summed, the sum and the largest.
        self.kl_rows = 0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        #: Sequence outputs: samples by the first position whose argmax differs.
        self.first_divergence: list[int] = []
        self.classlike = True
        self.mask_inter = 0
        self.mask_union = 0
        self.parts: dict[str, OutputAccumulator] = {}
        self.part_errors: dict[str, ErrorAccumulator] = {}
        self.part_local: dict[str, ErrorAccumulator] = {}
        for p in self.spec.parts:
            self.parts[p.label] = OutputAccumulator(OutputSpec(kind=p.kind))
            self.part_errors[p.label] = ErrorAccumulator()

    def _slice(self, a: np.ndarray, part: OutputPart) -> np.ndarray:
        index: list[slice] = [slice(None)] * a.ndim
        index[self.spec.part_axis or 0] = slice(part.start, part.stop)
        return a[tuple(index)]

    def update(
        self, fp: np.ndarray, q: np.ndarray, name: str | None = None, feeds: dict[str, np.ndarray] | None = None
    ) -> None:
        """Add one batch of an output (``name`` only labels the error when the shapes differ).

        ``feeds``: the batch's model inputs, for an output graded on the positions it adds to
        one of them (:meth:`OutputSpec.new_values`).
        """
        if self.errors is not None and np.shape(fp) == np.shape(q):
            self.errors.update(np.asarray(fp), np.asarray(q))
        x = np.asarray(self.spec.new_values(fp, feeds), dtype=np.float32)
        y = np.asarray(self.spec.new_values(q, feeds), dtype=np.float32)
        if self.spec.appended_to is not None and x.shape == y.shape:
            self.part_errors.setdefault(NEW_POSITIONS, ErrorAccumulator()).update(x, y)
        if x.shape != y.shape:
            raise DiagError(
                "model-mismatch",
                f"output '{name}'" if name else "a model output",
                f"has shape {x.shape} in the FP32 model but {y.shape} in the INT8 model",
                "compare an INT8 model with the FP32 model it was quantized from",
            )
        if x.ndim == 0 or x.size == 0:
            self.classlike = False
            x, y = x.reshape(1, -1), y.reshape(1, -1)
        xs, ys = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)
        finite_x = np.asarray(np.isfinite(xs).all(axis=1))
        finite = finite_x & np.isfinite(ys).all(axis=1)
        # A sample the FP32 model itself breaks on says nothing about quantization.
        self.nonfinite += int((finite_x & ~finite).sum())
        self.nonfinite_fp += int((~finite_x).sum())
        self.total += int(finite.size)
        if not finite.all():  # a boolean index copies: only when some sample is dropped
            xs, ys = xs[finite], ys[finite]
        if xs.shape[0]:
            prod = _row_products(xs, ys)
            cos = cosines(prod.num, prod.sxx, prod.syy)
            self.cos_min = min(self.cos_min, float(cos.min()))
            self.cos_sum += float(cos.sum())
            self.samples += int(xs.shape[0])
            self.max_abs = max(self.max_abs, prod.max_abs_e)
            self.fp_absmax = max(self.fp_absmax, prod.max_abs_x)
        self._agreement(x, y, finite_x)
        if self.spec.mask_threshold is not None and xs.shape[0]:
            threshold = np.float64(self.spec.mask_threshold)  # compared in float64, as the values were
            mx, my = xs > threshold, ys > threshold
            self.mask_inter += int((mx & my).sum())
            self.mask_union += int((mx | my).sum())
        for p in self.spec.parts:
            px, py = self._slice(x, p), self._slice(y, p)
            self.parts[p.label].update(px, py, name)
            self.part_errors[p.label].update(px, py)

    def _agreement(self, x: np.ndarray, y: np.ndarray, finite_x: np.ndarray) -> None:
        if self.spec.kind is None:
            axis: int | None = x.ndim - 1 if self.classlike and x.ndim >= 2 else None
        else:
            axis = self.spec.class_axis
        if axis is not None and axis < 0:
            axis += x.ndim
        if axis is None or not 0 <= axis < x.ndim or not 2 <= x.shape[axis] <= 100_000:
            self.classlike = False
            return
        if not finite_x.all():  # samples the FP32 model breaks on say nothing
            x, y = x[finite_x], y[finite_x]
        x2 = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
        y2 = np.moveaxis(y, axis, -1).reshape(-1, y.shape[axis])
        broken = ~np.isfinite(y2).all(axis=1)  # an INT8 row with NaN/Inf disagrees, whatever its argmax
        agree = (x2.argmax(axis=1) == y2.argmax(axis=1)) & ~broken
        self.rows += int(x2.shape[0])
        self.agree += int(agree.sum())
        if self.spec.kind in _DISTRIBUTION_KINDS:
            self._divergence(x2[~broken], y2[~broken])
        if x.ndim >= 3 and axis > 0 and x.shape[0]:
            # NOTE: [N, T, classes] (CTC/OCR, token logits): one prediction per position. The rows
            # above are positions; a sample agrees only when every one of its positions does.
            per_sample = agree.reshape(x.shape[0], -1)
            self.seq_samples += int(x.shape[0])
            self.seq_agree += int(per_sample.all(axis=1).sum())
            first = np.argmin(per_sample, axis=1)[~per_sample.all(axis=1)]
            if first.size:
                counts = np.bincount(first, minlength=len(self.first_divergence))
                self.first_divergence += [0] * (len(counts) - len(self.first_divergence))
                self.first_divergence = [a + int(b) for a, b in zip(self.first_divergence, counts, strict=True)]

    def _divergence(self, x2: np.ndarray, y2: np.ndarray) -> None:
        """KL(softmax FP32 || softmax INT8) per row (rows = predictions), summed and maxed.

        Probabilities are renormalised logs (a probability output is a softmax already); logits
        go through a stable log-softmax in float64.
        """
        # NOTE: in blocks of rows: float64 copies of a whole [positions, 32000] batch of logits
        # held several at once were the largest temporaries of a decoder's compare (~300 MB).
        step = max(1, _CHUNK_VALUES // max(1, x2.shape[1]))
        for start in range(0, x2.shape[0], step):
            self._divergence_rows(x2[start : start + step], y2[start : start + step])

    def _divergence_rows(self, x2: np.ndarray, y2: np.ndarray) -> None:
        if not x2.shape[0]:
            return
        if self.spec.kind == "probabilities":
            tiny = np.finfo(np.float64).tiny
            a = np.log(np.maximum(x2.astype(np.float64), tiny))
            b = np.log(np.maximum(y2.astype(np.float64), tiny))
        else:
            a, b = x2.astype(np.float64), y2.astype(np.float64)
        # NOTE: KL(p || q) = sum p (a - b) - (lse(a) - lse(b)) for p = softmax(a), q = softmax(b):
        # two exps instead of three, no log-probability arrays (a 500M decoder's logits went from
        # ~40 % of the main thread's own time to ~15 %). Both terms are float64, each as precise
        # as the per-value log-ratios they replace.
        d = a - b
        ma, mb = a.max(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
        a -= ma
        np.exp(a, out=a)
        b -= mb
        np.exp(b, out=b)
        za, zb = a.sum(axis=1), b.sum(axis=1)
        expected = np.einsum("ij,ij->i", a, d) / za
        lse = (ma[:, 0] + np.log(za)) - (mb[:, 0] + np.log(zb))
        kl = np.maximum(expected - lse, 0.0)
        self.kl_rows += int(kl.size)
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))

    def update_local(self, fp: np.ndarray, local: np.ndarray) -> None:
        """Add one batch of the output as the cut model recomputes it (its writer fed FP32 inputs):
        the local error of each Concat part."""
        x = np.asarray(fp, dtype=np.float32)
        y = np.asarray(local, dtype=np.float32)
        if x.shape != y.shape:
            return
        for p in self.spec.parts:
            self.part_local.setdefault(p.label, ErrorAccumulator()).update(self._slice(x, p), self._slice(y, p))

    def merge(self, other: OutputAccumulator) -> OutputAccumulator:
        self.samples += other.samples
        self.nonfinite += other.nonfinite
        self.nonfinite_fp += other.nonfinite_fp
        self.total += other.total
        self.cos_min = min(self.cos_min, other.cos_min)
        self.cos_sum += other.cos_sum
        self.max_abs = max(self.max_abs, other.max_abs)
        self.fp_absmax = max(self.fp_absmax, other.fp_absmax)
        self.rows += other.rows
        self.agree += other.agree
        self.seq_samples += other.seq_samples
        self.seq_agree += other.seq_agree
        self.kl_rows += other.kl_rows
        self.kl_sum += other.kl_sum
        self.kl_max = max(self.kl_max, other.kl_max)
        width = max(len(self.first_divergence), len(other.first_divergence))
        self.first_divergence = [
            (self.first_divergence[i] if i < len(self.first_divergence) else 0)
            + (other.first_divergence[i] if i < len(other.first_divergence) else 0)
            for i in range(width)
        ]
        self.classlike = self.classlike and other.classlike
        self.mask_inter += other.mask_inter
        self.mask_union += other.mask_union
        for k, acc in other.parts.items():
            if k in self.parts:
                self.parts[k].merge(acc)
            else:
                self.parts[k] = acc
        for mine, theirs in ((self.part_errors, other.part_errors), (self.part_local, other.part_local)):
            for k, e in theirs.items():
                mine.setdefault(k, ErrorAccumulator()).merge(e)
        if other.errors is not None:
            self.errors = (self.errors or ErrorAccumulator()).merge(other.errors)
        return self

    def to_state(self) -> State:
        """Counts, exact floats, the spec and every part's own state (the shard file layout)."""
        d: State = {k: getattr(self, k) for k in _OUTPUT_INTS}
        d.update({k: float_to_state(getattr(self, k)) for k in _OUTPUT_FLOATS})
        d["classlike"] = self.classlike
        d["first_divergence"] = list(self.first_divergence)
        d["spec"] = self.spec.to_dict()
        d["parts"] = {k: a.to_state() for k, a in self.parts.items()}
        d["part_errors"] = {k: a.to_state() for k, a in self.part_errors.items()}
        d["part_local"] = {k: a.to_state() for k, a in self.part_local.items()}
        if self.errors is not None:
            d["errors"] = self.errors.to_state()
        return d

    @classmethod
    def from_state(cls, state: State) -> OutputAccumulator:
        """The inverse of :meth:`to_state`; counts and floats missing from older files read as unset."""
        acc = cls(OutputSpec.from_dict(state["spec"]) if state.get("spec") else None)
        for k in _OUTPUT_INTS:
            setattr(acc, k, int_from_state(state.get(k, 0)))
        for k in _OUTPUT_FLOATS:
            if k in state:
                setattr(acc, k, float_from_state(state[k]))
        acc.classlike = bool(state["classlike"])
        acc.first_divergence = [int_from_state(c) for c in state.get("first_divergence") or []]
        acc.parts = {str(k): cls.from_state(v) for k, v in (state.get("parts") or {}).items()}
        acc.part_errors = {str(k): ErrorAccumulator.from_state(v) for k, v in (state.get("part_errors") or {}).items()}
        acc.part_local = {str(k): ErrorAccumulator.from_state(v) for k, v in (state.get("part_local") or {}).items()}
        acc.errors = ErrorAccumulator.from_state(state["errors"]) if state.get("errors") else None
        return acc

    def new_position_errors(self) -> ErrorStats | None:
        """A KV cache present's error over the positions it adds (None for any other output).

        The output's own tensor error counts the copied past too; this is what grades it.
        """
        acc = self.part_errors.get(NEW_POSITIONS) if self.spec.appended_to is not None else None
        return acc.finalize() if acc is not None else None

    def finalize(self) -> OutputStats:
        agreement = self.agree / self.rows if (self.classlike and self.rows) else None
        parts = {
            k: (
                acc.finalize(),
                self.part_errors[k].finalize(),
                self.part_local[k].finalize() if k in self.part_local else None,
            )
            for k, acc in self.parts.items()
        }
        finite = self.samples > 0 and not self.nonfinite
        return OutputStats(
            samples=self.samples,
            cosine_min=self.cos_min if finite else math.nan,
            cosine_mean=self.cos_sum / self.samples if finite else math.nan,
            max_abs=math.inf if self.nonfinite else self.max_abs,
            top1_agreement=agreement,
            nonfinite_samples=self.nonfinite,
            nonfinite_fp_samples=self.nonfinite_fp,
            total_samples=self.total,
            kind=self.spec.kind,
            mask_iou=self.mask_inter / self.mask_union if self.mask_union else None,
            rel_max_abs=self.max_abs / self.fp_absmax if self.fp_absmax > 0 else None,
            parts=parts,
            positions=self.rows if (self.classlike and self.seq_samples) else None,
            sequence_agreement=self.seq_agree / self.seq_samples if (self.classlike and self.seq_samples) else None,
            kl_mean=self.kl_sum / self.kl_rows if (self.classlike and self.kl_rows) else None,
            kl_max=self.kl_max if (self.classlike and self.kl_rows) else None,
            first_divergence=tuple(self.first_divergence) if (self.classlike and self.seq_samples) else (),
            cache_of=self.spec.appended_to,
        )
