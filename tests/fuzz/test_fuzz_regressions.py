"""Regression tests: failures the fuzzer (tests/test_fuzz_kernels.py) found, each a named case."""
from __future__ import annotations

import pytest
import torch

import epifuse
from epifuse.ops import OPS
from fuzz_harness import build, check_kernels
from fuzz_strategies import Example, Operand, Output


def _regression(source, M, N, K, device, in_dtype=torch.float32, A_layout="contiguous", batch="",
                outputs=None, **operands):
    ex = Example(source, M, N, K, batch, in_dtype, A_layout, "contiguous",
                 [Operand(n, *spec) for n, spec in operands.items()], outputs or [Output("D")],
                 accumulate=False, deterministic=False, seed=0)
    args, prior = build(ex, device)
    assert check_kernels(ex, args, prior)


def test_regression_output_named_like_generated_identifiers(device):
    """Operands and outputs named like the generator's own identifiers (acc, mask, v0, tl)."""
    src = ("def epi(accum, acc, mask, v0, tl):\n    x0 = accum * acc + mask\n    y0 = relu(x0) - v0 * tl\n"
           "    return y0, x0\n")
    _regression(src, 33, 37, 9, device, outputs=[Output("y0"), Output("x0", dtype=torch.float16)],
                acc=("row", "N"), mask=("col", "M1"), v0=("tile", "MN", torch.float16, "transposed"),
                tl=("number", (), torch.float32, "contiguous", 2.0))


@pytest.mark.parametrize("expr", ["logical_and(accum, s)", "logical_or(accum, s)",
                                  "(s > 1.0) & (accum > 0.0)", "accum < s < 3.0",
                                  "logical_and(s > 1.0, s < 3.0)", "logical_not(s > 1.0) | (accum > 1.0)",
                                  "where(logical_and(accum > 0.0, s), accum, -accum)",
                                  "logical_or(logical_not(accum > s), t) & (t > s)"])
def test_regression_logical_and_of_scalar_and_tile_conditions(expr, device):
    """`a & b` of a scalar condition (a number or one-element operand) and a tile condition
    crashed Triton's interpreter: it broadcasts a scalar comparison as a float array, which
    numpy's bitwise_and refuses next to a bool tile. logical_and/or now lower to tl.where."""
    src = f"def epi(accum, s, t):\n    D = {expr}\n    return D\n"
    _regression(src, 5, 6, 3, device, s=("number", (), torch.float32, "contiguous", 2.0),
                t=("scalar", (1,), torch.float32))


@pytest.mark.parametrize("source", ["D = clamp(accum)", "D = clamp(2.0)", "D = accum.clamp(None, None)",
                                    "D = torch.clip(accum, min=None)"])
def test_regression_clamp_without_bounds_is_a_user_error(source):
    """clamp(x) with no bound crashed binding (constant folding) or the reference kernel with
    torch's RuntimeError; torch refuses it too, so it is an EpilogueError at parse time."""
    from epifuse.frontend import parse
    with pytest.raises(epifuse.EpilogueError, match=r"clamp\(\) needs a bound"):
        parse(f"def epi(accum):\n    {source}\n    return D\n")


def test_regression_where_of_literals_folds(device):
    """fold_constants called torch.where with a float64 condition: `where(-1, -1, 4.0)` crashed
    binding with torch's RuntimeError (found by the fuzzer)."""
    src = ("def epi(accum, s):\n    v1 = -1\n    C = torch.sum(epifuse.ops.where(v1, v1, 4.0), (0, -1), keepdim=True)\n"
           "    D = where(0.0, accum, 2.0) + where(v1, accum, s)\n    return C, D\n")
    _regression(src, 36, 50, 35, device, in_dtype=torch.float16,
                outputs=[Output("C", "sum", (0, 1)), Output("D")],
                s=("number", (), torch.float32, "contiguous", 0.25))


@pytest.mark.parametrize("op", sorted(n for n, o in OPS.items() if o.kind in ("elementwise", "cast")))
def test_every_op_folds_on_literals(op):
    """Every elementwise op of the registry applied to literals folds to a literal (no crash)."""
    from epifuse.ir import Node, const
    from epifuse.passes.fold import fold_literal_op
    args = [const(0.5)] + [const(0.25)] * (OPS[op].arity - 1)
    params = (("min", -1.0),) if op == "clamp" else None  # clamp() without bounds does not parse
    folded = fold_literal_op(Node(OPS[op], args, params))
    assert folded is not None and folded.op.name == "const"


def test_regression_max_with_a_negative_int_reduces(device):
    """max(x, -1) was read as the elementwise maximum with -1, while torch.max(x, -1) (and
    epifuse.ops.max on tensors) reduce the last dim; found when the fuzzer spelled a reduction
    with a negative dim."""
    src = ("def epi(accum):\n    r = torch.max(accum, -1)\n    s = min(accum, -2, keepdim=True)\n"
           "    D = max(accum, -1.0)\n    return r, s, D\n")
    _regression(src, 20, 30, 7, device, outputs=[Output("r", "max", (1,)), Output("s", "min", (0,), True),
                                                 Output("D")])
    from epifuse.ops import max as max_op
    x = torch.randn(4, 5)
    assert torch.equal(max_op(x, -1), x.amax(-1))


