"""FusedLinear under tensor parallelism: a layer whose parameters are DTensors on a 1-D mesh, as
`parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})` leaves
them, runs each rank's shard through epifuse's op and returns DTensors laid out as torch's
styles expect of an nn.Linear.

- Column-parallel (weight Shard(0): each rank holds some output features, and its slice of
  the bias): x is replicated, each rank runs the whole fused epilogue on its columns, and the
  outputs are Shard(-1). An epilogue is applied to a column independently of the others, so
  this is exact, unless it reads more than its own column: a reduction across columns (a row
  sum, a mean over N, a loss) would need a combine across ranks, and `col()` would count each
  rank's columns from 0; such epilogues are refused. `row()` is exact: every rank has all rows.
- Row-parallel (weight Shard(1): each rank holds some input features; the bias replicated):
  x is Shard(-1), each rank's GEMM gives a partial accum (epifuse's op, no epilogue), the
  partials are summed across ranks (DTensor Partial -> Replicate: an all-reduce), and the
  epilogue then runs on the whole accum as torch ops (reference.evaluate; not fused: a
  nonlinear epilogue of partial sums would be wrong). Its outputs are Replicate. Dtypes are
  the unsharded layer's: under autocast x and W are cast to the autocast dtype, the epilogue
  computes in the dtype the op would (float32 unless an input is float64) and tile outputs
  have x's (cast) dtype.
- Replicated weight: each rank runs the layer as it is.

On a sharded weight the epilogue must return one output: torch's styles (ColwiseParallel,
RowwiseParallel) lay out one output tensor. Tensor operands other than the layer's bias are
refused for now (their layouts would have to follow the output's); numbers are fine.
Gradients flow as torch's for nn.Linear under the same styles: the replicated x of a
column-parallel layer gets Partial gradients. DTensors passed straight to epifuse.gemm take
another road, DTensor's dispatch with the rules of epifuse.sharding.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import reference, torch_ops
from .allocation import output_specs
from .arguments import bound_graph, default_compute_dtype
from .errors import UnsupportedError
from .shapes import classify_operand
from .sharding import is_dtensor


def forward(layer, x, operands: dict, local_forward: Callable, autocast_dtype: torch.dtype | None = None):
    """`layer`'s output for DTensor parameters (and x, DTensor or plain): see the module doc.
    `local_forward(x, weight, bias, operands)` is the layer's forward on plain tensors (it
    applies autocast itself); `autocast_dtype` is the dtype autocast gives the layer's matmul
    (None where autocast is off), which the row-parallel GEMM takes."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    weight, bias = layer.weight, layer.bias
    if not is_dtensor(weight):
        raise UnsupportedError(f"x is a DTensor but {type(layer).__name__}'s weight is a plain tensor; "
                               "distribute the layer (parallelize_module, distribute_module) or pass x.to_local().")
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise UnsupportedError(f"{type(layer).__name__} runs on DTensors of a 1-D mesh; its weight's mesh has "
                               f"{mesh.ndim} dims.")
    tensors = [name for name, value in operands.items() if isinstance(value, Tensor)]
    if tensors:
        raise UnsupportedError(f"{type(layer).__name__} under tensor parallelism takes no tensor operands yet "
                               f"(got {', '.join(tensors)}); numbers are fine.")
    if not is_dtensor(x):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    if bias is not None and not is_dtensor(bias):
        raise UnsupportedError("the layer's weight is a DTensor but its bias is not.")
    placement = weight.placements[0]
    if placement.is_shard(0) or placement.is_shard(1):
        _check_shardable(layer, column=placement.is_shard(0))
    if placement.is_shard(0):
        return _column_parallel(layer, x, operands, local_forward, mesh, Partial, Replicate, Shard, DTensor)
    if placement.is_shard(1):
        return _row_parallel(layer, x, operands, autocast_dtype, mesh, Partial, Replicate, Shard, DTensor)
    if isinstance(placement, Replicate):
        x_local = x.redistribute(mesh, [Replicate()]).to_local()
        local = local_forward(x_local, weight.to_local(), None if bias is None else bias.to_local(), operands)
        return _wrap(local, lambda o: DTensor.from_local(o, mesh, [Replicate()], run_check=False))
    raise UnsupportedError(f"{type(layer).__name__}'s weight has the placement {placement}; "
                           "Shard(0), Shard(1) and Replicate() are supported.")


