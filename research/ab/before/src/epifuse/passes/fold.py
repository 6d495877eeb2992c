"""Constant folding: an elementwise op whose sources are all literals becomes a literal.

Folding evaluates the op's torch reference in float64, as Python evaluates literal arithmetic
in the user's function before any tensor sees it. Comparisons and reductions are left alone.
"""
from __future__ import annotations

import torch

from .. import ops
from ..ir import CONST, Graph, Node, const
from ..rewrite import rewrite


def fold_literal_op(node: Node) -> Node | None:
    opdef = node.op
    if opdef.kind not in ("elementwise", "cast") or not node.src:
        return None
    if not all(s.op is CONST for s in node.src):
        return None
    values = [torch.tensor(s.arg, dtype=torch.float64) for s in node.src]
    if node.op is ops.where:
        values[0] = values[0] != 0  # a number as a condition: nonzero is true (as the reference reads it)
    return const(float(opdef.ref(*values, **node.params)))


def fold_constants(graph: Graph) -> Graph:
    return rewrite(graph, [fold_literal_op])
