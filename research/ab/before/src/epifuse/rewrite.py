"""Rewrite a graph bottom-up with a table of rules, to a fixed point.

A rule is a function Node -> Node | None that returns None when it does not apply. Because
nodes are interned, rebuilding an unchanged node returns the same object, so "nothing
changed" is an identity check and no pass ever mutates a node.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .ir import Graph, Node, Output

Rule = Callable[[Node], "Node | None"]
MAX_ROUNDS = 64


def rewrite_node(node: Node, rules: Sequence[Rule], memo: dict[int, Node]) -> Node:
    """Rewrite one node whose sources are already in memo; rules apply until none fires."""
    src = tuple(memo.get(id(s), s) for s in node.src)
    current = node if src == node.src else Node(node.op, src, node.arg)
    for _ in range(MAX_ROUNDS):
        for rule in rules:
            replacement = rule(current)
            if replacement is not None and replacement is not current:
                current = _settle(replacement, rules, memo)
                break
        else:
            return current
    return current


def _settle(node: Node, rules: Sequence[Rule], memo: dict[int, Node]) -> Node:
    """A rule may build new nodes whose own sources can rewrite further."""
    order = Graph((Output("_", node),), ()).nodes()
    local: dict[int, Node] = {}
    for n in order:
        if n is node:
            break
        local[id(n)] = rewrite_node(n, rules, local)
    src = tuple(local.get(id(s), s) for s in node.src)
    return node if src == node.src else Node(node.op, src, node.arg)


def rewrite(graph: Graph, rules: Sequence[Rule]) -> Graph:
    """Apply `rules` to every node of `graph`, sources first; returns a new Graph."""
    memo: dict[int, Node] = {}
    names, locs = dict(graph.names or {}), dict(graph.locs or {})
    for node in graph.nodes():
        new = rewrite_node(node, rules, memo)
        memo[id(node)] = new
        if new is not node:
            if node in names:
                names.setdefault(new, names[node])
            if node in locs:
                locs.setdefault(new, locs[node])
    outputs = tuple(Output(o.name, memo[id(o.node)]) for o in graph.outputs)
    return Graph(outputs, graph.operands, names, locs)
