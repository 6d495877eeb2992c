"""The bad-input matrix: every way a caller can get the arguments wrong, with its outcome.

Each case builds a problem and states what must happen: either it runs correctly (every kernel
`get_kernels` offers, the generated ones and the reference, gives the same result, equal to the
float64 reference, plus a case-specific check), or it raises the named `EpilogueError` subclass
with a phrase that names the problem, before anything is written: every tensor involved (outputs
included, poisoned beforehand) is compared with its copy afterwards. Never a crash, a hang, or a
partly written output.

Inputs are integer-valued, so every kernel's result is exact and compared with `torch.equal`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, EpilogueError, FusedGemm, GemmArguments, torch_ops
from epifuse.errors import EpilogueArgumentError, EpilogueSyntaxError, ShapeError
from epifuse.frontend import parse
from epifuse.shapes import overlaps
from helpers import reference_outputs

M, N, K, L = 8, 12, 7, 2

BIAS = "def epi(accum, bias):\n    D = accum + bias\n    return D\n"
ALPHA = "def epi(accum, alpha):\n    D = accum * alpha\n    return D\n"
TWO = "def epi(accum, bias):\n    D = accum + bias\n    F = accum * 2.0\n    return D, F\n"
RELU_BIAS = "def epi(accum, bias):\n    D = relu(accum + bias)\n    return D\n"
IN_PLACE = "def epi(accum, C):\n    D = accum + C\n    return D\n"


def red(kind: str, dim: str = "dim=1", expr: str = "accum") -> str:
    return f"def epi(accum):\n    r = {kind}({expr}{', ' + dim if dim else ''})\n    return r\n"


@dataclass
class Problem:
    """What a case hands to epifuse: A, B, an epilogue and its keywords, and how to call."""

    A: Any
    B: Any
    source: str | None = BIAS
    tensors: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)        # EpilogueArguments / gemm options
    gemm_options: dict = field(default_factory=dict)   # GemmArguments options (out=, precision=, ...)
    via: str = "args"                                  # "args": GemmArguments + every kernel; "gemm"; VIAS
    check: Callable | None = None                      # check(problem, outputs) for "ok" cases


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[str], Problem]
    expect: type | None = None       # None: runs correctly
    phrase: str = ""


def ints(*shape, device="cpu", dtype=torch.float32, low=-3, high=4):
    return torch.randint(low, high, shape).to(dtype).to(device)


def out(*shape, device="cpu", dtype=torch.float32):
    return torch.full(shape or (M, N), 7, dtype=dtype, device=device)


def ab(device, m=M, k=K, n=N, dtype=torch.float32, batch=False):
    if batch:
        return ints(L, m, k, device=device, dtype=dtype), ints(L, k, n, device=device, dtype=dtype)
    return ints(m, k, device=device, dtype=dtype), ints(k, n, device=device, dtype=dtype)


def bias_problem(device, bias=None, D=None, **kw) -> Problem:
    A, B = ab(device)
    bias = ints(N, device=device) if bias is None else bias
    return Problem(A, B, BIAS, {"bias": bias, "D": out(device=device) if D is None else D}, **kw)


def accum_of(p: Problem) -> torch.Tensor:
    if not p.A.is_floating_point():
        return (p.A.long().cpu() @ p.B.long().cpu()).double()
    return p.A.double().cpu() @ p.B.double().cpu()


def expect_tensor(name: str, fn: Callable) -> Callable:
    """A check: output `name` equals fn(problem) (NaN where it is NaN)."""
    def check(p, outputs):
        got, want = outputs[name].cpu(), fn(p)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert torch.equal(got.double().nan_to_num(1e300), want.double().nan_to_num(1e300)), (got, want)
    return check


def with_value(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t[index] = value
    return t


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


def neg(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` with torch's negative bit: it reads as -t, its memory holds t."""
    return torch._neg_view(t)


def conj_imag(*shape, device="cpu") -> torch.Tensor:
    """x.conj().imag of a complex x: a real view with the negative bit set."""
    return torch.complex(ints(*shape, device=device), ints(*shape, device=device)).conj().imag


def freed(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)
    return t


