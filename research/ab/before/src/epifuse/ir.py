"""The epilogue IR: frozen, hash-consed nodes and the graph of one bound epilogue.

A `Node` is (op, src, arg), `op` an `OpDef`. Nodes are interned: building a node equal to an
existing one returns the existing object, so common-subexpression elimination is construction
and node equality is identity. Five leaf ops are not in the user-visible registry:

    ACCUM                       the GEMM accumulator tile (in a gated GEMM, its first half)
    ACCUM_IMAG                  its imaginary part, in a planar complex GEMM (epifuse.complex_parts)
    ACCUM_UP                    the second half of its columns, in a gated GEMM (`gate, up =
                                accum.chunk(2, dim=-1)`)
    CONST   arg=float           a literal (folded in double precision, emitted as fp32)
    INPUT   arg=Operand         an epilogue operand (scalar, row, column, tile, per-batch scalar)

Every other op is a registry op, with `arg` its sorted compile-time parameters (for
reductions: the reduced axes). A join (cat of a gated epilogue's halves) is N wide where every
other value is N / 2: it is only ever an output's node (`joined_shape` gives its shape). `axes`
says which of accum's axes ("L", "M", "N") a value varies along; `dtype` is "float" or "bool".
"""
from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import InternalError, Location
from .ops import OPS, OpDef, Symbolic

AXES = ("L", "M", "N")

ACCUM = OpDef("accum", 0, None, kind="leaf", doc="the GEMM accumulator")
ACCUM_IMAG = OpDef("accum_imag", 0, None, kind="leaf",
                   doc="the imaginary part of a planar complex GEMM's accumulator (accum is its real part)")
ACCUM_UP = OpDef("accum_up", 0, None, kind="leaf",
                 doc="the second half of a gated GEMM's accumulator columns (accum is the first)")
# The leaves a kernel fills from a second accumulator, by the parameter name that binds them.
SECOND_ACCUMULATORS = {"accum_imag": ACCUM_IMAG, "accum_up": ACCUM_UP}
CONST = OpDef("const", 0, None, kind="leaf", doc="a literal")
INPUT = OpDef("input", 0, None, kind="leaf", doc="an epilogue operand")


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

    op: OpDef
    src: tuple["Node", ...]
    arg: Any
    axes: frozenset
    dtype: str

    def __new__(cls, op: OpDef, src: Iterable["Node"] = (), arg: Any = None):
        if not isinstance(op, OpDef):
            raise InternalError(f"a node's op is an OpDef, not {op!r}")
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
        return dict(self.arg or ()) if self.op not in (CONST, INPUT) else {}

    @property
    def reduction(self):
        """The op's Reduction (what it folds, how partials combine), or None."""
        return self.op.reduction

    @property
    def dims(self) -> tuple[str, ...]:
        """The axes a reduction folds."""
        return tuple(self.params["dim"])

    def __repr__(self) -> str:
        return f"Node({self.op.name}, {self.arg!r}, {len(self.src)} src)"


def _infer(op: OpDef, src: tuple[Node, ...], arg: Any) -> tuple[frozenset, str]:
    """Shape and dtype propagation: which accum axes a value varies along, and its type."""
    if op is ACCUM or op is ACCUM_IMAG or op is ACCUM_UP:
        return frozenset(AXES), "float"
    if op is CONST:
        return frozenset(), "float"
    if op is INPUT:
        return frozenset(arg.axes), "float"
    if op.is_leaf or OPS.get(op.name) is not op:
        raise InternalError(f"node with unknown op {op!r}")
    if len(src) != op.arity:
        raise InternalError(f"{op.name} takes {op.arity} inputs, got {len(src)}")
    if op.kind == "index":
        return frozenset((op.axis,)), "float"
    axes = frozenset().union(*(s.axes for s in src))
    if op.is_reduction:
        return axes - frozenset(dict(arg)["dim"]), "float"
    return axes, "bool" if op.makes_bool else "float"


def joined_shape(accum_shape) -> tuple:
    """The shape of a join's output: accum's (the half width) with the last dim doubled."""
    return (*tuple(accum_shape)[:-1], 2 * accum_shape[-1])


def accum() -> Node:
    return Node(ACCUM)


def accum_imag() -> Node:
    return Node(ACCUM_IMAG)


def accum_up() -> Node:
    return Node(ACCUM_UP)


def const(value: float) -> Node:
    return Node(CONST, (), float(value))


def input_node(operand: Operand) -> Node:
    return Node(INPUT, (), operand)


def op(which: OpDef | str, *src: Node, **params) -> Node:
    """A node applying `which` (an OpDef or a registry name) to `src`."""
    opdef = OPS[which] if isinstance(which, str) else which
    return Node(opdef, src, tuple(sorted(params.items())) if params else None)


