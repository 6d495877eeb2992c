"""Whether a fused region is faster than what it replaces, measured on the GPU while the graph
compiles: the compile backend's guard that a model compiled with it is not slower than
Inductor alone (epifuse.graph_fusion asks before it rewrites a region).

Unfused, a region is the GEMM as torch runs it (cuBLAS: `mm`, `addmm` with its bias, `bmm`)
and Inductor's pointwise pass over its result, which reads accum and the operands and writes
the outputs: memory-bound, so it takes about as long as a copy of as many bytes (a copy of
accum's size is timed for the rate). Fused, it is the epifuse call itself, timed after its
first call (which tunes it, as the compiled graph's first call would have; the choice is
remembered for that call). Host time counts too: a step whose GPU work is short waits for the
host, and an epifuse call costs more of it than torch's GEMM (the calls are launched back to
back and the clock stopped before the GPU is waited for). The region is fused where the fused
call's GPU time plus the host time it adds is no more than the GEMM's plus the pass's.
What the estimate leaves out: a pointwise pass that Inductor fuses with other work (then it
saves less than estimated), and the host time of launching that pass (not credited to the
unfused side). GEMMs below graph_fusion.MIN_FUSED_ELEMENTS are left alone before this is asked.
Timing noise decides close calls; the decision is part of the compiled graph (and of
Inductor's cache of it).

Inputs are drawn at random with the graph's shapes, strides and dtypes, outside the graph's
fake mode and without the Python dispatcher (on while a forward graph compiles, it adds host
time to every op). Symbolic sizes (dynamic shapes) are not measured: the region is fused.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .runtime.tune import TUNE_REP_MS, TUNE_WARMUP_MS, fresh_like


@dataclass
class Timing:
    """Microseconds: the fused call, the GEMM as torch runs it, and the estimated pass, on the
    GPU; and the host time of a fused call and of the GEMM's call (what a step waits for when
    the GPU outruns the host)."""

    fused_us: float
    gemm_us: float
    pass_us: float
    fused_host_us: float = 0.0
    gemm_host_us: float = 0.0

    @property
    def extra_host_us(self) -> float:
        return max(0.0, self.fused_host_us - self.gemm_host_us)

    @property
    def pays(self) -> bool:
        """The fused call's GPU time plus the host time it adds (counted as if the step waited
        for the host: never slower either way) against the GEMM's plus the pass's."""
        return self.fused_us + self.extra_host_us <= self.gemm_us + self.pass_us

    def why_not(self) -> str:
        return (f"measured on the GPU, the fused call takes {self.fused_us:.0f} us (and {self.extra_host_us:.0f} us "
                f"more host time than the GEMM's call) against {self.gemm_us:.0f} us for the GEMM plus about "
                f"{self.pass_us:.0f} us for the pass it would replace")


def pass_bytes(accum, operands, outputs) -> int:
    """The bytes Inductor's pass over a region moves: accum and each operand read once, each
    output written once (accum itself, where it is an output, the GEMM writes anyway)."""
    return sum(t.numel() * t.element_size() for t in (accum, *operands, *(o for o in outputs if o is not accum)))


def _concrete(value) -> bool:
    return all(isinstance(s, int) for s in (*value.shape, *value.stride()))


def _drawn(value, generators: dict):
    """A real tensor with `value`'s shape, strides, dtype and device, random (tune.fresh_like),
    from a generator of its own per device, so the caller's random streams are left as they
    were."""
    if value.device not in generators:
        generators[value.device] = torch.Generator(device=value.device).manual_seed(0)
    return fresh_like(value, generators[value.device])


def _time_us(fn) -> float:
    """Microseconds of one call on the GPU, timed as tuning times a kernel (do_bench's median)."""
    from triton.testing import do_bench
    fn()
    return do_bench(fn, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median") * 1e3


HOST_CALLS = 10   # calls launched back to back to time the host's share (fewer than the launch queue holds)


def _host_us(fn) -> float:
    """The host time of one call: HOST_CALLS calls launched back to back after a sync, the
    clock stopped before waiting for the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def measure(gemm_target, gemm_inputs, call_args, accum, operands, outputs) -> Timing | None:
    """Times the fused call (`torch.ops.epifuse.gemm` with `call_args`, its tensors given as
    fake values) against torch's GEMM of `gemm_target` over `gemm_inputs` (fake values, in
    the aten op's order) plus the estimated pass. None where a size is symbolic."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    aten = torch.ops.aten
    values = [*gemm_inputs, accum, *operands, *outputs]
    if not all(_concrete(v) for v in values):
        return None
    with unset_fake_temporarily(), torch._C._DisablePythonDispatcher(), torch.no_grad():
        generators: dict = {}
        real = {id(v): _drawn(v, generators) for v in (*gemm_inputs, *call_args[3])}
        fused_args = (call_args[0], real[id(call_args[1])], real[id(call_args[2])],
                      [real[id(o)] for o in call_args[3]], *call_args[4:])

        def fused():
            return torch.ops.epifuse.gemm.default(*fused_args)
        gemm = {aten.mm.default: torch.mm, aten.addmm.default: torch.addmm, aten.bmm.default: torch.bmm}[gemm_target]
        inputs = [real[id(v)] for v in gemm_inputs]

        def unfused():
            return gemm(*inputs)
        fused_us, gemm_us = _time_us(fused), _time_us(unfused)
        fused_host_us, gemm_host_us = _host_us(fused), _host_us(unfused)
        total = pass_bytes(accum, operands, outputs)
        block = _drawn(accum, generators).reshape(-1)   # accum's bytes, flat
        copy_us = _time_us(lambda: block.clone())
    return Timing(fused_us, gemm_us, copy_us * total / (2 * math.prod(accum.shape) * accum.element_size()),
                  fused_host_us, gemm_host_us)


def slower(gemm_target, gemm_inputs, call_args, accum, operands, outputs) -> str | None:
    """graph_fusion's judge: why the region should stay Inductor's (measured slower fused),
    or None to fuse it."""
    timing = measure(gemm_target, gemm_inputs, call_args, accum, operands, outputs)
    return None if timing is None or timing.pays else timing.why_not()


__all__ = ["Timing", "measure", "pass_bytes", "slower"]
