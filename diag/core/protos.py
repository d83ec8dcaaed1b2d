"""Facts read off an ONNX graph without its weights: node ids, a weight-free copy, element types.

The lowest core module: :mod:`diag.core.precision` (format detection, below :mod:`diag.core.load`),
:mod:`diag.core.match` and :mod:`diag.core.run` all need these, and none of them may import the others
for it.
"""

from __future__ import annotations

import numpy as np
import onnx

#: Initializers up to this many elements keep their data for shape inference (shape tensors,
#: axes); larger ones (weights) are described by type and shape only.
SMALL_INITIALIZER = 4096


def node_id(node: onnx.NodeProto, index: int) -> str:
    """A node's name, or a stable stand-in for unnamed nodes (``<OpType>#<index>``).

    Example:
        >>> node_id(onnx.helper.make_node("Relu", ["x"], ["y"]), 3)
        'Relu#3'
    """
    return node.name if node.name else f"{node.op_type}#{index}"


def structure_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without weight data: large initializers become typed graph inputs.

    NOTE: shape inference serializes the whole model; on a model with inline weights that means
    two transient copies of every weight just to learn element types. Types need no weights.
    """
    g = model.graph
    lite = onnx.ModelProto()
    lite.ir_version = model.ir_version
    lite.opset_import.extend(model.opset_import)
    graph = lite.graph
    graph.node.extend(g.node)
    graph.input.extend(g.input)
    graph.output.extend(g.output)
    graph.value_info.extend(g.value_info)
    declared = {i.name for i in g.input}
    for t in g.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and np.prod(t.dims, dtype=np.int64) <= SMALL_INITIALIZER:
            graph.initializer.append(t)
        elif t.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return lite


def value_dtypes(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every top-level value, using shape inference where the model lacks it."""
    try:
        inferred = onnx.shape_inference.infer_shapes(structure_only(model), strict_mode=False)
    except Exception:  # inference is a help, not a requirement
        inferred = model
    g = inferred.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in g.initializer:
        types[t.name] = t.data_type
    return types


def default_opset(model: onnx.ModelProto, missing: int = 0) -> int:
    """The model's ``ai.onnx`` opset version (``missing`` when it imports none).

    Example:
        >>> default_opset(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []),
        ...     opset_imports=[onnx.helper.make_opsetid("", 12)]))
        12
    """
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), missing)
