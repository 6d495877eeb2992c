"""Planar complex GEMMs: `epifuse.gemm_planar_complex`.

    D = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, epi, alpha=2 - 1j, C=(Cr, Ci))

computes accum = (Ar + i Ai) @ (Br + i Bi), the planes real tensors of one dtype (fp16, bf16,
fp32, float64), and runs `epi` over complex values, fused: one kernel whose K loop multiplies
four real tile products into two accumulators, the real part (Ar Br - Ai Bi) and the
imaginary part (Ar Bi + Ai Br), and whose epilogue computes on both (CUTLASS's planar
complex GEMM). epifuse.complex_parts rewrites the epilogue over real parts; the rest is the
real GEMM's pipeline (GemmArguments with A_imag and B_imag, the planar Triton family, the
reference kernel on CPU and for float64).

Operands: a Python complex number (complex scalar), a torch complex tensor (read in place
through torch.view_as_real's two strided planes; a one-element one is a complex scalar read at
run time), a pair (re, im) of real tensors or numbers, or anything real (a real tensor, a
number). Outputs: a pair (re, im) of real tensors, or a torch complex tensor, passed by name;
outputs not passed are allocated, as planar pairs in `out_dtype` (default the planes' dtype),
or as torch complex tensors where `out_dtype` is complex (torch.complex64, ...). A complex
result comes back as the tensor it was written to (a complex tensor) or as its (re, im) pair;
a real result (abs(accum), accum.real) as one real tensor.
"""
from __future__ import annotations

from typing import Callable

import torch

from .allocation import output_specs_of
from .arguments import EpilogueArguments, GemmArguments, check_keywords, epilogue_program
from .backends.select import choose_kernel
from .complex_parts import split
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError
from .program import Program
from .staging import needs_passes

# A complex out_dtype and the real dtype of its planes.
COMPLEX_PLANES = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
_PLANES_COMPLEX = {real: cplx for cplx, real in COMPLEX_PLANES.items()}


def gemm_planar_complex(Ar: torch.Tensor, Ai: torch.Tensor, Br: torch.Tensor, Bi: torch.Tensor,
                        epilogue: Callable | str | Program | None = None, /, *,
                        out_dtype: torch.dtype | None = None, deterministic: bool = False,
                        compute_dtype: torch.dtype | None = None, precision: str = "default", **tensors):
    """`(Ar + i Ai) @ (Br + i Bi)` with a complex epilogue fused (see the module doc); None
    stores accum. Returns the outputs: one as itself, several as a tuple in return order, each
    complex one as its complex tensor or (re, im) pair.

    >>> import torch, epifuse
    >>> def epi(accum, alpha):
    ...     D = alpha * accum
    ...     return D
    >>> ones = torch.ones(2, 2)
    >>> Dr, Di = epifuse.gemm_planar_complex(ones, ones, ones, -ones, epi, alpha=1j)
    >>> Dr, Di
    (tensor([[0., 0.],
            [0., 0.]]), tensor([[4., 4.],
            [4., 4.]]))
    """
    args, returns = planar_arguments(Ar, Ai, Br, Bi, epilogue, out_dtype=out_dtype, deterministic=deterministic,
                                     compute_dtype=compute_dtype, precision=precision, **tensors)
    choose_kernel(args).run(args)
    return returns[0] if len(returns) == 1 else returns


