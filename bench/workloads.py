"""The seven benchmark workloads of BENCHMARKS.md (names are stable).

Each workload is a plain epilogue function (what a user hands to ``epifuse.gemm``), an operand
builder, an eager torch version (``A @ B`` then the same epilogue function on torch tensors), a
float64 reference, and where one exists a fixed-epilogue vendor baseline ("cublaslt").

The epilogue functions call ``relu``, ``gelu``, ``sigmoid``, ``log``, ``clamp`` and ``sum`` as
module globals. epifuse parses the source and resolves those names by name, so what they are bound
to here only matters when the functions run on torch tensors:

- ``bind_ops("torch")`` (the default at import): plain torch equivalents, so the eager, inductor and
  reference numbers never depend on epifuse code;
- ``bind_ops("epifuse")``: ``epifuse.ops`` itself (imported only then), to check that the same
  function doubles as its own eager version through epifuse's ops.

Note: this module rebinds the builtin name ``sum``; nothing here uses the builtin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as _F

# ----------------------------------------------------------------------------------- op binding


def _torch_sum(x, dim=None, keepdim=False):
    return x.sum() if dim is None else x.sum(dim=dim, keepdim=keepdim)


_TORCH_OPS = {"relu": torch.relu, "gelu": _F.gelu, "sigmoid": torch.sigmoid, "log": torch.log,
              "clamp": torch.clamp, "sum": _torch_sum, "softmax": torch.softmax}
relu = gelu = sigmoid = log = clamp = sum = softmax = None  # bound just below
OPS_SOURCE = ""


def bind_ops(source: str = "torch") -> str:
    """Bind the op names the epilogues use to ``"torch"`` or ``"epifuse"`` (``epifuse.ops``)."""
    global OPS_SOURCE
    if source == "epifuse":
        import epifuse.ops as eops  # lazy: epifuse may not be importable yet
        table = {name: getattr(eops, name) for name in _TORCH_OPS}
    elif source == "torch":
        table = dict(_TORCH_OPS)
    else:
        raise ValueError(f"unknown op source {source!r}; expected 'torch' or 'epifuse'")
    globals().update(table)
    OPS_SOURCE = source
    return source


bind_ops("torch")

# ----------------------------------------------------------------------- the epilogue functions


def identity(accum):
    D = accum
    return D


def lincomb(accum, alpha, beta, C):
    D = alpha * accum + beta * C
    return D


def bias_gelu(accum, bias):
    D = gelu(accum + bias, approximate="tanh")
    return D


def relu_aux(accum, alpha, C):
    F = alpha * accum + 2.0 * C
    D = relu(F)
    return D, F


def bce_loss(accum, bias, C):
    f = accum + bias
    loss = sum((1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))
    return loss


def rowsumsq(accum, alpha):
    D = accum * alpha
    r = sum(D * D, dim=1)
    return D, r


def softmax_rows(accum, scale):
    D = softmax(accum * scale, dim=1)
    return D


def fp8_scaled(accum, sa, sb, bias):
    D = accum * sa * sb + bias
    return D


def int8_scaled(accum, bias, sa, sb):
    D = (accum + bias) * sa * sb
    return D


# ------------------------------------------------------------------------------ shapes, inputs

SHAPES = {"S1": (4096, 4096, 4096), "S2": (16384, 4096, 1024),
          "S3": (8192, 8192, 8192), "S4": (128, 8192, 8192)}


def shape_dims(shape: str) -> tuple[int, int, int] | None:
    """M, N, K of a named shape (S1-S4) or of one written MxNxK (a model's layer: 1024x16384x4096);
    None for anything else."""
    if shape in SHAPES:
        return SHAPES[shape]
    parts = shape.split("x")
    if len(parts) == 3 and all(part.isdigit() and int(part) > 0 for part in parts):
        return tuple(int(part) for part in parts)
    return None
FP8 = torch.float8_e4m3fn


@dataclass
class Inputs:
    """One input set: A (M,K), B (K,N), the epilogue kwargs, and the output dtypes in return order."""
    A: torch.Tensor
    B: torch.Tensor
    operands: dict
    out_dtypes: tuple
    extra: dict = field(default_factory=dict)  # tensors only the vendor baselines use

    def nbytes(self) -> int:
        ts = [self.A, self.B, *self.operands.values(), *self.extra.values()]
        return int(math.fsum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t)))


def _randn(shape, dtype, device, gen, scale=1.0):
    x = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    return (x * scale).to(dtype)


def _ab(M, N, K, dtype, device, gen):
    """A ~ N(0,1); B ~ N(0,1)/sqrt(K), so accum ~ N(0,1) whatever K."""
    return _randn((M, K), dtype, device, gen), _randn((K, N), dtype, device, gen, 1 / math.sqrt(K))


def _outs(dtype, *rules):
    return tuple(dtype if r == "in" else r for r in rules)


def _build_plain(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    return Inputs(A, B, {}, _outs(dtype, "in"))


def _build_lincomb(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    C = _randn((M, N), dtype, device, gen)
    return Inputs(A, B, {"alpha": 1.5, "beta": 0.5, "C": C}, _outs(dtype, "in"))


def _build_bias_gelu(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    return Inputs(A, B, {"bias": _randn((N,), dtype, device, gen)}, _outs(dtype, "in"))


def _build_relu_aux(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    C = _randn((M, N), dtype, device, gen)
    return Inputs(A, B, {"alpha": 1.5, "C": C}, _outs(dtype, "in", "in"))


def _build_bce(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    labels = torch.randint(0, 2, (M, N), device=device, generator=gen).to(dtype)
    ops = {"bias": _randn((N,), dtype, device, gen), "C": labels}
    return Inputs(A, B, ops, _outs(dtype, torch.float32))


def _build_rowsumsq(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    return Inputs(A, B, {"alpha": 1.5}, _outs(dtype, "in", torch.float32))


def _build_softmax_rows(M, N, K, dtype, device, gen):
    A, B = _ab(M, N, K, dtype, device, gen)
    return Inputs(A, B, {"scale": 2.0}, _outs(dtype, "in"))


def _build_fp8(M, N, K, dtype, device, gen):
    """A (M,K) row-major and B (K,N) column-major (B = Bt.t()), as torch._scaled_mm wants.
    B stays N(0,1) so e4m3 keeps its precision; 1/sqrt(K) is folded into sb instead.
    With dtype float32 (the CPU dry run) the same layout is built in float32."""
    A = _randn((M, K), dtype, device, gen)
    B = _randn((N, K), dtype, device, gen).t()
    sa = torch.rand((M, 1), device=device, generator=gen) + 0.5
    sb = (torch.rand((1, N), device=device, generator=gen) + 0.5) / math.sqrt(K)
    out = torch.bfloat16 if dtype == FP8 else dtype
    bias = _randn((N,), out, device, gen)
    one = torch.ones((), device=device, dtype=torch.float32)
    return Inputs(A, B, {"sa": sa, "sb": sb, "bias": bias}, (out,), {"one": one})


def _build_int8(M, N, K, dtype, device, gen):
    """W8A8: int8 A (M,K) row-major and B (K,N) column-major (what torch._int_mm's cuBLASLt
    path wants), an int32 bias, per-row and per-column float scales, a bf16 D. Integer values
    in [-8, 8], so accum is exact. With dtype float32 (the CPU dry run) the same values in float32."""
    int_dtype = torch.int8 if dtype == torch.int8 else dtype
    A = torch.randint(-8, 9, (M, K), device=device, generator=gen).to(int_dtype)
    B = torch.randint(-8, 9, (N, K), device=device, generator=gen).to(int_dtype).t()
    bias_dtype = torch.int32 if dtype == torch.int8 else dtype
    bias = torch.randint(-64, 65, (N,), device=device, generator=gen).to(bias_dtype)
    sa = (torch.rand((M, 1), device=device, generator=gen) + 0.5) / 64
    sb = (torch.rand((1, N), device=device, generator=gen) + 0.5) / math.sqrt(K)
    out = torch.bfloat16 if dtype == torch.int8 else dtype
    return Inputs(A, B, {"bias": bias, "sa": sa, "sb": sb}, (out,))


# ---------------------------------------------------------------------------- baselines


def _eager_accum(A, B):
    return A @ B


def _eager_accum_fp32(A, B):  # a summed loss overflows fp16; users upcast first
    return (A @ B).float()


def _eager_accum_fp8(A, B):  # no fp8 matmul in eager torch: upcast to bf16
    if A.dtype == FP8:
        A, B = A.to(torch.bfloat16), B.to(torch.bfloat16)
    return A @ B


def _eager_accum_int8(A, B):  # cuBLASLt's int8 GEMM (int32 accum); float copies off the GPU
    if A.dtype == torch.int8 and A.is_cuda:
        return torch._int_mm(A, B)
    return A.to(torch.int32) @ B.to(torch.int32) if A.dtype == torch.int8 else A @ B


def _int_mm(inp: Inputs):
    A, B = inp.A, inp.B
    return lambda: torch._int_mm(A, B)


def _cublas(inp: Inputs):
    A, B = inp.A, inp.B
    return lambda: A @ B


def _scaled_mm_unit(inp: Inputs):
    A, B, one = inp.A, inp.B, inp.extra["one"]
    return lambda: torch._scaled_mm(A, B, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _lt_bias_gelu(inp: Inputs):
    A, B, bias = inp.A, inp.B, inp.operands["bias"]
    return lambda: torch._addmm_activation(bias, A, B, use_gelu=True)


def _lt_lincomb(inp: Inputs):
    A, B, o = inp.A, inp.B, inp.operands
    return lambda: torch.addmm(o["C"], A, B, beta=o["beta"], alpha=o["alpha"])


def _lt_fp8(inp: Inputs):
    A, B, o = inp.A, inp.B, inp.operands
    return lambda: torch._scaled_mm(A, B, scale_a=o["sa"], scale_b=o["sb"], bias=o["bias"],
                                    out_dtype=torch.bfloat16)


# ------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Workload:
    name: str
    epilogue: Callable
    build: Callable                    # (M, N, K, dtype, device, generator) -> Inputs
    outputs: tuple                     # (name, kind) in return order; kind "MN", "M" or "1"
    family: str                        # identity | pointwise | reduction | fp8
    target: float | None               # epifuse / cublas ratio the project aims at (None: none set)
    accum: Callable = _eager_accum     # how the eager version forms accum from A and B
    cublas: Callable = _cublas         # the denominator
    cublaslt: Callable | None = None   # a vendor fixed-epilogue baseline, if one exists
    cublaslt_desc: str = ""
    fixed_dtype: torch.dtype | None = None  # input dtype regardless of --dtypes

    def eager_fn(self) -> Callable:
        """``eager(A, B, **operands)``: accum from A and B, the epilogue, outputs cast."""
        epilogue, accum_of = self.epilogue, self.accum

        def eager(A, B, out_dtypes, **operands):
            outs = epilogue(accum_of(A, B), **operands)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return tuple(o.to(dt) for o, dt in zip(outs, out_dtypes))
        eager.__name__ = f"eager_{self.name}"
        return eager

    def reference(self, inp: Inputs) -> tuple:
        """The epilogue on float64 copies, with accum = A.double() @ B.double()."""
        ops = {k: (v.double() if torch.is_tensor(v) else v) for k, v in inp.operands.items()}
        outs = self.epilogue(inp.A.double() @ inp.B.double(), **ops)
        return outs if isinstance(outs, tuple) else (outs,)

    def expected_shapes(self, M: int, N: int) -> tuple:
        return tuple({"MN": (M, N), "M": (M,), "1": (1,)}[kind] for _, kind in self.outputs)

    def tolerance(self, in_dtype: torch.dtype) -> float:
        return 5e-2 if self.family == "fp8" or in_dtype == FP8 else 2e-2


WORKLOADS = {w.name: w for w in [
    Workload("identity", identity, _build_plain, (("D", "MN"),), "identity", 1.02),
    Workload("lincomb", lincomb, _build_lincomb, (("D", "MN"),), "pointwise", 1.05,
             cublaslt=_lt_lincomb, cublaslt_desc="torch.addmm(C, A, B, beta, alpha) (cuBLAS beta*C)"),
    Workload("bias_gelu", bias_gelu, _build_bias_gelu, (("D", "MN"),), "pointwise", 1.05,
             cublaslt=_lt_bias_gelu, cublaslt_desc="torch._addmm_activation(bias, A, B, use_gelu=True)"),
    Workload("relu_aux", relu_aux, _build_relu_aux, (("D", "MN"), ("F", "MN")), "pointwise", 1.05),
    Workload("bce_loss", bce_loss, _build_bce, (("loss", "1"),), "reduction", 1.10,
             accum=_eager_accum_fp32),
    Workload("rowsumsq", rowsumsq, _build_rowsumsq, (("D", "MN"), ("r", "M")), "reduction", 1.10),
    Workload("softmax_rows", softmax_rows, _build_softmax_rows, (("D", "MN"),), "reduction", None),
    Workload("fp8_scaled", fp8_scaled, _build_fp8, (("D", "MN"),), "fp8", 1.05,
             accum=_eager_accum_fp8, cublas=_scaled_mm_unit, cublaslt=_lt_fp8,
             cublaslt_desc="torch._scaled_mm(A, B, sa, sb, bias, out_dtype=bf16)", fixed_dtype=FP8),
    Workload("int8_scaled", int8_scaled, _build_int8, (("D", "MN"),), "int8", 1.05,
             accum=_eager_accum_int8, cublas=_int_mm, fixed_dtype=torch.int8),
]}
