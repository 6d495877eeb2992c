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

import torch

from ..arguments import GemmArguments
from ..grouped_arguments import GroupedGemmArguments
from ..errors import EpilogueArgumentError, UnsupportedError
from ..ir import fed_reductions
from ..runtime import ahead, compiled, tune
from .base import remember_supported
from .reference import GroupedReference, ReferenceKernel
from .triton import configs
from .triton import device as target
from .triton.families import COOPERATIVE, GATED, PERSISTENT, PINGPONG, PLANAR, SPLIT_K, TILED
from .triton.grouped import GROUPED
from .triton.kernels import TritonKernel, interpreter_config

# K from which split-K comes first on a grid too small to fill the GPU: its split main loops
# then outweigh the fix-up that adds the partials
LONG_K = 2048


def kernel_statuses(args, cc: int | None = None) -> list:
    """(kernel, Status) for every kernel class and config, supported or not, best first.
    `args` is a GemmArguments or a GroupedGemmArguments."""
    if not isinstance(args, (GemmArguments, GroupedGemmArguments)):
        raise EpilogueArgumentError(f"Kernels are chosen for a GemmArguments; got {type(args).__name__}.",
                                    hint="epifuse.get_kernels(epifuse.GemmArguments(A, B, epilogue=epi)).")
    if cc is not None and (not isinstance(cc, int) or isinstance(cc, bool) or cc <= 0):
        raise EpilogueArgumentError(f"cc must be a compute capability as an int such as 90, not {cc!r}.")
    if isinstance(args, GroupedGemmArguments):
        kernels, reference = grouped_candidates(args), GroupedReference()
    else:
        kernels, reference = candidates(args), ReferenceKernel()
    statuses = [*((k, k.supports(args, cc)) for k in kernels), (reference, reference.supports(args))]
    if cc is None:  # asked for this machine's GPU
        remember_supported(args, (k for k, status in statuses if status.ok))
    return statuses


def get_kernels(args, cc: int | None = None) -> list:
    """Every kernel that supports `args`, best first (the reference kernel last)."""
    return [k for k, status in kernel_statuses(args, cc) if status.ok]


def candidates(args) -> list:
    """The kernels tried for one GEMM, in the untimed order: on a GPU the persistent TMA kernels,
    the Gluon ping-pong and cooperative ones, the tiled ones, the two-rows-deep ping-pong where
    all of B fits in a quarter of L2; split-K last, or first where the usual tiles leave SMs
    idle and K is long; and there the 64-row ping-pong before all, elsewhere after all."""
    dtype = args.A.dtype
    if args.form != "real":   # two accumulators: the planar complex or the gated kernel
        family = PLANAR if args.planar else GATED
        if target.uses_interpreter(args.A.device):
            return [TritonKernel(family, configs.INTERPRETER)]
        return [TritonKernel(family, c) for c in configs.by_dtype(dtype, configs.TWO_ACCUMULATORS,
                                                                  configs.TWO_ACCUMULATORS_BYTES,
                                                                  configs.TWO_ACCUMULATORS_FP32)]
    cooperative = () if dtype == torch.int8 else configs.by_dtype(dtype, configs.COOPERATIVE, configs.COOPERATIVE_BYTES)
    if target.uses_interpreter(args.A.device):
        return [TritonKernel(PERSISTENT, interpreter_config(configs.INTERPRETER, args)),
                TritonKernel(TILED, interpreter_config(configs.INTERPRETER, args)),
                TritonKernel(SPLIT_K, interpreter_config(configs.INTERPRETER_SPLIT_K, args))]
    # where a reduction over N feeds later math, tiles no wider than the row (those narrower
    # than it stay listed, refused: families.in_tile_check)
    fitted = _fitted(args)
    candidates = [*(TritonKernel(PERSISTENT, c) for c in configs.by_dtype(dtype, configs.PERSISTENT,
                                                                          configs.PERSISTENT_BYTES,
                                                                          configs.PERSISTENT_FP32)),
                  *(TritonKernel(PINGPONG, c) for c in configs.by_dtype(dtype, configs.PINGPONG,
                                                                        configs.PINGPONG_BYTES)),
                  *(TritonKernel(COOPERATIVE, c) for c in cooperative),
                  *(TritonKernel(TILED, c) for c in fitted(configs.by_dtype(dtype, configs.TILED, configs.TILED_BYTES)))]
    if target.b_fits_l2(args) and dtype.itemsize == 2:
        candidates += [TritonKernel(PINGPONG, c) for c in configs.ROW_ORDER]
    split = [TritonKernel(SPLIT_K, c)
             for c in fitted(configs.by_dtype(dtype, configs.SPLIT_K, configs.SPLIT_K_BYTES))]
    candidates = [*split, *candidates] if split_k_first(args) else [*candidates, *split]
    small_grid = [TritonKernel(PINGPONG, c) for c in configs.by_dtype(dtype, configs.SMALL_GRID, configs.SMALL_GRID_BYTES)]
    if target.leaves_sms_idle(args):
        return [*small_grid, *candidates]
    # last elsewhere: each consumer holds half the unrolled epilogue of the 128-row kernel's,
    # which heavy epilogues of the compile backend time (tune.choose)
    return [*candidates, *small_grid]