def shrunk(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    t.untyped_storage().resize_(nbytes)
    return t


def given_back(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage freed and given its size back (new memory, random values written)."""
    size = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(size)
    return t.copy_(ints(*t.shape, device=t.device, dtype=t.dtype))


def overlapping(shape, strides, device):
    return torch.full((64,), 7.0, device=device).as_strided(shape, strides)


# ---- the matrix ---------------------------------------------------------------------------------

CASES: list = [
    # devices (the meta device stands in for a second device)
    Case("device-A-meta", lambda d: Problem(meta(M, K), ints(K, N), tensors={"bias": 1.0, "D": out()}),
         ShapeError, "A is on meta but B is on cpu"),
    Case("device-B-meta", lambda d: Problem(ints(M, K), meta(K, N), tensors={"bias": 1.0, "D": out()}),
         ShapeError, "A is on cpu but B is on meta"),
    Case("device-operand-meta", lambda d: bias_problem(d, bias=meta(N)),
         ShapeError, "Operand bias is on meta but A and B are on"),
    Case("device-one-element-operand-meta", lambda d: bias_problem(d, bias=meta(1)),
         ShapeError, "Operand bias is on meta but A and B are on"),
    Case("device-output-meta", lambda d: bias_problem(d, D=meta(M, N)),
         ShapeError, "Output D is on meta but A and B are on"),
    Case("device-second-output-meta", lambda d: Problem(*ab(d), TWO, {"bias": 1.0, "D": out(device=d), "F": meta(M, N)}),
         ShapeError, "Output F is on meta but A and B are on"),
    Case("device-reduction-output-meta", lambda d: Problem(*ab(d), red("sum"), {"r": meta(M)}),
         ShapeError, "Output r is on meta but A and B are on"),
    Case("device-operand-meta-via-gemm", lambda d: Problem(*ab(d), tensors={"bias": meta(N)}, via="gemm"),
         ShapeError, "Operand bias is on meta but A and B are on"),
    Case("device-all-meta", lambda d: Problem(meta(M, K), meta(K, N), tensors={"bias": meta(N), "D": meta(M, N)},
                                              check=lambda p, o: o["D"].shape == (M, N))),

    # dtypes
    Case("dtype-int8-x-fp16", lambda d: Problem(ints(M, K, device=d, dtype=torch.int8), ints(K, N, device=d, dtype=torch.float16),
                                                tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A is torch.int8 and B is torch.float16: both must be floating point or both integer."),
    Case("dtype-fp16-x-int32", lambda d: Problem(ints(M, K, device=d, dtype=torch.float16), ints(K, N, device=d, dtype=torch.int32),
                                                 tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "both must be floating point or both integer"),
    Case("dtype-complex-A", lambda d: Problem(ints(M, K, device=d, dtype=torch.complex64), ints(K, N, device=d),
                                              tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A has dtype torch.complex64; use a real floating-point or integer type."),
    Case("dtype-bool-B", lambda d: Problem(ints(M, K, device=d), ints(K, N, device=d, dtype=torch.bool),
                                           tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "B has dtype torch.bool"),
    Case("dtype-int8-with-float32-accumulator", lambda d: Problem(*ab(d, dtype=torch.int8), tensors={"bias": 1.0, "D": out(device=d)},
                                                                  gemm_options={"accumulator_type": torch.float32}),
         ShapeError, "accumulator_type torch.float32 does not fit torch.int8 inputs; use torch.int32."),
    Case("dtype-int8-default-accumulator", lambda d: Problem(
        *ab(d, dtype=torch.int8), tensors={"bias": ints(N, device=d), "D": out(device=d)},
        check=expect_tensor("D", lambda p: accum_of(p) + p.tensors["bias"].double().cpu()))),
    Case("dtype-int8-with-int32-accumulator", lambda d: Problem(
        *ab(d, dtype=torch.int8), tensors={"bias": ints(N, device=d), "D": out(device=d)},
        gemm_options={"accumulator_type": torch.int32},
        check=expect_tensor("D", lambda p: accum_of(p) + p.tensors["bias"].double().cpu()))),
    Case("dtype-integer-overflow-saturates", lambda d: Problem(
        torch.full((M, K), 100, dtype=torch.int8, device=d), torch.full((K, N), 100, dtype=torch.int8, device=d),
        ALPHA, {"alpha": -1, "D": out(device=d, dtype=torch.int8)}, gemm_options={"accumulator_type": torch.int32},
        check=expect_tensor("D", lambda p: torch.full((M, N), -128.0)))),
    Case("dtype-int32-output-from-float-inputs", lambda d: Problem(
        *ab(d), ALPHA, {"alpha": 0.5, "D": out(device=d, dtype=torch.int32)},
        check=expect_tensor("D", lambda p: torch.round(accum_of(p) * 0.5)))),
    Case("dtype-mixed-fp16-bf16", lambda d: Problem(ints(M, K, device=d, dtype=torch.float16), ints(K, N, device=d, dtype=torch.bfloat16),
                                                    tensors={"bias": ints(N, device=d), "D": out(device=d)})),
    Case("dtype-fp32-x-fp16", lambda d: Problem(ints(M, K, device=d), ints(K, N, device=d, dtype=torch.float16),
                                                tensors={"bias": ints(N, device=d), "D": out(device=d)})),
    Case("dtype-fp64-inputs", lambda d: Problem(*ab(d, dtype=torch.float64), tensors={"bias": ints(N, device=d), "D": out(device=d, dtype=torch.float64)})),
    Case("dtype-fp8-inputs", lambda d: Problem(*ab(d, dtype=torch.float8_e4m3fn), tensors={"bias": ints(N, device=d), "D": out(device=d)})),
    Case("dtype-int32-accumulator-for-float", lambda d: bias_problem(d, gemm_options={"accumulator_type": torch.int32}),
         ShapeError, "accumulator_type torch.int32 does not fit torch.float32 inputs"),
    Case("dtype-fp16-accumulator-for-fp32", lambda d: bias_problem(d, gemm_options={"accumulator_type": torch.float16}),
         ShapeError, "accumulator_type torch.float16 does not fit torch.float32 inputs; use torch.float32."),
    Case("dtype-fp16-accumulator-for-bf16", lambda d: Problem(
        *ab(d, dtype=torch.bfloat16), BIAS, {"bias": ints(N, device=d), "D": out(device=d)},
        gemm_options={"accumulator_type": torch.float16}),
         ShapeError, "accumulator_type torch.float16 does not fit torch.bfloat16 inputs; use torch.float32."),
    Case("dtype-fp16-accumulator-for-fp16", lambda d: Problem(
        *ab(d, dtype=torch.float16), BIAS, {"bias": ints(N, device=d), "D": out(device=d)},
        gemm_options={"accumulator_type": torch.float16},
        check=expect_tensor("D", lambda p: accum_of(p) + p.tensors["bias"].double().cpu()))),
    Case("dtype-fp16-accumulator-overflows-to-inf", lambda d: Problem(
        torch.full((M, K), 128.0, dtype=torch.float16, device=d), torch.full((K, N), 128.0, dtype=torch.float16, device=d),
        BIAS, {"bias": ints(N, device=d), "D": out(device=d)}, gemm_options={"accumulator_type": torch.float16},
        check=expect_tensor("D", lambda p: torch.full((M, N), float("inf"))))),
    Case("dtype-compute-fp16", lambda d: bias_problem(d, options={"compute_dtype": torch.float16}),
         ShapeError, "compute_dtype must be torch.float32 or torch.float64, got torch.float16."),
    Case("dtype-compute-fp64", lambda d: bias_problem(d, options={"compute_dtype": torch.float64})),
    Case("dtype-complex-operand", lambda d: bias_problem(d, bias=ints(N, device=d, dtype=torch.complex64)),
         EpilogueArgumentError, "Operand bias has dtype torch.complex64"),
    Case("dtype-bool-operand", lambda d: bias_problem(d, bias=ints(N, device=d, dtype=torch.bool)),
         EpilogueArgumentError, "Operand bias has dtype torch.bool"),
    Case("dtype-complex-output", lambda d: bias_problem(d, D=out(device=d, dtype=torch.complex64)),
         ShapeError, "Output D has dtype torch.complex64"),
    Case("dtype-bool-output", lambda d: bias_problem(
        d, bias=torch.zeros(N, device=d), D=out(device=d, dtype=torch.bool),
        check=expect_tensor("D", lambda p: (accum_of(p) != 0).double()))),
    Case("dtype-int8-output-saturates", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1000.0, "D": out(device=d, dtype=torch.int8)},
                                                          check=expect_tensor("D", lambda p: (accum_of(p) * 1000).clamp(-128, 127)))),
    Case("dtype-fp64-output", lambda d: bias_problem(d, D=out(device=d, dtype=torch.float64))),
    Case("dtype-fp8-output", lambda d: Problem(ints(M, K, device=d, low=-1, high=2), ints(K, N, device=d, low=-1, high=2),  # |D| <= 10: exact in fp8
                                               tensors={"bias": ints(N, device=d), "D": out(device=d, dtype=torch.float8_e4m3fn)})),
    Case("dtype-int32-operand", lambda d: bias_problem(d, bias=ints(N, device=d, dtype=torch.int32))),

    # shapes
    Case("shape-row-wrong-length", lambda d: bias_problem(d, bias=ints(3, device=d)),
         ShapeError, "Operand bias with shape (3,) does not broadcast against accum (8, 12)"),
    Case("shape-column-wrong-length", lambda d: bias_problem(d, bias=ints(3, 1, device=d)),
         ShapeError, "Operand bias with shape (3, 1) does not broadcast against accum (8, 12)"),
    Case("shape-tile-transposed", lambda d: bias_problem(d, bias=ints(N, M, device=d)),
         ShapeError, "Operand bias with shape (12, 8) does not broadcast against accum (8, 12)"),
    Case("shape-column-given-as-row", lambda d: bias_problem(d, bias=ints(M, device=d)),
         ShapeError, "Operand bias with shape (8,) does not broadcast against accum (8, 12)"),
    Case("shape-batched-operand-on-2d-accum", lambda d: bias_problem(d, bias=ints(2, M, N, device=d)),
         ShapeError, "Operand bias with shape (2, 8, 12) does not broadcast against accum (8, 12)"),
    Case("shape-operand-batch-3-vs-2", lambda d: Problem(*ab(d, batch=True), tensors={"bias": ints(3, 1, N, device=d), "D": out(L, M, N, device=d)}),
         ShapeError, "Operand bias with shape (3, 1, 12) does not broadcast against accum (2, 8, 12)"),
    Case("shape-empty-operand", lambda d: bias_problem(d, bias=ints(0, device=d)),
         ShapeError, "Operand bias with shape (0,) does not broadcast against accum (8, 12)"),
    Case("shape-4d-operand", lambda d: bias_problem(d, bias=ints(1, 1, 1, N, device=d)),
         ShapeError, "Operand bias with shape (1, 1, 1, 12) does not broadcast against accum (8, 12)"),
    Case("shape-K-mismatch", lambda d: Problem(ints(M, K, device=d), ints(K - 1, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A (8, 7) and B (6, 12) do not multiply: A has K=7 columns but B has 6 rows."),
    Case("shape-batch-mismatch", lambda d: Problem(ints(2, M, K, device=d), ints(3, K, N, device=d), tensors={"bias": 1.0, "D": out(3, M, N, device=d)}),
         ShapeError, "A has batch 2 but B has batch 3; batch sizes must match (or be 1)."),
    Case("shape-A-1d", lambda d: Problem(ints(K, device=d), ints(K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A must be 2-D or 3-D (batched), but has shape (7,)."),
    Case("shape-B-4d", lambda d: Problem(ints(M, K, device=d), ints(1, 1, K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "B must be 2-D or 3-D (batched), but has shape (1, 1, 7, 12)."),
    pytest.param(Case("shape-A-a-list", lambda d: Problem([[1.0] * K] * M, ints(K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
                      ShapeError, "A must be a torch.Tensor, but got list."),
                 id="shape-A-a-list"),
    Case("shape-B-a-numpy-array", lambda d: Problem(ints(M, K, device=d), np.ones((K, N), np.float32), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "B must be a torch.Tensor, but got ndarray."),
    Case("shape-A-a-list-via-torch-ops-grad", lambda d: Problem([[1.0] * K] * M, ints(K, N, device=d), tensors={"bias": ints(N, device=d)},
                                                                via="torch-ops-grad"),
         ShapeError, "A must be a torch.Tensor, but got list."),
    Case("shape-B-a-numpy-array-via-torch-ops-grad", lambda d: Problem(ints(M, K, device=d), np.ones((K, N), np.float32),
                                                                       tensors={"bias": ints(N, device=d)}, via="torch-ops-grad"),
         ShapeError, "B must be a torch.Tensor, but got ndarray."),
    Case("shape-A-sparse", lambda d: Problem(ints(M, K).to_sparse(), ints(K, N), tensors={"bias": 1.0, "D": out()}),
         ShapeError, "A has layout torch.sparse_coo; epifuse needs dense (strided) tensors."),
    Case("shape-operand-sparse", lambda d: bias_problem("cpu", bias=ints(M, N).to_sparse()),
         ShapeError, "Operand bias has layout torch.sparse_coo"),
    Case("shape-output-sparse", lambda d: bias_problem("cpu", D=torch.zeros(M, N).to_sparse()),
         ShapeError, "Output D has layout torch.sparse_coo"),
    Case("shape-output-wrong-N", lambda d: bias_problem(d, D=out(M, N + 1, device=d)),
         ShapeError, "Output D has shape (8, 13) but accum is (8, 12); an elementwise output must match accum."),
    Case("shape-output-transposed-shape", lambda d: bias_problem(d, D=out(N, M, device=d)),
         ShapeError, "Output D has shape (12, 8) but accum is (8, 12)"),
    Case("shape-output-0d-for-elementwise", lambda d: bias_problem(d, D=torch.tensor(7.0, device=d)),
         ShapeError, "Output D has shape () but accum is (8, 12)"),
    Case("shape-output-batched-for-2d-accum", lambda d: bias_problem(d, D=out(1, M, N, device=d)),
         ShapeError, "Output D has shape (1, 8, 12) but accum is (8, 12)"),
    Case("shape-output-2d-for-batched-accum", lambda d: Problem(*ab(d, batch=True), tensors={"bias": 1.0, "D": out(M, N, device=d)}),
         ShapeError, "Output D has shape (8, 12) but accum is (2, 8, 12)"),

    # aliasing
    Case("alias-output-is-A", lambda d: (lambda A, B: Problem(A, B, ALPHA, {"alpha": 1.0, "D": A}))(*ab(d, k=N)),
         ShapeError, "Output D overlaps the GEMM input A."),
    Case("alias-output-is-B", lambda d: (lambda A, B: Problem(A, B, ALPHA, {"alpha": 1.0, "D": B}))(*ab(d, m=K, k=K, n=N)),
         ShapeError, "Output D overlaps the GEMM input B."),
    Case("alias-output-overlaps-part-of-A", lambda d: (lambda S: Problem(S[:M], ints(N, N, device=d), ALPHA, {"alpha": 1.0, "D": S[M // 2:M // 2 + M]}))(ints(2 * M, N, device=d)),
         ShapeError, "Output D overlaps the GEMM input A."),
    Case("alias-output-is-a-transposed-view-of-A", lambda d: (lambda S: Problem(S.t(), ints(M, M, device=d), ALPHA, {"alpha": 1.0, "D": S}))(ints(M, M, device=d)),
         ShapeError, "Output D overlaps the GEMM input A."),
    Case("alias-two-outputs-one-tensor", lambda d: (lambda D: Problem(*ab(d), TWO, {"bias": 1.0, "D": D, "F": D}))(out(device=d)),
         ShapeError, "Outputs D and F overlap in memory."),
    Case("alias-two-outputs-partly-overlap", lambda d: (lambda S: Problem(*ab(d), TWO, {"bias": 1.0, "D": S[:M], "F": S[1:M + 1]}))(out(M + 1, N, device=d)),
         ShapeError, "Outputs D and F overlap in memory."),
    Case("alias-reduction-inside-tile-output", lambda d: (lambda D: Problem(
        *ab(d), "def epi(accum):\n    D = accum * 2.0\n    r = sum(accum, dim=1)\n    return D, r\n", {"D": D, "r": D[:, 0]}))(out(device=d)),
         ShapeError, "Outputs D and r overlap in memory."),
    Case("alias-in-place-D-is-C", lambda d: (lambda C: Problem(*ab(d), IN_PLACE, {"C": C, "D": C},
                                                               check=expect_tensor("D", lambda p: accum_of(p) + p.C0)))(ints(M, N, device=d))),
    Case("alias-in-place-D-is-C-transposed-layout", lambda d: (lambda C: Problem(*ab(d), IN_PLACE, {"C": C, "D": C},
                                                                                 check=expect_tensor("D", lambda p: accum_of(p) + p.C0)))(ints(N, M, device=d).t())),
    Case("alias-in-place-via-gemm", lambda d: (lambda C: Problem(*ab(d), IN_PLACE, {"C": C, "D": C}, via="gemm",
                                                                 check=expect_tensor("D", lambda p: accum_of(p) + p.C0)))(ints(M, N, device=d))),
    Case("alias-output-partly-overlaps-operand", lambda d: (lambda S: Problem(*ab(d), IN_PLACE, {"C": S[:M], "D": S[1:]}))(ints(M + 1, N, device=d)),
         ShapeError, "Output D partly overlaps operand C."),
    Case("alias-output-is-operand-transposed", lambda d: (lambda S: Problem(*ab(d, m=M, n=M), IN_PLACE, {"C": S, "D": S.t()}))(ints(M, M, device=d)),
         ShapeError, "Output D partly overlaps operand C."),
    Case("alias-reduction-output-is-operand", lambda d: (lambda b: Problem(
        *ab(d), "def epi(accum, bias):\n    r = sum(accum + bias, dim=1)\n    return r\n", {"bias": b, "r": b}))(ints(M, 1, device=d)),
         ShapeError, "Output r partly overlaps operand bias."),
    Case("alias-disjoint-views-of-one-storage", lambda d: (lambda S: Problem(S[:M, :K], ints(K, N, device=d), BIAS, {"bias": 1.0, "D": S[M:, :]}))(ints(2 * M, N, device=d))),
    Case("alias-expanded-output", lambda d: bias_problem(d, D=torch.zeros(N, device=d).expand(M, N)),
         ShapeError, "Output D has elements that share memory"),
    Case("alias-as-strided-output", lambda d: bias_problem(d, D=overlapping((M, N), (1, 1), d)),
         ShapeError, "Output D has elements that share memory (shape (8, 12), strides (1, 1))"),
    Case("alias-expanded-reduction-output", lambda d: Problem(*ab(d), red("sum"), {"r": torch.zeros(1, device=d).expand(M)}),
         ShapeError, "Output r has elements that share memory"),
    Case("alias-expanded-operand-is-fine", lambda d: bias_problem(d, bias=ints(N, device=d).expand(M, N))),
    Case("alias-A-and-B-share-memory", lambda d: (lambda S: Problem(S, S.t(), BIAS, {"bias": ints(M, device=d), "D": out(M, M, device=d)}))(ints(M, M, device=d))),
    Case("alias-operand-overlaps-A", lambda d: (lambda S: Problem(S[:, :K], ints(K, N, device=d), BIAS, {"bias": S[:, :N], "D": out(device=d)}))(ints(M, N + K, device=d))),

    # zero sizes
    Case("zero-M", lambda d: Problem(*ab(d, m=0), tensors={"bias": ints(N, device=d), "D": out(0, N, device=d)})),
    Case("zero-N", lambda d: Problem(*ab(d, n=0), tensors={"bias": ints(M, 1, device=d), "D": out(M, 0, device=d)})),
    Case("zero-K-accum-is-zero-and-the-epilogue-runs", lambda d: Problem(
        *ab(d, k=0), "def epi(accum, bias, alpha):\n    D = relu(accum + 1.0) * alpha + bias\n    return D\n",
        {"bias": ints(N, device=d), "alpha": 3.0, "D": out(device=d)},
        check=expect_tensor("D", lambda p: 3.0 + p.tensors["bias"].double().cpu().expand(M, N)))),
    Case("zero-K-reduction", lambda d: Problem(*ab(d, k=0), red("sum", "dim=1", "accum + 1.0"), {"r": out(M, device=d)},
                                               check=expect_tensor("r", lambda p: torch.full((M,), float(N))))),
    Case("zero-K-batched", lambda d: Problem(*ab(d, k=0, batch=True), ALPHA, {"alpha": 2.0, "D": out(L, M, N, device=d)},
                                             check=expect_tensor("D", lambda p: torch.zeros(L, M, N)))),
    Case("zero-everything", lambda d: Problem(*ab(d, m=0, k=0, n=0), ALPHA, {"alpha": 2.0, "D": out(0, 0, device=d)})),
    Case("zero-L", lambda d: Problem(ints(0, M, K, device=d), ints(0, K, N, device=d), tensors={"bias": 1.0, "D": out(0, M, N, device=d)})),
    Case("zero-M-sum-over-M", lambda d: Problem(*ab(d, m=0), red("sum", "dim=0"), {"r": out(N, device=d)},
                                                check=expect_tensor("r", lambda p: torch.zeros(N)))),
    Case("zero-M-max-over-M", lambda d: Problem(*ab(d, m=0), red("max", "dim=0"), {"r": out(N, device=d)}),
         ShapeError, "reduces an empty dimension"),
    Case("zero-M-amax-over-everything", lambda d: Problem(*ab(d, m=0), red("amax", ""), {"r": out(1, device=d)}),
         ShapeError, "reduces an empty dimension"),
    Case("zero-M-max-over-N", lambda d: Problem(*ab(d, m=0), red("max", "dim=1"), {"r": out(0, device=d)})),
    Case("zero-M-mean-over-M-is-nan", lambda d: Problem(*ab(d, m=0), red("mean", "dim=0"), {"r": out(N, device=d)},
                                                        check=expect_tensor("r", lambda p: torch.full((N,), float("nan"))))),
    Case("zero-M-deterministic-mean-over-M-is-nan", lambda d: Problem(
        *ab(d, m=0), red("mean", "dim=0"), {"r": out(N, device=d)}, {"deterministic": True},
        check=expect_tensor("r", lambda p: torch.full((N,), float("nan"))))),
    Case("zero-K-batched-mean-over-empty-L", lambda d: Problem(
        ints(0, M, K, device=d), ints(0, K, N, device=d), red("mean", "dim=(0, 1)"), {"r": out(N, device=d)},
        check=expect_tensor("r", lambda p: torch.full((N,), float("nan"))))),
    Case("zero-M-mean-into-int32-is-zero", lambda d: Problem(*ab(d, m=0), red("mean", "dim=0"),
                                                             {"r": out(N, device=d, dtype=torch.int32)},
                                                             check=expect_tensor("r", lambda p: torch.zeros(N)))),
    Case("zero-M-mean-over-N-is-empty", lambda d: Problem(*ab(d, m=0), red("mean", "dim=1"), {"r": out(0, device=d)})),

    # NaN and Inf propagate
    Case("nan-in-A", lambda d: (lambda A, B: Problem(with_value(A, (2, 3), float("nan")), B,
                                                     tensors={"bias": ints(N, device=d), "D": out(device=d)},
                                                     check=lambda p, o: bool(o["D"][2].isnan().all()) and not o["D"][:2].isnan().any()))(*ab(d))),
    Case("inf-in-B", lambda d: (lambda A, B: Problem(torch.ones(M, K, device=d), with_value(B, (0, 5), float("inf")),
                                                     tensors={"bias": ints(N, device=d), "D": out(device=d)},
                                                     check=expect_tensor("D", lambda p: accum_of(p) + p.tensors["bias"].double().cpu())))(*ab(d))),
    Case("nan-in-bias-relu-keeps-nan", lambda d: Problem(*ab(d), RELU_BIAS, {"bias": torch.tensor([float("nan")] + [-100.0] * (N - 1), device=d), "D": out(device=d)},
                                                         check=lambda p, o: bool(o["D"][:, 0].isnan().all()) and bool((o["D"][:, 1:] == 0).all()))),
    Case("inf-number-operand", lambda d: Problem(*ab(d), ALPHA, {"alpha": float("inf"), "D": out(device=d)})),
    Case("nan-number-operand", lambda d: Problem(*ab(d), ALPHA, {"alpha": float("nan"), "D": out(device=d)},
                                                 check=lambda p, o: bool(o["D"].isnan().all()))),
    Case("nan-max-reduction", lambda d: Problem(*ab(d), "def epi(accum, bias):\n    r = max(accum + bias, dim=1)\n    return r\n",
                                                {"bias": torch.tensor([0.0] * (N - 1) + [float("nan")], device=d), "r": out(M, device=d)},
                                                check=lambda p, o: bool(o["r"].isnan().all()))),
    Case("inf-sum-reduction", lambda d: Problem(*ab(d), "def epi(accum, bias):\n    r = sum(accum + bias, dim=0)\n    return r\n",
                                                {"bias": torch.tensor([float("inf")] + [0.0] * (N - 1), device=d), "r": out(N, device=d)})),
    Case("minus-inf-min-reduction", lambda d: Problem(*ab(d), "def epi(accum, bias):\n    r = min(accum + bias, dim=(0, 1))\n    return r\n",
                                                      {"bias": torch.tensor([-float("inf")] + [0.0] * (N - 1), device=d), "r": out(1, device=d)},
                                                      check=expect_tensor("r", lambda p: torch.tensor([-float("inf")])))),

    # scalars of the wrong type
    Case("scalar-str", lambda d: Problem(*ab(d), ALPHA, {"alpha": "2.0", "D": out(device=d)}),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got str."),
    Case("scalar-None", lambda d: Problem(*ab(d), ALPHA, {"alpha": None, "D": out(device=d)}),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got NoneType."),
    Case("scalar-bool", lambda d: Problem(*ab(d), ALPHA, {"alpha": True, "D": out(device=d)}),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got bool."),
    Case("scalar-complex", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1 + 2j, "D": out(device=d)}),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got complex."),
    Case("scalar-list", lambda d: Problem(*ab(d), ALPHA, {"alpha": [2.0], "D": out(device=d)}),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got list."),
    Case("scalar-numpy-array", lambda d: Problem(*ab(d), ALPHA, {"alpha": np.array(2.0), "D": out(device=d)}),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got ndarray."),
    Case("scalar-too-large-for-a-float", lambda d: Problem(*ab(d), ALPHA, {"alpha": 10 ** 400, "D": out(device=d)}),
         ShapeError, "Operand alpha = an integer of 1329 bits cannot be converted to a float."),
    Case("scalar-str-via-gemm", lambda d: Problem(*ab(d), ALPHA, {"alpha": "2.0"}, via="gemm"),
         EpilogueArgumentError, "Operand alpha must be a number or a torch.Tensor, but got str."),
    Case("scalar-int", lambda d: Problem(*ab(d), ALPHA, {"alpha": -2, "D": out(device=d)},
                                         check=expect_tensor("D", lambda p: accum_of(p) * -2))),
    Case("scalar-numpy-float64", lambda d: Problem(*ab(d), ALPHA, {"alpha": np.float64(0.5), "D": out(device=d)})),
    Case("scalar-one-element-int-tensor", lambda d: Problem(*ab(d), ALPHA, {"alpha": torch.tensor([3], device=d), "D": out(device=d)},
                                                            check=expect_tensor("D", lambda p: accum_of(p) * 3))),

    # outputs that are not tensors
    Case("output-a-float", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "D": 3.0}),
         EpilogueArgumentError, "Output D must be a torch.Tensor, but got float."),
    Case("output-None", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "D": None}),
         EpilogueArgumentError, "Output D must be a torch.Tensor, but got NoneType."),
    Case("output-a-list", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "D": [[0.0] * N] * M}),
         EpilogueArgumentError, "Output D must be a torch.Tensor, but got list."),
    Case("output-a-numpy-array", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "D": np.zeros((M, N), np.float32)}),
         EpilogueArgumentError, "Output D must be a torch.Tensor, but got ndarray."),

    # missing and extra operands
    Case("missing-operand", lambda d: Problem(*ab(d), ALPHA, {"D": out(device=d)}),
         EpilogueArgumentError, "Argument alpha is not provided in the kwargs of the EpilogueArguments constructor"),
    Case("missing-output", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0}),
         EpilogueArgumentError, "Argument D is not provided in the kwargs of the EpilogueArguments constructor"),
    Case("missing-operand-via-gemm", lambda d: Problem(*ab(d), ALPHA, {}, via="gemm"),
         EpilogueArgumentError, "Argument alpha is not provided in the kwargs of the EpilogueArguments constructor"),
    Case("extra-kwarg", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "D": out(device=d), "gamma": 2.0}),
         EpilogueArgumentError, "Unexpected keyword argument 'gamma'"),
    Case("extra-tensor-kwarg-via-gemm", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "gamma": out(device=d)}, via="gemm"),
         EpilogueArgumentError, "Unexpected keyword argument 'gamma'"),
    Case("out-and-D-differ", lambda d: Problem(*ab(d), ALPHA, {"alpha": 1.0, "D": out(device=d)}, gemm_options={"out": out(device=d)}),
         EpilogueArgumentError, "`out` and the epilogue's output D are different tensors."),
    Case("no-out-and-no-epilogue", lambda d: Problem(*ab(d), None, {}),
         EpilogueArgumentError, "GemmArguments needs `out` or an `epilogue`."),
    Case("out-without-epilogue", lambda d: Problem(*ab(d), None, {}, gemm_options={"out": out(device=d)},
                                                   check=lambda p, o: torch.equal(p.gemm_options["out"].double().cpu(), accum_of(p)))),
    Case("bad-precision", lambda d: bias_problem(d, gemm_options={"precision": "tf32"}),
         EpilogueArgumentError, "precision must be 'default' or 'highest', got 'tf32'."),
    Case("operand-named-like-an-option", lambda d: Problem(*ab(d), "def epi(accum, accumulate):\n    D = accum + accumulate\n    return D\n",
                                                           {"D": out(device=d)}),
         EpilogueSyntaxError, "The name 'accumulate' cannot be an operand or output"),
    Case("operand-named-A-via-gemm", lambda d: Problem(*ab(d), "def epi(accum, A):\n    D = accum + A\n    return D\n",
                                                       {"A": 2.0}, via="gemm"),
         EpilogueSyntaxError, "The name 'A' cannot be an operand or output: it clashes with the gemm option 'A'"),

    # reduction destinations
    Case("reduction-destination-wrong-length", lambda d: Problem(*ab(d), red("sum"), {"r": out(M + 1, device=d)}),
         ShapeError, "Output r has shape (9,) but sum(dim=(1)) over accum (8, 12) gives (8,): expected (8,) or (8, 1)."),
    Case("reduction-destination-keepdim-transposed", lambda d: Problem(*ab(d), red("sum"), {"r": out(1, M, device=d)}),
         ShapeError, "expected (8,) or (8, 1)"),
    Case("reduction-destination-for-dim-0", lambda d: Problem(*ab(d), red("max", "dim=0"), {"r": out(M, device=d)}),
         ShapeError, "Output r has shape (8,) but max(dim=(0)) over accum (8, 12) gives (12,)"),
    Case("reduction-full-into-several-values", lambda d: Problem(*ab(d), red("mean", ""), {"r": out(2, device=d)}),
         ShapeError, "gives one value: pass a one-element tensor"),
    Case("reduction-into-elementwise-shape", lambda d: Problem(*ab(d), red("amax"), {"r": out(M, N, device=d)}),
         ShapeError, "expected (8,) or (8, 1)"),
    Case("reduction-keepdim-destination", lambda d: Problem(*ab(d), red("sum"), {"r": out(M, 1, device=d)},
                                                            check=expect_tensor("r", lambda p: accum_of(p).sum(1, keepdim=True)))),
    Case("reduction-0d-destination", lambda d: Problem(*ab(d), red("sum", ""), {"r": torch.tensor(7.0, device=d)},
                                                       check=expect_tensor("r", lambda p: accum_of(p).sum()))),
    Case("reduction-batched-per-batch", lambda d: Problem(*ab(d, batch=True), red("max", "dim=(1, 2)"), {"r": out(L, device=d)},
                                                          check=expect_tensor("r", lambda p: accum_of(p).amax((1, 2))))),
    Case("reduction-batched-keepdim", lambda d: Problem(*ab(d, batch=True), red("min", "dim=(1, 2)"), {"r": out(L, 1, 1, device=d)})),
    Case("reduction-fp16-destination", lambda d: Problem(*ab(d), red("sum"), {"r": out(M, device=d, dtype=torch.float16)})),
    Case("reduction-int32-destination", lambda d: Problem(*ab(d), red("sum"), {"r": out(M, device=d, dtype=torch.int32)},
                                                          check=expect_tensor("r", lambda p: accum_of(p).sum(1)))),
    Case("reduction-strided-destination", lambda d: Problem(*ab(d), red("mean", "dim=0"), {"r": out(2 * N, device=d)[::2]})),

    # non-contiguous outputs are fine
    Case("output-transposed", lambda d: bias_problem(d, D=out(N, M, device=d).t())),
    Case("output-sliced", lambda d: bias_problem(d, D=out(M, 2 * N, device=d)[:, ::2])),
    Case("output-offset-view", lambda d: bias_problem(d, D=out(M + 3, N + 5, device=d)[3:, 5:])),
    Case("output-batched-permuted", lambda d: Problem(*ab(d, batch=True), tensors={"bias": ints(N, device=d), "D": out(M, L, N, device=d).permute(1, 0, 2)})),
    Case("output-batch-stride-zero-is-rejected", lambda d: Problem(*ab(d, batch=True), tensors={"bias": 1.0, "D": out(1, M, N, device=d).expand(L, M, N)}),
         ShapeError, "Output D has elements that share memory"),

    # tensors requiring grad
    Case("operand-requires-grad-low-level", lambda d: bias_problem(d, bias=ints(N, device=d).requires_grad_())),
    Case("inputs-require-grad-via-gemm", lambda d: Problem(ints(M, K, device=d).requires_grad_(), ints(K, N, device=d),
                                                           BIAS, {"bias": ints(N, device=d)}, via="gemm",
                                                           check=lambda p, o: o["D"].requires_grad)),
    Case("output-requires-grad-low-level", lambda d: bias_problem(d, D=out(device=d).requires_grad_()),
         EpilogueArgumentError, "Output D requires grad: epifuse writes outputs in place"),
    Case("output-requires-grad-via-out", lambda d: Problem(*ab(d), None, {}, gemm_options={"out": out(device=d).requires_grad_()}),
         EpilogueArgumentError, "Output D requires grad"),
    Case("reduction-output-requires-grad", lambda d: Problem(*ab(d), red("sum"), {"r": out(M, device=d).requires_grad_()}),
         EpilogueArgumentError, "Output r requires grad"),
    Case("non-leaf-output-requires-grad", lambda d: bias_problem(d, D=out(device=d).requires_grad_() * 1.0),
         EpilogueArgumentError, "Output D requires grad"),
    Case("output-requires-grad-detached-is-fine", lambda d: bias_problem(d, D=out(device=d).requires_grad_().detach())),

    # torch's lazy sign bits: the memory holds the values without the sign
    Case("view-bit-neg-A", lambda d: Problem(neg(ints(M, K, device=d)), ints(K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A has torch's negative bit set"),
    Case("view-bit-neg-B", lambda d: Problem(ints(M, K, device=d), neg(ints(K, N, device=d)), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "B has torch's negative bit set"),
    Case("view-bit-conj-imag-A", lambda d: Problem(conj_imag(M, K, device=d), ints(K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A has torch's negative bit set"),
    Case("view-bit-neg-operand", lambda d: bias_problem(d, bias=neg(ints(N, device=d))),
         ShapeError, "Operand bias has torch's negative bit set"),
    Case("view-bit-conj-imag-operand", lambda d: bias_problem(d, bias=conj_imag(M, N, device=d)),
         ShapeError, "Operand bias has torch's negative bit set"),
    Case("view-bit-neg-one-element-operand", lambda d: bias_problem(d, bias=neg(ints(1, device=d))),
         ShapeError, "Operand bias has torch's negative bit set"),
    Case("view-bit-neg-output", lambda d: bias_problem(d, D=neg(out(device=d))),
         ShapeError, "Output D has torch's negative bit set"),
    Case("view-bit-conj-imag-output", lambda d: bias_problem(d, D=conj_imag(M, N, device=d)),
         ShapeError, "Output D has torch's negative bit set"),
    Case("view-bit-neg-reduction-output", lambda d: Problem(*ab(d), red("sum"), {"r": neg(out(M, device=d))}),
         ShapeError, "Output r has torch's negative bit set"),
    Case("view-bit-neg-operand-via-gemm", lambda d: Problem(*ab(d), tensors={"bias": neg(ints(N, device=d))}, via="gemm"),
         ShapeError, "Operand bias has torch's negative bit set"),
    Case("view-bit-neg-A-via-gemm", lambda d: Problem(neg(ints(M, K, device=d)), ints(K, N, device=d), tensors={"bias": 1.0}, via="gemm"),
         ShapeError, "A has torch's negative bit set"),
    Case("view-bit-neg-output-via-gemm", lambda d: Problem(*ab(d), tensors={"bias": 1.0, "D": neg(out(device=d))}, via="gemm"),
         ShapeError, "Output D has torch's negative bit set"),
    Case("view-bit-resolved-is-fine", lambda d: (lambda A, B: Problem(neg(A).resolve_neg(), B, tensors={"bias": ints(N, device=d), "D": out(device=d)},
                                                                      check=expect_tensor("D", lambda p: -(A.double().cpu() @ B.double().cpu()) + p.tensors["bias"].double().cpu())))(*ab(d))),

    # storage freed or shrunk under a view: nothing to read or write there
    Case("storage-freed-A", lambda d: Problem(freed(ints(M, K, device=d)), ints(K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "A's storage holds 0 bytes but the tensor reaches"),
    Case("storage-freed-B", lambda d: Problem(ints(M, K, device=d), freed(ints(K, N, device=d)), tensors={"bias": 1.0, "D": out(device=d)}),
         ShapeError, "B's storage holds 0 bytes"),
    Case("storage-freed-operand", lambda d: bias_problem(d, bias=freed(ints(N, device=d))),
         ShapeError, "Operand bias's storage holds 0 bytes"),
    Case("storage-freed-one-element-operand", lambda d: bias_problem(d, bias=freed(ints(1, device=d))),
         ShapeError, "Operand bias's storage holds 0 bytes"),
    Case("storage-freed-output", lambda d: bias_problem(d, D=freed(out(device=d))),
         ShapeError, "Output D's storage holds 0 bytes"),
    Case("storage-freed-reduction-output", lambda d: Problem(*ab(d), red("max"), {"r": freed(out(M, device=d))}),
         ShapeError, "Output r's storage holds 0 bytes"),
    Case("storage-shrunk-under-a-view", lambda d: bias_problem(d, bias=shrunk(ints(2, N, device=d)[1], 4 * N)),
         ShapeError, f"Operand bias's storage holds {4 * N} bytes but the tensor reaches {8 * N}"),
    Case("storage-freed-A-via-gemm", lambda d: Problem(freed(ints(M, K, device=d)), ints(K, N, device=d), tensors={"bias": 1.0}, via="gemm"),
         ShapeError, "A's storage holds 0 bytes"),
    Case("storage-freed-output-via-gemm", lambda d: Problem(*ab(d), tensors={"bias": 1.0, "D": freed(out(device=d))}, via="gemm"),
         ShapeError, "Output D's storage holds 0 bytes"),
    Case("storage-freed-and-given-back-is-fine", lambda d: bias_problem(d, bias=given_back(ints(N, device=d)))),

    # `out` is the epilogue's D: checked whatever the epilogue returns
    Case("out-not-a-tensor-epilogue-without-D", lambda d: Problem(*ab(d), red("sum"), {"r": out(M, device=d)}, gemm_options={"out": "not a tensor"}),
         EpilogueArgumentError, "`out` must be a torch.Tensor, but got str."),
    Case("out-tensor-epilogue-without-D", lambda d: Problem(*ab(d), red("sum"), {"r": out(M, device=d)}, gemm_options={"out": out(device=d)}),
         EpilogueArgumentError, "`out` is the epilogue's output D, but this epilogue returns r and no D"),
    Case("out-not-a-tensor-epilogue-with-D", lambda d: bias_problem(d, gemm_options={"out": [[0.0] * N] * M}),
         EpilogueArgumentError, "`out` must be a torch.Tensor, but got list."),
    Case("out-not-a-tensor-without-epilogue", lambda d: Problem(*ab(d), None, {}, gemm_options={"out": 3.0}),
         EpilogueArgumentError, "`out` must be a torch.Tensor, but got float."),

    # reduction destinations in torch's broadcasting forms: keepdim less its leading ones
    Case("reduction-batched-column-into-M-by-1", lambda d: Problem(*ab(d, batch=True), red("sum", "dim=(0, 2)"), {"r": out(M, 1, device=d)},
                                                                   check=expect_tensor("r", lambda p: accum_of(p).sum((0, 2)).reshape(M, 1)))),
    Case("reduction-batched-column-max-into-M-by-1", lambda d: Problem(*ab(d, batch=True), red("max", "dim=(0, 2)"), {"r": out(M, 1, device=d)},
                                                                       check=expect_tensor("r", lambda p: accum_of(p).amax((0, 2)).reshape(M, 1)))),
    Case("reduction-batched-column-amax-into-strided-M-by-1", lambda d: Problem(
        *ab(d, batch=True), red("amax", "dim=(0, 2)"), {"r": out(M, 3, device=d)[:, 1:2]},
        check=expect_tensor("r", lambda p: accum_of(p).abs().amax((0, 2)).reshape(M, 1)))),
    Case("reduction-batched-column-mean-into-fp16-M-by-1", lambda d: Problem(
        *ab(d, batch=True), red("mean", "dim=(0, 2)"), {"r": out(M, 1, device=d, dtype=torch.float16)},
        {"deterministic": True})),
    Case("reduction-batched-row-into-1-by-N", lambda d: Problem(*ab(d, batch=True), red("sum", "dim=(0, 1)"), {"r": out(1, N, device=d)},
                                                                check=expect_tensor("r", lambda p: accum_of(p).sum((0, 1)).reshape(1, N)))),
    Case("reduction-batched-column-into-1-by-M", lambda d: Problem(*ab(d, batch=True), red("sum", "dim=(0, 2)"), {"r": out(1, M, device=d)}),
         ShapeError, "Output r has shape (1, 8) but sum(dim=(0, 2)) over accum (2, 8, 12) gives (8,): expected (8,), (1, 8, 1) or (8, 1)."),
]


# Tensors no kernel can read or write as they are, each refused with the ShapeError that names it
UNUSABLE = {
    "sparse-coo": (lambda t: t.to_sparse(), " has layout torch.sparse_coo"),
    "sparse-csr": (lambda t: t.to_sparse_csr(), " has layout torch.sparse_csr"),
    "mkldnn": (lambda t: t.cpu().to_mkldnn(), " has layout torch._mkldnn"),   # CPU only; checked before devices
    "nested": (lambda t: torch.nested.nested_tensor([t, t]), " is a nested tensor"),
    "nested-jagged": (lambda t: torch.nested.nested_tensor([t, t], layout=torch.jagged), " is a nested tensor"),
    "neg-bit": (neg, " has torch's negative bit set"),
    "conj-imag": (lambda t: conj_imag(*t.shape, device=t.device), " has torch's negative bit set"),
    "conj-bit": (lambda t: torch.complex(t, ints(*t.shape, device=t.device)).conj(), " has torch's conjugate bit set"),
    "storage-freed": (freed, "'s storage holds 0 bytes but the tensor reaches"),
}
TWO_REDUCTIONS = "def epi(accum):\n    r = sum(accum, dim=1)\n    q = sum(accum, dim=0)\n    return r, q\n"
# where the tensor goes: (the problem with `make` applied to that tensor, its label in errors)
PLACES = {
    "A": (lambda d, f: Problem(f(ints(M, K, device=d)), ints(K, N, device=d), tensors={"bias": 1.0, "D": out(device=d)}), "A"),
    "B": (lambda d, f: Problem(ints(M, K, device=d), f(ints(K, N, device=d)), tensors={"bias": 1.0, "D": out(device=d)}), "B"),
    "operand": (lambda d, f: Problem(ints(M, K, device=d), ints(K, N, device=d), tensors={"bias": f(ints(M, N, device=d)), "D": out(device=d)}),
                "Operand bias"),
    "output": (lambda d, f: Problem(ints(M, K, device=d), ints(K, N, device=d), tensors={"bias": ints(N, device=d), "D": f(out(device=d))}),
               "Output D"),
    "reduction-output": (lambda d, f: Problem(ints(M, K, device=d), ints(K, N, device=d), TWO_REDUCTIONS,
                                              {"r": f(out(M, 1, device=d)), "q": out(N, device=d)}), "Output r"),
}
# how it is called: GemmArguments; epifuse.gemm and torch_ops.gemm without and with inputs that
# require grad (the custom ops' autograd path); a FusedGemm call and its arguments()
VIAS = ("args", "gemm", "gemm-grad", "torch-ops", "torch-ops-grad", "fused", "fused-args")


def _unusable_tensor_cases() -> list:
    """Every kind of tensor in UNUSABLE in every place, through every entry point: the ShapeError
    that names the tensor and what is wrong with it, before autograd, torch's dispatch or a
    kernel reads it (not torch's error from deep inside, nor a sign silently dropped)."""
    cases = []
    for kind, (make, phrase) in UNUSABLE.items():
        for place, (build, label) in PLACES.items():
            for via in VIAS:
                def problem(d, build=build, make=make, via=via):
                    p = build(d, make)
                    p.via = via
                    return p
                expect, words = ShapeError, label + phrase
                if kind == "conj-bit" and place == "operand" and not via.startswith("torch-ops") and via != "gemm-grad":
                    # a conjugate bit is on a complex tensor, and EpilogueArguments checks an
                    # operand's dtype first (the custom ops check the bit first)
                    expect, words = EpilogueArgumentError, "Operand bias has dtype torch.complex64"
                if kind == "nested-jagged" and via in ("gemm", "fused") and place not in ("A", "B"):
                    # epifuse.gemm's call-signature check (runtime/callsite) names a keyword alone
                    words = label.split()[-1] + phrase
                cases.append(Case(f"unusable-{kind}-{place}-via-{via}", problem, expect, words))
    return cases


CASES += _unusable_tensor_cases()


def _params():
    return [c if not isinstance(c, Case) else pytest.param(c, id=c.id) for c in CASES]


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 60
    ids = [c.id if isinstance(c, Case) else c.values[0].id for c in CASES]
    assert len(set(ids)) == len(ids)


# ---- running a case -----------------------------------------------------------------------------

def _tensors_of(p: Problem) -> list[torch.Tensor]:
    """The tensors a case can compare before and after: memory that holds them, strided."""
    values = [p.A, p.B, *p.tensors.values(), *p.gemm_options.values()]
    return [v for v in values if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.layout == torch.strided
            and not v.is_nested and not v.is_quantized and v.untyped_storage().nbytes() > 0]


def _requiring_grad(p: Problem) -> None:
    """A, B and the tensor operands that autograd can track, made leaves that require grad."""
    def track(t):
        usable = (type(t) is torch.Tensor and t.layout == torch.strided and t.is_floating_point() and t.is_leaf
                  and not (t.is_neg() or t.is_conj()) and t.untyped_storage().nbytes() > 0)
        return t.requires_grad_() if usable else t
    p.A, p.B = track(p.A), track(p.B)
    outputs = {n for n, _ in parse(p.source or "def e(accum):\n    D = accum\n    return D\n").outputs}
    p.tensors = {n: v if n in outputs or not isinstance(v, torch.Tensor) else track(v) for n, v in p.tensors.items()}


def _fused_gemm(source: str | None) -> type:
    return type("Fused", (FusedGemm,), {"epilogue": source or "def e(accum):\n    D = accum\n    return D\n"})


def _execute(p: Problem):
    """Everything a user would do with the problem: build the arguments and run every kernel."""
    if p.via.endswith("-grad"):
        _requiring_grad(p)
    if p.via in ("gemm", "gemm-grad"):
        result = epifuse.gemm(p.A, p.B, p.source, **p.options, **p.tensors)
        return None, result
    if p.via in ("torch-ops", "torch-ops-grad"):
        return None, torch_ops.gemm(p.A, p.B, p.source, **p.options, **p.tensors)
    if p.via == "fused":
        return None, _fused_gemm(p.source)(**p.options)(p.A, p.B, **p.tensors)
    if p.via == "fused-args":
        return _fused_gemm(p.source)(**p.options).arguments(p.A, p.B, **p.tensors), None
    epi = None if p.source is None else EpilogueArguments(p.source, **p.options, **p.tensors)
    args = GemmArguments(p.A, p.B, epilogue=epi, **p.gemm_options)
    return args, None


def _poison(t: torch.Tensor) -> None:
    if t.device.type == "meta":
        return
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(True if t.dtype == torch.bool else 77)


def _held_by_its_storage(t: torch.Tensor) -> bool:
    """Whether every element of `t` lies in its storage (a shrunk one's view reaches past it,
    into memory other allocations may change between two reads)."""
    if t.numel() == 0:
        return True
    reach = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.storage_offset() + reach) * t.element_size() <= t.untyped_storage().nbytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        return torch.equal(a.double().nan_to_num(1e300, 2e300, -2e300), b.double().nan_to_num(1e300, 2e300, -2e300))
    return torch.equal(a, b)


def _run_ok(p: Problem) -> None:
    p.C0 = p.tensors["C"].double().cpu().clone() if isinstance(p.tensors.get("C"), torch.Tensor) else None
    if p.via == "gemm":
        _, result = _execute(p)
        results = result if isinstance(result, tuple) else (result,)
        names = [n for n in ("D", "F", "r") if n in p.tensors] or ["D"]
        outputs = dict(zip(names, results)) if "D" not in p.tensors else {"D": p.tensors["D"]}
        if p.check is not None:
            assert p.check(p, outputs) is not False
        return
    args, _ = _execute(p)
    statuses = epifuse.kernel_statuses(args)
    for kernel, status in statuses:
        assert isinstance(status.reason, str) and status.reason, kernel
    kernels = epifuse.get_kernels(args)
    assert kernels and kernels[-1].name == "reference", statuses
    on_meta = args.A.device.type == "meta"
    # operands that are also outputs (in place: D = C) get their values back before each run
    operands = {n: v.clone() for n, v in args.operands.items() if isinstance(v, torch.Tensor) and not on_meta
                and any(overlaps(v, dest) for dest in args.outputs.values())}
    fp64 = None if on_meta else reference_outputs(args)
    results = {}
    for kernel in reversed(kernels):  # the reference first
        for dest in args.outputs.values():
            _poison(dest)
        for name, saved in operands.items():
            args.operands[name].copy_(saved)  # in-place cases overwrite their operand
        kernel.run(args)
        results[kernel.name] = {n: t.clone() for n, t in args.outputs.items()}
    expected = results["reference"]
    if not on_meta:
        for name, ref in fp64.items():
            dest = args.outputs[name]
            if dest.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                assert _same(expected[name], ref.to(dest.dtype)), (name, expected[name], ref)
        for kernel_name, outs in results.items():
            for name, value in outs.items():
                assert _same(value, expected[name]), (kernel_name, name, value, expected[name])
    if p.check is not None:
        assert p.check(p, expected) is not False


@pytest.mark.parametrize("case", _params())
def test_bad_input(case: Case, device):
    problem = case.build(device)
    if case.expect is None:
        _run_ok(problem)
        return
    tensors = _tensors_of(problem)
    before = [t.clone() for t in tensors]
    # any exception, then its type: a wrong one is reported without the frames it came through,
    # whose arguments pytest would print (torch crashes printing a tensor whose storage is freed)
    with pytest.raises(Exception) as info:
        args, _ = _execute(problem)
        for kernel in epifuse.get_kernels(args):
            kernel.run(args)
    assert isinstance(info.value, case.expect), f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, EpilogueError)
    assert case.phrase in str(info.value), str(info.value)
    for t, b in zip(tensors, before):
        if _held_by_its_storage(t):   # a view past its storage's end reads memory it does not own
            assert _same(t, b), "an input or output changed although the call failed"


def test_output_that_requires_grad_is_written_under_no_grad(device):
    """As torch's out=: under torch.no_grad() writing into a tensor that requires grad is allowed
    (filling a parameter, say), and every kernel, the reference included, writes it."""
    A, B = ab(device)
    bias = ints(N, device=device)
    D = out(device=device).requires_grad_()
    with torch.no_grad():
        args = GemmArguments(A, B, epilogue=EpilogueArguments(BIAS, bias=bias, D=D))
        for kernel in epifuse.get_kernels(args):
            D.fill_(float("nan"))
            kernel.run(args)
            assert torch.equal(D.double().cpu(), accum_of(Problem(A, B)) + bias.double().cpu()), kernel
    assert D.requires_grad and D.grad_fn is None


def test_drawing_takes_a_graph(tmp_path):
    from epifuse import debug
    args = debug.random_arguments("def e(accum):\n    D = relu(accum)\n    return D\n", 4, 4, 4, dtype=torch.float32)
    for wrong in (None, args, args.epilogue.program):
        with pytest.raises(EpilogueArgumentError, match="Drawing takes a Graph"):
            debug.draw(wrong, tmp_path / "g.dot")
    assert "digraph" in debug.draw(args.graph, tmp_path / "g.dot").read_text()


# ---- planning from stand-ins: fake and meta tensors ----------------------------------------------

STAND_IN_SRC = ("def epi(accum, bias, C):\n    D = accum + bias + C\n    r = sum(D, dim=1)\n    m = max(D, dim=0)\n"
                "    return D, r, m\n")


def _stand_in_problem(device):
    """Real tensors of every role, some of them views at offsets into one storage."""
    S = ints(M * N + N + 1, device=device)
    return {"A": ints(M, K, device=device), "B": ints(N, K, device=device).t(), "bias": ints(N, device=device),
            "C": S[1:1 + M * N].view(M, N), "D": out(device=device), "r": out(M, device=device),
            "m": S[1 + M * N:]}


def _args_of(t: dict) -> GemmArguments:
    return GemmArguments(t["A"], t["B"], epilogue=EpilogueArguments(
        STAND_IN_SRC, bias=t["bias"], C=t["C"], D=t["D"], r=t["r"], m=t["m"]))


def _fake_mode(unsafe_data_ptr: bool):
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=unsafe_data_ptr):
        return FakeTensorMode()


