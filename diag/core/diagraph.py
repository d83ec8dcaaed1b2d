"""The diagnostic graph: FP32, INT8 and cut models in one onnxruntime graph whose outputs are statistics.

``diag compare --reductions graph`` builds, per pass, one ONNX graph holding the FP32
model, the INT8 model and the cut (local-error) model, every name prefixed so they cannot collide
(``f/``, ``q/``, ``c/``; the model inputs are shared). The cut model's inputs are wired to the FP32
graph's tensors directly (through a QuantizeLinear with the model's own grid for integer cuts), so no
tensor is copied between sessions. For every matched pair the graph computes, as ONNX nodes, the
sums the accumulators need (:func:`diagnostic_graph`); one ``run()`` per batch returns those sums,
a strided subsample of each tensor for its histograms and the model outputs, and
:func:`stats_to_accumulators` feeds them to :meth:`ErrorAccumulator.update_from_sums` and
:meth:`DistributionAccumulator.update_from_sums`. Cross-batch merging, shard files and the analysis
are unchanged.

NOTE: sums of squares and products are reduced in float64 (``Cast`` to DOUBLE first): onnxruntime's
float32 ``ReduceSum`` over tens of millions of values drifts by more than the 0.01 dB diag promises.
The error ``e = y - x`` itself is computed in float32, as the numpy reference does.

NOTE: a batch whose sums are not finite (NaN / Inf in a tensor, or float32 overflow in the numpy
reference) is not reduced here: :func:`stats_to_accumulators` returns those tensors and the caller
reduces them with the numpy reference, so NaN handling is the reference's, exactly.

Example:
    >>> dg = diagnostic_graph(fp.proto, q.proto, cut, pairs, dists, ["logits"], types)  # doctest: +SKIP
    >>> sorted(dg.model.graph.output, key=lambda o: o.name)[0].name  # doctest: +SKIP
    'diag/0/emax'
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from diag.core.distributions import DISPLAY_SAMPLE_MAX, SAMPLE_MAX, BatchSummary, DistributionAccumulator
from diag.core.instrument import CutModel
from diag.core.match import QuantParams, TensorPair
from diag.core.metrics import ErrorAccumulator
from diag.core.protos import default_opset
from diag.core.run import inferred_for_batch, session_from_model

#: Name prefixes of the three models inside the diagnostic graph, and of diag's own nodes.
FP_PREFIX, INT8_PREFIX, CUT_PREFIX, STAT_PREFIX = "f/", "q/", "c/", "diag/"
#: A serialized graph above this many bytes is saved with external data and loaded from a path
#: (protobuf refuses messages of 2 GiB and more).
PROTOBUF_LIMIT = (2 << 30) - (64 << 20)
#: Sums beyond this are where the float32 reference overflows: such a batch is reduced by it.
_FLOAT32_SAFE = float(np.finfo(np.float32).max) / 4
_INT64_MAX = np.iinfo(np.int64).max
_INTEGER_GRIDS = {TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16}


class Unsupported(Exception):
    """This pass cannot be built as one diagnostic graph; the caller runs the numpy reference instead."""


@dataclass
class PairSpec:
    """Where the statistics of one matched tensor sit among the graph's outputs."""

    index: int
    fp_name: str
    #: Graph values of the FP32 tensor and of the (dequantized, float32) INT8 value compared with it.
    x: str
    y: str
    dist: bool
    axis: int | None
    rank: int | None
    clip: bool
    dynamic_scale: str | None
    #: Index of the pair whose size set the subsample stride this pair shares (same size when
    #: built; checked per batch, as a size could change differently at run time).
    stride_of: int | None = None


@dataclass
class LocalSpec:
    """Where the local-error sums of one tensor sit (the cut model's value vs the FP32 tensor)."""

    index: int
    fp_name: str
    x: str
    y: str
    #: Index of the accumulated pair whose sum x^2 this one shares.
    xx_index: int


@dataclass
class DiagGraph:
    """One pass's diagnostic graph and how to read its outputs."""

    model: onnx.ModelProto
    pairs: list[PairSpec]
    local: list[LocalSpec]
    #: Model output name -> (FP32 value, INT8 value) graph output names.
    outputs: dict[str, tuple[str, str]]
    #: Matched tensors reduced by the numpy reference (exposed as raw values), with the reason.
    exposed: dict[str, str] = field(default_factory=dict)
    #: Model output name -> graph output with its local value (the cut model's), for the per-part
    #: local error of Concat-built outputs (:meth:`diag.core.metrics.OutputAccumulator.update_local`).
    local_outputs: dict[str, str] = field(default_factory=dict)


