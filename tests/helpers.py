"""Shared test helpers: float64 references and error measures."""
from __future__ import annotations

import torch

import epifuse
from epifuse.reference import reference_accum
from epifuse.ir import Output, op
from epifuse.ops import OPS, relu, sum  # noqa: A004  (names relu_aux_loss uses)
from epifuse.reference import evaluate


def reference_outputs(args: epifuse.GemmArguments, graph=None) -> dict:
    """Every output of `args` (or of `graph`, over the same operands) by the reference
    interpreter in float64, in destination shapes."""
    accum = reference_accum(args.A, args.B, torch.float64, args.accumulator_type).reshape(args.accum_shape)
    operands = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in args.operands.items()}
    results = evaluate(graph or args.graph, accum, operands, torch.float64)
    return {k: v.reshape(args.outputs[k].shape) for k, v in results.items()}


def magnitude_outputs(args: epifuse.GemmArguments) -> dict:
    """For each sum or mean output of `args`, the same reduction of |x| in float64: the scale an
    fp32 sum's rounding error is proportional to, however much its terms cancel."""
    folds = [o for o in args.graph.outputs if o.node.reduction and o.node.reduction.combine == "add"]
    if not folds:
        return {}
    return reference_outputs(args, args.graph.with_outputs(
        Output(o.name, op(o.node.op, op("abs", o.node.src[0]), **o.node.params)) for o in folds))


def _finite_mismatch(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """NaN in different places, or a different inf: no error measure applies."""
    if not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return True
    infinite = ~torch.isfinite(ref) & ~torch.isnan(ref)
    return not torch.equal(out[infinite], ref[infinite])


def fold_error(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    """Largest |out - ref| / (same reduction of |x|), in float64: a sum's or mean's error as a
    fraction of what its rounding is bounded by, so terms that cancel to near zero do not turn
    an fp32-accurate result into a large relative error. NaN mismatches -> inf."""
    out, ref, magnitude = out.double().cpu(), ref.double().cpu(), magnitude.double().cpu()
    if _finite_mismatch(out, ref):
        return float("inf")
    finite = torch.isfinite(ref)
    diff = (out[finite] - ref[finite]).abs()
    scale = magnitude[finite].clamp(min=torch.finfo(torch.float64).tiny)
    return float((diff / scale).max()) if diff.numel() else 0.0


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, over finite reference entries; NaN mismatches -> inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if _finite_mismatch(out, ref):
        return float("inf")
    finite = torch.isfinite(ref)
    diff = (out[finite] - ref[finite]).norm()
    scale = ref[finite].norm()
    return float(diff / scale) if scale > 0 else float(diff)


def integer_tensor(*shape, low=-3, high=4, dtype=torch.float16, device="cpu"):
    """Random integer-valued tensor: exact in fp16/bf16/fp32 and in every product we take."""
    return torch.randint(low, high, shape, device=device).to(dtype)


def run_spawned(target, count: int, *args) -> list:
    """Start `count` spawned processes at once, each running target(*args, barrier, index, queue)
    behind a shared barrier, and return what each put on the queue (one item per process)."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(count), context.Queue()
    processes = [context.Process(target=target, args=(*args, barrier, i, queue)) for i in range(count)]
    for p in processes:
        p.start()
    results = [queue.get(timeout=300) for _ in processes]
    for p in processes:
        p.join(timeout=60)
    return results


def check_reductions(args, kind):
    """Every output of `args` against float64: max/min/amax exactly, sums and means relative to
    the same fold of |x| (fold_error) where a magnitude is known, else relatively, log-sum-exps
    within 2e-6 of max(|value|, 1) (infinities and NaN exactly)."""
    magnitudes = magnitude_outputs(args)
    for name, ref in reference_outputs(args).items():
        out = args.outputs[name]
        if OPS[kind].reduction.combine == "logsumexp":   # fp32 exp and log: relative to max(|ref|, 1)
            scale = ref.abs().clamp(min=1.0).nan_to_num(posinf=1.0)
            assert torch.allclose(out.double(), ref, rtol=0, atol=0, equal_nan=True) or bool(
                (((out.double() - ref).abs() <= 2e-6 * scale) | (out.double() == ref) | (out.isnan() & ref.isnan())).all()), \
                (name, float((out.double() - ref).abs().nan_to_num().max()))
        elif OPS[kind].reduction.combine != "add":
            expected = ref.to(out.dtype).double()
            assert torch.allclose(out.double(), expected, rtol=0, atol=0, equal_nan=True), name
        else:
            error = fold_error(out, ref, magnitudes[name]) if name in magnitudes else rel_error(out, ref)
            assert error < 1e-5, (name, error)


def run_python(source: str, timeout: float):
    """Run `source` in a fresh Python process that imports what this one does (its sys.path),
    so that a crash or a hang fails one test, not the whole run; the CompletedProcess."""
    import os
    import subprocess
    import sys
    import tempfile
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryDirectory() as folder:  # a file: a long source is over the argument limit
        script = os.path.join(folder, "script.py")
        with open(script, "w") as f:
            f.write(source)
        return subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=timeout, env=env)


def fast(values, keep, ids=None) -> list:
    """Parametrize values, those whose index is not in `keep` marked slow: the README's test run
    takes a representative few, `-m slow` (CI) the rest."""
    import pytest
    names = ids or [None] * len(values)
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=name,
                         marks=() if i in keep else pytest.mark.slow)
            for i, (v, name) in enumerate(zip(values, names))]


def lm_head(device, tokens: int, hidden: int, vocab: int, seed: int):
    """x (tokens, hidden), W (vocab, hidden), b (vocab,) and class targets (tokens,): the inputs
    of a language-model head's cross-entropy."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    W = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(device)
    b = torch.randn(vocab, generator=gen).to(device)
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return x, W, b, target


def relu_aux_loss(accum, alpha, C, bias):
    F = (accum * alpha) + (C * 2.0) + bias
    D = relu(F)
    r = sum(D, dim=1)
    return D, F, r


def op_tensors(dtype=torch.float64, grad=True):
    """A, B, C and bias of a 6 x 5 x 4 problem, seeded (the custom ops' tests)."""
    g = torch.Generator().manual_seed(7)
    shapes = {"A": (6, 4), "B": (4, 5), "C": (6, 5), "bias": (5,)}
    return {k: torch.randn(*s, dtype=dtype, generator=g).requires_grad_(grad) for k, s in shapes.items()}
