"""The outputs epifuse allocates: `output_specs` / `allocate_outputs` are the one place that
decides the shape and dtype of an output a call does not pass (epifuse.gemm, the torch ops,
FusedGemm and the named epilogues all ask it)."""
from __future__ import annotations

import torch

from .arguments import _halves, bound_graph, default_compute_dtype
from .errors import EpilogueArgumentError, ShapeError
from .program import Program
from .ir import AXES, Graph, joined_shape
from .shapes import accum_shape_of, classify_operand


def check_out_dtype(out_dtype) -> None:
    """`out_dtype`, the dtype of allocated tile outputs, is None or a torch.dtype."""
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise EpilogueArgumentError(f"out_dtype must be a torch.dtype such as torch.float16, not {out_dtype!r}.")


def reduction_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a reduction output epifuse allocates: float64 when the epilogue computes
    in float64, else float32 (whatever the inputs' dtype, as the kernels accumulate)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def output_specs(graph: Graph, accum_shape, A: torch.Tensor, out_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None) -> dict[str, tuple[tuple, torch.dtype]]:
    """(shape, dtype) of every output of `graph`, by name: a tile output has accum's shape (a
    cat of a gated epilogue's halves, accum's with the last dim doubled: ir.joined_shape) and
    `out_dtype` (default A's dtype; float32 for integer inputs); a reduction keeps accum's
    other dims (0-d when it reduces them all, as torch.sum does) in float32, or float64 when the
    epilogue computes in float64 (`compute_dtype`; None takes default_compute_dtype(A): callers
    that have the operands pass the dtype GemmArguments decides for them)."""
    check_out_dtype(out_dtype)
    if compute_dtype is None:
        compute_dtype = default_compute_dtype(A)
    axes = AXES[3 - len(accum_shape):]
    specs = {}
    for o in graph.outputs:
        if o.node.op.is_reduction:
            shape = tuple(s for a, s in zip(axes, accum_shape) if a not in o.node.dims)
            specs[o.name] = (shape, reduction_dtype(compute_dtype))
        else:
            dtype = out_dtype or (A.dtype if A.is_floating_point() else torch.float32)
            wide = o.node.op.kind == "join"   # cat of a gated epilogue's halves: B's whole width
            specs[o.name] = (joined_shape(accum_shape) if wide else tuple(accum_shape), dtype)
    return specs


def allocate_outputs(program: Program, A: torch.Tensor, B: torch.Tensor, tensors: dict,
                     out_dtype: torch.dtype | None = None,
                     compute_dtype: torch.dtype | None = None, accumulate: bool = False) -> dict:
    """`tensors` plus a new tensor (see output_specs) for every output of `program` it lacks.
    Where an operand is missing nothing is allocated: EpilogueArguments names what is missing.
    `compute_dtype` None is the default GemmArguments takes for these inputs. With `accumulate`
    every reduction output must be passed: a new tensor holds nothing to fold into."""
    specs = output_specs_of(program, A, B, tensors, out_dtype, compute_dtype)
    folded = [name for name, (_, _, reduced) in specs.items() if reduced]
    if accumulate and folded:
        raise EpilogueArgumentError("accumulate=True needs the reduction outputs to fold into; "
                                    f"{', '.join(folded)} {'is' if len(folded) == 1 else 'are'} not passed.",
                                    hint=f"Pass {'it' if len(folded) == 1 else 'them'} as keyword arguments "
                                         f"({', '.join(f'{n}=...' for n in folded)}).")
    out = dict(tensors)
    for name, (shape, dtype, _) in specs.items():
        out[name] = torch.empty(shape, device=A.device, dtype=dtype)
    return out


def epilogue_accum_shape(program: Program, A: torch.Tensor, B: torch.Tensor) -> tuple:
    """accum's shape as `program` sees it: A @ B's, or for a gated epilogue (accum.chunk(2,
    dim=-1)) that of either half of its columns."""
    return tuple(accum_shape_of(A, _halves(B)[0] if "accum_up" in program.params else B)[0])


def output_specs_of(program: Program, A: torch.Tensor, B: torch.Tensor, tensors: dict,
                    out_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None) -> dict:
    """(shape, dtype, whether it is a reduction) of every output of `program` that `tensors`
    lacks, by name (see output_specs); empty where an operand is missing (EpilogueArguments
    names what is missing)."""
    check_out_dtype(out_dtype)
    missing = [name for name, _ in program.outputs if name not in tensors]
    if not missing or any(name not in tensors for name in program.operands):
        return {}
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
        raise ShapeError("A and B must be torch tensors.")
    accum_shape = epilogue_accum_shape(program, A, B)
    roles = tuple(classify_operand(n, tensors[n], accum_shape, A.device)[0] for n in program.operands)
    graph, _ = bound_graph(program, roles, len(accum_shape), in_tile=True)   # for a GemmArguments
    if compute_dtype is None:
        compute_dtype = default_compute_dtype(A, B, *(tensors[n] for n in program.operands))
    specs = output_specs(graph, accum_shape, A, out_dtype, compute_dtype)
    return {name: (*specs[name], graph.output(name).node.op.is_reduction) for name in missing}