class _Builder:
    """Appends diag's statistic nodes, constants and outputs to the diagnostic graph."""

    def __init__(self, graph: onnx.GraphProto, opset: int) -> None:
        self.graph = graph
        self.opset = opset
        self.count = 0
        self.consts: dict[tuple[Any, ...], str] = {}
        self.strides: dict[tuple[int, int], str] = {}
        self.stride_owner: dict[int, int] = {}

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{STAT_PREFIX}{hint}#{self.count}"

    def node(self, op: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        out = out or self.name(op)
        self.graph.node.append(helper.make_node(op, inputs, [out], name=out + ":node", **attrs))
        return out

    def const(self, value: Any, dtype: Any) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.consts:
            name = self.name("const")
            self.graph.initializer.append(numpy_helper.from_array(arr, name))
            self.consts[key] = name
        return self.consts[key]

    def reduce(self, op: str, x: str, axes: list[int] | None = None, out: str | None = None) -> str:
        if axes is None:
            return self.node(op, [x], out, keepdims=0)
        if self.opset >= 18 or (op == "ReduceSum" and self.opset >= 13):
            return self.node(op, [x, self.const(axes, np.int64)], out, keepdims=0)
        return self.node(op, [x], out, keepdims=0, axes=axes)

    def output(self, name: str) -> None:
        self.graph.output.append(onnx.ValueInfoProto(name=name))


def _rename_graph(graph: onnx.GraphProto, rename: Callable[[str], str], prefix: str) -> None:
    """Rename every value (and prefix every node name) of ``graph`` and its subgraphs, in place."""
    for i, node in enumerate(graph.node):
        node.name = prefix + (node.name or f"{node.op_type}#{i}")
        for i, n in enumerate(node.input):
            if n:
                node.input[i] = rename(n)
        for i, n in enumerate(node.output):
            if n:
                node.output[i] = rename(n)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename_graph(attr.g, rename, prefix)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _rename_graph(g, rename, prefix)
    for seq in (graph.input, graph.output, graph.value_info):
        for vi in seq:
            vi.name = rename(vi.name)
    for t in graph.initializer:
        t.name = rename(t.name)


def _copy_model_into(
    dst: onnx.GraphProto, src: onnx.GraphProto, rename: Callable[[str], str], prefix: str, initializers: bool
) -> None:
    """Append ``src``'s nodes (and initializers, value infos) to ``dst``, renamed; never touches ``src``."""
    tmp = onnx.GraphProto()
    tmp.node.extend(src.node)
    tmp.value_info.extend(src.value_info)
    if initializers:
        tmp.initializer.extend(src.initializer)
    _rename_graph(tmp, rename, prefix)
    dst.node.extend(tmp.node)
    dst.value_info.extend(tmp.value_info)
    dst.initializer.extend(tmp.initializer)


def _check_supported(fp: onnx.ModelProto, q: onnx.ModelProto) -> int:
    opset = default_opset(fp, missing=1)
    if default_opset(q, missing=1) != opset:
        raise Unsupported(f"the FP32 and INT8 models use different opsets ({opset} and {default_opset(q, missing=1)})")
    if opset < 10:
        raise Unsupported(f"opset {opset} < 10 (no Slice with steps)")
    for m in (fp, q):
        if len(m.functions) or len(m.graph.sparse_initializer):
            raise Unsupported("the model has local functions or sparse initializers")
    for a in fp.opset_import:
        for b in q.opset_import:
            if a.domain == b.domain and a.domain not in ("", "ai.onnx") and a.version != b.version:
                raise Unsupported(f"the models import domain '{a.domain}' at different versions")
    return opset


@dataclass(frozen=True)
class ValueTypes:
    """What shape inference says about one pass's values, for the first batch's input shapes.

    Attributes:
        shapes: FP32 value -> shape (None for an unknown dimension); a value of unknown rank is absent.
        dtypes: FP32 value -> ONNX element type.
        q_dtypes: INT8 value -> ONNX element type.
    """

    shapes: dict[str, tuple[int | None, ...]]
    dtypes: dict[str, int]
    q_dtypes: dict[str, int]


class _Names:
    """Value names of the three models inside the diagnostic graph (the model inputs are shared)."""

    def __init__(self, shared: set[str], q_inits: set[str]) -> None:
        self.shared = shared
        self.q_inits = q_inits
        #: Cut model input -> the diagnostic graph value that feeds it.
        self.wired: dict[str, str] = {}

    def fp(self, n: str) -> str:
        return n if n in self.shared else FP_PREFIX + n

    def q(self, n: str) -> str:
        return n if n in self.shared else INT8_PREFIX + n

    def cut(self, n: str) -> str:
        if n in self.wired:
            return self.wired[n]
        if n in self.q_inits:
            return INT8_PREFIX + n  # NOTE: the cut model is the INT8 model: share its weights
        return n if n in self.shared else CUT_PREFIX + n


def diagnostic_graph(
    fp: onnx.ModelProto,
    q: onnx.ModelProto,
    cut: CutModel | None,
    pairs: dict[str, TensorPair],
    distributions: dict[str, DistributionAccumulator],
    output_names: list[str],
    types: ValueTypes,
    part_outputs: frozenset[str] = frozenset(),
) -> DiagGraph:
    """Build the diagnostic graph of one pass: three models, statistics of ``pairs``, model outputs.

    ``part_outputs``: model outputs built from Concat parts, whose local values are returned too.

    ``types`` holds the FP32 tensors' shapes and element types (shape inference with the first
    batch's shapes) and the INT8 model's element types. A pair whose rank is unknown while its
    distribution is wanted is exposed raw and reduced by the numpy reference (listed in
    ``DiagGraph.exposed``). Never modifies its arguments.

    Raises:
        Unsupported: the pass cannot be one graph (different opsets, local functions, ...).
    """
    opset = _check_supported(fp, q)
    model, names = _three_models(fp, q)
    b = _Builder(model.graph, opset)
    if cut is not None:
        _wire_cut(b, cut, names)
    dg = DiagGraph(model, [], [], {})
    xs = _pair_statistics(b, dg, pairs, distributions, types, names)
    if cut is not None:
        _local_statistics(b, dg, cut, pairs, types, names, xs, frozenset(output_names) & part_outputs)
    for name in output_names:
        fo = b.node("Identity", [names.fp(name)], f"{STAT_PREFIX}out/f/{name}")
        qo = b.node("Identity", [names.q(name)], f"{STAT_PREFIX}out/q/{name}")
        b.output(fo)
        b.output(qo)
        dg.outputs[name] = (fo, qo)
    return dg


def _three_models(fp: onnx.ModelProto, q: onnx.ModelProto) -> tuple[onnx.ModelProto, _Names]:
    """A new model holding the FP32 and INT8 graphs side by side, renamed, their inputs shared."""
    model = onnx.ModelProto()
    model.ir_version = max(fp.ir_version, q.ir_version)
    versions: dict[str, int] = {}
    for m in (fp, q):
        for o in m.opset_import:
            versions[o.domain] = max(versions.get(o.domain, 0), o.version)
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in versions.items())
    model.producer_name = "diag"
    graph = model.graph
    graph.name = "diag_diagnostic_graph"
    fp_inits = {t.name for t in fp.graph.initializer}
    shared = [i for i in fp.graph.input if i.name not in fp_inits]
    graph.input.extend(shared)
    names = _Names({i.name for i in shared}, {t.name for t in q.graph.initializer})
    _copy_model_into(graph, fp.graph, names.fp, FP_PREFIX, True)
    _copy_model_into(graph, q.graph, names.q, INT8_PREFIX, True)
    return model, names


