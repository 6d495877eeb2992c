"""The optimization pipeline (read top to bottom) and the graph's canonical hash."""
from __future__ import annotations

import hashlib
import os

from ..ir import INPUT, Graph, conditional_stores, verify
from .algebra import simplify_algebra
from .dce import eliminate_dead_code
from .fold import fold_constants

PIPELINE = [
    fold_constants,
    simplify_algebra,
    fold_constants,
    eliminate_dead_code,
]


def optimize(graph: Graph, check: bool | None = None) -> Graph:
    """Run every pass in order; `check` (default: EPIFUSE_DEBUG set) verifies between passes."""
    check = bool(os.environ.get("EPIFUSE_DEBUG")) if check is None else check
    for run_pass in PIPELINE:
        graph = run_pass(graph)
        if check:
            verify(graph)
    return graph


def canonical_text(graph: Graph) -> str:
    """The graph without the user's names: operands by position, nodes by topological index."""
    position = {o.name: i for i, o in enumerate(graph.operands)}
    index: dict[int, int] = {}
    lines = []
    for i, node in enumerate(graph.nodes()):
        index[id(node)] = i
        if node.op is INPUT:
            arg = (position[node.arg.name], node.arg.kind, node.arg.axes)
        else:
            arg = node.arg
        lines.append(f"{node.op.name} {arg!r} {[index[id(s)] for s in node.src]}")
    lines.append("outputs " + repr([index[id(o.node)] for o in graph.outputs]))
    # an output stored only where a condition holds (D = where(cond, value, D)) compiles to
    # another kernel than the same where() returned under a new name
    # (only then: every other graph keeps the text, and so the key, it always had)
    conditional, _ = conditional_stores(graph)
    if conditional:
        lines.append("conditional " + repr([(k, index[id(c)], index[id(v)], when)
                                            for k, o in enumerate(graph.outputs) if o.name in conditional
                                            for c, v, when in [conditional[o.name]]]))
    lines.append("operands " + repr([(o.kind, o.axes) for o in graph.operands]))
    return "\n".join(lines)


def canonical_hash(graph: Graph) -> str:
    """A stable key: the same epilogue under other local names hashes the same."""
    return hashlib.sha256(canonical_text(graph).encode()).hexdigest()[:20]
