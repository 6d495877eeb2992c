"""The epilogue IR: frozen, hash-consed nodes and the graph of one bound epilogue.

A `Node` is (op, src, arg). Nodes are interned: building a node equal to an existing one
returns the existing object, so common-subexpression elimination is construction and node
equality is identity. Leaf ops:

    accum                      the GEMM accumulator tile
    const   arg=float          a literal (folded in double precision, emitted as fp32)
    input   arg=Operand        an epilogue operand (scalar, row, column, tile, per-batch scalar)

Every other op is a name in the ops registry, with `arg` its sorted compile-time parameters
(for reductions: the reduced axes). `axes` says which of accum's axes ("L", "M", "N") a value
varies along; `dtype` is "float" or "bool".
"""
from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import InternalError, Location
from .ops import OPS

AXES = ("L", "M", "N")


@dataclass(frozen=True)
class Operand:
    """An epilogue input as the kernel sees it.

    kind: "number" (a Python number passed at launch), "tensor" (loaded through a pointer).
    axes: the accum axes the operand varies along; () for scalars.
    """

    name: str
    kind: str
    axes: tuple[str, ...]


def _freeze(value: Any) -> Any:
    """A hashable key that tells -0.0 from 0.0 and NaN from NaN."""
    if isinstance(value, float):
        return ("f", struct.pack("<d", value))
    if isinstance(value, tuple):
        return tuple(_freeze(v) for v in value)
    return value


class Node:
    __slots__ = ("op", "src", "arg", "axes", "dtype", "__weakref__")
    _interned: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()

    op: str
    src: tuple["Node", ...]
    arg: Any
    axes: frozenset
    dtype: str

    def __new__(cls, op: str, src: Iterable["Node"] = (), arg: Any = None):
        src = tuple(src)
        key = (op, _freeze(arg), tuple(id(s) for s in src))
        node = cls._interned.get(key)
        if node is not None and node.src == src:
            return node
        node = super().__new__(cls)
        object.__setattr__(node, "op", op)
        object.__setattr__(node, "src", src)
        object.__setattr__(node, "arg", arg)
        axes, dtype = _infer(op, src, arg)
        object.__setattr__(node, "axes", axes)
        object.__setattr__(node, "dtype", dtype)
        cls._interned[key] = node
        return node

    def __setattr__(self, name, value):
        raise AttributeError("Node is immutable")

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.arg or ())

    def __repr__(self) -> str:
        return f"Node({self.op}, {self.arg!r}, {len(self.src)} src)"


def _infer(op: str, src: tuple[Node, ...], arg: Any) -> tuple[frozenset, str]:
    """Shape and dtype propagation: which accum axes a value varies along, and its type."""
    if op == "accum":
        return frozenset(("L", "M", "N")), "float"
    if op == "const":
        return frozenset(), "float"
    if op == "input":
        return frozenset(arg.axes), "float"
    opdef = OPS.get(op)
    if opdef is None:
        raise InternalError(f"node with unknown op {op!r}")
    if len(src) != opdef.arity:
        raise InternalError(f"{op} takes {opdef.arity} inputs, got {len(src)}")
    axes = frozenset().union(*(s.axes for s in src))
    if opdef.kind == "reduce":
        return axes - frozenset(dict(arg)["dim"]), "float"
    if opdef.kind in ("compare", "logical"):
        return axes, "bool"
    return axes, "float"


def const(value: float) -> Node:
    return Node("const", (), float(value))


def op(name: str, *src: Node, **params) -> Node:
    return Node(name, src, tuple(sorted(params.items())) if params else None)


@dataclass(frozen=True)
class Output:
    """A value the epilogue returns, and where it goes.

    name: the kwarg that holds the destination tensor; node: the value. A reduction output's
    node is the reduce node itself.
    """

    name: str
    node: Node


@dataclass(frozen=True)
class Graph:
    """One bound epilogue: its outputs (in return order) and its operands (in parameter order).

    names and locs map nodes to the user's variable names and source places, for printing and
    errors; they do not take part in equality or hashing.
    """

    outputs: tuple[Output, ...]
    operands: tuple[Operand, ...]
    names: Any = None
    locs: Any = None

    def nodes(self) -> list[Node]:
        """Every node reachable from the outputs, in topological order (sources first)."""
        order: list[Node] = []
        seen: set[int] = set()
        stack: list[tuple[Node, bool]] = [(o.node, False) for o in reversed(self.outputs)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((s, False) for s in reversed(node.src) if id(s) not in seen)
        return order

    def users(self) -> dict[int, int]:
        """How many times each node (by id) is used as a source or an output."""
        count: dict[int, int] = {}
        for node in self.nodes():
            for s in node.src:
                count[id(s)] = count.get(id(s), 0) + 1
        for o in self.outputs:
            count[id(o.node)] = count.get(id(o.node), 0) + 1
        return count

    def with_outputs(self, outputs) -> "Graph":
        return Graph(tuple(outputs), self.operands, self.names, self.locs)

    def name_of(self, node: Node) -> str | None:
        return (self.names or {}).get(node)

    def loc_of(self, node: Node) -> Location | None:
        return (self.locs or {}).get(node)

    def __str__(self) -> str:
        return format_graph(self)


def format_graph(graph: Graph) -> str:
    """A readable listing: one line per node, in SSA form, with the user's names."""
    ids: dict[int, str] = {}
    lines = []
    for i, node in enumerate(graph.nodes()):
        user = graph.name_of(node)
        ids[id(node)] = f"%{i}" + (f"({user})" if user else "")
        args = ", ".join(ids[id(s)] for s in node.src)
        if node.op == "const":
            detail = repr(node.arg)
        elif node.op == "input":
            detail = f"{node.arg.name} [{node.arg.kind}, axes={''.join(node.arg.axes) or '-'}]"
        else:
            params = ", ".join(f"{k}={v!r}" for k, v in (node.arg or ()))
            detail = args + (", " + params if params and args else params)
        axes = "".join(a for a in AXES if a in node.axes) or "-"
        lines.append(f"{ids[id(node)]} = {node.op}({detail})  : {node.dtype}[{axes}]")
    for o in graph.outputs:
        lines.append(f"return {o.name} <- {ids[id(o.node)]}")
    return "\n".join(lines)


def verify(graph: Graph) -> None:
    """Check invariants between passes; raises InternalError on a malformed graph."""
    operand_names = {o.name for o in graph.operands}
    for node in graph.nodes():
        if node.op == "input" and node.arg.name not in operand_names:
            raise InternalError(f"input {node.arg.name!r} is not an operand", format_graph(graph))
        if node.op not in ("accum", "const", "input") and node.op not in OPS:
            raise InternalError(f"unknown op {node.op!r}", format_graph(graph))
        for s in node.src:
            if s.op in OPS and OPS[s.op].kind == "reduce":
                raise InternalError("a reduction feeds another node", format_graph(graph))
    names = [o.name for o in graph.outputs]
    if len(set(names)) != len(names):
        raise InternalError(f"duplicate outputs {names}", format_graph(graph))
