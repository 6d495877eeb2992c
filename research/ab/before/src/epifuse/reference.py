"""The executable spec: what an epilogue computes, evaluated with torch ops on any device.

Every kernel is tested against this module. `reference_accum` is the GEMM (exact in int64 for
integer inputs), `evaluate` runs a Graph over it, and `saturate` is the conversion every kernel
applies when it stores a value into an output's dtype. Operand tensors are given in their user
shapes (torch broadcasting against accum does the rest); results come back in `dtype` (float64
for verification), one tensor per output, reductions already reduced over their dims.
"""
from __future__ import annotations

import torch

from . import ops
from .errors import InternalError
from .ir import ACCUM, AXES, CONST, INPUT, SECOND_ACCUMULATORS, Graph, Node

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def reference_accum(A: torch.Tensor, B: torch.Tensor, dtype=torch.float32,
                    accumulator_type: torch.dtype | None = None) -> torch.Tensor:
    """accum = A @ B in `dtype` (int64 for integer inputs, exact), broadcasting batch dims.
    An fp16 `accumulator_type` holds accum rounded to fp16 (the kernels' sums round at every
    step, so they agree with this within fp16's accumulated rounding, exactly on small integers)."""
    if not A.is_floating_point():
        return torch.matmul(A.to(torch.int64).cpu(), B.to(torch.int64).cpu()).to(A.device)
    accum = torch.matmul(A.to(dtype), B.to(dtype))
    if accumulator_type == torch.float16:
        accum = accum.to(torch.float16).to(dtype)
    return accum


def planar_accum(A: torch.Tensor, Ai: torch.Tensor, B: torch.Tensor, Bi: torch.Tensor, dtype=torch.float32,
                 accumulator_type: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The real and imaginary parts of (A + i Ai) @ (B + i Bi), from four real GEMMs in `dtype`."""
    def gemm(x, y):
        return reference_accum(x, y, dtype, accumulator_type)
    return gemm(A, B) - gemm(Ai, Bi), gemm(A, Bi) + gemm(Ai, B)


def gemm_accumulators(args, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """accum of GemmArguments `args` in `dtype` and accum's shape, and the second accumulator
    of planar complex arguments (its imaginary part) or gated ones (accum is B's first half
    of columns, the second half's product), else None."""
    if args.planar:
        re, im = planar_accum(args.A, args.A_imag, args.B, args.B_imag, dtype, args.accumulator_type)
        return re.to(dtype).reshape(args.accum_shape), im.to(dtype).reshape(args.accum_shape)
    accum = reference_accum(args.A, args.B, dtype, args.accumulator_type).to(dtype).reshape(args.accum_shape)
    if args.gated:
        up = reference_accum(args.A, args.B_up, dtype, args.accumulator_type).to(dtype).reshape(args.accum_shape)
        return accum, up
    return accum, None


def evaluate(graph: Graph, accum: torch.Tensor, operands: dict, dtype=torch.float32,
             accum2: torch.Tensor | None = None) -> dict:
    """Return {output name: tensor} for `graph` applied to `accum` (shape (M,N) or (L,M,N));
    `accum2` is the second accumulator (gemm_accumulators), which the graph's ACCUM_IMAG or
    ACCUM_UP leaf reads."""
    return output_values(graph, node_values(graph, accum, operands, dtype, accum2), accum, dtype)


def output_values(graph: Graph, values: dict, accum: torch.Tensor, dtype) -> dict:
    """{output name: tensor} from the node values (node_values) of `graph`."""
    results = {}
    for out in graph.outputs:
        value = values[id(out.node)]
        if value.dtype == torch.bool:
            value = value.to(dtype)
        if not out.node.op.is_reduction and out.node.op.kind != "join":   # a join is built whole
            value = torch.broadcast_to(value, accum.shape)
        results[out.name] = value
    return results


def node_values(graph: Graph, accum: torch.Tensor, operands: dict, dtype=torch.float32,
                accum2: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """{id(node): its value} for every node of `graph` (see evaluate)."""
    rank = accum.dim()
    values: dict[int, torch.Tensor] = {}
    for node in graph.nodes():
        if node.op in SECOND_ACCUMULATORS.values():
            if accum2 is None:
                raise InternalError(f"the graph reads {node.op.name}, the second accumulator of a planar "
                                    "complex or gated GEMM, and none was given")
            values[id(node)] = accum2.to(dtype)
            continue
        srcs = [_kept(values[id(s)], s, accum) if s.op.is_reduction else values[id(s)] for s in node.src]
        values[id(node)] = _evaluate_node(node, srcs, accum, operands, dtype, rank)
    return values


def _kept(value: torch.Tensor, reduction: Node, accum: torch.Tensor) -> torch.Tensor:
    """A reduction's value as later math reads it: accum's shape with the reduced dims 1."""
    axes = AXES[3 - accum.dim():]
    return value.reshape(tuple(1 if a in reduction.dims else size for a, size in zip(axes, accum.shape)))


def _evaluate_node(node: Node, src, accum, operands, dtype, rank):
    if node.op is ACCUM:
        return accum.to(dtype)
    if node.op is CONST:
        return torch.tensor(node.arg, dtype=dtype, device=accum.device)
    if node.op is INPUT:
        value = operands[node.arg.name]
        if not isinstance(value, torch.Tensor):
            return torch.tensor(float(value), dtype=dtype, device=accum.device)
        value = value.to(device=accum.device, dtype=dtype)
        return value.reshape(()) if node.arg.kind == "tensor" and not node.arg.axes else value
    opdef = node.op
    params = node.params
    if opdef.kind == "index":
        return opdef.ref(accum).to(dtype)
    if opdef.is_reduction:
        full = torch.broadcast_to(src[0], accum.shape).to(dtype)
        axes = AXES[3 - rank:]
        dims = tuple(axes.index(a) for a in params["dim"])
        return opdef.ref(full, dim=dims)
    if opdef.kind == "join":   # the pieces as tiles of the half width (a tile operand may lack L)
        src = [torch.broadcast_to(s.to(dtype), accum.shape) for s in src]
        return opdef.ref(*src, dim=-1)
    if opdef.kind in ("elementwise", "cast"):
        src = [s.to(dtype) if s.dtype == torch.bool else s for s in src]
    if opdef.kind == "logical":
        src = [s if s.dtype == torch.bool else s != 0 for s in src]
    if opdef is ops.where and src[0].dtype != torch.bool:
        src = [src[0] != 0, *src[1:]]
    result = opdef.ref(*src, **params)
    if result.is_floating_point() and result.dtype != dtype:
        result = result.to(dtype)
    return result


def saturate(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The conversion every kernel applies to outputs, before the cast to `dtype`: integers
    round to nearest even and saturate (NaN becomes 0, +-inf the largest and smallest values),
    and come back in `dtype` (int64's largest value has no float64); fp8 saturates to its
    largest finite value (NaN stays NaN); other floating types round to nearest even (the cast
    itself)."""
    if dtype in FP8_MAX:
        return value.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
    if dtype.is_floating_point or dtype == torch.bool:
        return value
    info = torch.iinfo(dtype)
    value = torch.nan_to_num(value.double(), nan=0.0).round()
    top = value >= float(info.max)  # int64's largest value rounds up to 2**63 in float64
    return value.clamp(min=info.min).masked_fill(top, 0.0).to(dtype).masked_fill(top, info.max)