def _wire_cut(b: _Builder, cut: CutModel, names: _Names) -> None:
    """Add the cut model, its inputs wired to the FP32 graph's tensors (quantized for integer cuts)."""
    for ci in cut.inputs:
        src = names.fp(ci.fp_name)
        if ci.quant is None and ci.dtype == TensorProto.FLOAT16:  # a model computing in float16
            names.wired[ci.name] = b.node("Cast", [src], CUT_PREFIX + ci.name, to=TensorProto.FLOAT16)
            continue
        if ci.quant is None:
            names.wired[ci.name] = src
            continue
        if ci.dtype not in _INTEGER_GRIDS or (ci.quant.axis is not None and b.opset < 13):
            raise Unsupported(f"cut input '{ci.name}' has a grid QuantizeLinear cannot express here")
        scale, zp, axis = _grid_constants(b, ci.quant, ci.dtype)
        attrs = {"axis": axis} if axis is not None else {}
        names.wired[ci.name] = b.node("QuantizeLinear", [src, scale, zp], CUT_PREFIX + ci.name, **attrs)
    # The cut model's initializers are the INT8 model's: not copied (a > 2 GB model stays one copy).
    _copy_model_into(b.graph, cut.model.graph, names.cut, CUT_PREFIX, False)


def _pair_statistics(
    b: _Builder,
    dg: DiagGraph,
    pairs: dict[str, TensorPair],
    distributions: dict[str, DistributionAccumulator],
    types: ValueTypes,
    names: _Names,
) -> dict[str, tuple[str, str]]:
    """Error sums and distribution statistics of every pair into ``dg.pairs``.

    Returns:
        FP32 tensor -> (its float32 value in the graph, its sum x^2), for the local-error sums.
    """
    xs: dict[str, tuple[str, str]] = {}
    for k, (name, pair) in enumerate(pairs.items()):
        dist = distributions.get(name)
        shape = types.shapes.get(name)
        rank = len(shape) if shape is not None else None
        axis = None
        if dist is not None and rank is not None:
            axis = dist.axis_for(rank)
        needs_axis = pair.dequant is not None and pair.dequant.scale.size > 1 and b.opset < 13
        if needs_axis or (dist is not None and rank is None):
            why = "its rank is unknown before the run" if not needs_axis else "its grid needs opset 13"
            dg.exposed[name] = f"exposed and reduced in numpy: {why}"
            dg.pairs.append(PairSpec(k, name, "", "", False, None, None, False, None))
            continue
        x = _as_float32(b, names.fp(name), types.dtypes.get(name), f"{k}/x")
        y = _int8_value(b, names.q(pair.int8_name), pair.dequant, types.q_dtypes.get(pair.int8_name), b.opset, f"{k}/y")
        assert y is not None
        dyn = None
        if pair.dynamic_scale:
            dyn = b.node("Identity", [names.q(pair.dynamic_scale)], f"{STAT_PREFIX}{k}/dyn")
            b.output(dyn)
        grid_clip = dist is not None and dist.grid is not None
        spec = PairSpec(k, name, x, y, dist is not None, axis, rank, grid_clip, dyn)
        xs[name] = (x, _error_sums(b, x, y, f"{STAT_PREFIX}{k}/", shape))
        if dist is not None:
            _distribution_stats(b, x, y, spec, dist, f"{STAT_PREFIX}{k}/", shape)
        dg.pairs.append(spec)
    return xs


