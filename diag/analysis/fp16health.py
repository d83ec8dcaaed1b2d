"""FP16 findings: where the FP16 model first creates NaN/Inf, the ``node_block_list`` that removes it.

The analysis-side half of FP16 support (the core half, :mod:`diag.core.fp16`, casts at the session
boundary and counts range per tensor in :class:`diag.core.fp16.Fp16Range`). Where NaN/Inf first appear
is decided by one rule, :func:`diag.analysis.analyze.nonfinite_origins`; this module reads that origin once
per question and turns it into the converter's fix, the headline cause and the lines `diag compare`
prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diag.analysis.analyze import NodeFinding, nonfinite_origins
from diag.analysis.headline import Headline, Name, group_name
from diag.core.fp16 import Fp16Range


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


def fp16_origin(findings: list[NodeFinding]) -> NodeFinding | None:
    """The node where the FP16 model creates NaN/Inf its FP32 counterpart does not, else None.

    The FP16 model sits in the ``INT8`` slot of a comparison, so this is the ``INT8`` origin of
    :func:`diag.analysis.analyze.nonfinite_origins`: the one NaN/Inf-origin rule of diag.
    """
    return nonfinite_origins(findings).get("INT8")


def fp16_fix(findings: list[NodeFinding], ranges: dict[str, Fp16Range]) -> Fp16Fix | None:
    """Derive ``node_block_list`` from where NaN/Inf first appear in the FP16 model.

    The first node (graph order) whose FP16 output holds NaN/Inf while its FP32 output does not
    is where FP16 breaks; when its FP32 output fits FP16's range, the overflow is inside the node
    (attention scores, a reduction's sum of squares) and keeping that node in float32 removes it.
    Returns None when the FP16 model has no NaN/Inf of its own.

    Example:
        >>> fp16_fix(result.findings, result.state.fp16_ranges).node_block_list  # doctest: +SKIP
        ['attn/Attention']
    """
    return _fix_at(fp16_origin(findings), ranges)


def _fix_at(origin: NodeFinding | None, ranges: dict[str, Fp16Range]) -> Fp16Fix | None:
    """:func:`fp16_fix` for an origin already found."""
    over = {name: r.peak for name, r in ranges.items() if r.overflow}
    if origin is None and not over:
        return None
    fix = Fp16Fix(over_range=dict(sorted(over.items(), key=lambda kv: -kv[1])))
    if origin is not None:
        peak = over.get(origin.tensor)
        if peak is None:
            fix.node_block_list = list(origin.group.fp_nodes)
            fix.op_block_list = sorted(set(origin.group.op_types))
            fix.why.append(
                f"{origin.group.label} writes NaN/Inf in FP16 while its FP32 output fits FP16's range: "
                "the overflow is inside the node; keep it in float32"
            )
        else:
            # NOTE: no block list: the converter casts a blocked node's output back to float16
            # (value_info says float16), even when every consumer is blocked too.
            fix.why.append(
                f"{origin.group.label}'s FP32 output reaches {peak:.3g} (> 65504): no node_block_list helps, "
                "the converter stores every node's output in float16 again; rescale the model so the tensor "
                "fits (fold a scale into the weights) or keep it in FP32"
            )
    return fix


def nonfinite_cause(findings: list[NodeFinding], ranges: dict[str, Fp16Range]) -> Headline | None:
    """The headline of an FP16 comparison whose FP16 model creates NaN/Inf, else None.

    NaN/Inf is no rounding error: local SQNR cannot rank it (it is NaN) and no share of the
    output error can be "recovered". The first node (graph order) whose FP16 output holds NaN/Inf
    that its FP32 output does not is the root cause; the sentence carries the converter's fix.
    """
    origin = fp16_origin(findings)
    fix = _fix_at(origin, ranges)
    if fix is None or origin is None:
        return None
    for f in findings:
        if f is origin:
            f.role = "root-cause"
        elif f.role == "root-cause":
            f.role = "contributor"
    count = origin.accumulated.nonfinite_int8 if origin.accumulated is not None else 0
    head = ("single root cause: ", *group_name(origin.group.fp_nodes), " overflows FP16")
    if fix.node_block_list:
        return Headline(
            "single-cause",
            (
                *head,
                f" inside the node (its FP32 output fits FP16): {count} NaN/Inf value(s) in '",
                Name(origin.tensor),
                "'; keep it in float32: ",
                Name(f"node_block_list={fix.node_block_list!r}"),
            ),
            node=origin.group.label,
        )
    return Headline(
        "single-cause",
        (*head, f" in its output: {count} NaN/Inf value(s) in '", Name(origin.tensor), f"'; {fix.why[0]}"),
        node=origin.group.label,
    )
