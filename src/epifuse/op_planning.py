"""What the custom ops (torch_ops.py) plan before they run anything, shared by the real and the
fake impls, the backward (op_backward.py) and the backward compiled ahead (backward_ahead.py):
operands packed into and unpacked from the ops' (tensors, numbers, kinds), each operand's role
and the bound graph, and every output's shape and dtype (remembered per call metadata)."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor

from .allocation import epilogue_accum_shape, output_specs
from .arguments import bound_graph
from .epilogue_table import Entry
from .errors import EpilogueArgumentError
from .program import Program
from .ops import dtype_from_name
from .shapes import classify_operand


def pack(names, values: dict) -> tuple[list, list, str]:
    """Operands by name -> (tensors, numbers, kinds) as the ops take them."""
    tensors, numbers, kinds = [], [], ""
    for name in names:
        value = values[name]
        if isinstance(value, Tensor):
            tensors.append(value)
            kinds += "t"
        else:
            numbers.append(float(value))
            kinds += "n"
    return tensors, numbers, kinds


def unpack(names, tensors, numbers, kinds: str) -> dict:
    if len(kinds) != len(names) or kinds.count("t") != len(tensors) \
            or kinds.count("n") != len(numbers):
        raise EpilogueArgumentError(
            f"epifuse::gemm got operands {kinds!r} ({len(tensors)} tensors, {len(numbers)} "
            f"numbers) for {', '.join(names) or 'no operands'}.")
    t, n = iter(tensors), iter(numbers)
    return {name: next(t) if kind == "t" else next(n) for name, kind in zip(names, kinds)}


def bind_operands(program: Program, A: Tensor, B: Tensor, values: dict):
    accum_shape = epilogue_accum_shape(program, A, B)
    roles = tuple(classify_operand(name, values[name], accum_shape, A.device)[0]
                  for name in program.operands)
    graph, _ = bound_graph(program, roles, len(accum_shape))
    return program, graph, tuple(accum_shape), values, roles


def op_output_specs(e: Entry, graph, accum_shape, A: Tensor, out_dtypes: str, compute_dtype) -> list:
    """(shape, dtype) of each output: epifuse.gemm's (allocation.output_specs), or as `out_dtypes`
    says: "" (those), "tiles=float16" (the caller's tile outputs), or one name per output,
    comma-separated ("" for the default)."""
    tiles = out_dtypes.removeprefix("tiles=") if out_dtypes.startswith("tiles=") else ""
    named = out_dtypes.split(",") if out_dtypes and not tiles else [""] * len(graph.outputs)
    if len(named) != len(graph.outputs):
        raise EpilogueArgumentError(f"out_dtypes {out_dtypes!r} names {len(named)} dtypes for "
                                    f"{len(graph.outputs)} outputs.")
    defaults = output_specs(graph, accum_shape, A, None, compute_dtype)
    specs = []
    for k, (out, spelled) in enumerate(zip(graph.outputs, named)):
        shape, dtype = defaults[out.name]
        if tiles and k < e.visible and not out.node.op.is_reduction:
            dtype = named_dtype(tiles)
        specs.append((shape, named_dtype(spelled) if spelled else dtype))
    return specs


def named_dtype(name: str) -> torch.dtype:
    dtype = dtype_from_name(name)
    if dtype is None:
        raise EpilogueArgumentError(f"epifuse::gemm got the output dtype {name!r}, which names no torch dtype.")
    return dtype


_LOCK = threading.Lock()   # the output plans'
_OUTPUT_PLANS: OrderedDict = OrderedDict()   # (epilogue, tensors' metadata, options) -> (specs, names)
OUTPUT_PLANS_KEPT = 512


def planned_outputs(epilogue, e: Entry, A: Tensor, B: Tensor, values: dict, out_dtypes: str, compute_dtype):
    """(shape, dtype) and name of each output of a call, remembered per epilogue and the
    metadata of its tensors (a compiled graph calls the op with the same metadata every step,
    and planning costs about 25 us of its host time). Only what was planned without error is
    remembered; the call itself is checked as every call is (torch_ops._run)."""
    def meta(t):
        return (t.shape, t.stride(), t.dtype, t.device, t.layout) if isinstance(t, Tensor) else None
    key = (epilogue, meta(A), meta(B), tuple(meta(v) for v in values.values()), out_dtypes, compute_dtype)
    with _LOCK:
        found = _OUTPUT_PLANS.get(key)
    if found is not None:
        return found
    program, graph, accum_shape, _, _ = bind_operands(e.program, A, B, values)
    found = (op_output_specs(e, graph, accum_shape, A, out_dtypes, compute_dtype), [o.name for o in graph.outputs])
    with _LOCK:
        _OUTPUT_PLANS[key] = found
        while len(_OUTPUT_PLANS) > OUTPUT_PLANS_KEPT:
            _OUTPUT_PLANS.popitem(last=False)
    return found