def _local_statistics(
    b: _Builder,
    dg: DiagGraph,
    cut: CutModel,
    pairs: dict[str, TensorPair],
    types: ValueTypes,
    names: _Names,
    xs: dict[str, tuple[str, str]],
    part_outputs: frozenset[str],
) -> None:
    """Local-error sums of every cut output into ``dg.local`` (sharing each pair's sum x^2)."""
    index_of = {s.fp_name: s.index for s in dg.pairs}
    for lo in cut.outputs:
        if lo.fp_name not in xs or lo.fp_name in dg.exposed:
            continue
        k = len(dg.pairs) + len(dg.local)
        dtype = pairs[lo.fp_name].cut_dtype if lo.dequant is not None else TensorProto.FLOAT
        y = _int8_value(b, names.cut(lo.name), lo.dequant, dtype, b.opset, f"{k}/ly")
        if y is None:
            dg.exposed[lo.fp_name] = "reduced in numpy: its grid needs a newer opset"
            continue
        x, xx = xs[lo.fp_name]
        _error_sums(b, x, y, f"{STAT_PREFIX}{k}/", types.shapes.get(lo.fp_name), xx)
        dg.local.append(LocalSpec(k, lo.fp_name, x, y, index_of[lo.fp_name]))
        if lo.fp_name in part_outputs:
            lo_out = b.node("Identity", [y], f"{STAT_PREFIX}out/l/{lo.fp_name}")
            b.output(lo_out)
            dg.local_outputs[lo.fp_name] = lo_out


