"""A networkx view of the FP32 graph: producers, consumers, topological order, neighbourhoods.

Nodes are FP32 node ids (name, or ``<OpType>#<index>`` when unnamed); each edge carries the
tensor it transports. Subgraph-holding nodes (If/Loop/Scan) are single nodes whose edges include
the values their bodies read from the outer scope.
"""

from __future__ import annotations

import networkx as nx
import onnx

from diag.core.load import outer_scope_inputs
from diag.core.protos import node_id


def fp_graph(model: onnx.ModelProto) -> nx.DiGraph:
    """Directed graph of the FP32 model's top-level nodes, in file (= topological) order.

    Example:
        >>> from diag.fixtures.models import convnet
        >>> g = fp_graph(convnet().model)
        >>> list(g.successors("conv2"))
        ['relu2']
    """
    g = nx.DiGraph()
    producer: dict[str, str] = {}
    for i, node in enumerate(model.graph.node):
        nid = node_id(node, i)
        g.add_node(nid, op_type=node.op_type, index=i, inputs=list(node.input), outputs=list(node.output))
        for o in node.output:
            if o:
                producer[o] = nid
    for i, node in enumerate(model.graph.node):
        nid = node_id(node, i)
        for t in list(node.input) + outer_scope_inputs(node):
            if t in producer and producer[t] != nid:
                g.add_edge(producer[t], nid, tensor=t)
    return g


def input_tensors(g: nx.DiGraph, nid: str) -> list[str]:
    """Tensors a node reads that another node produces (weights and model inputs excluded)."""
    return [d["tensor"] for _, _, d in g.in_edges(nid, data=True)]
