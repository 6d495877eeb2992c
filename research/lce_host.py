"""Where epifuse.linear_cross_entropy's step waits on the host, without a profiler's overhead:
one training step from an idle GPU (as bench.lce times it), with the entry and exit of the
loss's pieces (the argument check, each epifuse GEMM, the forward's chunk loop, the backward's
scaling) stamped twice: the host's clock when Python got there, and a CUDA event recorded on
the stream at that point (when the GPU got there). A piece whose GPU stamp trails its host
stamp has work queued ahead of it; one whose GPU stamp equals its host stamp found the GPU idle.

    PYTHONPATH=src:. python -m research.lce_host [--tokens 8192] [--vocab 128256] [--hidden 4096]
"""
from __future__ import annotations

import argparse
import time

import torch

import epifuse
from epifuse import losses

WRAPPED = ("_check", "gemm", "_statistics_and_gradients", "_recompute_rows", "_scaled")


def _stamped(name, fn, stamps):
    def wrapper(*args, **kwargs):
        stamps.append((f"> {name}", time.perf_counter(), _event()))
        out = fn(*args, **kwargs)
        stamps.append((f"< {name}", time.perf_counter(), _event()))
        return out
    return wrapper


def _event():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


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
    stamps: list = []
    originals = {name: getattr(losses, name) for name in WRAPPED}
    for name, fn in originals.items():
        setattr(losses, name, _stamped(name, fn, stamps))
    try:
        for attempt in range(4):
            x.grad = w.grad = None
            torch.cuda.synchronize()
            stamps.clear()
            stamps.append(("step", time.perf_counter(), _event()))
            x.grad = w.grad = None
            loss = epifuse.linear_cross_entropy(x, w, t)
            stamps.append(("forward returned", time.perf_counter(), _event()))
            loss.backward()
            stamps.append(("backward returned", time.perf_counter(), _event()))
            torch.cuda.synchronize()
            stamps.append(("synchronized", time.perf_counter(), _event()))
            torch.cuda.synchronize()
    finally:
        for name, fn in originals.items():
            setattr(losses, name, fn)
    _, host0, gpu0 = stamps[0]
    print(f"{torch.cuda.get_device_name()}, {ns.tokens} x {ns.vocab} x {ns.hidden}, the last of 4 steps:")
    print(f"  {'point':34s} {'host ms':>8s} {'GPU ms':>8s}")
    for label, host, event in stamps:
        print(f"  {label:34s} {(host - host0) * 1e3:8.2f} {gpu0.elapsed_time(event):8.2f}")


if __name__ == "__main__":
    main()
