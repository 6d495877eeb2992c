"""Whether a fused region is faster than what it replaces, measured on the GPU while the graph
compiles: the compile backend's guard that a model compiled with it is not slower than
Inductor alone (epifuse.graph_fusion asks before it rewrites a region).

Unfused, a region is the GEMM as torch runs it (cuBLAS: `mm`, `addmm` with its bias, `bmm`)
and Inductor's pointwise pass over its result, which reads accum and the operands and writes
the outputs: memory-bound, so it takes about as long as a copy of as many bytes (a copy of
accum's size is timed for the rate). Fused, it is the epifuse call itself, timed after its
first call (which tunes it, as the compiled graph's first call would have; the choice is
remembered for that call). The region is fused where the fused call is no slower than the two.
What the estimate leaves out: a pointwise pass that Inductor fuses with other work (then it
saves less than estimated), and host time (GEMMs below graph_fusion.MIN_FUSED_ELEMENTS are
left alone before this is asked).

Inputs are drawn at random with the graph's shapes, strides and dtypes, outside the graph's
fake mode. Symbolic sizes (dynamic shapes) are not measured: the region is fused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .shapes import span

WARMUP_MS, REP_MS = 3, 15   # each timing (do_bench)


@dataclass
class Timing:
    """Microseconds: the fused call, the GEMM as torch runs it, and the estimated pass."""

    fused_us: float
    gemm_us: float
    pass_us: float

    @property
    def pays(self) -> bool:
        return self.fused_us <= self.gemm_us + self.pass_us

    def why_not(self) -> str:
        return (f"measured on the GPU, the fused call takes {self.fused_us:.0f} us against {self.gemm_us:.0f} us for "
                f"the GEMM plus about {self.pass_us:.0f} us for the pass it would replace")


def pass_bytes(accum, operands, outputs) -> int:
    """The bytes Inductor's pass over a region moves: accum and each operand read once, each
    output written once (accum itself, where it is an output, the GEMM writes anyway)."""
    return sum(t.numel() * t.element_size() for t in (accum, *operands, *(o for o in outputs if o is not accum)))


def _concrete(value) -> bool:
    return all(isinstance(s, int) for s in (*value.shape, *value.stride()))


def _drawn(value, generators: dict):
    """A real tensor with `value`'s shape, strides, dtype and device, random (0/1 for integer
    and bool tensors), stride-0 dims included; drawn from a generator of its own, so the
    caller's random streams are left as they were."""
    device = value.device
    if device not in generators:
        generators[device] = torch.Generator(device=device).manual_seed(0)
    g, n = generators[device], span(value)
    if value.dtype.is_floating_point:
        base = torch.randn(n, generator=g, device=device, dtype=value.dtype)
    else:
        base = torch.randint(0, 2, (n,), generator=g, device=device, dtype=torch.uint8).to(value.dtype)
    return base.as_strided(tuple(value.shape), tuple(value.stride()))


def _time_us(fn) -> float:
    from triton.testing import do_bench
    fn()
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") * 1e3


def measure(gemm_target, gemm_inputs, call_args, accum, operands, outputs) -> Timing | None:
    """Times the fused call (`torch.ops.epifuse.gemm` with `call_args`, its tensors given as
    fake values) against torch's GEMM of `gemm_target` over `gemm_inputs` (fake values, in
    the aten op's order) plus the estimated pass. None where a size is symbolic."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    aten = torch.ops.aten
    values = [*gemm_inputs, accum, *operands, *outputs]
    if not all(_concrete(v) for v in values):
        return None
    with unset_fake_temporarily(), torch.no_grad():
        generators: dict = {}
        real = {id(v): _drawn(v, generators) for v in (*gemm_inputs, *call_args[3])}
        fused_args = (call_args[0], real[id(call_args[1])], real[id(call_args[2])],
                      [real[id(o)] for o in call_args[3]], *call_args[4:])
        fused_us = _time_us(lambda: torch.ops.epifuse.gemm.default(*fused_args))
        gemm = {aten.mm.default: torch.mm, aten.addmm.default: torch.addmm, aten.bmm.default: torch.bmm}[gemm_target]
        inputs = [real[id(v)] for v in gemm_inputs]
        gemm_us = _time_us(lambda: gemm(*inputs))
        total = pass_bytes(accum, operands, outputs)
        block = torch.randn(math.prod(accum.shape), device=accum.device, dtype=accum.dtype,
                            generator=generators.setdefault(accum.device, torch.Generator(device=accum.device)))
        copy_us = _time_us(lambda: block.clone())
    return Timing(fused_us, gemm_us, copy_us * total / (2 * math.prod(accum.shape) * accum.element_size()))


def slower(gemm_target, gemm_inputs, call_args, accum, operands, outputs) -> str | None:
    """graph_fusion's judge: why the region should stay Inductor's (measured slower fused),
    or None to fuse it."""
    timing = measure(gemm_target, gemm_inputs, call_args, accum, operands, outputs)
    return None if timing is None or timing.pays else timing.why_not()


__all__ = ["Timing", "measure", "pass_bytes", "slower"]
