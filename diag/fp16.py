"""FP16 models: feeding and reading float16 sessions, numeric health, and the block lists that fix them.

An FP16 model (``onnxruntime.transformers.float16.convert_float_to_float16``) keeps the FP32
model's tensor names, so :mod:`diag.match` pairs them by name; what changes is the element type.
Everything diag compares is float32: float16 values are cast back on the way out of a session, and
FP32 values are cast to float16 on the way into one (the cut model's FP16 region, an FP16 model
converted without ``keep_io_types``). The cast happens once, in :func:`diag.run.run_batch`.

What goes wrong in FP16 is range, not rounding: a value beyond 65504 becomes ``inf`` and the next
``inf - inf`` or ``0 * inf`` a ``NaN``; values below 6.1e-5 lose precision (subnormals) and below
6e-8 flush to zero. :class:`Fp16Range` counts those per tensor from the FP32 values (what the
FP16 model would have to hold) and the fix is the converter's own argument, ``node_block_list``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diag.state import float_from_state, float_to_state

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
class Fp16Range:
    """How one FP32 tensor fits FP16's range: streaming (``update`` per batch), mergeable.

    Counts come from the FP32 values, i.e. what the FP16 model would have to hold there:
    ``overflow`` values round to inf (|x| >= 65520, the first value float16 rounds up to inf),
    ``subnormal`` keep fewer than 11 significant bits (0 < |x| < 2^-14), ``flushed`` round to zero
    (0 < |x| < 2^-25). Memory O(1). Implements :class:`diag.state.Accumulator`.

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


def fp16_fix(findings: list[Any], ranges: dict[str, Fp16Range]) -> Fp16Fix | None:
    """Derive ``node_block_list`` from where NaN/Inf first appear in the FP16 model.

    The first node (graph order) whose FP16 output holds NaN/Inf while its FP32 output does not
    is where FP16 breaks; when its FP32 output fits FP16's range, the overflow is inside the node
    (attention scores, a reduction's sum of squares) and keeping that node in float32 removes it.
    Returns None when the FP16 model has no NaN/Inf of its own.

    Example:
        >>> fp16_fix(result.findings, result.state.fp16_ranges).node_block_list  # doctest: +SKIP
        ['attn/Attention']
    """
    from diag.analyze import nonfinite_origins

    origin = nonfinite_origins(findings).get("INT8")
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


def nonfinite_cause(findings: list[Any], ranges: dict[str, Fp16Range]) -> tuple[bool, str, Any] | None:
    """The headline of an FP16 comparison whose FP16 model creates NaN/Inf, else None.

    NaN/Inf is no rounding error: local SQNR cannot rank it (it is NaN) and no share of the
    output error can be "recovered". The first node (graph order) whose FP16 output holds NaN/Inf
    that its FP32 output does not is the root cause; the sentence carries the converter's fix.
    """
    fix = fp16_fix(findings, ranges)
    from diag.analyze import nonfinite_origins

    origin = nonfinite_origins(findings).get("INT8")
    if fix is None or origin is None:
        return None
    for f in findings:
        if f is origin:
            f.role = "root-cause"
        elif f.role == "root-cause":
            f.role = "contributor"
    count = origin.accumulated.nonfinite_int8 if origin.accumulated is not None else 0
    head = f"single root cause: {origin.group.label} overflows FP16"
    if fix.node_block_list:
        return (
            True,
            f"{head} inside the node (its FP32 output fits FP16): {count} NaN/Inf value(s) in "
            f"'{origin.tensor}'; keep it in float32: node_block_list={fix.node_block_list!r}",
            origin,
        )
    return True, f"{head} in its output: {count} NaN/Inf value(s) in '{origin.tensor}'; {fix.why[0]}", origin


