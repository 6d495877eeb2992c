"""What the target offers: the interpreter or a GPU, its SMs, L2, compute capability, Gluon.

The kernels' support checks, the candidates' order and tuning read these facts; on a CPU and
under Triton's interpreter the GPU facts are None or False.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

import torch


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (as triton.cdiv; Triton itself is imported when a kernel is built)."""
    return -(-a // b)


# Triton's interpreter patches triton.language globally while a kernel runs: one at a time.
INTERPRETER_LOCK = threading.Lock()


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def uses_interpreter(device: torch.device) -> bool:
    return device.type == "cpu" or interpreter_requested()


def capability(device: torch.device) -> int:
    """The compute capability of a CUDA device as an int: 90 for Hopper."""
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_bytes(index: int) -> int:
    """The GPU's L2 size; 0 where torch does not report it (before torch 2.5)."""
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton ships Gluon's Hopper module: looked up, not imported (importing
    Gluon costs 0.1 s, a warm start's budget, and only a launch of a Gluon kernel needs it)."""
    spec = importlib.util.find_spec("triton.experimental")
    roots = spec.submodule_search_locations if spec is not None else None
    return any(os.path.exists(os.path.join(root, "gluon", "nvidia", "hopper", "__init__.py")) or
               os.path.exists(os.path.join(root, "gluon", "nvidia", "hopper.py")) for root in roots or ())


def gpu_index(args) -> int | None:
    """The index of the GPU args' kernels run on; None on a CPU or under the interpreter."""
    device = args.A.device
    if device.type != "cuda" or uses_interpreter(device):
        return None
    return device.index or 0


def gpu_sms(args) -> int | None:
    """The SM count of args' GPU; None on a CPU or under the interpreter."""
    index = gpu_index(args)
    return None if index is None else sm_count(index)


def output_tiles(args, config) -> int:
    return args.L * cdiv(args.M, config.block_m) * cdiv(args.N, config.block_n)


# The tiles most configs take: what decides whether a grid is small.
USUAL_TILE = (128, 128)


def few_tiles(args, sms: int) -> bool:
    """Whether the usual 128x128 output tiles are fewer than the GPU's `sms`."""
    return args.L * cdiv(args.M, USUAL_TILE[0]) * cdiv(args.N, USUAL_TILE[1]) < sms


def leaves_sms_idle(args) -> bool:
    """Whether the usual 128x128 tiles leave SMs of args' GPU without a tile (never on a CPU
    or under the interpreter): where the split-K kernels and the 64-row ping-pong come first."""
    sms = gpu_sms(args)
    return sms is not None and few_tiles(args, sms)


def b_fits_l2(args) -> bool:
    """Whether B of one GEMM takes at most a quarter of L2 on args' GPU while the usual tiles
    fill it (never on a CPU, under the interpreter or for a batch): where a tile order two rows
    deep lets B stay in L2 between rows."""
    index = gpu_index(args)
    if index is None or args.L != 1 or leaves_sms_idle(args):
        return False
    return args.N * args.K * args.B.element_size() <= l2_bytes(index) // 4


def on_device(device: torch.device):
    """Run a kernel's compile and launch with its tensors' GPU current: Triton compiles, loads
    and launches on the current device (the tensors may be on another one, cuda:1 in a
    process whose current device is cuda:0)."""
    if device.type != "cuda" or device.index is None or device.index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` (the current device) is capturing a CUDA graph."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()
