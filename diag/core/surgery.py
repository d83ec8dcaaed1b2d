"""Float regions spliced into an INT8 model: the one place diag does graph surgery.

Every fix diag verifies is a model the user can ship: *their* INT8 model, with the FP32 nodes of
a few groups computed in float where their INT8 versions were, and every other node and
initializer left as they were. The effect check (:mod:`diag.analysis.effects`), the exclusion
search (:mod:`diag.fix.exclude`), the tier search and the remedies all build such models here.

What a float region is, per format (it mirrors onnxruntime's ``nodes_to_exclude`` in spirit):

* **QDQ**: the FP32 node(s) of the group, with their FP32 weights, read the dequantized value of
  each input (or the float tensor itself when no quantized node reads it any more: its Q/DQ pair
  goes with the region), and the consumers read the float output, re-quantized onto its own grid
  while a quantized consumer still reads it.
* **dynamic**: MatMulInteger / ConvInteger / DynamicQuantizeLinear / MatMulIntegerToFloat are
  replaced by the FP32 node reading the float tensor (a DynamicQuantizeLinear another quantized
  node shares stays).
* **QOperator**: a QLinear* node is replaced by DequantizeLinear -> FP32 node -> QuantizeLinear on
  the tensors' own scales.
* **MatMulNBits**: the FP32 MatMul with its FP32 weight; or, for a tier plan (``bits``), the
  FP32 weight re-blocked at another width by onnxruntime's own ``MatMulNBitsQuantizer`` (round to
  nearest, the user's block size, symmetry and accuracy level), that one node only.

:func:`float_region_model` is the trial model (kept INT8 nodes that nothing reads any more are
dropped; their initializers may stay). :func:`spliced_model` is the shippable one: the same graph
with the initializers only the replaced nodes read removed, so it differs from the user's model
only inside the regions (``tests/test_surgery.py`` compares every other node and initializer).

NOTE: nothing here touches a model on disk; every model is a new proto.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_model, load_external_data_for_tensor, uses_external_data

from diag.core.load import LoadedModel, outer_scope_inputs, subgraphs
from diag.core.match import Matching, TensorPair
from diag.core.protos import default_opset, node_id

#: Names of the nodes, tensors and initializers a float region adds (never an FP32 or INT8 name).
PREFIX = "diag_float/"


def float_region_model(
    fp: onnx.ModelProto,
    q: onnx.ModelProto,
    group_fp_nodes: list[str],
    matching: Matching,
    op_types: set[str] | None = None,
    fp_dir: Path | None = None,
) -> onnx.ModelProto:
    """The INT8 model with the FP32 node(s) ``group_fp_nodes`` computed in float (see module doc).

    Mirrors what ``nodes_to_exclude`` does: the float node reads the value its INT8 version reads
    (the dequantized input in static formats, where the producer's output quantization stays; the
    float tensor itself in dynamic ones, whose input quantization belongs to the consumer), and its
    output enters the INT8 graph where the INT8 node's did (``cut_name``), quantized onto the same
    grid when that tensor is an integer, so the output quantization the consumers need stays too.
    In static QDQ models a tensor keeps its Q/DQ only while a node that is still quantized reads
    or writes it (``op_types``: the op types the recipe quantizes; None: quantize_static's
    defaults), as with onnxruntime. Raises ValueError when the region cannot be rebuilt (a
    subgraph, a tensor with no INT8 pair).

    External data: the copy keeps the INT8 model's references (run it with the INT8 model's
    folder as ``external_data_dir``). The region's own FP32 weights keep theirs too when both
    models sit in one folder (``fp_dir`` None); ``fp_dir``, the FP32 model's folder when it is
    another one, has them read into the copy (only the region's: one projection, not the model;
    over :data:`REGION_READ_BYTES` the region is refused with ValueError).

    Example:
        >>> m = float_region_model(fp.proto, q.proto, ["conv3"], matching)  # doctest: +SKIP
    """
    nodes = _region_nodes(fp, group_fp_nodes)
    region = _Region(
        pairs=matching.pairs,
        produced={o for n in nodes for o in n.output if o},
        stays_quantized=_still_quantized(fp, set(group_fp_nodes), matching, op_types),
    )
    _read_region_inputs(region, nodes, fp, {i.name for i in q.graph.input}, fp_dir)
    for o in region.produced:
        region.rename[o] = PREFIX + o
    _copy_region_nodes(region, nodes)
    model = onnx.ModelProto()
    model.CopyFrom(q)
    g = model.graph
    fp_consumed = {t for n in fp.graph.node for t in n.input}
    if not _splice_region_outputs(region, g, fp_consumed):
        raise ValueError("no output of the group has an INT8 counterpart")
    g.initializer.extend(region.new_inits)
    g.node.extend(region.new_nodes)
    _drop_dead_nodes(g)
    _sort_topologically(g)
    return model


@dataclass
class _Region:
    """A float region being built: the nodes and initializers it adds, and what each FP32 tensor is read as."""

    pairs: dict[str, TensorPair]
    #: the tensors the region's nodes write
    produced: set[str]
    #: does a static QDQ model keep this tensor's Q/DQ with the region in float (``_still_quantized``)
    stays_quantized: Callable[[str], bool]
    new_nodes: list[onnx.NodeProto] = field(default_factory=list)
    new_inits: list[onnx.TensorProto] = field(default_factory=list)
    #: FP32 tensor name -> the tensor the float copy reads (or writes) instead
    rename: dict[str, str] = field(default_factory=dict)
    #: tensors made inside the region that a float node reads through their kept Q/DQ
    requantized: dict[str, str] = field(default_factory=dict)


def _region_nodes(fp: onnx.ModelProto, group_fp_nodes: list[str]) -> list[onnx.NodeProto]:
    """The FP32 nodes of the group; a region diag cannot rebuild (missing node, subgraph) raises ValueError."""
    fp_index = {node_id(n, i): n for i, n in enumerate(fp.graph.node)}
    nodes = [fp_index[n] for n in group_fp_nodes if n in fp_index]
    if len(nodes) != len(group_fp_nodes):
        raise ValueError("a node of the group is not in the FP32 graph")
    if any(subgraphs(n) for n in nodes):
        raise ValueError("the group holds a subgraph (If / Loop)")
    return nodes


def _read_region_inputs(
    region: _Region,
    nodes: list[onnx.NodeProto],
    fp: onnx.ModelProto,
    graph_inputs: set[str],
    fp_dir: Path | None = None,
) -> None:
    """Decide what each input of the region reads: the value the INT8 node read before it was excluded.

    Weights are the FP32 initializers (or Constant nodes) themselves; a tensor the region makes
    itself is read directly, or through its kept Q/DQ while another consumer is still quantized;
    any other tensor is read from the INT8 graph by :func:`_region_input`.
    """
    fp_inits = {i.name: i for i in fp.graph.initializer}
    # Paddle and TF exports hold weights in Constant nodes, which the quantizer lifts into
    # initializers first: the float copy reads the constant itself.
    fp_consts = {n.output[0]: n for n in fp.graph.node if n.op_type == "Constant" and n.output}
    pairs, rename = region.pairs, region.rename
    out_grids = [pairs[o].grid for o in region.produced if o in pairs and pairs[o].grid is not None]
    is_concat = any(n.op_type == "Concat" for n in nodes)
    for n in nodes:
        for t in n.input:
            if not t or t in rename or t in region.requantized:
                continue
            if t in region.produced:
                pair = pairs.get(t)
                if pair is not None and pair.how == "qdq" and pair.grid is not None and region.stays_quantized(t):
                    # Another consumer is still quantized, so onnxruntime keeps this tensor's Q/DQ
                    # and every consumer, this float one too, reads the dequantized value.
                    q_out = _grid_node("QuantizeLinear", PREFIX + t, pair.grid, region.new_nodes, region.new_inits)
                    region.requantized[t] = _grid_node(
                        "DequantizeLinear", q_out, pair.grid, region.new_nodes, region.new_inits
                    )
                continue
            if t in fp_inits:
                init = onnx.TensorProto()
                init.CopyFrom(fp_inits[t])
                if init.data_location == onnx.TensorProto.EXTERNAL and fp_dir is not None:
                    _read_external(init, fp_dir)
                init.name = PREFIX + t
                region.new_inits.append(init)
                rename[t] = init.name
            elif t in fp_consts and t not in pairs:
                const = onnx.NodeProto()
                const.CopyFrom(fp_consts[t])
                const.name = PREFIX + (const.name or t)
                const.output[0] = PREFIX + t
                region.new_nodes.append(const)
                rename[t] = const.output[0]
            elif t in graph_inputs and not (t in pairs and pairs[t].how == "qdq" and region.stays_quantized(t)):
                rename[t] = t
            elif t in pairs:
                rename[t] = _region_input(region, t, pairs[t], is_concat and _shares_grid(pairs[t], out_grids))
            else:
                raise ValueError(f"input '{t}' has no INT8 counterpart")


#: The most FP32 weight bytes a float region may read into memory (models in two folders).
REGION_READ_BYTES = 512 * 2**20


def _read_external(init: onnx.TensorProto, folder: Path) -> None:
    """Read one external initializer's bytes into it (paths were confined to the model's folder by
    :func:`diag.core.load.load_model`); ValueError over :data:`REGION_READ_BYTES`."""
    length = next((int(e.value) for e in init.external_data if e.key == "length"), None)
    size = length if length is not None else int(np.prod(init.dims, dtype=np.int64)) * 4
    if size > REGION_READ_BYTES:
        raise ValueError(f"weight '{init.name}' is {size >> 20} MB in another folder's external data")
    load_external_data_for_tensor(init, str(folder))
    del init.external_data[:]
    init.data_location = onnx.TensorProto.DEFAULT


def _qdq_region_input(region: _Region, t: str, pair: TensorPair, concat_grid: bool) -> str:
    """A QDQ input's value: the float one where the input leaves quantization with the region."""
    if pair.tail and not region.stays_quantized(t):
        # Nothing that still quantizes this tensor touches it: excluded, it stays float.
        return pair.cut_name
    if concat_grid and pair.tail:
        # onnxruntime's QDQ quantizer gives a Concat's inputs the output's scale: that
        # quantization belongs to this node and goes with it (excluded, the input keeps
        # its producer's own, finer grid; its float value is the closest stand-in).
        return pair.cut_name
    return pair.int8_name


