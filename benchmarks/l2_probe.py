"""Do the streaming C, D and F tiles evict A and B from L2? Times chosen kernels on the probe's
epilogues, alternating with cuBLAS's A @ B, under four L2 conditions set on the stream through
the driver API: `none` (no persisting set-aside), `setaside` (the largest set-aside for
persisting lines, no window), `B` and `A` (that operand in an access-policy window whose hits
persist, the rest streaming).

    PYTHONPATH=src:. python -m benchmarks.l2_probe [--shapes S2] [--epilogues identity,tile_C,two_outputs]

Found on an H100 (RESULTS.md, 2026-11-26 14:10): the set-aside alone takes its 31 MiB from
ordinary lines (cuBLAS 35 % slower at S2, relu_aux's kernel 2.3x), and a window over B or A
changes no kernel's time beyond it (the TMA loads of cuBLAS and of these kernels do not appear
to take the window), so the window cannot keep B resident; the tile order can
(pingpong.ROW_ORDER_CONFIGS).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch
from triton.testing import do_bench

import epifuse

from .probe import make_args, make_operands
from .workloads import SHAPES

CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
CU_ACCESS_PROPERTY_NORMAL, CU_ACCESS_PROPERTY_STREAMING, CU_ACCESS_PROPERTY_PERSISTING = 0, 1, 2
DEFAULT_KERNELS = ("<gluon_pingpong 128x128x64 group 8, 4 warps, 5 stages, epilogue in 2>;"
                   "<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages, epilogue in 2>")


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # CUstreamAttrValue: a 64-byte union
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]


class Driver:
    """The CUDA driver calls the probe needs, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        torch.zeros(1, device="cuda")  # makes torch's context current for the driver API

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUresult {code}")

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(value), attr, torch.cuda.current_device()),
                    "cuDeviceGetAttribute")
        return value.value

    def set_persisting_limit(self, nbytes: int) -> None:
        self._check(self.lib.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(nbytes)),
                    "cuCtxSetLimit")

    def set_window(self, stream: torch.cuda.Stream, tensor: torch.Tensor | None, hit_ratio: float = 1.0) -> None:
        value = _AttrValue()
        if tensor is not None:
            value.accessPolicyWindow = _Window(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                               hit_ratio, CU_ACCESS_PROPERTY_PERSISTING,
                                               CU_ACCESS_PROPERTY_STREAMING)
        self._check(self.lib.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                                  CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(value)),
                    "cuStreamSetAttribute")
        self._check(self.lib.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
        back = _AttrValue()
        self._check(self.lib.cuStreamGetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                                  CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(back)),
                    "cuStreamGetAttribute")
        if back.accessPolicyWindow.num_bytes != value.accessPolicyWindow.num_bytes:
            raise RuntimeError("the stream's access-policy window did not take")


def alternate(calls: dict, rounds: int, rep_ms: int) -> dict:
    """Median time in us of each call, measured in turn `rounds` times (do_bench medians)."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(do_bench(call, warmup=25, rep=rep_ms, return_mode="median") * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="S2")
    parser.add_argument("--epilogues", default="identity,tile_C,two_outputs")
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, help="';'-separated reprs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    driver = Driver()
    max_persist = driver.attribute(CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)
    max_window = driver.attribute(CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)
    print(f"{torch.cuda.get_device_name()}: L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB, "
          f"persisting at most {max_persist >> 20} MiB, window at most {max_window >> 20} MiB", flush=True)
    stream = torch.cuda.Stream()
    rows = []
    with torch.cuda.stream(stream):
        for shape in ns.shapes.split(","):
            M, N, K = SHAPES[shape]
            A, B, operands = make_operands(M, N, K)
            for epilogue in ns.epilogues.split(","):
                args = make_args(epilogue, A, B, operands)
                kernels = {repr(k): k for k in epifuse.get_kernels(args)}
                calls = {"cublas": lambda: A @ B}
                for name in ns.kernels.split(";"):
                    if name in kernels:
                        calls[name] = (lambda k: lambda: k.run(args))(kernels[name])
                    else:
                        print(f"{epilogue} at {shape}: no candidate {name}", flush=True)
                for call in calls.values():
                    call()
                torch.cuda.synchronize()
                windows = {"none": (None, 1.0), "setaside": (None, 1.0), "B": (B, 1.0),
                           "A": (A, min(1.0, max_persist / (A.numel() * A.element_size())))}
                for window, (tensor, ratio) in windows.items():
                    if tensor is not None and tensor.numel() * tensor.element_size() > max_window:
                        print(f"{window} ({tensor.numel() * tensor.element_size() >> 20} MiB) exceeds the "
                              "largest window; left out", flush=True)
                        continue
                    # the set-aside L2 share for persisting lines: none for the first condition
                    driver.set_persisting_limit(0 if window == "none" else max_persist)
                    driver.set_window(stream, tensor, ratio)
                    us = alternate(calls, ns.rounds, ns.rep_ms)
                    for name, t in us.items():
                        row = dict(shape=shape, epilogue=epilogue, window=window, hit_ratio=ratio, kernel=name,
                                   us=t, ratio=t / us["cublas"])
                        rows.append(row)
                        print(f"{shape} {epilogue:12s} window {window:4s} {t:7.1f} us  {row['ratio']:.3f}  {name}",
                              flush=True)
                driver.set_window(stream, None)
                driver.set_persisting_limit(0)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "max_persisting_bytes": max_persist,
                       "max_window_bytes": max_window, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