def _fitted(args):
    """configs -> the same configs, each with tiles narrowed to a row of N where a reduction
    over N feeds later math (duplicates dropped); else unchanged."""
    if not fed_reductions(args.graph):
        return tuple
    return lambda found: tuple(dict.fromkeys(configs.spanning(c, args.N, c.block_n) for c in found))


def split_k_first(args, sms: int | None = None) -> bool:
    """Whether the untimed order puts split-K first (on a GPU of `sms` SMs, default args'):
    where the usual 128x128 tiles leave SMs idle and K is long."""
    sms = sms if sms is not None else target.gpu_sms(args)
    return sms is not None and target.few_tiles(args, sms) and args.K >= LONG_K


def grouped_candidates(grouped_args) -> list:
    if target.uses_interpreter(grouped_args.device):
        return [TritonKernel(GROUPED, configs.INTERPRETER)]
    return [TritonKernel(GROUPED, c) for c in configs.TILED]


def which_kernel(args, kernel=None) -> str:
    """Which kernel runs `args` and how, in words: `kernel` if given, else the one `epifuse.gemm`
    runs for arguments like these (choose_kernel: tuned on a GPU; for grouped arguments, the
    first of get_kernels). One line, such as

        fused Triton kernel triton_tiled 32x32x32 group 2, 1 warps, 1 stages (Triton's interpreter)
        reference kernel (torch matmul, then the epilogue in torch ops; not fused), since CPU
        tensors run Triton kernels only under its interpreter: set TRITON_INTERPRET=1 (slow; for
        testing)
    """
    grouped = isinstance(args, GroupedGemmArguments)
    if kernel is None:
        kernel = get_kernels(args)[0] if grouped else choose_kernel(args)
    if isinstance(kernel, TritonKernel):
        device = args.device if grouped else args.A.device
        where = ("Triton's interpreter" if target.uses_interpreter(device)
                 else f"compiled for {torch.cuda.get_device_name(device)}")
        return f"fused {'Gluon' if kernel.gluon else 'Triton'} kernel {kernel.name} {kernel.config} ({where})"
    if isinstance(kernel, (ReferenceKernel, GroupedReference)):
        text = ("reference kernel (torch matmul, then the epilogue in torch ops"
                + (", one group after another" if grouped else "") + "; not fused)")
        others = [status for k, status in kernel_statuses(args) if k.name != kernel.name]
        if others and not any(others):   # why no generated kernel runs them
            text += f", since {others[0].reason}"
        return text
    return repr(kernel)


CHOSEN_KEPT = 4096  # kernel choices remembered (by argument signature), least recently used dropped
_CHOSEN: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def _forget_choices() -> None:
    """Background tuning remembered a winner: later calls choose again (and find it)."""
    with _LOCK:
        _CHOSEN.clear()


tune.LISTENERS.append(_forget_choices)


def kernels_to_compile(args: GemmArguments, time_heavy: bool = False) -> list:
    """The kernels a first call of `args` would compile (tune.to_compile): the one it would
    run, or those it would time; nothing is timed or remembered."""
    kernels = get_kernels(args)
    return tune.to_compile(args, kernels, time_heavy) if kernels else []


def choose_kernel(args: GemmArguments, time_heavy: bool = False):
    """The kernel `epifuse.gemm` runs for `args`: of the supported ones, the one the tuning
    policy picks (runtime/tune.py; `time_heavy` as tune.choose takes it)."""
    key = args.signature
    with _LOCK:
        kernel = _CHOSEN.get(key)
        if kernel is not None:
            _CHOSEN.move_to_end(key)
    if kernel is not None:  # chosen for arguments of this signature, which decides support
        remember_supported(args, (kernel,))
        return kernel
    generation = tune.generation()
    if ahead.compiles_on(args.A.device):
        compiled.set_up_soon()   # Triton's one-time set-up, while this thread chooses and plans
    kernels = get_kernels(args)
    if not kernels:
        raise UnsupportedError("No kernel supports these arguments.")
    kernel = tune.choose(args, kernels, time_heavy=True) if time_heavy else tune.choose(args, kernels)
    with _LOCK:
        # kept only if no background winner was remembered meanwhile: its listeners may have
        # dropped the choices already, and this one would then outlive the winner
        if tune.generation() == generation:
            _CHOSEN[key] = kernel
            while len(_CHOSEN) > CHOSEN_KEPT:
                _CHOSEN.popitem(last=False)
    return kernel
