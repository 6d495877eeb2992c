"""Shared helpers of the frontend tests (test_frontend_*.py): parsing shortcuts, graphs
before any pass, and the small integer-valued A and B the end-to-end checks multiply."""
from __future__ import annotations

import torch

from epifuse.binding import bind
from epifuse.frontend import parse
from epifuse.program import Expr
from epifuse.ir import Graph, Node, Operand

from helpers import integer_tensor

M = N = K = 16


def strip(expr: Expr):
    """An Expr without source places: (kind, value, args, params)."""
    return (expr.kind, expr.value, tuple(strip(a) for a in expr.args), expr.params)


def shape_of(program):
    """A Program without source places or names of the file it came from."""
    return (program.params, tuple((s.target, strip(s.expr)) for s in program.statements),
            tuple(name for name, _ in program.outputs))


def body(text: str, params: str = "accum") -> str:
    """A string epilogue `D = <text>`."""
    return f"def epi({params}):\n    D = {text}\n    return D\n"


def only_expr(source) -> Expr:
    program = parse(source)
    assert len(program.statements) == 1
    return program.statements[0].expr


def op_names(expr: Expr) -> list[str]:
    """Every op name in an Expr tree, outermost first."""
    names = [expr.value] if expr.kind == "call" else []
    for a in expr.args:
        names.extend(op_names(a))
    return names


def bound(source, rank: int = 2, **roles) -> Graph:
    """The Graph of `source` before any pass; roles: name -> Operand axes (a tuple) or 'number'."""
    program = parse(source)
    operands = {}
    for name in program.operands:
        role = roles.get(name, "number")
        operands[name] = (Operand(name, "number", ()) if role == "number"
                          else Operand(name, "tensor", tuple(role)))
    return bind(program, operands, rank)


def ops_in(graph: Graph) -> list[str]:
    return [n.op.name for n in graph.nodes()]


def output_node(graph: Graph, name: str = "D") -> Node:
    return next(o.node for o in graph.outputs if o.name == name)

def accum_of(A, B):
    return A.double() @ B.double()



def cpu_ab():
    # Frontend tests build their other tensors on the CPU, so A and B live there too (on a GPU
    # machine these run through the reference kernel; the kernel tests cover CUDA).
    A = integer_tensor(M, K, dtype=torch.float32)
    B = integer_tensor(K, N, dtype=torch.float32)
    return A, B