def _grid_constants(b: _Builder, grid: QuantParams, dtype: int) -> tuple[str, str, int | None]:
    """Scale and zero point initializers of a grid, the zero point in ``dtype`` (it sets the integer type)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    scale = grid.scale.astype(np.float32)
    zp = grid.zero_point.astype(np_dtype)
    if scale.size == 1:
        return b.const(scale.reshape(()), np.float32), b.const(zp.reshape(()), np_dtype), None
    return b.const(scale.reshape(-1), np.float32), b.const(zp.reshape(-1), np_dtype), grid.axis


def _as_float32(b: _Builder, name: str, dtype: int | None, hint: str) -> str:
    if dtype == TensorProto.FLOAT:
        return name
    return b.node("Cast", [name], f"{STAT_PREFIX}{hint}", to=TensorProto.FLOAT)


def _int8_value(
    b: _Builder, name: str, dequant: QuantParams | None, dtype: int | None, opset: int, hint: str
) -> str | None:
    """The INT8 model's value as float32: dequantized with the pair's grid for QOperator integer tensors."""
    if dequant is None:
        return _as_float32(b, name, dtype, hint)
    if dequant.scale.size > 1 and opset < 13:
        return None
    zp_dtype = dtype if dtype in _INTEGER_GRIDS else helper.np_dtype_to_tensor_dtype(dequant.zero_point.dtype)
    scale, zp, axis = _grid_constants(b, dequant, zp_dtype)
    attrs = {"axis": axis} if axis is not None else {}
    return b.node("DequantizeLinear", [name, scale, zp], f"{STAT_PREFIX}{hint}", **attrs)


#: Float32 partial sums cover at most this many values (relative error ~1e-7 at most), and at
#: least ``_ROW_MIN`` when the shape allows (fewer, larger partials leave the session).
_ROW_MAX, _ROW_MIN = 1 << 16, 1 << 8
#: More partials than this are summed in float64 inside the graph instead of leaving it.
_PARTIALS_MAX = 4096
#: Up to this many values a tensor is reduced whole in float32: onnxruntime's vectorized full
#: reduction runs at memory speed (~5x its per-row reductions) and stays within ~2e-4 relative
#: (measured: 4.3e-4 on 10^7 lognormal values, 0.002 dB of SQNR).
_FULL_MAX = 1 << 22


def _row_axes(shape: tuple[int | None, ...] | None) -> tuple[list[int], int | None] | None:
    """Trailing axes whose block holds ``_ROW_MIN`` to ``_ROW_MAX`` values, and how many blocks there are.

    NOTE: onnxruntime reduces a trailing block of axes on its fast contiguous path; a float32 sum
    over at most 2^16 values is exact to ~1e-7, and the partials are summed in float64 (numpy, or
    the graph when there are many). None when the shape is unknown or the last axis alone is too
    long: the graph then casts to float64 before reducing (slower, as exact).
    """
    if shape is None:
        return None
    size = _known_size(shape)
    if size is not None and size <= _FULL_MAX:
        return [], 1
    if not shape:
        return None
    axes: list[int] = []
    block = 1
    for a in range(len(shape) - 1, -1, -1):
        d = shape[a]
        if d is None or block >= _ROW_MIN or block * d > _ROW_MAX:
            break
        block *= d
        axes.insert(0, a)
    if not axes:
        return None
    return axes, _known_size(shape[: axes[0]])


def _known_size(shape: tuple[int | None, ...]) -> int | None:
    """The number of values of ``shape`` (1 for a scalar); None when a dimension is unknown."""
    size = 1
    for d in shape:
        if d is None:
            return None
        size *= d
    return size


def _partial(b: _Builder, op: str, x: str, rows: tuple[list[int], int | None] | None, out: str) -> str:
    """``op`` over ``x`` as float32 partials per block (finished in float64), or whole in float64."""
    if rows is None:
        if op in ("ReduceMax", "ReduceMin"):
            return b.reduce(op, x, out=out)
        return b.reduce(op, b.node("Cast", [x], to=TensorProto.DOUBLE), out=out)
    axes, count = rows
    if not axes:
        return b.reduce(op, x, out=out)
    if count is not None and count <= _PARTIALS_MAX:
        return b.reduce(op, x, axes, out=out)
    part = b.reduce(op, x, axes)
    if op in ("ReduceMax", "ReduceMin"):
        return b.reduce(op, part, out=out)
    return b.reduce("ReduceSum", b.node("Cast", [part], to=TensorProto.DOUBLE), out=out)


def _error_sums(
    b: _Builder, x: str, y: str, p: str, shape: tuple[int | None, ...] | None, xx: str | None = None
) -> str:
    """Sum x^2, x*e, e^2, |e| and max / min e of one pair, and both shapes; returns the sum x^2.

    ``xx``: the sum x^2 already computed for the same FP32 tensor (local error reuses it).
    """
    rows = _row_axes(shape)
    e = b.node("Sub", [y, x], p + "e")
    if xx is None:
        xx = _partial(b, "ReduceSumSquare", x, rows, p + "xx")
        b.output(xx)
    for out, node in (
        ("ee", _partial(b, "ReduceSumSquare", e, rows, p + "ee")),
        ("xe", _partial(b, "ReduceSum", b.node("Mul", [x, e], p + "xed"), rows, p + "xe")),
        ("ab", _partial(b, "ReduceL1", e, rows, p + "ab")),
        ("emax", _partial(b, "ReduceMax", e, rows, p + "emax")),
        ("emin", _partial(b, "ReduceMin", e, rows, p + "emin")),
        ("shx", b.node("Shape", [x], p + "shx")),
        ("shy", b.node("Shape", [y], p + "shy")),
    ):
        assert node == p + out
        b.output(node)
    return xx


def _strided_sample(b: _Builder, x: str, limit: int, out: str, key: tuple[int, int] | None = None) -> str:
    """The same elements as :func:`diag.core.distributions._sample`: ``flat[::stride]``, odd stride.

    NOTE: tensors of the same size share one stride computation (``key``: size when built, limit):
    a dozen scalar nodes fewer per tensor, a quarter of the graph's nodes.
    """
    flat = b.node("Reshape", [x, b.const([-1], np.int64)])
    if key is not None and key in b.strides:
        steps = b.strides[key]
        return b.node(
            "Slice", [flat, b.const([0], np.int64), b.const([_INT64_MAX], np.int64), b.const([0], np.int64), steps], out
        )
    size = b.node("Size", [x])
    s1 = b.node("Add", [b.node("Div", [size, b.const(limit, np.int64)]), b.const(1, np.int64)])
    odd = b.node("Add", [s1, b.node("Sub", [b.const(1, np.int64), b.node("Mod", [s1, b.const(2, np.int64)])])])
    stride = b.node("Where", [b.node("Greater", [size, b.const(limit, np.int64)]), odd, b.const(1, np.int64)])
    steps = b.node("Reshape", [stride, b.const([1], np.int64)])
    if key is not None:
        b.strides[key] = steps
    return b.node(
        "Slice", [flat, b.const([0], np.int64), b.const([_INT64_MAX], np.int64), b.const([0], np.int64), steps], out
    )


def _distribution_stats(
    b: _Builder,
    x: str,
    y: str,
    spec: PairSpec,
    dist: DistributionAccumulator,
    p: str,
    shape: tuple[int | None, ...] | None,
) -> None:
    """Per-channel (or whole-tensor) min / max / sum, clip counts and the histogram subsamples.

    Channel statistics reduce the axes after the channel axis in onnxruntime (a contiguous block)
    and leave ``[before..., C]`` partials, which numpy finishes (sums in float64).
    """
    if spec.axis is not None and spec.rank is not None:
        after = list(range(spec.axis + 1, spec.rank))
        axes = after or list(range(spec.axis))
        for stat, op in (("cmin", "ReduceMin"), ("cmax", "ReduceMax"), ("csum", "ReduceSum")):
            b.output(b.reduce(op, x, axes, out=p + stat))
        lo = b.reduce("ReduceMin", p + "cmin")
        hi = b.reduce("ReduceMax", p + "cmax")
    else:
        rows = _row_axes(shape)
        lo = _partial(b, "ReduceMin", x, rows, p + "min")
        hi = _partial(b, "ReduceMax", x, rows, p + "max")
        b.output(lo)
        b.output(hi)
        lo, hi = b.reduce("ReduceMin", lo), b.reduce("ReduceMax", hi)
    if spec.clip:
        assert dist.grid is not None
        for stat, op, edge, extreme in (("clo", "Less", dist.grid.low, lo), ("chi", "Greater", dist.grid.high, hi)):
            # NOTE: counted only when the batch leaves the grid (an If), as the numpy reference does.
            edge_name = b.const(edge, np.float32)
            leaves = b.node(op, [extreme, edge_name])
            b.output(
                b.node(
                    "If",
                    [leaves],
                    p + stat,
                    then_branch=_count_branch(b, x, op, edge_name, shape),
                    else_branch=_zero_branch(b),
                )
            )
    size = _known_size(shape) if shape is not None else None
    if size is not None:
        spec.stride_of = b.stride_owner.setdefault(size, spec.index)
    b.output(_strided_sample(b, x, SAMPLE_MAX, p + "sample", (size, SAMPLE_MAX) if size is not None else None))
    key8 = (size, DISPLAY_SAMPLE_MAX) if size is not None else None
    b.output(_strided_sample(b, y, DISPLAY_SAMPLE_MAX, p + "sample8", key8))


def _count_branch(b: _Builder, x: str, op: str, edge: str, shape: tuple[int | None, ...] | None) -> onnx.GraphProto:
    """If-branch: how many values of outer-scope ``x`` are beyond ``edge`` (a float64 scalar)."""
    g = onnx.GraphProto(name=b.name("count"))
    sub = _Builder(g, b.opset)
    sub.count = b.count  # names stay unique across the whole graph, branches included
    hit = sub.node("Cast", [sub.node(op, [x, edge])], to=TensorProto.FLOAT)
    rows = _row_axes(shape)
    if rows is None or not rows[0]:
        total = sub.reduce("ReduceSum", sub.node("Cast", [hit], to=TensorProto.DOUBLE))
    else:
        total = sub.reduce(
            "ReduceSum", sub.node("Cast", [sub.reduce("ReduceSum", hit, rows[0])], to=TensorProto.DOUBLE)
        )
    b.count = sub.count
    g.output.append(helper.make_tensor_value_info(total, TensorProto.DOUBLE, []))
    return g


def _zero_branch(b: _Builder) -> onnx.GraphProto:
    g = onnx.GraphProto(name=b.name("none"))
    zero = b.name("zero")
    g.node.append(helper.make_node("Constant", [], [zero], value=numpy_helper.from_array(np.array(0.0))))
    g.output.append(helper.make_tensor_value_info(zero, TensorProto.DOUBLE, []))
    return g


@dataclass
class Flagged:
    """Matched tensors of one batch that the numpy reference must reduce (non-finite sums)."""

    accumulated: list[str] = field(default_factory=list)
    local: list[str] = field(default_factory=list)


def _size(out: dict[str, np.ndarray], index: int) -> int:
    return int(np.prod(out[f"{STAT_PREFIX}{index}/shx"], dtype=np.int64))


def _total(a: np.ndarray) -> float:
    return float(np.sum(a, dtype=np.float64))


def _sums_ok(out: dict[str, np.ndarray], p: str, xx: str) -> bool:
    """Finite and far from float32 overflow (where the numpy reference's float32 sums overflow)."""
    return all(abs(_total(out[k])) < _FLOAT32_SAFE for k in (xx, p + "ee", p + "xe", p + "ab"))


def stats_to_accumulators(
    dg: DiagGraph,
    out: dict[str, np.ndarray],
    pairs: dict[str, TensorPair],
    accumulated: dict[str, ErrorAccumulator],
    local: dict[str, ErrorAccumulator],
    distributions: dict[str, DistributionAccumulator],
    runtime_unmatched: dict[str, str],
) -> Flagged:
    """Feed one batch's statistics to the accumulators; returns what the numpy reference must reduce.

    Pairs whose FP32 and INT8 shapes differ at run time are dropped with a reason, as the numpy
    reference does. A pair's accumulators see each batch once, in order (bit-identical merges).
    """
    flagged = Flagged()
    dropped: set[str] = set()
    for spec in dg.pairs:
        name = spec.fp_name
        if name in dg.exposed or name not in pairs:
            continue
        p = f"{STAT_PREFIX}{spec.index}/"
        shx, shy = tuple(int(d) for d in out[p + "shx"]), tuple(int(d) for d in out[p + "shy"])
        if shx != shy:
            runtime_unmatched[name] = f"shape differs at run time: FP32 {shx}, INT8 '{pairs[name].int8_name}' {shy}"
            pairs.pop(name, None)
            accumulated.pop(name, None)
            distributions.pop(name, None)
            dropped.add(name)
            continue
        owner = spec.stride_of
        shared_stride_ok = owner is None or owner == spec.index or _size(out, owner) == _size(out, spec.index)
        if not _sums_ok(out, p, p + "xx") or not shared_stride_ok:
            flagged.accumulated.append(name)
            continue
        pair = pairs[name]
        dyn = float(np.max(out[spec.dynamic_scale])) if spec.dynamic_scale and out[spec.dynamic_scale].size else None
        scale = pair.grid.per_tensor_scale if pair.grid is not None else dyn
        acc = accumulated.setdefault(name, ErrorAccumulator())
        _update_error(acc, out, p, p + "xx", scale)
        dist = distributions.get(name)
        if dist is not None and spec.dist and int(np.prod(shx, dtype=np.int64)) > 0:  # the reference skips empty ones
            dist.update_from_sums(_batch_summary(spec, out, p, shx, dyn if pair.dynamic_scale else None))
    for ls in dg.local:
        if ls.fp_name in dropped or ls.fp_name not in pairs:
            continue
        p = f"{STAT_PREFIX}{ls.index}/"
        shx, shy = tuple(out[p + "shx"]), tuple(out[p + "shy"])
        if shx != shy:
            continue  # the numpy reference skips such a local value too
        xx = f"{STAT_PREFIX}{ls.xx_index}/xx"
        if not _sums_ok(out, p, xx):
            flagged.local.append(ls.fp_name)
            continue
        grid = pairs[ls.fp_name].grid
        _update_error(
            local.setdefault(ls.fp_name, ErrorAccumulator()), out, p, xx, grid.per_tensor_scale if grid else None
        )
    return flagged


def _batch_summary(
    spec: PairSpec, out: dict[str, np.ndarray], p: str, shx: tuple[int, ...], dyn: float | None
) -> BatchSummary:
    """One pair's distribution statistics of a batch (``p``: its output prefix; ``shx``: its shape)."""
    n = int(np.prod(shx, dtype=np.int64))
    channels: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    if spec.axis is not None:
        c = shx[spec.axis]
        cmin, cmax = out[p + "cmin"].reshape(-1, c), out[p + "cmax"].reshape(-1, c)
        channels = (cmin.min(axis=0), cmax.max(axis=0), out[p + "csum"].reshape(-1, c).sum(axis=0, dtype=np.float64))
        lo, hi = (float(cmin.min()), float(cmax.max())) if n else (0.0, 0.0)
    else:
        lo, hi = (float(np.min(out[p + "min"])), float(np.max(out[p + "max"]))) if n else (0.0, 0.0)
    return BatchSummary(
        n,
        spec.rank or 0,
        lo,
        hi,
        channels,
        out[p + "sample"],
        out[p + "sample8"],
        int(out[p + "clo"]) if spec.clip else 0,
        int(out[p + "chi"]) if spec.clip else 0,
        dyn,
    )


def _update_error(acc: ErrorAccumulator, out: dict[str, np.ndarray], p: str, xx: str, scale: float | None) -> None:
    n = int(np.prod(out[p + "shx"], dtype=np.int64))
    if n == 0:
        return
    max_abs = max(float(np.max(out[p + "emax"])), -float(np.min(out[p + "emin"])))
    s_xe, s_ee, s_abs_e = (_total(out[p + k]) for k in ("xe", "ee", "ab"))
    acc.update_from_sums(n, _total(out[xx]), s_xe, s_ee, s_abs_e, max_abs, scale)


def stat_to_model(name: str) -> tuple[str, str]:
    """``('FP32' | 'INT8' | 'cut' | 'diag', original name)`` of a diagnostic-graph node or value name.

    Example:
        >>> stat_to_model("q/conv1_quant")
        ('INT8', 'conv1_quant')
    """
    for prefix, role in ((FP_PREFIX, "FP32"), (INT8_PREFIX, "INT8"), (CUT_PREFIX, "cut"), (STAT_PREFIX, "diag")):
        if name.startswith(prefix):
            return role, name[len(prefix) :]
    return "diag", name


def shapes_and_types(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> tuple[dict[str, tuple[int | None, ...]], dict[str, int]]:
    """Shape (None for unknown dims) and element type of every top-level value of ``model`` for ``feeds``.

    Shape inference runs on a weight-free copy with the inputs pinned to the batch's shapes; a
    value whose rank stays unknown is absent (its pair is then reduced by the numpy reference).
    """

    inferred = inferred_for_batch(model, feeds)  # unknown ranks fall back to the numpy reference
    shapes: dict[str, tuple[int | None, ...]] = {}
    types: dict[str, int] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if tt.elem_type:
            types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            shapes[vi.name] = tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim)
    for k, v in feeds.items():
        shapes[k] = tuple(int(d) for d in np.shape(v))
    return shapes, types


def session_from_graph(dg: DiagGraph, role: str, threads: int, external_data_dir: Any) -> Any:
    """An exact-mode session on the diagnostic graph; drops the graph's proto once onnxruntime has it.

    A graph whose serialized size would pass protobuf's 2 GiB limit (inline weights of two large
    models) is saved with external data to a temporary folder and loaded from that path.
    """

    model, dg.model = dg.model, onnx.ModelProto()
    if model.ByteSize() < PROTOBUF_LIMIT:
        return session_from_model(
            model, role, "disabled", threads, external_data_dir, takes_turns=True, frees_inside_run=True
        )
    if external_data_dir is not None:
        raise Unsupported("the graph exceeds 2 GiB with inline weights next to external ones")
    with tempfile.TemporaryDirectory(prefix="diag-graph-") as tmp:
        path = Path(tmp) / "diagnostic.onnx"
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin")
        del model
        # NOTE: onnxruntime has read (or mapped) the weights once the session exists; the folder can go.
        return session_from_model(path, role, "disabled", threads, None, takes_turns=True, frees_inside_run=True)