def _region_input(region: _Region, t: str, pair: TensorPair, concat_grid: bool) -> str:
    """The INT8 graph's value a float node reads for input ``t``, made outside the region.

    ``concat_grid``: the region is a Concat whose output grid this input shares.
    """
    if pair.how == "qdq" and pair.cut_dtype == onnx.TensorProto.FLOAT16:
        # A model computing in float16 around its Q/DQ pairs (ModelOpt's default): the float32
        # node reads the float16 value cast up, as it does in an FP16 model.
        return _cast_node(_qdq_region_input(region, t, pair, concat_grid), onnx.TensorProto.FLOAT, region.new_nodes)
    if pair.how == "qdq" and pair.tail:
        return _qdq_region_input(region, t, pair, concat_grid)
    if pair.how == "fp16":
        # What node_block_list does: the float32 node reads its float16 input cast up.
        return _cast_node(pair.int8_name, onnx.TensorProto.FLOAT, region.new_nodes)
    if pair.dequant is not None:
        return _grid_node("DequantizeLinear", pair.int8_name, pair.dequant, region.new_nodes, region.new_inits)
    return pair.int8_name


def _copy_region_nodes(region: _Region, nodes: list[onnx.NodeProto]) -> None:
    """The float copies of the region's nodes, reading and writing the renamed tensors."""
    for n in nodes:
        copy = helper.make_node(
            n.op_type,
            [region.requantized.get(t) or region.rename.get(t, t) if t else "" for t in n.input],
            [region.rename.get(o, o) if o else "" for o in n.output],
            name=PREFIX + (n.name or n.op_type),
            domain=n.domain,
        )
        copy.attribute.extend(n.attribute)
        region.new_nodes.append(copy)


