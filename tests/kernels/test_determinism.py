"""Determinism: the same inputs give bitwise the same outputs, run after run, for tile outputs
and deterministic=True reductions, from every kernel offered. Atomic (deterministic=False)
sums may differ between runs on a GPU by fp32 rounding (the order atomics land in); they are
checked to 1e-5 there, and exactly on the interpreter."""
from __future__ import annotations

import pytest
import torch

import epifuse
from helpers import fast, reference_outputs, rel_error

DETERMINISM_CASES = {
    "tile-outputs": "def epi(accum, C, bias):\n    F = gelu(accum * 0.37 + C) - bias\n"
                    "    D = sigmoid(F) * tanh(accum)\n    return D, F\n",
    "sum-over-N": "def epi(accum, C, bias):\n    r = sum(sigmoid(accum * 0.37) + C, dim=-1)\n    return r\n",
    "mean-over-M": "def epi(accum, C, bias):\n    r = mean(accum * 0.37 - bias, dim=1)\n    return r\n",
    "sum-over-all": "def epi(accum, C, bias):\n    r = sum(exp(clamp(accum * 0.1, -5.0, 5.0)))\n    return r\n",
    "max-min-amax": "def epi(accum, C, bias):\n    a = amax(accum * 0.37 + C, dim=(0, 2))\n"
                    "    b = min(accum + bias, dim=2)\n    c = max(tanh(accum), dim=0)\n    return a, b, c\n",
    "tile-and-sum": "def epi(accum, C, bias):\n    D = silu(accum * 0.37)\n    r = sum(D, dim=(1, 2))\n"
                    "    return D, r\n",
}


def _determinism_args(source, deterministic, device, seed):
    """Random fp16 A and B (L=2, ragged M, N, K), fp32 operands; outputs allocated to fit."""
    gen = torch.Generator().manual_seed(seed)
    L, m, n, k = 2, 70, 53, 37
    A = torch.randn(L, m, k, generator=gen).to(device, torch.float16)
    B = torch.randn(L, k, n, generator=gen).to(device, torch.float16)
    tensors = {"C": torch.randn(L, m, n, generator=gen).to(device), "bias": torch.randn(n, generator=gen).to(device)}
    for name, shape in _output_shapes(A, B, source, tensors).items():
        tensors[name] = torch.empty(shape, device=device)
    epi = epifuse.EpilogueArguments(source, deterministic=deterministic, **tensors)
    return epifuse.GemmArguments(A, B, epilogue=epi)


def _output_shapes(A, B, source, operands) -> dict:
    from epifuse.arguments import bound_graph
    from epifuse.frontend import parse
    from epifuse.ir import AXES
    from epifuse.shapes import accum_shape_of, classify_operand
    program = parse(source)
    shape, _ = accum_shape_of(A, B)
    roles = tuple(classify_operand(n, operands[n], shape, A.device)[0] for n in program.operands)
    graph, _ = bound_graph(program, roles, len(shape))
    shapes = {}
    for out in graph.outputs:
        if out.node.op.name in ("sum", "mean", "max", "min", "amax"):
            dims = out.node.params["dim"]
            shapes[out.name] = tuple(s for a, s in zip(AXES[3 - len(shape):], shape) if a not in dims) or (1,)
        else:
            shapes[out.name] = shape
    return shapes


@pytest.mark.slow   # one of the longest: the README's run leaves it to -m slow (CI runs it)
@pytest.mark.parametrize("case", fast(sorted(DETERMINISM_CASES), keep={0}))
def test_same_inputs_give_bitwise_the_same_outputs(case, device):
    source = DETERMINISM_CASES[case]
    runs = []
    for attempt in range(2):
        args = _determinism_args(source, True, device, seed=7)
        kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
        assert kernels
        per_kernel = []
        for kernel in kernels:
            for _ in range(2):
                for dest in args.outputs.values():
                    dest.fill_(float("nan"))
                kernel.run(args)
                per_kernel.append({n: t.clone() for n, t in args.outputs.items()})
        runs.append(per_kernel)
    first = runs[0][0]
    for per_kernel in runs:  # each kernel ran twice on the same arguments ...
        for i in range(0, len(per_kernel), 2):
            for name in first:
                a, b = per_kernel[i][name], per_kernel[i + 1][name]
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (case, name, "run to run")
    for i in range(len(runs[0])):  # ... and again on fresh arguments
        for name in first:
            assert torch.equal(runs[0][i][name].nan_to_num(7.0), runs[1][i][name].nan_to_num(7.0)), (case, name)
    refs = reference_outputs(_determinism_args(source, True, device, seed=7))  # and they are right
    for name, ref in refs.items():
        assert rel_error(first[name], ref) < 1e-5, (case, name)


@pytest.mark.parametrize("case", fast(["sum-over-N", "mean-over-M", "sum-over-all", "tile-and-sum"], keep={0}))
def test_atomic_reductions_agree_to_rounding(case, device):
    """deterministic=False sums fold with atomics: on a GPU their order (and so the last bits)
    may change run to run; the values agree to fp32 rounding, and exactly on the interpreter."""
    source = DETERMINISM_CASES[case]
    args = _determinism_args(source, False, device, seed=11)
    kernel = next(k for k in epifuse.get_kernels(args) if k.name != "reference")
    results = []
    for _ in range(3):
        kernel.run(args)
        results.append({n: t.clone() for n, t in args.outputs.items()})
    for other in results[1:]:
        for name, value in other.items():
            if device == "cpu":
                assert torch.equal(value, results[0][name]), name
            else:
                assert rel_error(value, results[0][name]) < 1e-5, name