@pytest.mark.parametrize("unsafe_data_ptr", [True, False], ids=["data-ptr-allowed", "data-ptr-refused"])
def test_kernels_are_planned_from_fake_tensors_and_run_on_real_ones(unsafe_data_ptr, device):
    """GemmArguments, kernel_statuses, get_kernels and compile take fake tensors (every fake
    address reads 0, or reading one raises); the kernels they offer are those the real tensors
    get, and each runs on GemmArguments of real tensors with the same metadata, exactly."""
    real = _stand_in_problem(device)
    mode = _fake_mode(unsafe_data_ptr)
    fake = {name: mode.from_tensor(t) for name, t in real.items()}
    planned = _args_of(fake)
    statuses = epifuse.kernel_statuses(planned)
    real_args = _args_of(real)
    assert [(repr(k), s) for k, s in statuses] == [(repr(k), s) for k, s in epifuse.kernel_statuses(real_args)]
    kernels = epifuse.get_kernels(planned)
    for kernel in kernels:
        kernel.compile(planned)
    expected = reference_outputs(real_args)
    for kernel in kernels:
        for dest in real_args.outputs.values():
            _poison(dest)
        kernel.run(real_args)
        for name, want in expected.items():
            assert _same(real_args.outputs[name], want.float()), (kernel, name)
    for kernel in kernels:
        if kernel.name != "reference":   # torch ops, which take fake tensors as torch does
            with pytest.raises(ShapeError, match="fake or meta tensors, which have no memory"):
                kernel.run(planned)