def _splice_region_outputs(region: _Region, g: onnx.GraphProto, fp_consumed: set[str]) -> int:
    """Make the INT8 graph read the region's outputs where it read the INT8 node's; returns how many.

    Each output enters where the INT8 node's did (``cut_name``), re-quantized onto its grid when
    the consumers expect integers, or replaces the quantized tensor itself when no quantized
    consumer is left (onnxruntime drops its Q/DQ then), or the model output nothing else reads.
    """
    graph_outputs = {o.name for o in g.output}
    replaced = 0
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    writers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in g.node:
        for i, t in enumerate(node.input):
            readers.setdefault(t, []).append((node, i))
        for i, t in enumerate(node.output):
            writers.setdefault(t, []).append((node, i))
    for o in sorted(region.produced):
        pair = region.pairs.get(o)
        if pair is None:
            continue  # an internal tensor of a fused group: it has no INT8 twin to replace
        value = region.rename[o]
        target = pair.cut_name
        if o in graph_outputs and o not in fp_consumed and pair.int8_name in graph_outputs:
            # A model output nothing else reads: excluded, onnxruntime leaves it unquantized.
            target = pair.int8_name
        elif pair.how == "qdq" and pair.tail and not region.stays_quantized(o):
            target = pair.int8_name  # no quantized consumer is left: its Q/DQ goes too
        if pair.cut_quant is not None and target == pair.cut_name:
            value = _grid_node(
                "QuantizeLinear", value, pair.cut_quant, region.new_nodes, region.new_inits, pair.cut_dtype
            )
        elif pair.cut_dtype == onnx.TensorProto.FLOAT16 and (target == pair.cut_name or pair.how == "qdq"):
            value = _cast_node(value, onnx.TensorProto.FLOAT16, region.new_nodes)  # and its output cast back down
        # NOTE: the region writes the very tensor the consumers read (its INT8 writer's output is
        # renamed, and that writer, read by nothing now, is dropped), so no node outside the region
        # is edited: the spliced model is the user's, byte for byte, outside the regions.
        for node, i in writers.get(target, []):
            node.output[i] = target + "__diag_replaced"
        region.new_nodes.append(helper.make_node("Identity", [value], [target], name=PREFIX + "out/" + target))
        replaced += 1
    return replaced