def fp16_range_lines(findings: list[Any], ranges: dict[str, Fp16Range], top: int = 3) -> list[str]:
    """What `diag compare` prints about an FP16 model: the fix, then the tensors out of FP16's range.

    Example:
        >>> fp16_range_lines(result.findings, result.state.fp16_ranges)  # doctest: +SKIP
        ["FP16 fix: convert_float_to_float16(..., node_block_list=['attn/Attention'])"]
    """
    lines: list[str] = []
    fix = fp16_fix(findings, ranges)
    if fix is not None and fix.node_block_list:
        lines.append(f"FP16 fix: convert_float_to_float16(..., node_block_list={fix.node_block_list!r})")
    over = sorted((r.overflow, n) for n, r in ranges.items() if r.overflow)
    for count, name in over[::-1][:top]:
        r = ranges[name]
        lines.append(f"FP16 range: '{name}' reaches {r.peak:.3g} in FP32: {count} of {r.count} values overflow to inf")
    under = sorted((r.flushed / r.count, n) for n, r in ranges.items() if r.count and r.flushed)
    for share, name in under[::-1][:top]:
        r = ranges[name]
        lines.append(
            f"FP16 range: '{name}': {r.flushed} of {r.count} values ({share:.1%}) flush to zero, "
            f"{r.subnormal} are subnormal"
        )
    return lines


# ---------------------------------------------------------------- recipe mode "fp16"


def convert_model(fp32_path: str | os.PathLike[str], recipe: Any, out_path: str | os.PathLike[str]) -> Any:
    """`diag quantize` for ``mode = "fp16"``: ``convert_float_to_float16`` with the recipe's arguments.

    Guarded like the quantizer: names in ``node_block_list`` must exist (the converter ignores
    unknown ones silently), the output is verified to load in onnxruntime before it is renamed
    into place, and the input model is never modified.

    Example:
        >>> r = Recipe(mode="fp16", node_block_list=["attn"])  # doctest: +SKIP
        >>> convert_model("m.onnx", r, "m.fp16.onnx").format  # doctest: +SKIP
        'mixed'
    """
    import tempfile
    import time

    import onnx

    from diag.errors import DiagError
    from diag.load import detect_format, float_model_from_path, iter_nodes
    from diag.quantize import QuantizeReport, _checked_out, _load_error, _publish

    start = time.perf_counter()
    loaded = float_model_from_path(fp32_path)
    out = _checked_out(out_path, loaded.path)
    names = {n.name for n in iter_nodes(loaded.graph) if n.name}
    for name in recipe.node_block_list or []:
        if name not in names:
            raise DiagError(
                "bad-recipe",
                f"node_block_list entry '{name}'",
                "names no node of the FP32 model (convert_float_to_float16 would ignore it)",
                "use FP32 node names (diag inspect lists the model)",
            )
    if loaded.has_external_data:
        raise DiagError(
            "bad-recipe",
            f"FP32 model '{loaded.path}'",
            'has external data, which mode "fp16" does not convert yet',
            "call convert_float_to_float16 on the model path directly",
        )
    from onnxruntime.transformers.float16 import convert_float_to_float16

    actions: list[str] = []
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent) as stage:
        staged = Path(stage).resolve() / out.name
        try:
            model = convert_float_to_float16(
                onnx.load(str(loaded.path)),
                keep_io_types=bool(recipe.keep_io_types),
                op_block_list=recipe.op_block_list,
                node_block_list=recipe.node_block_list,
            )
        except Exception as e:
            raise DiagError(
                "quantize-failed",
                f"FP16 model for '{loaded.path}'",
                f"convert_float_to_float16 failed ({type(e).__name__}: {str(e).strip()[:200]})",
                "report the model; nothing was written",
            ) from e
        onnx.save(model, str(staged))
        error = _load_error(staged)
        if error:
            raise DiagError(
                "quantize-failed",
                f"FP16 model for '{loaded.path}'",
                f"does not load in onnxruntime ({error})",
                "nothing was written; add the failing node's op type to op_block_list",
            )
        fmt = detect_format(model)
        blocked = fmt.precisions.get("fp32", [])
        if blocked:
            actions.append(f"kept {len(blocked)} node(s) in float32: {', '.join(blocked[:5])}")
        actions.append(f"verified: the FP16 model loads in onnxruntime (format {fmt.kind})")
        _publish(staged, out)
    return QuantizeReport(out, actions, time.perf_counter() - start, fmt.kind, [], ["convert_float_to_float16"])


