"""`epifuse demo`: the examples of CUTLASS's epilogue notebook, checked against torch.

On a GPU each runs at 1024x1024x1024 with a timing line against eager torch; on a CPU-only
machine each runs at a small size through Triton's interpreter (the same generated kernel).
"""
from __future__ import annotations

import os

import torch
from triton.testing import do_bench

from .api import EpilogueArguments, GemmArguments, gemm
from .allocation import allocate_outputs
from .backends.select import which_kernel
from .frontend import parse
from .ops import gelu, relu
from .version import __version__


def alpha_beta_aux(accum, alpha, C, beta, extra):
    Aux = alpha * accum + beta * C
    D = Aux * extra
    return D, Aux


def relu_aux_store(accum, alpha, C):
    F = (accum * alpha) + (C * 2.0)
    D = relu(F)
    return D, F


def relu_scale_return_accum(accum, scale):
    D = relu(accum) * scale
    return D, accum


STRING_EPILOGUE = """
def bias_gelu(accum, bias):
    D = gelu(accum + bias, approximate="tanh")
    return D
"""


def _examples(M, N, device, dtype):
    C = torch.randn(M, N, device=device, dtype=dtype)
    bias = torch.randn(N, device=device, dtype=dtype)
    return [
        ("alpha/beta/extra scalar -> D, Aux", alpha_beta_aux,
         dict(alpha=1.5, C=C, beta=0.5, extra=2.0)),
        ("relu with aux store -> D, F", relu_aux_store, dict(alpha=3.0, C=C)),
        ("relu, scale, return accum -> D, accum", relu_scale_return_accum, dict(scale=0.25)),
        ("string epilogue: bias + gelu(tanh) -> D", STRING_EPILOGUE, dict(bias=bias)),
    ]


def _eager(fn, A, B, operands):
    if isinstance(fn, str):
        return (gelu(A.float() @ B.float() + operands["bias"].float(), approximate="tanh"),)
    accum = A.float() @ B.float()
    ops = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in operands.items()}
    result = fn(accum, **ops)
    return result if isinstance(result, tuple) else (result,)


def _arguments(fn, A, B, operands) -> GemmArguments:
    """The arguments `gemm(A, B, fn, **operands)` builds, to ask which kernel it ran."""
    program = parse(fn)
    return GemmArguments(A, B, epilogue=EpilogueArguments(program, **allocate_outputs(program, A, B, operands)))


def run_demo(print_fn=print) -> bool:
    """Run every example; returns True when all match torch. Each says which kernel ran."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cuda" if on_gpu else "cpu"
    M, N, K = (1024, 1024, 1024) if on_gpu else (96, 80, 64)
    dtype = torch.float16 if on_gpu else torch.float32
    where = (f"GPU {torch.cuda.get_device_name()}" if on_gpu
             else "CPU through Triton's interpreter")
    print_fn(f"epifuse {__version__} demo: {M}x{N}x{K}, {dtype}, {where}")
    A = torch.randn(M, K, device=device, dtype=dtype)
    B = torch.randn(K, N, device=device, dtype=dtype) / K ** 0.5
    all_ok = True
    for title, fn, operands in _examples(M, N, device, dtype):
        outs = gemm(A, B, fn, **operands)
        outs = outs if isinstance(outs, tuple) else (outs,)
        refs = _eager(fn, A, B, operands)
        errors = [float((o.double() - r.double()).norm() / r.double().norm()) for o, r in zip(outs, refs)]
        ok = all(e < (2e-3 if dtype == torch.float16 else 1e-4) for e in errors)
        all_ok &= ok
        line = f"  {'ok  ' if ok else 'FAIL'} {title:42s} max rel. error {max(errors):.1e}"
        if on_gpu:
            line += "  " + _timing(lambda: gemm(A, B, fn, **operands),
                                   lambda: _eager(fn, A, B, operands))
        print_fn(line)
        print_fn(f"       run by the {which_kernel(_arguments(fn, A, B, operands))}")
    print_fn("all examples match torch" if all_ok else "SOME EXAMPLES DO NOT MATCH")
    return all_ok


def _timing(fused, eager) -> str:
    t_fused = do_bench(fused, return_mode="median")
    t_eager = do_bench(eager, return_mode="median")
    return f"epifuse {t_fused * 1e3:7.1f} us, eager torch {t_eager * 1e3:7.1f} us"


if __name__ == "__main__":
    raise SystemExit(0 if run_demo() else 1)