@pytest.mark.parametrize("stand_in", ["fake", "meta"])
def test_stand_ins_alias_only_where_their_storage_is_shared(stand_in, device):
    """Stand-ins have no addresses: an output overlaps an input where both are views of one
    storage whose spans meet, as the real tensors would, and nowhere else."""
    mode = _fake_mode(False)
    make = (lambda t: mode.from_tensor(t)) if stand_in == "fake" else (lambda t: t.to("meta"))
    S = make(ints(2 * M, N, device=device))
    A = make(ints(M, K, device=device))
    B = make(ints(K, N, device=device))
    apart = GemmArguments(A, B, epilogue=EpilogueArguments(BIAS, bias=S[:M], D=S[M:]))
    kernels = epifuse.get_kernels(apart)
    assert kernels[-1].name == "reference"
    for kernel in kernels:
        kernel.compile(apart)
    with pytest.raises(ShapeError, match="Output D partly overlaps operand bias"):
        GemmArguments(A, B, epilogue=EpilogueArguments(BIAS, bias=S[:M], D=S[M - 1:2 * M - 1]))
    W = make(ints(M, N + K, device=device))
    with pytest.raises(ShapeError, match="Output D overlaps the GEMM input A"):
        GemmArguments(W[:, :K], B, epilogue=EpilogueArguments(BIAS, bias=1.0, D=W[:, K - 1:K - 1 + N]))


def test_a_kernel_run_on_arguments_it_was_not_offered_for_asks_first(device):
    """A kernel offered for one problem and run on another it does not support (A 4 bytes off a
    16-byte boundary, which TMA refuses) raises UnsupportedError with the reason, output
    untouched; the kernels offered for that problem run it exactly."""
    from epifuse.errors import UnsupportedError
    A = ints(M, K + 1, device=device)
    offered = epifuse.get_kernels(GemmArguments(A[:, :K], ints(K, N, device=device), out=out(device=device)))
    tma = [k for k in offered if k.name == "triton_persistent"]
    assert tma, offered
    D = out(device=device)
    args = GemmArguments(A.reshape(-1)[1:1 + M * K].view(M, K), ints(K, N, device=device), out=D)
    assert not tma[0].supports(args)
    with pytest.raises(UnsupportedError, match="not 16-byte aligned"):
        tma[0].run(args)
    assert bool((D == 7).all())
    for kernel in epifuse.get_kernels(args):
        D.fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(D.double().cpu(), accum_of(Problem(args.A, args.B))), kernel
