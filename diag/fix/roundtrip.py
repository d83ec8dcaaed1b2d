"""Round-trip proof: does a recipe rebuild the user's INT8 model exactly?

Every fix diag suggests re-quantizes the FP32 model with a recipe (the given one, or the one
:mod:`diag.fix.infer` read back from the user's INT8 model) plus a few more nodes in float. If the
recipe alone does not rebuild the model the user ships, the search's "before" is a model nobody
shipped, and its "after" mixes the fix with whatever the recipe got wrong (issue 41: a dynamic
model quantized with ``MatMulConstBOnly: False`` rebuilt with onnxruntime's defaults leaves
attention's MatMuls in float, and the "fix" gains accuracy the user could never see).

:func:`prove_roundtrip` quantizes the FP32 model with the recipe, unchanged, and
:func:`roundtrip_difference` compares the result with the user's model: the quantized nodes (name
and op type), the count of every op type, every node's op, inputs, outputs and attributes, every
initializer (integer weights, scales, zero points, float weights kept in float) by name, element
type, shape and bytes, and the opsets. :func:`roundtrip_line` says the verdict in the user's terms.

NOTE: Graph-level noise is ignored: node order, doc strings, producer name and version, value_info
(shape inference results) and metadata. onnxruntime's quantizers are deterministic given the same
model, recipe and calibration ranges: a dynamic recipe that matches rebuilds weights, scales and
zero points byte for byte, so any difference is a recipe difference, not rounding noise. A static
recipe rebuilds the same weights, but its activation scales are only as equal as the calibration
data: the model does not store it.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper

from diag.core.feeds import FeedSource, FeedSpec
from diag.core.load import iter_nodes, model_from_path
from diag.core.recipe import Recipe
from diag.fix.infer import two_activation_matmuls
from diag.fix.quantize import quantize_model
from diag.foundations.ortfacts import QUANTIZED_OPS

#: op types that exist only in quantized graphs (integer ops, Q/DQ, com.microsoft's fused ones).
QUANTIZED_OP_TYPES = frozenset(QUANTIZED_OPS)
#: quantized op types computing a MatMul (what "your model quantizes N MatMuls" counts).
MATMUL_OP_TYPES = frozenset(op.op_type for op in QUANTIZED_OPS.values() if op.float_op == "MatMul")
#: how many differences :func:`roundtrip_line` names before it only counts the rest.
NAMED_DIFFERENCES = 3


@dataclass(frozen=True)
class OpCountDifference:
    """One op type occurs a different number of times in the two models."""

    op_type: str
    user: int
    rebuilt: int


@dataclass(frozen=True)
class NodeSetDifference:
    """Quantized nodes (by name; an unnamed one by its first output) only one of the models has."""

    only_user: tuple[str, ...]
    only_rebuilt: tuple[str, ...]


@dataclass(frozen=True)
class NodeDifference:
    """A node both models have (same name) but built differently.

    Attributes:
        name: the node's name.
        op_type: its op type in the user's model.
        field: what differs: ``op_type`` (with its domain), ``inputs``, ``outputs`` or ``attributes``.
    """

    name: str
    op_type: str
    field: Literal["op_type", "inputs", "outputs", "attributes"]


@dataclass(frozen=True)
class InitializerDifference:
    """An initializer (weight, scale, zero point) that differs, by name.

    Attributes:
        name: the initializer's name.
        reason: ``only_user`` / ``only_rebuilt`` (one model lacks it), ``dtype``, ``shape`` or ``bytes``.
    """

    name: str
    reason: Literal["only_user", "only_rebuilt", "dtype", "shape", "bytes"]


@dataclass(frozen=True)
class OpsetDifference:
    """A domain imported at another version (None: not imported)."""

    domain: str
    user: int | None
    rebuilt: int | None


Difference = OpCountDifference | NodeSetDifference | NodeDifference | InitializerDifference | OpsetDifference


@dataclass(frozen=True)
class Lever:
    """A recipe option that explains the difference, and the value that rebuilds the user's model.

    Attributes:
        option: the ``extra_options`` key (``MatMulConstBOnly``).
        value: the value the recipe must set.
        user_matmuls: quantized MatMuls in the user's model.
        rebuilt_matmuls: quantized MatMuls in the rebuilt model.
        nodes: the quantized MatMuls reading two activations that only one of the models has.
    """

    option: str
    value: bool
    user_matmuls: int
    rebuilt_matmuls: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class RoundTrip:
    """How a rebuilt INT8 model differs from the user's, as data (:func:`roundtrip_line` words it).

    Attributes:
        identical: no difference at all (graph-level noise aside, see the module's NOTE).
        quantized_nodes: nodes of a quantized op type in the user's model (subgraphs included).
        differences: what differs, in this order: op counts, quantized node sets, nodes, initializers, opsets.
        lever: the recipe option that explains the difference, when a known one does.
    """

    identical: bool
    quantized_nodes: int
    differences: tuple[Difference, ...] = ()
    lever: Lever | None = None


def roundtrip_difference(
    user_int8: onnx.ModelProto,
    rebuilt: onnx.ModelProto,
    user_dir: str | os.PathLike[str] | None = None,
    rebuilt_dir: str | os.PathLike[str] | None = None,
) -> RoundTrip:
    """Compare two INT8 models made from the same FP32 model: does ``rebuilt`` equal ``user_int8``?

    Neither model is modified. Initializers are compared one at a time: external data (protos
    loaded without it) is read from ``user_dir`` / ``rebuilt_dir``, the models' folders, one tensor
    at a time, so external weights never sit in memory all at once.

    Example:
        >>> from diag.fixtures.models import convnet
        >>> m = convnet().model
        >>> roundtrip_difference(m, m).identical
        True
    """
    differences: list[Difference] = []
    user_nodes, rebuilt_nodes = iter_nodes(user_int8.graph), iter_nodes(rebuilt.graph)
    user_ops, rebuilt_ops = Counter(_op(n) for n in user_nodes), Counter(_op(n) for n in rebuilt_nodes)
    for op in sorted(user_ops.keys() | rebuilt_ops.keys(), key=lambda t: (t not in QUANTIZED_OP_TYPES, t)):
        if user_ops[op] != rebuilt_ops[op]:
            differences.append(OpCountDifference(op, user_ops[op], rebuilt_ops[op]))
    user_q = _keyed(n for n in user_nodes if n.op_type in QUANTIZED_OP_TYPES)
    rebuilt_q = _keyed(n for n in rebuilt_nodes if n.op_type in QUANTIZED_OP_TYPES)
    only_user = tuple(k for k in user_q if k not in rebuilt_q)
    only_rebuilt = tuple(k for k in rebuilt_q if k not in user_q)
    if only_user or only_rebuilt:
        differences.append(NodeSetDifference(only_user, only_rebuilt))
    differences += _node_differences(user_int8.graph, rebuilt.graph)
    differences += _initializer_differences(user_int8.graph, rebuilt.graph, user_dir, rebuilt_dir)
    user_opsets = {o.domain or "ai.onnx": o.version for o in user_int8.opset_import}
    rebuilt_opsets = {o.domain or "ai.onnx": o.version for o in rebuilt.opset_import}
    for domain in sorted(user_opsets.keys() | rebuilt_opsets.keys()):
        if user_opsets.get(domain) != rebuilt_opsets.get(domain):
            differences.append(OpsetDifference(domain, user_opsets.get(domain), rebuilt_opsets.get(domain)))
    lever = _matmul_const_b_lever(user_int8, rebuilt, user_nodes, rebuilt_nodes) if differences else None
    return RoundTrip(not differences, len(user_q), tuple(differences), lever)


def prove_roundtrip(
    fp32_path: str | os.PathLike[str],
    int8_path: str | os.PathLike[str],
    recipe: Recipe,
    work_dir: str | os.PathLike[str],
    calibration: FeedSource | FeedSpec | None = None,
) -> RoundTrip:
    """Quantize ``fp32_path`` with ``recipe`` as it is, and compare the result with ``int8_path``.

    The recipe is used unchanged (no exclusion added), through the same guarded quantizer every
    fix uses (:func:`diag.fix.quantize.quantize_model`): what this proves is what a fix starts
    from. The rebuilt model is written to ``work_dir`` as ``<int8 stem>.rebuilt.onnx`` (the folder is
    created); the user's files are only read. Static recipes calibrate on ``calibration`` (else the
    recipe's own ``calibration``): the round trip is exact only with the data the user calibrated on.

    Example:
        >>> rt = prove_roundtrip("model.onnx", "model.int8.onnx", Recipe(mode="dynamic"), "work")  # doctest: +SKIP
        >>> roundtrip_line(rt)  # doctest: +SKIP
        'the recipe rebuilds your INT8 model exactly (23 quantized nodes)'
    """
    user = model_from_path(int8_path, "INT8 model")  # checked first: a bad path fails before any work
    out = Path(work_dir) / f"{user.path.stem}.rebuilt.onnx"
    quantize_model(fp32_path, recipe, out, calibration=calibration)
    # NOTE: diag's own output, verified by quantize_model, is read with onnx.load, not as an input:
    # an input is remembered for the whole command and could not be written again (a second proof).
    rebuilt = onnx.load(str(out), load_external_data=False)
    return roundtrip_difference(user.proto, rebuilt, user.external_dir, out.parent)


def roundtrip_line(rt: RoundTrip) -> str:
    """The verdict of a round trip as one line, in the user's terms; the only place it is worded.

    A known lever is named with the value that fixes the recipe; otherwise the first differences
    are named (op counts, then nodes, then weights, then opsets) and the rest counted.

    Example:
        >>> roundtrip_line(RoundTrip(True, 37))
        'the recipe rebuilds your INT8 model exactly (37 quantized nodes)'
        >>> roundtrip_line(RoundTrip(False, 49, (OpCountDifference("MatMulInteger", 49, 37),),
        ...     Lever("MatMulConstBOnly", False, 49, 37, ("a",) * 12)))
        'your model quantizes 49 MatMuls, the recipe 37: the 12 with two activation inputs — set MatMulConstBOnly=False'
        >>> roundtrip_line(RoundTrip(False, 9, (InitializerDifference("fc1.weight_quantized", "bytes"),)))
        "the recipe does not rebuild your INT8 model: weight 'fc1.weight_quantized' differs (bytes)"
    """
    if rt.identical:
        return f"the recipe rebuilds your INT8 model exactly ({rt.quantized_nodes} quantized nodes)"
    lever = rt.lever
    if lever is not None:
        n = len(lever.nodes)
        if lever.value:
            said = f"the recipe also quantizes the {n} with two activation inputs"
        else:
            said = f"the {n} with two activation inputs"
        head = (
            f"your model quantizes {lever.user_matmuls} MatMuls, the recipe {lever.rebuilt_matmuls}: "
            f"{said} — set {lever.option}={lever.value}"
        )
        others = [d for d in rt.differences if isinstance(d, InitializerDifference) and d.reason in _CHANGED]
        return head if not others else f"{head}; also {_worded(others[0])}"
    kinds: list[Difference] = []
    for kind in (OpCountDifference, NodeSetDifference, NodeDifference, InitializerDifference, OpsetDifference):
        first = next((d for d in rt.differences if isinstance(d, kind)), None)
        if first is not None and len(kinds) < NAMED_DIFFERENCES:
            kinds.append(first)
    rest = len(rt.differences) - len(kinds)
    tail = f" (+{rest} more difference{'s' if rest > 1 else ''})" if rest else ""
    return "the recipe does not rebuild your INT8 model: " + "; ".join(_worded(d) for d in kinds) + tail


# ---------------------------------------------------------------- comparing


_CHANGED = ("dtype", "shape", "bytes")
#: initializer differences, most telling first: another type or granularity says more than values.
_TELLING = ("dtype", "shape", "only_user", "only_rebuilt", "bytes")


def _op(node: onnx.NodeProto) -> str:
    """The op type, with its domain when it is not the default one (``com.microsoft`` ops apart)."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _keyed(nodes: Iterable[onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
    """Nodes by name (an unnamed node by its first output); a repeated name gets ``#2``, ``#3``..."""
    out: dict[str, onnx.NodeProto] = {}
    for node in nodes:
        key = node.name or f"<{node.output[0] if node.output else ''}>"
        base, i = key, 1
        while key in out:
            i += 1
            key = f"{base}#{i}"
        out[key] = node
    return out


def _attributes(node: onnx.NodeProto) -> list[bytes]:
    """A node's attributes as bytes, by name, doc strings cleared (subgraphs compared whole)."""
    out = []
    for attr in sorted(node.attribute, key=lambda a: a.name):
        a = onnx.AttributeProto()
        a.CopyFrom(attr)
        a.ClearField("doc_string")
        out.append(a.SerializeToString(deterministic=True))
    return out


def _node_differences(user: onnx.GraphProto, rebuilt: onnx.GraphProto) -> list[NodeDifference]:
    """Nodes of the main graphs with the same name but another op, wiring or attributes."""
    rebuilt_nodes = _keyed(rebuilt.node)
    out = []
    for key, node in _keyed(user.node).items():
        other = rebuilt_nodes.get(key)
        if other is None:
            continue
        if _op(node) != _op(other):
            out.append(NodeDifference(key, node.op_type, "op_type"))
        elif list(node.input) != list(other.input):
            out.append(NodeDifference(key, node.op_type, "inputs"))
        elif list(node.output) != list(other.output):
            out.append(NodeDifference(key, node.op_type, "outputs"))
        elif _attributes(node) != _attributes(other):
            out.append(NodeDifference(key, node.op_type, "attributes"))
    return out


def _initializer_differences(
    user: onnx.GraphProto,
    rebuilt: onnx.GraphProto,
    user_dir: str | os.PathLike[str] | None,
    rebuilt_dir: str | os.PathLike[str] | None,
) -> list[InitializerDifference]:
    """Initializers of the main graphs compared by name: element type, shape, presence, then bytes.

    Bytes are the tensor's values (``numpy_helper.to_array``), so a tensor stored as ``raw_data`` in
    one model and as typed fields or external data in the other still compares equal.
    """
    user_inits = {t.name: t for t in user.initializer}
    rebuilt_inits = {t.name: t for t in rebuilt.initializer}
    out = [InitializerDifference(name, "only_user") for name in user_inits if name not in rebuilt_inits]
    out += [InitializerDifference(name, "only_rebuilt") for name in rebuilt_inits if name not in user_inits]
    for name, a in user_inits.items():
        b = rebuilt_inits.get(name)
        if b is None:
            continue
        if a.data_type != b.data_type:
            out.append(InitializerDifference(name, "dtype"))
        elif list(a.dims) != list(b.dims):
            out.append(InitializerDifference(name, "shape"))
        elif not _same_values(a, b, user_dir, rebuilt_dir):
            out.append(InitializerDifference(name, "bytes"))
    return sorted(out, key=lambda d: _TELLING.index(d.reason))  # stable: model order within a reason


def _same_values(
    a: onnx.TensorProto,
    b: onnx.TensorProto,
    a_dir: str | os.PathLike[str] | None,
    b_dir: str | os.PathLike[str] | None,
) -> bool:
    inline = a.data_location != onnx.TensorProto.EXTERNAL and b.data_location != onnx.TensorProto.EXTERNAL
    if inline and a.raw_data and a.raw_data == b.raw_data:
        return True  # the common case, without a copy
    x = numpy_helper.to_array(a, str(a_dir or ""))
    y = numpy_helper.to_array(b, str(b_dir or ""))
    return bool(x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes())


def _matmul_const_b_lever(
    user: onnx.ModelProto,
    rebuilt: onnx.ModelProto,
    user_nodes: list[onnx.NodeProto],
    rebuilt_nodes: list[onnx.NodeProto],
) -> Lever | None:
    """``MatMulConstBOnly`` when one model quantizes MatMuls reading two activations and the other none.

    Only one side having them is the lever's signature: with the lever on, onnxruntime quantizes
    none of them; off, all but the excluded ones. Both sides having some (different ones) is an
    exclusion difference, not the lever.
    """
    user_pairs, rebuilt_pairs = two_activation_matmuls(user.graph), two_activation_matmuls(rebuilt.graph)
    if bool(user_pairs) == bool(rebuilt_pairs):
        return None
    user_count = sum(n.op_type in MATMUL_OP_TYPES for n in user_nodes)
    rebuilt_count = sum(n.op_type in MATMUL_OP_TYPES for n in rebuilt_nodes)
    return Lever("MatMulConstBOnly", not user_pairs, user_count, rebuilt_count, tuple(user_pairs or rebuilt_pairs))


def _worded(d: Difference) -> str:
    if isinstance(d, OpCountDifference):
        return f"your model has {d.user} {d.op_type}, the rebuild {d.rebuilt}"
    if isinstance(d, NodeSetDifference):
        if d.only_user:
            more = f" and {len(d.only_user) - 1} more" if len(d.only_user) > 1 else ""
            return f"quantized node '{d.only_user[0]}'{more} only in your model"
        more = f" and {len(d.only_rebuilt) - 1} more" if len(d.only_rebuilt) > 1 else ""
        return f"quantized node '{d.only_rebuilt[0]}'{more} only in the rebuild"
    if isinstance(d, NodeDifference):
        return f"node '{d.name}' ({d.op_type}) differs ({d.field})"
    if isinstance(d, InitializerDifference):
        if d.reason == "only_user":
            return f"weight '{d.name}' only in your model"
        if d.reason == "only_rebuilt":
            return f"weight '{d.name}' only in the rebuild"
        return f"weight '{d.name}' differs ({d.reason})"
    return f"opset {d.domain} {d.user} in your model, {d.rebuilt} in the rebuild"