def infer_fp16_recipe(proto: Any) -> tuple[dict[str, Any], list[str]]:
    """The ``mode = "fp16"`` recipe that made an FP16 model, and the evidence.

    ``keep_io_types`` from the graph's float inputs/outputs; ``node_block_list`` = the nodes still
    computing in float32, minus those onnxruntime's default ``op_block_list`` keeps anyway (the
    graph cannot tell a node block from an op block: it lists nodes, which re-converts alike).

    Example:
        >>> infer_fp16_recipe(onnx.load("m.fp16.onnx"))[0]  # doctest: +SKIP
        {'mode': 'fp16', 'keep_io_types': True, 'node_block_list': ['attn/Attention']}
    """
    from onnx import TensorProto
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

    from diag.precision import fp16_breakdown

    g = proto.graph
    inits = {t.name for t in g.initializer}
    io = [v for v in list(g.input) + list(g.output) if v.name not in inits and v.type.HasField("tensor_type")]
    elem = {v.type.tensor_type.elem_type for v in io}
    keep = TensorProto.FLOAT in elem
    b = fp16_breakdown(proto)
    ops = {n.name: n.op_type for n in g.node}
    blocked = [n for n in (b.nodes.get("fp32", []) if b else []) if ops.get(n) not in DEFAULT_OP_BLOCK_LIST]
    evidence = [
        f"keep_io_types from the graph's {'float32' if keep else 'float16'} inputs/outputs",
        f"node_block_list: {len(blocked)} node(s) compute in float32",
    ]
    return {"mode": "fp16", "keep_io_types": keep, "node_block_list": blocked}, evidence


def fix_snippet_fp16(settings: dict[str, Any], nodes: list[str], fp32_path: str, fp16_path: str) -> str:
    """Python that re-converts with plain onnxruntime, adding ``nodes`` to ``node_block_list``.

    Example:
        >>> print(fix_snippet_fp16({"mode": "fp16", "keep_io_types": True}, ["attn"], "m.onnx", "m.fp16.onnx"))
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
        <BLANKLINE>
        model = convert_float_to_float16(
            onnx.load("m.onnx"),
            keep_io_types=True,
            node_block_list=["attn"],
        )
        onnx.save(model, "m.fp16.fixed.onnx")
    """
    blocked = list(dict.fromkeys([*(settings.get("node_block_list") or []), *nodes]))
    out = str(Path(fp16_path).with_name(Path(fp16_path).name.removesuffix(".onnx") + ".fixed.onnx"))
    args = [f"    keep_io_types={bool(settings.get('keep_io_types'))},"]
    if settings.get("op_block_list") is not None:
        args.append(f"    op_block_list={json.dumps(settings['op_block_list'])},")
    args.append(f"    node_block_list={json.dumps(blocked)},")
    return "\n".join(
        [
            "import onnx",
            "from onnxruntime.transformers.float16 import convert_float_to_float16",
            "",
            "model = convert_float_to_float16(",
            f"    onnx.load({json.dumps(fp32_path)}),",
            *args,
            ")",
            f"onnx.save(model, {json.dumps(out)})",
        ]
    )


def reproduce_fp16(result: Any, model_out: str) -> str:
    """`diag exclude`'s reproduce.py for an ``fp16`` recipe: one converter call, no diag.

    ``result`` is a :class:`diag.exclude.ExclusionResult`; its kept-in-float nodes become
    ``node_block_list``.

    Example:
        >>> print(reproduce_fp16(result, "m.reproduced.onnx"))  # doctest: +SKIP
        # Rebuilds the mixed-precision model found by `diag exclude` with plain onnx/onnxruntime calls.
        ...
    """
    r = result.recipe
    blocked = list(dict.fromkeys([*(r.get("node_block_list") or []), *result.nodes_to_exclude]))
    args = [f"    keep_io_types={bool(r.get('keep_io_types'))!r},"]
    if r.get("op_block_list") is not None:
        args.append(f"    op_block_list={r['op_block_list']!r},")
    args.append(f"    node_block_list={blocked!r},")
    return "\n".join(
        [
            "# Rebuilds the mixed-precision model found by `diag exclude` with plain onnx/onnxruntime calls.",
            f"# target {result.target}: {result.verdict}; {len(result.nodes_to_exclude)} node(s) kept in float32.",
            "# Paths are as given to diag exclude: run this from the folder diag exclude ran in.",
            "import os",
            "",
            "import onnx",
            "from onnxruntime.transformers.float16 import convert_float_to_float16",
            "",
            f"FP32 = os.path.abspath({result.fp32!r})",
            f"OUT = os.path.abspath({model_out!r})",
            "model = convert_float_to_float16(",
            "    onnx.load(FP32),",
            *args,
            ")",
            "onnx.save(model, OUT)",
            "",
        ]
    )
