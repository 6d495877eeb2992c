"""Which kernels can run a problem, in which order, and which one runs it.

`kernel_statuses(args)` lists every kernel (a family and a config) with its Status, best first:
the untimed order that `EPIFUSE_TUNE=0` and the interpreter take as it is, and the candidates
tuning times. `choose_kernel(args)` is the kernel `epifuse.gemm` runs, remembered per
`args.signature` (everything a kernel's support and the choice depend on: a key that cannot
serve a kernel chosen for other arguments).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..arguments import GemmArguments, GroupedGemmArguments
from ..errors import EpilogueArgumentError, UnsupportedError
from ..runtime import tune
from .reference import GroupedReference, ReferenceKernel
from .triton import grouped, persistent, pingpong, splitk, tiled


def kernel_statuses(args, cc: int | None = None) -> list:
    """(kernel, Status) for every kernel class and config, supported or not, best first.
    `args` is a GemmArguments or a GroupedGemmArguments."""
    if not isinstance(args, (GemmArguments, GroupedGemmArguments)):
        raise EpilogueArgumentError(f"Kernels are chosen for a GemmArguments; got {type(args).__name__}.",
                                    hint="epifuse.get_kernels(epifuse.GemmArguments(A, B, epilogue=epi)).")
    if cc is not None and (not isinstance(cc, int) or isinstance(cc, bool) or cc <= 0):
        raise EpilogueArgumentError(f"cc must be a compute capability as an int such as 90, not {cc!r}.")
    if isinstance(args, GroupedGemmArguments):
        candidates = _grouped_candidates(args)
        reference = GroupedReference()
    else:
        candidates = _candidates(args)
        reference = ReferenceKernel()
    return [*((k, k.supports(args, cc)) for k in candidates), (reference, reference.supports(args))]


def get_kernels(args, cc: int | None = None) -> list:
    """Every kernel that supports `args`, best first (the reference kernel last)."""
    return [k for k, status in kernel_statuses(args, cc) if status.ok]


def _candidates(args) -> list:
    if tiled.uses_interpreter(args.A.device):
        candidates = [persistent.TritonPersistent(persistent.INTERPRETER_CONFIG),
                      tiled.TritonTiled(tiled.INTERPRETER_CONFIG)]
    else:
        dtype = args.A.dtype
        candidates = [*(persistent.TritonPersistent(c) for c in persistent.cuda_configs(dtype)),
                      *(pingpong.GluonPingPong(c) for c in pingpong.cuda_configs(dtype)),
                      *(pingpong.GluonCooperative(c) for c in pingpong.cooperative_configs(dtype)),
                      *(tiled.TritonTiled(c) for c in tiled.cuda_configs(dtype))]
        if persistent.b_fits_l2(args):
            candidates += [pingpong.GluonPingPong(c) for c in pingpong.row_order_configs(dtype)]
    split = splitk.candidates(args)
    candidates = [*split, *candidates] if splitk.ranks_first(args) else [*candidates, *split]
    if persistent.leaves_sms_idle(args):  # the 64-row ping-pong is the fastest where 128-row tiles leave SMs idle
        candidates = [*(pingpong.GluonPingPong(c) for c in pingpong.small_grid_configs(args.A.dtype)),
                      *candidates]
    return candidates


def _grouped_candidates(grouped_args) -> list:
    if tiled.uses_interpreter(grouped_args.device):
        return [grouped.TritonGrouped(tiled.INTERPRETER_CONFIG)]
    return [grouped.TritonGrouped(c) for c in tiled.CUDA_CONFIGS]


CHOSEN_KEPT = 4096  # kernel choices remembered (by argument signature), least recently used dropped
_CHOSEN: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def choose_kernel(args: GemmArguments):
    """The kernel `epifuse.gemm` runs for `args`: the tuned best of the supported ones."""
    key = args.signature
    with _LOCK:
        kernel = _CHOSEN.get(key)
        if kernel is not None:
            _CHOSEN.move_to_end(key)
            return kernel
    kernels = get_kernels(args)
    if not kernels:
        raise UnsupportedError("No kernel supports these arguments.")
    kernel = tune.choose(args, kernels)
    with _LOCK:
        _CHOSEN[key] = kernel
        while len(_CHOSEN) > CHOSEN_KEPT:
            _CHOSEN.popitem(last=False)
    return kernel