def planar_arguments(Ar, Ai, Br, Bi, epilogue=None, /, *, out_dtype=None, deterministic=False,
                     compute_dtype=None, precision="default", accumulator_type=None, **tensors):
    """(GemmArguments of the planar complex GEMM, what gemm_planar_complex returns once a kernel
    has run them): every output not passed is allocated."""
    for label, t in (("Ar", Ar), ("Ai", Ai), ("Br", Br), ("Bi", Bi)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{label} must be a torch tensor, not {type(t).__name__}.")
        if t.is_complex():
            raise ShapeError(f"{label} is a complex tensor ({t.dtype}); gemm_planar_complex takes the real "
                             "and imaginary planes of A and B as real tensors.",
                             hint="Pass torch.view_as_real(z).unbind(-1) for a complex tensor z: its two "
                                  "planes, read in place.")
    if torch.compiler.is_compiling():
        raise UnsupportedError("gemm_planar_complex does not run under torch.compile yet.",
                               hint="Call it outside the compiled region (torch.compiler.disable).")
    values = [Ar, Ai, Br, Bi, *(v for v in tensors.values() if isinstance(v, torch.Tensor)),
              *(p for v in tensors.values() if isinstance(v, (tuple, list)) for p in v if isinstance(p, torch.Tensor))]
    if torch.is_grad_enabled() and any(t.requires_grad for t in values):
        raise UnsupportedError("gemm_planar_complex has no backward: an input requires grad.",
                               hint="Run it under torch.no_grad(), or detach the inputs.")
    planes_dtype = _out_planes(out_dtype)
    program = epilogue_program(epilogue)
    if "accum_up" in program.params:
        raise UnsupportedError("A planar complex GEMM cannot also chunk accum into gated halves.",
                               hint="Run the gated epilogue through epifuse.gemm on real tensors.")
    if program.updates:
        raise UnsupportedError(f"A planar complex GEMM does not take conditional stores ({', '.join(program.updates)} "
                               "= where(cond, value, ...)) yet: its epilogue is split into real parts.",
                               hint="Return the new value under another name, or pass the same tensor as an "
                                    "operand and as the output (an in-place update that writes every element).")
    outputs = tuple(name for name, _ in program.outputs)
    check_keywords(program, tensors, required=program.operands, allowed=(*program.operands, *outputs))
    parts_of = {name: _parts(name, tensors[name], output=False) for name in program.operands}
    given = {name: _parts(name, tensors[name], output=True) for name in outputs if name in tensors}
    complex_operands = {name for name, parts in parts_of.items() if len(parts) == 2}
    halves = split(program, complex_operands)
    if needs_passes(halves.program):
        raise UnsupportedError("A planar complex epilogue whose reductions feed later math is not supported.",
                               hint="Return the reduction and finish the computation after the GEMM.")
    real = {}
    for name, names in halves.operands.items():
        real.update(zip(names, parts_of[name]))
    for name, names in halves.outputs.items():
        if name not in given:
            continue
        if len(given[name]) != len(names):
            raise EpilogueArgumentError(
                f"Output {name} is {'complex' if len(names) == 2 else 'real'}, but the tensor passed for it is "
                f"{'complex (or a pair)' if len(given[name]) == 2 else 'real'}.",
                hint="Pass a pair (re, im) or a complex tensor for a complex result, one real tensor for a real one.")
        real.update(zip(names, given[name]))
    specs = output_specs_of(halves.program, Ar, Br, real, planes_dtype, compute_dtype)
    stored = {}   # a complex result allocated as a complex tensor: returned as such
    for name, names in halves.outputs.items():
        if name in given or names[0] not in specs:
            continue
        shape, dtype, _ = specs[names[0]]
        if len(names) == 2 and out_dtype in COMPLEX_PLANES:
            whole = torch.empty(shape, device=Ar.device, dtype=_PLANES_COMPLEX[dtype])
            stored[name] = whole
            real.update(zip(names, torch.view_as_real(whole).unbind(-1)))
        else:
            real.update({part: torch.empty(specs[part][0], device=Ar.device, dtype=specs[part][1])
                         for part in names})
    epi = EpilogueArguments(halves.program, deterministic=deterministic, compute_dtype=compute_dtype, **real)
    args = GemmArguments(Ar, Br, epilogue=epi, precision=precision, accumulator_type=accumulator_type,
                         A_imag=Ai, B_imag=Bi)
    returns = []
    for name, names in halves.outputs.items():
        if name in stored or (name in given and isinstance(tensors[name], torch.Tensor) and tensors[name].is_complex()):
            returns.append(stored.get(name, tensors.get(name)))
        else:
            parts = tuple(real[n] for n in names)
            returns.append(parts if len(parts) == 2 else parts[0])
    return args, tuple(returns)


def _out_planes(out_dtype):
    """The real dtype of allocated outputs' planes for `out_dtype` (None: the inputs')."""
    if out_dtype is None or out_dtype in COMPLEX_PLANES:
        return COMPLEX_PLANES.get(out_dtype)
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise EpilogueArgumentError(f"out_dtype must be a floating-point or complex torch dtype, got {out_dtype!r}.")
    return out_dtype


def _parts(name: str, value, output: bool) -> tuple:
    """A complex value as its two real parts, or a real one as itself (a 1-tuple)."""
    what = "Output" if output else "Operand"
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise EpilogueArgumentError(f"{what} {name} is a sequence of {len(value)}; a complex value is given as a "
                                        "pair (re, im).")
        for part in value:
            if isinstance(part, torch.Tensor) and part.is_complex() or isinstance(part, complex):
                raise EpilogueArgumentError(f"{what} {name}'s pair (re, im) holds a complex part; each part is real.")
            if output and not isinstance(part, torch.Tensor):
                raise EpilogueArgumentError(f"Output {name}'s pair (re, im) must hold two tensors, "
                                            f"not {type(part).__name__}.")
        return tuple(value)
    if isinstance(value, torch.Tensor) and value.is_complex():
        if value.is_conj():
            if output:
                raise ShapeError(f"Output {name} is a conjugated view (its conjugate bit is set): its planes "
                                 "cannot be written in place.", hint="Pass a tensor without the bit (not z.conj()).")
            value = value.resolve_conj()   # an operand is read: its conjugate, materialized
        if value.dtype not in COMPLEX_PLANES:
            raise ShapeError(f"{what} {name} is {value.dtype}, which torch.view_as_real does not take.")
        return tuple(torch.view_as_real(value).unbind(-1))
    if isinstance(value, complex):
        if output:
            raise EpilogueArgumentError(f"Output {name} must be a tensor, a complex tensor or a pair of tensors.")
        return (value.real, value.imag)
    return (value,)


__all__ = ["gemm_planar_complex", "planar_arguments"]