class Sym(Symbolic):
    """A value in a derivative rule: an IR node with arithmetic that builds nodes.

    `g * y * (1.0 - y)` and `where(x > 0.0, g, 0.0)` (with `where` the registry op) build the
    same interned nodes the binder would. `==` keeps Python's meaning; write `eq(a, b)`.
    """

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    @classmethod
    def apply(cls, opdef: OpDef, args: tuple, params: dict) -> "Sym":
        return cls(op(opdef, *(cls.lift(a).node for a in args), **params))

    @staticmethod
    def lift(value) -> "Sym":
        if isinstance(value, Sym):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"a derivative rule used {type(value).__name__}; only Syms and numbers mix")
        return Sym(const(float(value)))

    def _binary(self, name, other, reverse=False):
        a, b = (Sym.lift(other), self) if reverse else (self, Sym.lift(other))
        return OPS[name](a, b)

    def __add__(self, o): return self._binary("add", o)
    def __radd__(self, o): return self._binary("add", o, True)
    def __sub__(self, o): return self._binary("sub", o)
    def __rsub__(self, o): return self._binary("sub", o, True)
    def __mul__(self, o): return self._binary("mul", o)
    def __rmul__(self, o): return self._binary("mul", o, True)
    def __truediv__(self, o): return self._binary("div", o)
    def __rtruediv__(self, o): return self._binary("div", o, True)
    def __pow__(self, o): return self._binary("pow", o)
    def __lt__(self, o): return self._binary("lt", o)
    def __le__(self, o): return self._binary("le", o)
    def __gt__(self, o): return self._binary("gt", o)
    def __ge__(self, o): return self._binary("ge", o)
    def __and__(self, o): return self._binary("logical_and", o)
    def __or__(self, o): return self._binary("logical_or", o)
    def __neg__(self): return OPS["neg"](self)
    def __invert__(self): return OPS["logical_not"](self)

    def __repr__(self) -> str:
        return f"Sym({self.node!r})"


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

    def operand_names_read(self) -> set[str]:
        return {n.arg.name for n in self.nodes() if n.op is INPUT}

    def with_outputs(self, outputs) -> "Graph":
        return Graph(tuple(outputs), self.operands, self.names, self.locs)

    def output(self, name: str) -> Output:
        return next(o for o in self.outputs if o.name == name)

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
        if node.op is CONST:
            detail = repr(node.arg)
        elif node.op is INPUT:
            detail = f"{node.arg.name} [{node.arg.kind}, axes={''.join(node.arg.axes) or '-'}]"
        else:
            params = ", ".join(f"{k}={v!r}" for k, v in (node.arg or ()))
            detail = args + (", " + params if params and args else params)
        axes = "".join(a for a in AXES if a in node.axes) or "-"
        lines.append(f"{ids[id(node)]} = {node.op.name}({detail})  : {node.dtype}[{axes}]")
    for o in graph.outputs:
        lines.append(f"return {o.name} <- {ids[id(o.node)]}")
    return "\n".join(lines)


def verify(graph: Graph) -> None:
    """Check invariants between passes; raises InternalError on a malformed graph."""
    operand_names = {o.name for o in graph.operands}
    for node in graph.nodes():
        if node.op is INPUT and node.arg.name not in operand_names:
            raise InternalError(f"input {node.arg.name!r} is not an operand", format_graph(graph))
        if not node.op.is_leaf and OPS.get(node.op.name) is not node.op:
            raise InternalError(f"unknown op {node.op!r}", format_graph(graph))
        for s in node.src:
            if s.op.is_reduction and s.dims != (AXES[-1],):
                raise InternalError("a reduction other than one over N feeds another node", format_graph(graph))
            if s.op.kind == "join":
                raise InternalError("a join (cat) feeds another node", format_graph(graph))
    names = [o.name for o in graph.outputs]
    if len(set(names)) != len(names):
        raise InternalError(f"duplicate outputs {names}", format_graph(graph))


def fed_reductions(graph: Graph) -> list[Node]:
    """The reductions whose value another node reads (each over N, the rows a tile can span:
    binding.bind refuses others), in topological order. A kernel computes them in registers
    over a tile as wide as N and broadcasts them back along N (backends/triton/epilogue.py)."""
    nodes = graph.nodes()
    read = {id(s) for node in nodes for s in node.src}
    return [node for node in nodes if node.op.is_reduction and id(node) in read]


def conditional_stores(graph: Graph) -> tuple[dict, set]:
    """The outputs stored only where a condition selects their new value: an output `D =
    where(cond, value, D)` (or `where(cond, D, value)`) of the operand of its own name, the
    in-place update the parser admits. Returns ({output name: (cond, value, stored where cond
    is true)}, ids of the nodes no longer computed: the where, and the operand's load, where
    nothing else reads them)."""
    uses = graph.users()
    conditional, unread = {}, set()
    for out in graph.outputs:
        node = out.node
        if node.op.name != "where" or uses.get(id(node)) != 1:
            continue
        cond, a, b = node.src
        for kept, value, when in ((b, a, True), (a, b, False)):
            if kept.op is INPUT and kept.arg.name == out.name and value is not kept and cond is not kept:
                conditional[out.name] = (cond, value, when)
                unread.add(id(node))
                if uses.get(id(kept)) == 1:
                    unread.add(id(kept))
                break
    return conditional, unread
