"""Where epifuse.linear_cross_entropy's training step goes (issue 36: 1.14-1.28x the
three-GEMM floor where the target is 1.1x), on one GPU.

    PYTHONPATH=src:. python -m research.lce_profile [--tokens 8192] [--vocab 128256] [--hidden 4096]

torch.profiler over three steps (loss, backward) after two warm-up steps: each GPU kernel's
time per step and calls per step, largest first, and the step's GPU time against one cuBLAS
GEMM of the logits' shape timed alone (the floor is three of those).
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import epifuse


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    ns = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ns.tokens, ns.hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(ns.vocab, ns.hidden, device="cuda", generator=g) / ns.hidden ** 0.5).bfloat16().requires_grad_()
    t = torch.randint(0, ns.vocab, (ns.tokens,), device="cuda", generator=g)

    def step():
        x.grad = w.grad = None
        epifuse.linear_cross_entropy(x, w, t).backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    xd, wd = x.detach(), w.detach()
    for _ in range(3):
        xd @ wd.t()
    a.record()
    for _ in range(5):
        xd @ wd.t()
    b.record()
    torch.cuda.synchronize()
    gemm_ms = a.elapsed_time(b) / 5
    a.record()
    for _ in range(3):
        step()
    b.record()
    torch.cuda.synchronize()
    step_ms = a.elapsed_time(b) / 3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time / 3
            per[e.name][1] += 1
    print(f"{torch.cuda.get_device_name()}: step {step_ms:.2f} ms, one cuBLAS GEMM {gemm_ms:.2f} ms, "
          f"floor {3 * gemm_ms:.2f} ms ({step_ms / (3 * gemm_ms):.2f}x)")
    total = sum(v[0] for v in per.values()) / 1e3
    print(f"kernels' sum {total:.2f} ms per step (the rest is the GPU waiting on the host)")
    for name, (us, calls) in sorted(per.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {us / 1e3:8.3f} ms  x{calls // 3:<3d} {name[:100]}")
    _idle_gaps(prof)


def _idle_gaps(prof, shown: int = 12) -> None:
    """The longest stretches with no GPU activity between the profiled steps' first and last
    kernels, each with the activity before and after it: where in the step the GPU waits on
    the host."""
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None)
    gaps, end, before = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, before, name, end, start))
        if end is None or stop > end:
            end, before = stop, name
    total = sum(g[0] for g in gaps) / 3e3
    print(f"GPU idle between kernels: {total:.2f} ms per step; the longest stretches (us, after -> before):")
    for us, after, before_next, since, until in sorted(gaps, reverse=True)[:shown]:
        print(f"  {us:9.1f}  {after[:50]} -> {before_next[:50]}")
        # the host's top-level ops that ran while the GPU waited, and how long each took
        during = [(stop - start, name) for start, stop, name in host if start < until and stop > since]
        print("             host: " + ", ".join(f"{name[:40]} {us_:.0f}" for us_, name in during[:12])
              + (f" (+{len(during) - 12} more)" if len(during) > 12 else ""))


if __name__ == "__main__":
    main()