def _still_quantized(
    fp: onnx.ModelProto, excluded: set[str], matching: Matching, op_types: set[str] | None
) -> Callable[[str], bool]:
    """``f(tensor)``: does a static QDQ model keep ``tensor``'s Q/DQ with ``excluded`` in float?

    onnxruntime's QDQ quantizer quantizes a tensor when a node it quantizes reads or writes it,
    and then rewires *every* reader to the dequantized value. So the tensor stays quantized while
    a node touching it is still quantized (an op type the quantizer handles, in a group that was
    quantized in the INT8 model, not being excluded); read by excluded nodes only, it becomes
    float. (A HardSigmoid has Q/DQ on its output only because the Mul after it asked for it.)
    """
    if op_types is None:
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

        op_types = set(QDQRegistry) | set(QLinearOpsRegistry)
    by_id = {node_id(n, i): n for i, n in enumerate(fp.graph.node)}
    quantized = {n for g in matching.groups if g.quantized for n in g.fp_nodes if n in by_id} - excluded
    quantized = {n for n in quantized if by_id[n].op_type in op_types}
    touching: dict[str, set[str]] = {}
    for nid, n in by_id.items():
        for t in [*n.input, *n.output]:
            if t:
                touching.setdefault(t, set()).add(nid)

    def stays(tensor: str, ignoring: frozenset[str] = frozenset()) -> bool:
        for nid in sorted((touching.get(tensor, set()) & quantized) - ignoring):
            node = by_id[nid]
            if node.op_type not in _FOLLOWERS:
                return True
            # Reshape, MaxPool, Relu, ...: onnxruntime quantizes them only when their data
            # input is already quantized by another node.
            data = node.input[1] if node.op_type == "Where" and len(node.input) > 1 else node.input[0]
            if stays(data, ignoring | {nid}):
                return True
        return False

    return stays


#: QDQ op quantizers that act only when their data input is already quantized (onnxruntime's
#: QDQDirect8BitOp and kin): they pass a quantization on, they never start one.
_FOLLOWERS = frozenset(
    {
        "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "AveragePool", "Slice", "TopK", "MaxPool",
        "Resize", "Gather", "GatherElements", "Split", "Where", "Relu", "Clip", "Pad",
    }
)  # fmt: skip


