"""The parts of a complex value: `x.real`, `x.imag` and `conj(x)` (also `x.conj()`), for the
epilogue of a planar complex GEMM (epifuse.gemm_planar_complex), which epifuse.complex_parts
rewrites over real and imaginary parts before binding: no kernel sees these ops, and a real
GEMM's epilogue that uses them is refused when it is bound. On a real value in a complex
epilogue, x.real is x, x.imag is 0 and conj(x) is x. Called on torch tensors they run torch's
own.
"""
from __future__ import annotations

import torch

from .registry import Cost, OpDef, register


def _conj(x: torch.Tensor) -> torch.Tensor:
    return torch.conj_physical(x) if x.is_complex() else x


real = register(OpDef("real", 1, torch.real, kind="complex", complex=lambda call, x: x[0],
                      doc="the real part of a complex value (x.real)", cost=Cost(0)))
imag = register(OpDef("imag", 1, torch.imag, kind="complex", complex=lambda call, x: x[1],
                      doc="the imaginary part of a complex value (x.imag)", cost=Cost(0)))
conj = register(OpDef("conj", 1, _conj, kind="complex", aliases=("conj_physical",),
                      complex=lambda call, x: (x[0], None if x[1] is None else call("neg", x[1])),
                      doc="the complex conjugate (x.conj())", cost=Cost(1)))

__all__ = ["real", "imag", "conj"]
