"""Dead-code elimination: keep only what the outputs need, operands included.

Nodes are already only those reachable from the outputs (Graph.nodes walks from them); what
is left to drop are operands that no output reads.
"""
from __future__ import annotations

from ..ir import Graph


def eliminate_dead_code(graph: Graph) -> Graph:
    used = graph.operand_names_read()
    operands = tuple(o for o in graph.operands if o.name in used)
    return Graph(graph.outputs, operands, graph.names, graph.locs)
