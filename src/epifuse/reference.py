"""The reference backend's interpreter: evaluate a Graph with torch ops, on any device.

This is the executable spec every kernel is tested against. Operand tensors are given in
their user shapes (torch broadcasting against accum does the rest); results come back in
`dtype` (float64 for verification), one tensor per output, reductions already reduced over
their dims (not kept).
"""
from __future__ import annotations

import torch

from .ir import AXES, Graph, Node
from .ops import OPS


def evaluate(graph: Graph, accum: torch.Tensor, operands: dict, dtype=torch.float32) -> dict:
    """Return {output name: tensor} for `graph` applied to `accum` (shape (M,N) or (L,M,N))."""
    rank = accum.dim()
    values: dict[int, torch.Tensor] = {}
    for node in graph.nodes():
        values[id(node)] = _evaluate_node(node, [values[id(s)] for s in node.src],
                                          accum, operands, dtype, rank)
    results = {}
    for out in graph.outputs:
        value = values[id(out.node)]
        if value.dtype == torch.bool:
            value = value.to(dtype)
        if OPS.get(out.node.op) is None or OPS[out.node.op].kind != "reduce":
            value = torch.broadcast_to(value, accum.shape)
        results[out.name] = value
    return results


def _evaluate_node(node: Node, src, accum, operands, dtype, rank):
    if node.op == "accum":
        return accum.to(dtype)
    if node.op == "const":
        return torch.tensor(node.arg, dtype=dtype, device=accum.device)
    if node.op == "input":
        value = operands[node.arg.name]
        if not isinstance(value, torch.Tensor):
            return torch.tensor(float(value), dtype=dtype, device=accum.device)
        value = value.to(device=accum.device, dtype=dtype)
        return value.reshape(()) if node.arg.kind == "tensor" and not node.arg.axes else value
    opdef = OPS[node.op]
    params = node.params
    if opdef.kind == "reduce":
        full = torch.broadcast_to(src[0], accum.shape).to(dtype)
        axes = AXES[3 - rank:]
        dims = tuple(axes.index(a) for a in params["dim"])
        return opdef.ref(full, dim=dims)
    if opdef.kind in ("elementwise", "cast"):
        src = [s.to(dtype) if s.dtype == torch.bool else s for s in src]
    if opdef.kind == "logical":
        src = [s if s.dtype == torch.bool else s != 0 for s in src]
    if node.op == "where" and src[0].dtype != torch.bool:
        src = [src[0] != 0, *src[1:]]
    result = opdef.ref(*src, **params)
    if result.is_floating_point() and result.dtype != dtype:
        result = result.to(dtype)
    return result
