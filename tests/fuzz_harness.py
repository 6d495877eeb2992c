"""Running one fuzz example: building its tensors, checking every kernel against float64, and
the run's budget, seed and report (tests/gpu_fuzz.py starts many processes with these).

An output passes when its relative error (helpers.rel_error: NaN and Inf positions must match)
against the float64 result rounded to the output's dtype is within the dtype's tolerance
(bf16 1e-2: the interpreter truncates bf16; fp16 2e-3; fp32 2e-5), or within 8x the error of
the same epilogue evaluated by torch in float32 (cancellation hurts both alike). A sum or mean
is measured against the same fold of |x| instead (helpers.fold_error, |prior| added when
accumulating): its tile partials and atomics round differently from torch's sum, and where
signed terms cancel the kernel's error exceeded 8x torch's (a sum of sin(clamp(accum)) failed
4 of 800 seeds) while staying within fp32's bound.

Environment: EPIFUSE_FUZZ_EXAMPLES (examples per fuzz test), EPIFUSE_FUZZ_SEED (a fixed seed and
no example database: one process's share of a parallel run), EPIFUSE_FUZZ_DEADLINE (a time.time()
after which the remaining examples are generated but not run), EPIFUSE_FUZZ_REPORT (a file for
the JSON summary of a fuzz test; else $OUT/fuzz-report-<pid>.json when $OUT is set),
EPIFUSE_FUZZ_SHRINK=1 (shrink failures: re-runs kernels for minutes).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import seed as hypothesis_seed

import epifuse
from epifuse.reference import reference_accum
from epifuse.ops import OPS
from epifuse.reference import evaluate
from fuzz_strategies import Example, Operand, Output
from helpers import fold_error, magnitude_outputs, reference_outputs, rel_error

HAS_CUDA = torch.cuda.is_available()

# ---- budget, seeds and reports ------------------------------------------------------------------

# On a GPU every example compiles new kernels (seconds each): 50 by default there, to help the
# GPU subset fit one 10-minute call (with 200, a one-process subset on a fresh H100 was still in
# test_fuzz_gpu when its 390 s ran out, 2026-11-25; the time with 50 is not measured yet);
# thousands with EPIFUSE_FUZZ_EXAMPLES (or tests/gpu_fuzz.py) for the long run.
EXAMPLES = int(os.environ.get("EPIFUSE_FUZZ_EXAMPLES", "0")) or (50 if HAS_CUDA else 250)
SEED = os.environ.get("EPIFUSE_FUZZ_SEED")
DEADLINE = float(os.environ.get("EPIFUSE_FUZZ_DEADLINE", "inf"))
# Shrinking re-runs kernels hundreds of times (minutes in the interpreter): off unless asked for.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("EPIFUSE_FUZZ_SHRINK") else [])
# A seeded process runs exactly the examples its seed draws: no replays from a shared database.
_DATABASE = {"database": None} if SEED is not None else {}
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, phases=PHASES,
                         suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                HealthCheck.too_slow, HealthCheck.data_too_large],
                         print_blob=True, **_DATABASE)


def seeded(test):
    """`test` with EPIFUSE_FUZZ_SEED as its Hypothesis seed, when one is set."""
    return test if SEED is None else hypothesis_seed(int(SEED))(test)


@dataclass
class FuzzTally:
    """How many examples a fuzz test ran, and which failed; written as one JSON line."""

    test: str
    passed: int = 0
    failing: set = field(default_factory=set)   # descriptions: Hypothesis replays a failure
    skipped: int = 0                            # drawn after EPIFUSE_FUZZ_DEADLINE, not run
    kernels: dict = field(default_factory=dict)  # kernel class name -> examples it ran

    def run(self, ex: Example, device) -> None:
        if time.time() > DEADLINE:
            self.skipped += 1
            return
        try:
            ran = fuzz_once(ex, device)
        except Exception:
            self.failing.add(describe(ex))
            raise
        self.passed += 1
        for name in ran:
            self.kernels[name] = self.kernels.get(name, 0) + 1

    def summary(self) -> dict:
        return {"test": self.test, "examples": self.passed + len(self.failing),
                "failures": len(self.failing), "skipped_after_deadline": self.skipped,
                "kernels": dict(sorted(self.kernels.items())), "seed": SEED, "pid": os.getpid()}

    def write(self) -> None:
        line = json.dumps(self.summary())
        print(f"fuzz report: {line}")
        path = report_path()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(line + "\n")


def report_path() -> Path | None:
    if os.environ.get("EPIFUSE_FUZZ_REPORT"):
        return Path(os.environ["EPIFUSE_FUZZ_REPORT"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"fuzz-report-{os.getpid()}.json"
    return None


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ---- building tensors ---------------------------------------------------------------------------

def _dyadic(shape, dtype, gen, device) -> torch.Tensor:
    """Small multiples of 1/4 (integers for integer dtypes): exact in every dtype used here."""
    if not dtype.is_floating_point:
        return torch.randint(-3, 4, shape, generator=gen).to(dtype).to(device)
    return (torch.randint(-8, 9, shape, generator=gen).to(torch.float32) / 4).to(dtype).to(device)


def _laid_out(shape, dtype, layout, gen, device) -> torch.Tensor:
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        flipped = shape[:-2] + (shape[-1], shape[-2])
        return _dyadic(flipped, dtype, gen, device).transpose(-1, -2)
    if layout == "sliced" and len(shape) >= 1:
        wide = _dyadic(shape[:-1] + (2 * shape[-1] + 1,), dtype, gen, device)
        return wide[..., 1::2]
    if layout == "expanded_row" and len(shape) >= 2:
        return _dyadic(shape[:-2] + (1, shape[-1]), dtype, gen, device).expand(shape)
    if layout == "expanded_col" and len(shape) >= 2:
        return _dyadic(shape[:-1] + (1,), dtype, gen, device).expand(shape)
    return _dyadic(shape, dtype, gen, device)


def _empty_laid_out(shape, dtype, layout, device) -> torch.Tensor:
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        return torch.empty(shape[:-2] + (shape[-1], shape[-2]), dtype=dtype, device=device).transpose(-1, -2)
    if layout == "sliced" and len(shape) >= 1:
        return torch.empty(shape[:-1] + (2 * shape[-1] + 1,), dtype=dtype, device=device)[..., 1::2]
    if layout == "padded" and len(shape) >= 1:  # a window inside a larger tensor: margins all round
        big = torch.empty(tuple(s + 3 for s in shape), dtype=dtype, device=device)
        return big[tuple(slice(1, s + 1) for s in shape)]
    return torch.empty(shape, dtype=dtype, device=device)


SENTINEL = 1234.0


def _memory_of(dest: torch.Tensor) -> torch.Tensor:
    """The whole tensor an output is a view into (its margins and gaps included)."""
    return dest._base if dest._base is not None else dest


def _outside(dest: torch.Tensor) -> torch.Tensor:
    """The output's surrounding memory, with the output's own elements zeroed."""
    memory = _memory_of(dest).detach().clone()
    offset = dest.storage_offset() - _memory_of(dest).storage_offset()
    memory.as_strided(dest.shape, dest.stride(), memory.storage_offset() + offset).zero_()
    return memory


def _operand_shape(ex: Example, o: Operand) -> tuple:
    if o.role == "scalar":
        return o.shape
    sizes = {"L": ex.L, "M": ex.M, "N": ex.N, "1": 1}
    return tuple(sizes[c] for c in o.shape)


def _reduction_shape(ex: Example, out: Output) -> tuple:
    shape = ex.accum_shape
    dims = range(len(shape)) if out.dims is None else out.dims
    if out.keepdim_shape and out.dims is not None:
        return tuple(1 if d in dims else s for d, s in enumerate(shape))
    kept = tuple(s for d, s in enumerate(shape) if d not in dims)
    return kept or (1,)


def build(ex: Example, device) -> tuple[epifuse.GemmArguments, dict]:
    """The GemmArguments of an example (and the reduction outputs' prior contents)."""
    gen = torch.Generator().manual_seed(ex.seed)
    shape_a = {"": (ex.M, ex.K), "both": (2, ex.M, ex.K), "a": (2, ex.M, ex.K), "b": (ex.M, ex.K),
               "a1": (1, ex.M, ex.K)}[ex.batch]
    shape_b = {"": (ex.K, ex.N), "both": (2, ex.K, ex.N), "a": (ex.K, ex.N), "b": (2, ex.K, ex.N),
               "a1": (2, ex.K, ex.N)}[ex.batch]
    A = _laid_out(shape_a, ex.in_dtype, ex.layout_a, gen, device)
    B = _laid_out(shape_b, ex.in_dtype, ex.layout_b, gen, device)
    tensors: dict = {}
    for o in ex.operands:
        if o.role == "number":
            tensors[o.name] = o.number
        else:
            tensors[o.name] = _laid_out(_operand_shape(ex, o), o.dtype, o.layout, gen, device)
    prior = {}
    for out in ex.outputs:
        if out.reduce is None:
            tensors[out.name] = _empty_laid_out(ex.accum_shape, out.dtype, out.layout, device)
        else:
            dest = _empty_laid_out(_reduction_shape(ex, out), out.dtype, out.layout, device)
            prior[out.name] = _dyadic(dest.shape, out.dtype, gen, device)
            tensors[out.name] = dest
    epi = epifuse.EpilogueArguments(ex.source, accumulate=ex.accumulate, deterministic=ex.deterministic,
                                    **tensors)
    return epifuse.GemmArguments(A, B, epilogue=epi, precision="highest"), prior


# ---- the check ----------------------------------------------------------------------------------

def expected_outputs(args, prior: dict, dtype) -> dict:
    """Every output evaluated by the reference interpreter in `dtype`, folded into `prior`
    for reductions when accumulating, in destination shapes."""
    if dtype == torch.float64:
        results = reference_outputs(args)
    else:
        accum = reference_accum(args.A, args.B, dtype, args.accumulator_type).reshape(args.accum_shape)
        results = {k: v.reshape(args.outputs[k].shape)
                   for k, v in evaluate(args.graph, accum, args.operands, dtype).items()}
    if args.accumulate:
        for name, kind in args.reductions.items():
            results[name] = OPS[kind].reduction.merge(prior[name].to(dtype), results[name])
    return results


def _variant(kernel) -> tuple:
    """What the GPU fuzz runs one config of: a kernel class, and for the Gluon ping-pong each
    tile height (its 64-row config comes first on small grids and would hide the other)."""
    if kernel.name == "gluon_pingpong":
        return kernel.name, kernel.config.block_m
    return kernel.name, None


def check_kernels(ex: Example | None, args, prior: dict | None = None) -> list[str]:
    """Run every generated kernel that supports `args`; compare each output with float64.
    Returns the names of the kernels that ran."""
    prior = prior or {}
    statuses = epifuse.kernel_statuses(args)
    missing = [n.op.name for n in args.graph.nodes() if not n.op.is_leaf and not n.op.is_reduction
               and any(f"op {n.op.name} has no Triton lowering" in s.reason for _, s in statuses)]
    kernels = [k for k, s in statuses if s.ok and k.name != "reference"]
    if args.A.device.type == "cuda":  # one config per kernel class: each compile costs seconds
        kernels = [k for i, k in enumerate(kernels) if _variant(k) not in {_variant(j) for j in kernels[:i]}]
    if missing:  # an op without a lowering is reported, never a KeyError
        assert all(not s.ok for k, s in statuses if k.name == "triton_tiled"), statuses
        return []
    assert any(k.name == "triton_tiled" for k in kernels), [str(s) for _, s in statuses]
    ref64 = expected_outputs(args, prior, torch.float64)
    ref32 = expected_outputs(args, prior, torch.float32)
    folds = magnitude_outputs(args)
    if args.accumulate:
        folds = {name: fold + prior[name].double().abs() for name, fold in folds.items()}
    casts = ex.casts if ex is not None else set()
    ran = []
    for kernel in kernels:
        outside = {}
        for name, dest in args.outputs.items():
            _memory_of(dest).fill_(SENTINEL)  # margins and gaps: never written
            if name in args.reductions and args.accumulate:
                dest.copy_(prior[name])
            else:
                dest.fill_(float("nan"))  # poison: every element must be written
            outside[name] = _outside(dest)
        kernel.run(args)
        ran.append(kernel.name)
        for name, dest in args.outputs.items():
            assert torch.equal(_outside(dest), outside[name]), f"{kernel!r} wrote outside output {name}"
            exact = ref64[name].to(dest.dtype)
            measure = (lambda out, ref, fold=folds[name]: fold_error(out, ref, fold)) if name in folds else rel_error
            torch_error = measure(ref32[name].to(dest.dtype), exact)
            tolerance = max([TOLERANCE[dest.dtype], 8 * torch_error] + [TOLERANCE[c] for c in casts])
            error = measure(dest, exact)
            if torch_error == float("inf"):  # fp32 itself differs in kind (overflow): compare with it
                error = min(error, measure(dest, ref32[name].to(dest.dtype)))
            assert error <= tolerance, (
                f"{kernel!r}: output {name} ({dest.dtype}, shape {tuple(dest.shape)}) has error "
                f"{error:.3g} > {tolerance:.3g} (torch fp32: {torch_error:.3g}; "
                f"{'of the fold of |x|' if name in folds else 'relative'})\n"
                f"kernel: {dest.flatten()[:8].tolist()}\nfloat64: {exact.flatten()[:8].tolist()}")
    return ran


def describe(ex: Example) -> str:
    ops = ", ".join(f"{o.name}={o.number if o.role == 'number' else (o.role, o.shape, o.layout, o.dtype)}"
                    for o in ex.operands)
    outs = ", ".join(f"{o.name}:{o.reduce or 'tile'}{'' if o.dims is None else o.dims} {o.dtype} {o.layout}"
                     for o in ex.outputs)
    return (f"{ex.source}\nM={ex.M} N={ex.N} K={ex.K} batch={ex.batch!r} in={ex.in_dtype} "
            f"A:{ex.layout_a} B:{ex.layout_b} accumulate={ex.accumulate} deterministic={ex.deterministic} "
            f"seed={ex.seed}\noperands: {ops}\noutputs: {outs}")


def fuzz_once(ex: Example, device) -> list[str]:
    """Build `ex` and check every kernel on it; the names of the kernels that ran."""
    note(describe(ex))
    args, prior = build(ex, device)
    ran = check_kernels(ex, args, prior)
    event(f"kernels: {', '.join(sorted(ran)) or 'none'}")
    event(f"outputs: {len(args.outputs)} ({len(args.reductions)} reductions)")
    event(f"batch: {ex.batch or 'none'}")
    for node in args.graph.nodes():
        event(f"op: {node.op.name}")
    return ran