@pytest.mark.parametrize("batched", [False, True])
def test_regression_persistent_kernel_with_one_column(batched, device):
    """Found by the fuzzer: A (16, 40) bf16 times B (40, 1)."""
    L = (2,) if batched else ()
    A = torch.ones(L + (16, 40), dtype=torch.bfloat16, device=device)
    B = torch.ones(L + (40, 1), dtype=torch.bfloat16, device=device)
    D = torch.empty(L + (16, 1), device=device)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def epi(accum):\n    D = accum\n    return D\n", D=D))
    for kernel in epifuse.get_kernels(args):
        D.fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(D, torch.full_like(D, 40.0)), kernel


def _poison_allocator(device) -> None:
    """Leave freed memory full of a large value, so a reduction slot the kernel never writes
    shows up as that value instead of depending on what the last test left behind."""
    junk = torch.full((1 << 22,), 1.0e30, device=device)
    del junk


@pytest.mark.parametrize("batch", ["", "b"])
def test_regression_max_over_every_dim_reads_only_written_partials(batch, device):
    """Found by the GPU fuzz run (1800 examples, 2026-11-22): a max over every dim of a
    bf16 GEMM came out as 2.0 against 28.4 (and 6.0625 for a relu6 bounded by 6) on the first
    call of an example, right on its re-run: a sign of a partial the persistent kernel did not
    write. Fresh arguments each round, on poisoned memory."""
    src = ("def epi(accum):\n    P = torch.square(silu(accum))\n"
           "    m = torch.max(clip(accum, min=0.0))\n    s = torch.max(accum.relu6(), (-3, -2, -1))\n"
           "    return P, m, s\n")
    dims = (0, 1, 2) if batch else (0, 1)
    on_gpu = str(device).startswith("cuda")
    for M, N, K in ((47, 60, 32), (23, 40, 8), *(((300, 200, 64),) if on_gpu else ())):
        for _ in range(3 if on_gpu else 1):
            _poison_allocator(device)
            _regression(src if batch else src.replace("(-3, -2, -1)", "(-2, -1)"), M, N, K, device,
                        in_dtype=torch.bfloat16, batch=batch,
                        outputs=[Output("P"), Output("m", "max", None, True),
                                 Output("s", "max", dims, False, torch.bfloat16)])


@pytest.mark.gpu
def test_regression_persistent_first_run_with_short_k():
    """Found by the GPU fuzz runs of 2026-11-22 (4-7 of ~1800 examples per run, seed 20261122):
    the first run of some examples gave wrong reductions. A config that needed more shared memory
    than the GPU has fell back to a smaller config with a new plan while run() initialized and
    finished the old plan's reduction buffers; TritonTiled._loaded_plan now settles the config
    before anything is touched (passed on an H100 on 2026-11-23, in a fresh process)."""
    src = "def epi(accum, z, Tensor):\n    aux = accum.silu()\n    _clamp = max(abs(accum))\n    return aux, accum, _clamp\n"
    for _ in range(3):
        _poison_allocator("cuda")
        _regression(src, 12, 64, 32, "cuda", in_dtype=torch.float16,
                    outputs=[Output("aux"), Output("accum", dtype=torch.bfloat16), Output("_clamp", "max")],
                    z=("tile", "MN", torch.bfloat16, "expanded_row"),
                    Tensor=("tile", "MN", torch.bfloat16, "expanded_row"))


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", ["", "both"])
@pytest.mark.parametrize("over", ["all", "last"])
def test_regression_amax_alone_with_k_of_one(in_dtype, batch, over, device):
    """Found by the GPU fuzz run (seed 20261122, process 8, 2026-11-23): amax(0.5 + accum) of a
    16-bit GEMM with K = 1 gave 0.5 (as if accum were 0) in every tiled config that used Hopper's
    MMA, whenever the reduction was the only output; sum, max, K = 2 and a tile output beside it
    were right. Triton specialized K == 1 to a constexpr; the tiled kernels now keep K a runtime
    value."""
    dims = None if over == "all" else ((2,) if batch else (1,))
    dim = "" if dims is None else f", dim={dims[0]}"
    src = f"def epi(accum):\n    a = F.add(0.5, accum)\n    aux = torch.amax(a{dim})\n    return aux\n"
    for M, N in ((49, 34), (16, 16)):
        _regression(src, M, N, 1, device, in_dtype=in_dtype, batch=batch,
                    outputs=[Output("aux", "amax", dims, False, torch.float32)])


@pytest.mark.parametrize("deterministic", [False, True])
def test_regression_a_sum_whose_terms_cancel_is_judged_by_their_magnitudes(deterministic, device):
    """sum(sin(clamp(accum))) over signed terms that cancel: the kernel's tile partials round
    differently from torch's sum, and its error (1.2e-3 of the result at data seed 327) was
    over 8x torch's fp32 error, while within fp32's bound on a sum of these magnitudes."""
    ex = Example("def epi(accum):\n    r = sum(torch.sin(clamp(accum, -20.0, 20.0)))\n    return r\n",
                 70, 70, 40, "", torch.float32, "contiguous", "contiguous", [], [Output("r", "sum", None)],
                 accumulate=False, deterministic=deterministic, seed=327)
    args, prior = build(ex, device)
    assert check_kernels(ex, args, prior)
