"""FP16 models: feeding and reading float16 sessions, and how each FP32 tensor fits FP16's range.

An FP16 model (``onnxruntime.transformers.float16.convert_float_to_float16``) keeps the FP32
model's tensor names, so :mod:`diag.core.match` pairs them by name; what changes is the element type.
Everything diag compares is float32: float16 values are cast back on the way out of a session, and
FP32 values are cast to float16 on the way into one (the cut model's FP16 region, an FP16 model
converted without ``keep_io_types``). The cast happens once, in :func:`diag.core.run.run_batch`.

What goes wrong in FP16 is range, not rounding: a value beyond 65504 becomes ``inf`` and the next
``inf - inf`` or ``0 * inf`` a ``NaN``; values below 6.1e-5 lose precision (subnormals) and below
6e-8 flush to zero. :class:`Fp16Range` counts those per tensor from the FP32 values (what the
FP16 model would have to hold). Where NaN/Inf first appear and the converter's ``node_block_list``
that removes them are analysis (:mod:`diag.analysis.fp16health`); running the converter is a fix
(:mod:`diag.fix.fp16convert`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.core.state import float_from_state, float_to_state

#: Largest finite float16 value; anything larger in magnitude rounds to inf.
FP16_MAX = 65504.0
#: Smallest magnitude float16 rounds to inf (65504 plus half its spacing of 32).
FP16_OVERFLOW = 65520.0
#: Smallest positive normal float16; below it values are subnormal (fewer significant bits).
FP16_TINY = float(np.finfo(np.float16).tiny)
#: Smallest positive subnormal float16; below half of it values flush to zero.
FP16_MIN_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)


def float16_feeds(session: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with float32 arrays cast to float16 where ``session`` wants float16.

    Returns ``feeds`` itself when nothing needs a cast (FP32 and INT8 sessions pay one lookup).
    """
    wanted = getattr(session, "_diag_fp16_inputs", None)
    if wanted is None:
        wanted = {i.name for i in session.get_inputs() if i.type == "tensor(float16)"}
        with contextlib.suppress(AttributeError):  # a session type that refuses attributes: look up every time
            session._diag_fp16_inputs = wanted
    if not wanted:
        return feeds
    return {k: v.astype(np.float16) if k in wanted and v.dtype == np.float32 else v for k, v in feeds.items()}


def float32_outputs(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with float16 arrays cast back to float32, so every comparison runs in float32."""
    if not any(isinstance(v, np.ndarray) and v.dtype == np.float16 for v in values.values()):
        return values
    return {
        k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float16 else v for k, v in values.items()
    }


@dataclass
class Fp16Range:
    """How one FP32 tensor fits FP16's range: streaming (``update`` per batch), mergeable.

    Counts come from the FP32 values, i.e. what the FP16 model would have to hold there:
    ``overflow`` values round to inf (|x| >= 65520, the first value float16 rounds up to inf),
    ``subnormal`` keep fewer than 11 significant bits (0 < |x| < 2^-14), ``flushed`` round to zero
    (0 < |x| < 2^-25). Memory O(1). Implements :class:`diag.core.state.Accumulator`.

    Example:
        >>> r = Fp16Range()
        >>> r.update(np.array([1e5, 1e-6, 1e-9, 1.0], np.float32))
        >>> r.overflow, r.subnormal, r.flushed
        (1, 2, 1)
    """

    count: int = 0
    overflow: int = 0
    subnormal: int = 0
    flushed: int = 0
    peak: float = 0.0

    def update(self, x: np.ndarray) -> None:
        a = np.abs(np.asarray(x, dtype=np.float32)).reshape(-1)
        a = a[np.isfinite(a)] if a.size and not np.isfinite(a).all() else a
        self.count += int(a.size)
        if a.size == 0:
            return
        self.peak = max(self.peak, float(a.max()))
        if self.peak >= FP16_OVERFLOW:
            self.overflow += int(np.count_nonzero(a >= FP16_OVERFLOW))
        small = a[a < FP16_TINY]
        if small.size:
            nonzero = small[small > 0]
            self.subnormal += int(nonzero.size)
            self.flushed += int(np.count_nonzero(nonzero < FP16_MIN_SUBNORMAL / 2))

    def merge(self, other: Fp16Range) -> Fp16Range:
        self.count += other.count
        self.overflow += other.overflow
        self.subnormal += other.subnormal
        self.flushed += other.flushed
        self.peak = max(self.peak, other.peak)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "overflow": self.overflow,
            "subnormal": self.subnormal,
            "flushed": self.flushed,
            "peak": self.peak,
        }

    def finalize(self) -> dict[str, Any]:
        """The counts and the peak as diag.json reports them (:meth:`to_dict`)."""
        return self.to_dict()

    def to_state(self) -> dict[str, Any]:
        """Shard state: the counts, and the peak as an exact float (inf-safe)."""
        return {**self.to_dict(), "peak": float_to_state(self.peak)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Fp16Range:
        return cls(
            count=int(state["count"]),
            overflow=int(state["overflow"]),
            subnormal=int(state["subnormal"]),
            flushed=int(state["flushed"]),
            peak=float_from_state(state["peak"]),
        )
