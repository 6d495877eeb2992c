"""The later passes of a staged epilogue (staging.py) compiled while its first pass runs.

An epilogue whose reductions feed later math over a row that spans tiles runs as several
GEMMs, one after another (api._gemm_in_passes); a cold call would compile each pass's kernel
only when that pass is reached, so the compiles add up. Every pass's problem is known before
the first runs: the same A and B, the user's tensors, and statistics whose shapes and dtypes
the program decides. `queue` has a worker of runtime/ahead.py plan the later passes from
stand-ins (stand_in.py: metadata without memory; nothing is allocated or launched) exactly as
the passes' epifuse.gemm calls will make them, and has the pool compile their kernels while
the caller's thread compiles and runs the first pass; before the second pass the caller waits
for that job (`settle`) rather than compile the same kernel beside it. Nothing is queued on
the CPU, under Triton's interpreter, while a CUDA graph is captured, or with
EPIFUSE_COMPILE_AHEAD=0; a later call of the same layout queues nothing more (it pays for
building the job's key: its tensors' layouts, about 5 us on the CPU machine).
"""
from __future__ import annotations

import torch

from . import unsigned_inputs
from .allocation import allocate_outputs
from .arguments import EpilogueArguments, GemmArguments
from .backends.select import kernels_to_compile
from .backends.triton import device as target
from .program import Program
from .runtime import ahead, callsite
from .staging import Pass, pass_inputs, statistics
from .stand_in import layout, stand_in, stand_ins


def queue(program: Program, steps: tuple[Pass, ...], A, B, tensors: dict, options: dict, accum_shape: tuple):
    """Queue the compile of the passes after the first (see the module's docstring); the job's
    key, or None where nothing was queued. `tensors`, `options` and `accum_shape` are what
    _gemm_in_passes has (tensors and numbers by name; out_dtype, deterministic, compute_dtype
    and precision; accum's shape as the program sees it). Unsigned inputs are left out: each
    pass rewrites them as an int8 GEMM of its own (unsigned_inputs.py); so are calls that
    autograd records, whose passes go through the custom ops (torch_ops.py: their own outputs)."""
    if len(steps) < 2 or not ahead.compiles_on(A.device) or target.capturing(A.device) or \
            unsigned_inputs.applies(A, B):
        return None
    given = {name: v for name, v in tensors.items() if isinstance(v, torch.Tensor)}
    numbers = {name: v for name, v in tensors.items() if name not in given}
    grad = torch.is_grad_enabled()
    if any(type(t) not in callsite.PLAIN_TENSOR_TYPES or (grad and t.requires_grad) for t in (A, B, *given.values())):
        return None
    layouts = {name: layout(t) for name, t in given.items()}
    A_layout, B_layout = layout(A), layout(B)
    # a float by its bits: a NaN equals itself, and -0.0 is not 0.0
    key = ("passes", program.source, A_layout, B_layout, tuple(layouts.items()),
           tuple((name, type(v), v.hex() if type(v) is float else v) for name, v in numbers.items()),
           tuple(options.items()))
    try:
        ahead.soon(key, lambda: compile_later_passes(steps, A_layout, B_layout, layouts, numbers, options,
                                                     accum_shape))
    except TypeError:   # an option that does not hash: the pass's own call names it
        return None
    return key


def settle(key) -> None:
    """Before the second pass: wait for the job queued under `key` (None: nothing was queued)."""
    if key is not None:
        ahead.settle(key)


def compile_later_passes(steps, A_layout, B_layout, layouts: dict, numbers: dict, options: dict,
                         accum_shape: tuple) -> list:
    """Plan the passes after the first from stand-ins (plan_later_passes), then compile all
    their kernels at once in the pool; (args, kernel) of each kernel compiled. A compile that
    fails is recorded (ahead.FAILURES), never raised: the pass's real call compiles it again
    and raises there if it must."""
    return ahead.compile_planned(plan_later_passes(steps, A_layout, B_layout, layouts, numbers, options,
                                                   accum_shape))


def plan_later_passes(steps, A_layout, B_layout, layouts: dict, numbers: dict, options: dict,
                      accum_shape: tuple) -> list:
    """The arguments of each pass after the first, built from stand-ins as epifuse.gemm builds
    the pass's (its outputs allocated as gemm allocates them, the statistics of the passes
    before it as _gemm_in_passes reshapes them), with the kernels its first call would compile
    (select.kernels_to_compile) and each one's compile job: [(args, kernel, job or None)]."""
    device = A_layout[4]
    planned = []
    with stand_ins(), torch.no_grad(), target.on_device(device):
        A, B = stand_in(*A_layout), stand_in(*B_layout)
        tensors = {**{name: stand_in(*spec) for name, spec in layouts.items()}, **numbers}
        stats: dict = {}
        for i, step in enumerate(steps):
            given = pass_inputs(step, tensors, stats)
            full = allocate_outputs(step.program, A, B, given, options["out_dtype"], options["compute_dtype"])
            if i:
                epi = EpilogueArguments(step.program, deterministic=options["deterministic"],
                                        compute_dtype=options["compute_dtype"], **full)
                args = GemmArguments(A, B, epilogue=epi, precision=options["precision"])
                ahead.plan_compiles(args, kernels_to_compile(args), planned)
            stats.update(statistics(step, {name: full[name] for name, _ in step.program.outputs}, accum_shape))
    return planned

