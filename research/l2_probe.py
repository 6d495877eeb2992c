"""Do the streaming C, D and F tiles evict A and B from L2? Times chosen kernels on the probe's
epilogues, alternating with cuBLAS's A @ B, under four L2 conditions set on the stream through
the driver API: `none` (no persisting set-aside), `setaside` (the largest set-aside for
persisting lines, no window), `B` and `A` (that operand in an access-policy window whose hits
persist, the rest streaming). The set-aside and the window are put back as they were on exit.

    PYTHONPATH=src:. python -m research.l2_probe [--shapes S2] [--epilogues identity,tile_C,two_outputs]

Found on an H100 (NOTEBOOK.md, 2026-11-26 14:10): with the set-aside in place every S2 kernel
ran slower (cuBLAS 36 %, the two-output probe epilogue's ping-pong 2.3x) and S1's did not; a
window over B or A then changed no time by more than 0.7 %. Why the windows did nothing (the
TMA loads these kernels and cuBLAS use, or the set-aside's size) was not pursued, so the probe
did not answer its question; the tile order did (epifuse.backends.triton.configs.ROW_ORDER).

`--policies` (the same kernels with each level of Triton 3.9's TMA L2 cache policies) no longer
runs: epifuse's kernels no longer take L2 hints, so there is none to set. What it measured, that
no level moved a row beyond its spread, is NOTEBOOK.md 2026-11-26 17:53.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch

import epifuse
from bench.timing import alternate_ms
from bench.workloads import SHAPES

from .probe import make_args, make_operands

CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
CU_ACCESS_PROPERTY_STREAMING, CU_ACCESS_PROPERTY_PERSISTING = 1, 2
DEFAULT_KERNELS = ("<gluon_pingpong 128x128x64 group 8, 4 warps, 5 stages, epilogue in 2>;"
                   "<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages, epilogue in 2>")


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # CUstreamAttrValue: a 64-byte union
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]


class Driver:
    """The CUDA driver calls the probe needs, through ctypes, on torch's current device."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self.lib.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        self.lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.lib.cuStreamSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_AttrValue)]
        self.lib.cuStreamGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_AttrValue)]
        self.device = torch.cuda.current_device()
        torch.zeros(1, device="cuda")  # makes torch's context current for the driver API

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUresult {code}")

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(value), attr, self.device), "cuDeviceGetAttribute")
        return value.value

    def persisting_limit(self) -> int:
        value = ctypes.c_size_t()
        self._check(self.lib.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_PERSISTING_L2_CACHE_SIZE), "cuCtxGetLimit")
        return value.value

    def set_persisting_limit(self, nbytes: int) -> None:
        self._check(self.lib.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, nbytes), "cuCtxSetLimit")

    def window(self, stream: torch.cuda.Stream) -> _AttrValue:
        value = _AttrValue()
        self._check(self.lib.cuStreamGetAttribute(stream.cuda_stream, CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                                  ctypes.byref(value)), "cuStreamGetAttribute")
        return value

    def set_window(self, stream: torch.cuda.Stream, tensor: torch.Tensor | None, hit_ratio: float = 1.0,
                   value: _AttrValue | None = None) -> None:
        """Hold `tensor` (None: nothing) in the stream's window, or set the window `value`."""
        if value is None:
            value = _AttrValue()
            if tensor is not None:
                value.accessPolicyWindow = _Window(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                                   hit_ratio, CU_ACCESS_PROPERTY_PERSISTING,
                                                   CU_ACCESS_PROPERTY_STREAMING)
        self._check(self.lib.cuStreamSetAttribute(stream.cuda_stream, CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                                  ctypes.byref(value)), "cuStreamSetAttribute")
        self._check(self.lib.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
        if self.window(stream).accessPolicyWindow.num_bytes != value.accessPolicyWindow.num_bytes:
            raise RuntimeError("the stream's access-policy window did not take")


def alternate(calls: dict, rounds: int, rep_ms: int) -> dict:
    """Median time in us of each call, measured in turn `rounds` times (do_bench medians)."""
    return {name: statistics.median(ms) * 1e3 for name, ms in alternate_ms(calls, rounds, 25, rep_ms).items()}


def measure(driver: Driver, stream: torch.cuda.Stream, ns, max_persist: int, max_window: int) -> list:
    """One row per shape, epilogue, L2 condition and call (cuBLAS and each kernel of ns.kernels)."""
    rows = []
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
            conditions = {"none": (None, 1.0), "setaside": (None, 1.0), "B": (B, 1.0),
                          "A": (A, min(1.0, max_persist / (A.numel() * A.element_size())))}
            for condition, (tensor, ratio) in conditions.items():
                if tensor is not None and tensor.numel() * tensor.element_size() > max_window:
                    print(f"{condition} ({tensor.numel() * tensor.element_size() >> 20} MiB) exceeds the "
                          "largest window; left out", flush=True)
                    continue
                driver.set_persisting_limit(0 if condition == "none" else max_persist)
                driver.set_window(stream, tensor, ratio)
                us = alternate(calls, ns.rounds, ns.rep_ms)
                for name, t in us.items():
                    rows.append(dict(shape=shape, epilogue=epilogue, window=condition, hit_ratio=ratio,
                                     kernel=name, us=t, ratio=t / us["cublas"]))
                    print(f"{shape} {epilogue:12s} {condition:8s} {t:7.1f} us  {t / us['cublas']:.3f}  {name}",
                          flush=True)
    return rows


POLICIES_GONE = ("l2_probe --policies: epifuse's kernels no longer take L2 cache-policy hints (gluon_api's "
                 "L2_NONE / L2_STREAMS / L2_STREAMS_KEEP_B and the kernels' l2_hints were removed), so there "
                 "is no hint level to set. What this measured is research/NOTEBOOK.md, 2026-11-26 17:53 (no "
                 "level moved a row beyond its spread), and research/results/l2_policies_20261126-1753_H100.json. "
                 "The L2 set-aside and access-policy windows (without --policies) still run.")


def measure_policies(ns) -> list:
    """What `--policies` measured (each kernel of ns.kernels at each L2 hint level, alternating
    with cuBLAS) needs the hints the kernels no longer have: says so and exits."""
    raise SystemExit(POLICIES_GONE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="S2")
    parser.add_argument("--epilogues", default="identity,tile_C,two_outputs")
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, help="';'-separated reprs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--policies", default="",
                        help="no longer runs (the kernels lost their L2 hints): says why and exits")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    if ns.policies:
        measure_policies(ns)
    driver = Driver()
    max_persist = driver.attribute(CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)
    max_window = driver.attribute(CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)
    l2 = getattr(torch.cuda.get_device_properties(driver.device), "L2_cache_size", 0)
    print(f"{torch.cuda.get_device_name()}: L2 {l2 >> 20} MiB, persisting at most {max_persist >> 20} MiB, "
          f"window at most {max_window >> 20} MiB", flush=True)
    stream = torch.cuda.Stream()
    limit_before, window_before = driver.persisting_limit(), driver.window(stream)
    try:
        with torch.cuda.stream(stream):
            rows = measure(driver, stream, ns, max_persist, max_window)
    finally:  # the set-aside slows every later kernel of this context (NOTEBOOK.md, 14:10)
        torch.cuda.synchronize()
        driver.set_window(stream, None, value=window_before)
        driver.set_persisting_limit(limit_before)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "max_persisting_bytes": max_persist,
                       "max_window_bytes": max_window, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