def _shares_grid(pair: TensorPair, grids: list[Any]) -> bool:
    """Whether ``pair``'s static grid is one of ``grids`` (the same scale and zero point)."""
    g = pair.grid
    if g is None:
        return False
    return any(
        np.array_equal(np.asarray(g.scale), np.asarray(o.scale))
        and np.array_equal(np.asarray(g.zero_point), np.asarray(o.zero_point))
        for o in grids
    )


def _grid_node(
    op: str,
    value: str,
    grid: Any,
    new_nodes: list[onnx.NodeProto],
    new_inits: list[onnx.TensorProto],
    dtype: int | None = None,
) -> str:
    """A QuantizeLinear / DequantizeLinear of ``value`` on ``grid`` (a QuantParams)."""
    zp = np.asarray(grid.zero_point)
    if dtype is not None and dtype != onnx.TensorProto.FLOAT:
        zp = zp.astype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    elif not np.issubdtype(zp.dtype, np.integer):
        zp = zp.astype(np.int8 if grid.qmin < 0 else np.uint8)
    base = f"{PREFIX}{value}/{op}"
    s_init = numpy_helper.from_array(np.asarray(grid.scale, np.float32), base + "/scale")
    z_init = numpy_helper.from_array(zp, base + "/zero_point")
    new_inits += [s_init, z_init]
    out = base + "/out"
    attrs = {"axis": grid.axis} if grid.axis is not None and s_init.dims else {}
    new_nodes.append(helper.make_node(op, [value, s_init.name, z_init.name], [out], name=base, **attrs))
    return out


def node_reads(n: onnx.NodeProto) -> set[str]:
    """Every tensor ``n`` reads, its subgraphs' outer-scope reads included."""
    return {t for t in n.input if t} | set(outer_scope_inputs(n))


def _cast_node(value: str, to: int, new_nodes: list[onnx.NodeProto]) -> str:
    """A Cast of ``value`` to element type ``to`` (FP16 models: the float region's boundary)."""
    out = f"{PREFIX}{value}/Cast{to}"
    if not any(out in n.output for n in new_nodes):
        new_nodes.append(helper.make_node("Cast", [value], [out], name=out, to=to))
    return out


def _drop_dead_nodes(g: onnx.GraphProto) -> None:
    """Remove nodes no graph output depends on (the INT8 region the float copy replaced).

    One walk back from the outputs (linear in the graph: an exclusion search builds hundreds of
    these models).
    """
    needs = [node_reads(n) for n in g.node]
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    live: set[int] = set()
    stack = [producer[o.name] for o in g.output if o.name in producer]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        stack.extend(producer[t] for t in needs[i] if t in producer)
    if len(live) < len(g.node):
        keep = [n for i, n in enumerate(g.node) if i in live]
        del g.node[:]
        g.node.extend(keep)


