"""FP16 models: feeding and reading float16 sessions, numeric health, and the block lists that fix them.

An FP16 model (``onnxruntime.transformers.float16.convert_float_to_float16``) keeps the FP32
model's tensor names, so :mod:`diag.match` pairs them by name; what changes is the element type.
Everything diag compares is float32: float16 values are cast back on the way out of a session, and
FP32 values are cast to float16 on the way into one (the cut model's FP16 region, an FP16 model
converted without ``keep_io_types``). The cast happens once, in :func:`diag.run.run_batch`.

What goes wrong in FP16 is range, not rounding: a value beyond 65504 becomes ``inf`` and the next
``inf - inf`` or ``0 * inf`` a ``NaN``; values below 6.1e-5 lose precision (subnormals) and below
6e-8 flush to zero. :class:`Fp16Health` counts those per tensor from the FP32 values (what the
FP16 model would have to hold) and the fix is the converter's own argument, ``node_block_list``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Largest finite float16 value; anything larger in magnitude rounds to inf.
FP16_MAX = 65504.0
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
        try:
            session._diag_fp16_inputs = wanted
        except AttributeError:  # a session type that refuses attributes: look up every time
            pass
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
class Fp16Fix:
    """The converter arguments that keep an FP16 model finite, derived from one comparison.

    Attributes:
        node_block_list: FP32 node names for ``convert_float_to_float16(node_block_list=...)``.
        op_block_list: the same nodes' op types (coarser: every node of those types stays float32).
        over_range: FP32 tensors whose values exceed 65504: a block list cannot keep a tensor
            between two nodes in float32 (the converter casts every blocked output back to float16),
            so these need the model itself rescaled.
        why: one sentence per listed node.
    """

    node_block_list: list[str] = field(default_factory=list)
    op_block_list: list[str] = field(default_factory=list)
    over_range: dict[str, float] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)

    def snippet(self, fp32: str = "model.fp32.onnx", out: str = "model.fp16.onnx") -> str:
        """Plain onnxruntime code that re-converts with the derived block list."""
        return (
            "import onnx\n"
            "from onnxruntime.transformers.float16 import convert_float_to_float16\n\n"
            f"model = convert_float_to_float16(onnx.load({fp32!r}), keep_io_types=True, "
            f"node_block_list={self.node_block_list!r})\n"
            f"onnx.save(model, {out!r})\n"
        )


def fp16_fix(findings: list[Any], health: dict[str, Any]) -> Fp16Fix | None:
    """Derive ``node_block_list`` from where NaN/Inf first appear in the FP16 model.

    The first node (graph order) whose FP16 output holds NaN/Inf while its FP32 output does not
    is where FP16 breaks; when its FP32 output fits FP16's range, the overflow is inside the node
    (attention scores, a reduction's sum of squares) and keeping that node in float32 removes it.
    Returns None when the FP16 model has no NaN/Inf of its own.

    Example:
        >>> fp16_fix(result.findings, result.health).node_block_list  # doctest: +SKIP
        ['attn/Attention']
    """
    from diag.analyze import nonfinite_origins

    origin = nonfinite_origins(findings).get("INT8")
    over = {
        name: max(abs(h.fp_min), abs(h.fp_max))
        for name, h in health.items()
        if max(abs(h.fp_min), abs(h.fp_max)) > FP16_MAX
    }
    if origin is None and not over:
        return None
    fix = Fp16Fix(over_range=dict(sorted(over.items(), key=lambda kv: -kv[1])))
    if origin is not None:
        peak = over.get(origin.tensor)
        fix.node_block_list = list(origin.group.fp_nodes)
        fix.op_block_list = sorted(set(origin.group.op_types))
        if peak is None:
            fix.why.append(
                f"{origin.group.label} writes NaN/Inf in FP16 while its FP32 output fits FP16's range: "
                "the overflow is inside the node; keep it in float32"
            )
        else:
            fix.why.append(
                f"{origin.group.label}'s FP32 output reaches {peak:.3g} (> 65504): blocking the node keeps "
                "its arithmetic in float32, but the converter stores its output in float16 again"
            )
    return fix