def _wrap(outs, wrap):
    return tuple(wrap(o) for o in outs) if isinstance(outs, tuple) else wrap(outs)


def _check_shardable(layer, column: bool) -> None:
    """Refuse, before any GEMM or collective, an epilogue a sharded weight cannot run exactly:
    on a column-parallel layer one that reads other columns than its own (a reduction across
    columns) or the global column index (`col()`); on either one with several outputs."""
    name = type(layer).__name__
    graph = _graph(layer, 1, 1, torch.float32, "cpu")
    if column:
        reductions = [out.name for out in graph.outputs if out.node.op.is_reduction]
        if reductions:
            raise UnsupportedError(
                f"{name} is column-parallel (its weight is Shard(0)) but its epilogue reduces "
                f"across columns ({', '.join(reductions)}), which needs a combine across ranks.",
                hint="Make the layer row-parallel (RowwiseParallel) or replicated, where the epilogue sees "
                     "every column.")
        index = next((node for node in graph.nodes() if node.op.kind == "index" and node.op.axis == "N"), None)
        if index is not None:
            raise UnsupportedError(
                f"{name} is column-parallel (its weight is Shard(0)) but its epilogue reads col(), the "
                "global column index, which each rank would count from its own first column.",
                loc=graph.loc_of(index),
                hint="Make the layer row-parallel (RowwiseParallel) or replicated, where the epilogue sees "
                     "every column; row() is fine on a column-parallel layer.")
    if len(graph.outputs) > 1:
        names = ", ".join(out.name for out in graph.outputs)
        raise UnsupportedError(
            f"{name} is {'column' if column else 'row'}-parallel but its epilogue returns "
            f"{len(graph.outputs)} outputs ({names}); torch's tensor-parallel styles (ColwiseParallel, "
            "RowwiseParallel) take one output tensor.",
            hint="Return one output from the epilogue under tensor parallelism; FSDP2 (fully_shard) and "
                 "unsharded layers take any number.")


def _column_parallel(layer, x, operands, local_forward, mesh, Partial, Replicate, Shard, DTensor):
    bias = layer.bias
    x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    local = local_forward(x_local, layer.weight.to_local(), None if bias is None else bias.to_local(), operands)
    return _wrap(local, lambda o: DTensor.from_local(o, mesh, [Shard(o.dim() - 1)], run_check=False))


def _row_parallel(layer, x, operands, autocast_dtype, mesh, Partial, Replicate, Shard, DTensor):
    x_local = x.redistribute(mesh, [Shard(x.dim() - 1)]).to_local()
    weight = layer.weight.to_local()
    if autocast_dtype is not None:   # as the unsharded layer (nn.FusedLinear._forward_local)
        x_local, weight = x_local.to(autocast_dtype), weight.to(autocast_dtype)
    lead = x_local.shape[:-1]
    partial = torch_ops.gemm(x_local.reshape(lead.numel(), x_local.shape[-1]), weight.t())
    accum = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    values = dict(operands)
    if layer._bias_name is not None:
        values[layer._bias_name] = layer.bias.redistribute(mesh, [Replicate()]).to_local()
    graph = _graph(layer, *accum.shape, accum.dtype, accum.device)
    compute = default_compute_dtype(x_local, weight, *values.values())   # torch_ops.gemm's, unsharded
    specs = output_specs(graph, tuple(accum.shape), partial, None, compute)
    with torch.autocast(accum.device.type, enabled=False):   # the epilogue owns its dtypes, as in the op
        results = reference.evaluate(graph, accum.to(compute), values, compute)
    outs = []
    for out in graph.outputs:
        shape, dtype = specs[out.name]
        value = reference.saturate(results[out.name], dtype) if not dtype.is_floating_point else results[out.name].to(dtype)
        if value.dim() == 2 and value.shape[0] == accum.shape[0] and len(lead) != 1:
            value = value.reshape(*lead, value.shape[-1])
        outs.append(DTensor.from_local(value, mesh, [Replicate()], run_check=False))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _graph(layer, M: int, N: int, dtype, device):
    """The bound graph of the layer's epilogue over an M x N accum (the bias as a row vector,
    other operands numbers: tensor operands are refused before)."""
    program = layer._program
    roles = tuple(classify_operand(name, torch.empty(N, dtype=dtype, device="meta") if name == layer._bias_name
                                   else 1.0, (M, N), torch.device("meta"))[0]
                  for name in program.operands)
    return bound_graph(program, roles, 2)[0]