def _sort_topologically(g: onnx.GraphProto) -> None:
    """Order nodes so each follows its producers (Kahn's algorithm; ties keep the current order)."""

    nodes = list(g.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    followers: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for p in {producer[t] for t in node_reads(n) if t in producer} - {i}:
            waiting[i] += 1
            followers[p].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for f in followers[i]:
            waiting[f] -= 1
            if waiting[f] == 0:
                heapq.heappush(ready, f)
    placed = set(order)
    order += [i for i in range(len(nodes)) if i not in placed]  # a cycle: let onnxruntime name it
    del g.node[:]
    g.node.extend(nodes[i] for i in order)


def _fp_dir(fp: LoadedModel, q: LoadedModel) -> Path | None:
    """The FP32 model's folder when a float region must read its weights from there: external
    data in another folder than the INT8 model's (None: references stay valid as they are)."""
    folder = fp.external_dir
    return folder if folder is not None and folder != q.path.resolve().parent else None


def region_dirs(fp: LoadedModel, q: LoadedModel) -> tuple[Path | None, Path | None]:
    """(``fp_dir`` for :func:`float_region_model`, the ``external_data_dir`` its sessions read from).

    A region model holds the INT8 model's external references and, when both models share a
    folder, the FP32 region's: either way they resolve in the INT8 model's folder.
    """
    external = fp.has_external_data or q.has_external_data
    return _fp_dir(fp, q), (q.path.resolve().parent if external else None)


def spliced_model(
    fp: onnx.ModelProto,
    q: onnx.ModelProto,
    fp_nodes: list[str],
    matching: Matching,
    fp_dir: Path | None = None,
    bits: dict[str, int] | None = None,
    external_dir: Path | None = None,
) -> onnx.ModelProto:
    """The user's INT8 model ``q`` with the FP32 nodes ``fp_nodes`` in float: the model a fix ships.

    ``bits``: weight-only nodes (FP32 names) re-blocked at another width instead (a tier plan's
    ``int8`` over an int4 model): the FP32 weight quantized again by ``MatMulNBitsQuantizer`` with
    the user's node's settings (:func:`_reblock`); an FP32 weight kept in external data is read from
    ``fp_dir``, else ``external_dir`` (the folder both models share, :func:`region_dirs`).

    Unlike an onnxruntime re-quantization, nothing outside the regions changes: the kept nodes are
    the user's (only their order may differ, topologically), and so are their initializers; the
    initializers that only the replaced INT8 nodes read are removed. Every group the INT8 model
    quantized counts as quantized, whatever made it (onnxruntime, NNCF, ModelOpt, ...): a tensor
    keeps its Q/DQ while a node of such a group still reads or writes it. Raises ValueError when a
    region cannot be built (a subgraph, a tensor with no INT8 pair): the caller says which.

    Example:
        >>> m = spliced_model(fp.proto, q.proto, ["layer1/ffn/fc1/MatMul"], matching)  # doctest: +SKIP
        >>> sum(n.op_type == "MatMulInteger" for n in m.graph.node)  # doctest: +SKIP
        7
    """
    every_op = {n.op_type for n in fp.graph.node}
    model = float_region_model(fp, q, list(dict.fromkeys([*fp_nodes, *(bits or {})])), matching, every_op, fp_dir)
    floats = _reblock(model, q, bits or {}, matching, fp_dir or external_dir) if bits else set()
    drop_unread_initializers(model.graph, {i.name for i in q.graph.initializer} | floats)
    return model


def _reblock(
    model: onnx.ModelProto, q: onnx.ModelProto, bits: dict[str, int], matching: Matching, folder: Path | None
) -> set[str]:
    """Quantize the float copies of the weight-only nodes ``bits`` names again, each at its width.

    Each float MatMul of a region is quantized alone (a one-node model) by ``MatMulNBitsQuantizer``
    with the settings of the user's node it replaces (block size, symmetry, accuracy level, format),
    and its nodes and initializers take its place, named under :data:`PREFIX`. Returns the float
    weights it no longer reads (for :func:`drop_unread_initializers`). ValueError when the user's
    node is not a block-quantized weight (MatMulNBits, or a blocked DequantizeLinear before a MatMul).
    """
    by_id = {node_id(n, i): n for i, n in enumerate(q.graph.node)}
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    freed: set[str] = set()
    for fp_name, width in bits.items():
        settings = _weight_only_settings(fp_name, matching, by_id)
        index, copy = next(((i, n) for i, n in enumerate(g.node) if n.name == PREFIX + fp_name), (-1, None))
        if copy is None or copy.op_type != "MatMul" or copy.input[1] not in inits:
            raise ValueError(f"'{fp_name}' is not a MatMul with a constant weight: it cannot be re-blocked")
        weight = inits[copy.input[1]]
        if uses_external_data(weight):
            if folder is None:
                raise ValueError(f"the FP32 weight of '{fp_name}' is in external data and no folder was given")
            loaded = onnx.TensorProto()
            loaded.CopyFrom(weight)
            _read_external(loaded, folder)
            weight = loaded
        nodes, new_inits = _quantized_alone(copy, weight, width, settings, default_opset(model))
        del g.node[index]
        for offset, n in enumerate(nodes):
            g.node.insert(index + offset, n)
        g.initializer.extend(new_inits)
        freed.add(copy.input[1])
    return freed


def _weight_only_settings(fp_name: str, matching: Matching, by_id: dict[str, onnx.NodeProto]) -> dict[str, Any]:
    """The ``MatMulNBitsQuantizer`` settings the user's model used for ``fp_name``'s weight."""
    group = next((g for g in matching.groups if fp_name in g.fp_nodes), None)
    for nid in group.int8_nodes if group is not None else []:
        n = by_id.get(nid)
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute} if n is not None else {}
        if n is not None and n.op_type == "MatMulNBits":
            return {
                "block_size": int(attrs.get("block_size", 128)),
                "is_symmetric": len(n.input) < 4 or not n.input[3],
                "accuracy_level": int(attrs["accuracy_level"]) if "accuracy_level" in attrs else None,
                "quant_format": "QOperator",
            }
        if n is not None and n.op_type == "DequantizeLinear" and "block_size" in attrs:
            return {
                "block_size": int(attrs["block_size"]),
                "is_symmetric": len(n.input) < 3 or not n.input[2],
                "accuracy_level": None,
                "quant_format": "QDQ",
            }
    raise ValueError(f"'{fp_name}' has no block-quantized weight in the INT8 model: it cannot be re-blocked")


