"""The public API: gemm, gemm_planar_complex, get_kernels, kernel_statuses, and the argument classes.

    epi = EpilogueArguments(fn_or_string, alpha=3.0, C=C, D=D, F=F)
    args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi)
    kernels = get_kernels(args)          # every kernel that supports args, best first
    kernels[0].run(args)

    D, F = epifuse.gemm(A, B, fn, alpha=3.0, C=C)   # allocates outputs, picks a kernel

A facade: the arguments and their checks are epifuse.arguments, the choice of kernels
epifuse.backends.select, the custom ops epifuse.torch_ops.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import staged_ahead, staging, torch_ops, unsigned_inputs
from .allocation import allocate_outputs, check_out_dtype, epilogue_accum_shape
from .arguments import EpilogueArguments, GemmArguments, check_keywords, epilogue_program
from .grouped_arguments import GroupedGemmArguments
from .backends.select import choose_kernel, get_kernels, kernel_statuses
from .backends.triton import configs
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError
from .program import Program
from .planar import gemm_planar_complex
from .runtime import callsite, tune


def gemm(A: torch.Tensor, B: torch.Tensor, epilogue: Callable | str | Program | None = None, /, *,
         out_dtype: torch.dtype | None = None, accumulate: bool = False,
         deterministic: bool = False, compute_dtype: torch.dtype | None = None,
         precision: str = "default", recompute: bool = False, **tensors):
    """`A @ B` with the epilogue fused; allocates any output not passed; returns the outputs.

    The epilogue is a function, a string holding one `def`, or an activation's name, those
    FusedLinear takes ("gelu" is `D = gelu(accum)`); None stores accum. One output comes back
    as a tensor, several as a tuple in return order; a reduction over every dim is 0-d, as
    torch.sum's is. Tile outputs are allocated in `out_dtype` (default: A's dtype; float32 for
    integer inputs), reduction outputs in float32 (float64 when `compute_dtype` is float64).
    The epilogue math runs in `compute_dtype`, float32 or float64, by default the promoted
    dtype of A, B and the tensor operands (float64 inputs compute in float64).
    `precision="highest"` makes float32 inputs multiply in full fp32 rather than tf32.
    `recompute=True` (where autograd records the call): the backward recomputes A @ B rather
    than read a saved accum; it changes nothing else.

    >>> import torch, epifuse
    >>> from epifuse.ops import relu
    >>> def epi(accum, bias):
    ...     D = relu(accum + bias)
    ...     return D
    >>> A, B = torch.ones(4, 3), torch.ones(3, 5)
    >>> epifuse.gemm(A, B, epi, bias=torch.full((5,), -1.0))[0]
    tensor([2., 2., 2., 2., 2.])
    """
    check_out_dtype(out_dtype)
    # A kept launch first: its signature admits only calls that do not go through the custom
    # ops (torch.compile traces this function: nothing is looked up while it does)
    compiling = torch.compiler.is_compiling()
    call = None if compiling else callsite.signature(
        epilogue, A, B, tensors, (out_dtype, accumulate, deterministic, compute_dtype, precision))
    if call is not None:
        site = callsite.lookup(call)
        if site is not None:
            return site.call(A, B, tensors)
    if not compiling:
        program = epilogue_program(epilogue)
        if unsigned_inputs.applies(A, B):   # as an int8 GEMM whose epilogue first corrects accum
            program, A, B, corrections = unsigned_inputs.as_int8(program, A, B)
            return gemm(A, B, program, out_dtype=out_dtype, accumulate=accumulate, deterministic=deterministic,
                        compute_dtype=compute_dtype, precision=precision, recompute=recompute,
                        **tensors, **corrections)
        if staging.needs_passes(program):
            if program.updates:
                raise UnsupportedError(
                    f"An in-place update ({', '.join(program.updates)} = where(...)) in an epilogue whose "
                    "reductions feed later math: that runs as several GEMMs (staging.py), each writing its "
                    "outputs whole.", hint="Return the new value under another name.")
            if accumulate:
                raise EpilogueArgumentError(
                    "accumulate=True with an epilogue whose reductions feed later math is not supported: where "
                    "N spans tiles it runs as several GEMMs (staging.py).",
                    hint="Accumulate into the outputs after the call.")
            if not _in_one_pass(program, A, B, tensors):
                return _gemm_in_passes(program, A, B, tensors, accumulate, dict(
                    out_dtype=out_dtype, deterministic=deterministic, compute_dtype=compute_dtype,
                    precision=precision))
    if compiling or _through_torch_ops(A, B, tensors):
        return torch_ops.gemm(A, B, epilogue, out_dtype=out_dtype, accumulate=accumulate,
                       deterministic=deterministic, compute_dtype=compute_dtype,
                       precision=precision, recompute=recompute, **tensors)
    program = epilogue_program(epilogue)
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
        raise ShapeError("A and B must be torch tensors.")
    missing = [name for name, _ in program.outputs if name not in tensors]
    tensors = allocate_outputs(program, A, B, tensors, out_dtype, compute_dtype, accumulate)
    epi = EpilogueArguments(program, accumulate=accumulate, deterministic=deterministic,
                            compute_dtype=compute_dtype, **tensors)
    args = GemmArguments(A, B, epilogue=epi, precision=precision)
    chosen_in = tune.generation()
    kernel = choose_kernel(args)
    kernel.run(args)
    returns = tuple(name for name, _ in program.outputs)
    if tune.generation() == chosen_in:   # else a background winner landed meanwhile: keep nothing stale
        callsite.remember(call, args, kernel, tuple(missing), returns)
    outputs = tuple(epi.outputs[name] for name in returns)
    return outputs[0] if len(outputs) == 1 else outputs


def _in_one_pass(program: Program, A, B, tensors: dict) -> bool:
    """Whether one kernel runs `program`, whose reductions feed later math: each over accum's
    last dim, N, of at most configs.WIDEST_N columns (a tile spans the row), and nothing that
    autograd or a tensor subclass sends through the custom ops. Else it runs as passes."""
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor) or _through_torch_ops(A, B, tensors):
        return False
    accum_shape = epilogue_accum_shape(program, A, B)
    return staging.over_rows(program, len(accum_shape)) and accum_shape[-1] <= configs.WIDEST_N


def _gemm_in_passes(program: Program, A, B, tensors: dict, accumulate: bool, options: dict):
    """An epilogue whose reductions feed later math, as passes of the same GEMM (staging.py),
    where one kernel cannot run it (_in_one_pass): each pass gets the user's operands and the
    statistics of the passes before it, broadcast along their reduced dims; the user's outputs
    come from the pass that computes them."""
    if accumulate:
        raise EpilogueArgumentError(
            "accumulate=True with an epilogue whose reductions feed later math is not supported: it runs "
            "as several GEMMs (staging.py).", hint="Accumulate into the outputs after the call.")
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
        raise ShapeError("A and B must be torch tensors.")
    outputs = tuple(name for name, _ in program.outputs)
    check_keywords(program, tensors, required=program.operands, allowed=(*program.operands, *outputs))
    accum_shape = epilogue_accum_shape(program, A, B)
    steps = staging.passes(program)
    # the later passes' kernels compile while the first pass compiles and runs
    ahead_key = staged_ahead.queue(program, steps, A, B, tensors, options, accum_shape)
    stats, results = {}, {}
    for i, step in enumerate(steps):
        if i == 1:
            staged_ahead.settle(ahead_key)
        names = [name for name, _ in step.program.outputs]
        outs = gemm(A, B, step.program, **options, **staging.pass_inputs(step, tensors, stats))
        outs = outs if isinstance(outs, tuple) else (outs,)
        results.update(zip(names, outs))
        stats.update(staging.statistics(step, dict(zip(names, outs)), accum_shape))
        results.update({user: results[stat] for user, stat in step.returns.items()})
    values = tuple(results[name] for name in outputs)
    return values[0] if len(values) == 1 else values


def _through_torch_ops(A, B, tensors: dict) -> bool:
    """Inputs that require grad and tensor subclasses (FakeTensor, ...) go through
    epifuse.torch_ops (custom ops with fake impls and a derived backward), as does everything
    while torch.compile traces (gemm asks that first)."""
    values = [t for t in (A, B, *tensors.values()) if isinstance(t, torch.Tensor)]
    return any(type(t) not in callsite.PLAIN_TENSOR_TYPES for t in values) or (
        torch.is_grad_enabled() and any(t.requires_grad for t in values))


__all__ = ["gemm", "gemm_planar_complex", "get_kernels", "kernel_statuses", "EpilogueArguments",
           "GemmArguments", "GroupedGemmArguments"]
