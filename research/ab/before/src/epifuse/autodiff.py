"""Reverse-mode differentiation of an epilogue Graph, from each op's derivative rule.

`derive(graph, wrt, seeded, rank)` returns the backward of a bound epilogue as another Graph:
its inputs are the forward's operands, one gradient per forward output that receives one
(`seeded`), and, where rules read them, the value of a max/min/amax reduction and the element
count of a mean; its outputs are the gradient of accum and of each operand in `wrt`. A
broadcast operand's gradient is the sum over the axes it is broadcast along (a row bias gets a
sum over M), so the backward is one elementwise pass plus the reductions it implies: exactly
what the fused kernels already run. printing.graph_source prints it as an epilogue function,
which is how the backward reaches the kernels (parse, bind, optimize, cache: the same road as a
user's epilogue), with accum standing for either the GEMM (recompute) or a saved tensor.

Nothing is written per epilogue: a rule per op (`OpDef.vjp`, built from ops on `Sym` values)
is all autodiff reads.

>>> import torch
>>> from epifuse.binding import bind
>>> from epifuse.frontend import parse
>>> from epifuse.ir import Operand
>>> program = parse("def epi(accum, bias):\\n    D = relu(accum + bias)\\n    return D\\n")
>>> graph = bind(program, {"bias": Operand("bias", "tensor", ("N",))}, 2)
>>> backward = derive(graph, wrt=("accum", "bias"), seeded=("D",), rank=2)
>>> [o.node.op.name for o in backward.graph.outputs]
['where', 'sum']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from . import ops
from .errors import EpilogueError, InternalError
from .printing import FreshNames
from .ir import AXES, Graph, Node, Operand, Output, Sym, accum, accum_up, input_node, op

# The accumulator leaves one may differentiate with respect to: accum, and in a gated GEMM
# (`gate, up = accum.chunk(2, dim=-1)`) accum_up, the second half of its columns.
_ACCUMULATORS = {"accum": accum, "accum_up": accum_up}


@dataclass(frozen=True)
class Backward:
    """The backward of one epilogue for one choice of `wrt` and `seeded`.

    graph     outputs: gradients, in `wrt` order, of those that are not identically zero;
              operands: what the gradient needs (see `sources`)
    sources   operand name -> where its value comes from: ("operand", name) a forward operand;
              ("grad", output name) the gradient of a forward output; ("value", output name)
              the forward value of a max/min/amax reduction; ("count", output name) the number
              of elements a mean folds
    grads     wrt name -> output name in `graph`, or None where the gradient is zero
    """

    graph: Graph
    sources: dict
    grads: dict


def derive(graph: Graph, wrt: Sequence[str], seeded: Sequence[str], rank: int) -> Backward:
    """The backward of `graph` w.r.t. `wrt` ("accum", "accum_up" and/or operand names) given gradients of
    the outputs named in `seeded`, for an accum of rank `rank` (2 or 3). An operand the graph
    no longer reads (optimized away) has a zero gradient."""
    axes = AXES[3 - rank:]
    operands = {o.name: o for o in graph.operands}
    for name in wrt:
        if name in operands and operands[name].kind != "tensor":
            raise InternalError(f"cannot differentiate w.r.t. {name!r}: not a tensor operand",
                                str(graph))
    names = FreshNames({*_ACCUMULATORS, *operands, *(o.name for o in graph.outputs)})
    sources: dict[str, tuple] = {}
    extra: dict[str, Operand] = {}

    def new_input(prefix: str, kind: str, in_axes, source) -> Sym:
        name = names.fresh(prefix)
        extra[name] = Operand(name, kind, tuple(in_axes))
        sources[name] = source
        return Sym(input_node(extra[name]))

    wrt_ids = {id(_leaf(name, operands)) for name in wrt if name in _ACCUMULATORS or name in operands}
    nodes = graph.nodes()
    needs: set[int] = set()
    for node in nodes:
        if id(node) in wrt_ids or (node.dtype == "float" and any(id(s) in needs for s in node.src)):
            needs.add(id(node))

    grads: dict[int, Sym] = {}
    reduce_inputs: dict[int, tuple[Sym, Sym]] = {}
    outputs = {o.name: o for o in graph.outputs}
    for name in seeded:
        out = outputs[name]
        reduced = _is_reduce(out.node)
        kept = tuple(a for a in axes if not reduced or a not in out.node.dims)
        seed = new_input(f"grad_{name}", "tensor", kept, ("grad", name))
        _accumulate(grads, out.node, seed)
        if reduced and id(out.node) not in reduce_inputs:
            value = new_input(f"{name}_value", "tensor", kept, ("value", name))
            count = new_input(f"{name}_count", "number", (), ("count", name))
            reduce_inputs[id(out.node)] = (value, count)

    for node in reversed(nodes):
        g = grads.get(id(node))
        if g is None or id(node) not in needs or not node.src:
            continue
        opdef = node.op
        if opdef.vjp is None:
            raise EpilogueError(f"The op {opdef.name} has no derivative rule, so this epilogue cannot "
                                "be differentiated.", hint="Detach its inputs, or add `vjp=` to "
                                "the op's OpDef in epifuse/ops.")
        params = {**dict(opdef.params), **node.params}
        if opdef.is_reduction:
            value, count = reduce_inputs[id(node)]
            contributions = opdef.vjp(g, Sym(node.src[0]), value, **params, count=count)
        else:
            contributions = opdef.vjp(g, *(Sym(s) for s in node.src), Sym(node), **params)
        if len(contributions) != len(node.src):
            raise InternalError(f"the vjp of {opdef.name} returned {len(contributions)} gradients "
                                f"for {len(node.src)} inputs")
        for src, contribution in zip(node.src, contributions):
            if contribution is not None and id(src) in needs:
                _accumulate(grads, src, Sym.lift(contribution))

    results, grad_names = [], {}
    for name in wrt:
        g = grads.get(id(_leaf(name, operands))) if name in _ACCUMULATORS or name in operands else None
        if g is None:
            grad_names[name] = None
            continue
        out_name = names.fresh(f"grad_{name}")
        grad_names[name] = out_name
        node = g.node
        if name not in _ACCUMULATORS:
            dims = tuple(a for a in axes if a not in operands[name].axes)
            node = op(ops.sum, node, dim=dims) if dims else node
        results.append(Output(out_name, node))

    backward = Graph(tuple(results), ())
    used = backward.operand_names_read()
    all_inputs = [*graph.operands, *extra.values()]
    kept_inputs = tuple(o for o in all_inputs if o.name in used)
    for o in graph.operands:
        sources.setdefault(o.name, ("operand", o.name))
    return Backward(Graph(tuple(results), kept_inputs),
                    {o.name: sources[o.name] for o in kept_inputs}, grad_names)


def restrict(graph: Graph, names: Sequence[str]) -> Graph:
    """The forward graph computing only the outputs `names` (operands it no longer reads dropped)."""
    outputs = tuple(o for o in graph.outputs if o.name in names)
    used = Graph(outputs, ()).operand_names_read()
    return Graph(outputs, tuple(o for o in graph.operands if o.name in used), graph.names, graph.locs)


def _leaf(name: str, operands: dict) -> Node:
    return _ACCUMULATORS[name]() if name in _ACCUMULATORS else input_node(operands[name])


def _is_reduce(node: Node) -> bool:
    return node.op.is_reduction


def _accumulate(grads: dict, node: Node, contribution: Sym) -> None:
    previous = grads.get(id(node))
    grads[id(node)] = contribution if previous is None else previous + contribution


__all__ = ["Backward", "derive", "restrict"]