def _quantized_alone(
    matmul: onnx.NodeProto, weight: onnx.TensorProto, width: int, settings: dict[str, Any], opset: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``matmul`` with ``weight`` quantized at ``width`` bits by onnxruntime, as nodes and initializers
    to splice in place of the float copy (every new name under :data:`PREFIX`)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # before the import: it calls logging.basicConfig
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    a, y = matmul.input[0], matmul.output[0]
    k, n = list(weight.dims)
    alone = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["a", weight.name], ["y"], name=matmul.name)],
            "reblock",
            [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["n", k])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", n])],
            [weight],
        ),
        opset_imports=[helper.make_opsetid("", max(opset, 21 if settings["quant_format"] == "QDQ" else opset))],
    )
    quantizer = MatMulNBitsQuantizer(
        alone,
        bits=width,
        block_size=settings["block_size"],
        is_symmetric=settings["is_symmetric"],
        accuracy_level=settings["accuracy_level"],
        quant_format=QuantFormat[settings["quant_format"]],
    )
    root.handlers = [logging.NullHandler()]  # onnxruntime logs every weight it quantizes at INFO
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantizer.process()
    finally:
        root.handlers, root.level = handlers, level
    done = quantizer.model.model.graph
    outer = {"a": a, "y": y}

    def renamed(t: str) -> str:
        return outer.get(t) or (PREFIX + t.removeprefix(PREFIX) if t else "")

    nodes: list[onnx.NodeProto] = []
    for node in done.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = renamed(node.name or node.op_type)
        copy.input[:] = [renamed(t) for t in node.input]
        copy.output[:] = [renamed(t) for t in node.output]
        nodes.append(copy)
    inits = []
    for init in done.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = renamed(init.name)
        inits.append(copy)
    return nodes, inits


def drop_unread_initializers(g: onnx.GraphProto, among: set[str] | None = None) -> int:
    """Remove the initializers (of ``among``, default all) no node, subgraph or output reads; how many.

    Example:
        >>> g = helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.zeros(1, np.float32), "w")])
        >>> drop_unread_initializers(g), len(g.initializer)
        (1, 0)
    """
    read = {t for n in g.node for t in node_reads(n)} | {o.name for o in g.output}
    keep = [i for i in g.initializer if i.name in read or (among is not None and i.name not in among)]
    dropped = len(g.initializer) - len(keep)
    if dropped:
        del g.initializer[:]
        g.initializer.extend(keep)
    return dropped


def save_spliced(model: onnx.ModelProto, path: Path, external_dir: Path | None) -> Path:
    """Write a spliced model whole on its own, in the user's layout: when the INT8 model keeps its
    weights in external data (read from ``external_dir``), so does the copy (``<name>.data`` beside
    ``path``); otherwise one file, unless it passes protobuf's 2 GB limit.

    Example:
        >>> save_spliced(m, Path("work/mixed.onnx"), None)  # doctest: +SKIP
        PosixPath('work/mixed.onnx')
    """
    copy = model
    external = external_dir is not None and any(uses_external_data(t) for t in model.graph.initializer)
    if external:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        load_external_data_for_model(copy, str(external_dir))
    if external or sum(t.ByteSize() for t in copy.graph.initializer) > 1_800_000_000:
        onnx.save(copy, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(copy, str(path))
    return path
