"""A training step's backward kernels compiled while its forward runs (runtime/ahead.py). A
forward through the custom ops that records autograd asks for it (`request`, from
torch_ops.gemm); the op's first call of that layout queues a job (`queue_backward`) whose worker
plans the backward's calls from stand-ins (stand_in.py: no memory, nothing launched), exactly as
op_backward.Step would make them, and has the pool compile their kernels; the backward waits
for that job (`settle`) only where it will use what was compiled."""
from __future__ import annotations

import threading

import torch
from torch import Tensor

from .arguments import EpilogueArguments, GemmArguments
from .backends.select import kernels_to_compile
from .backends.triton import device as target
from .epilogue_table import _TIME_HEAVY, resolve
from .op_backward import Step, backward_plan, differentiated
from .op_planning import bind_operands, planned_outputs, unpack
from .runtime import ahead, callsite
from .stand_in import empty as empty_stand_in
from .stand_in import layout, stand_in, stand_ins


def ahead_key(epilogue, A, B, tensors, numbers, kinds, out_dtypes, options, needs) -> tuple:
    """What decides the backward's problems of a forward call: the forward's epilogue, its
    tensors' layouts, numbers and options, and which inputs need grad."""
    return ("backward", epilogue, tuple(layout(t) for t in (A, B, *tensors)), tuple(numbers), kinds,
            out_dtypes, tuple(options), tuple(needs[:2]) + (tuple(needs[2]),))


_REQUEST = threading.local()   # .call: the forward's request, taken by its op's first call (torch_ops._run);
                               # .queued: the key that call queued, taken by torch_ops._setup_context


def compiles_ahead(A: Tensor) -> bool:
    """Whether a forward on A's device has its backward's kernels compiled ahead: on a GPU, not
    under the interpreter (which compiles nothing), unless EPIFUSE_COMPILE_AHEAD=0."""
    return ahead.compiles_on(A.device)


def request(*call) -> None:
    """torch_ops.gemm, before a forward that records autograd: the op's first call (torch_ops._run) queues the backward's
    compile (queue_backward(*call)) only where the forward itself is not a kept launch,
    that is, the first call of its layout; later steps pay nothing for it."""
    _REQUEST.call = call


def take_request():
    call = getattr(_REQUEST, "call", None)
    if call is not None:
        _REQUEST.call = None
    return call


def queue_requested(call) -> None:
    """The op's first call of a layout whose forward made a request: queue the backward's job
    (queue_backward) and keep its key for the autograd context (take_queued_key)."""
    _REQUEST.queued = queue_backward(*call)


def clear_request() -> None:
    """torch_ops.gemm, once its op has returned or raised: no request or queued key outlives the call."""
    _REQUEST.call = _REQUEST.queued = None


def take_queued_key():
    """The key of the job torch_ops._run queued for the forward whose autograd context is being set up
    (the same thread, right after it), kept on the context: the backward settles on that key,
    not on one rebuilt from its saved tensors, which saved-tensor hooks may lay out anew."""
    key = getattr(_REQUEST, "queued", None)
    if key is not None:
        _REQUEST.queued = None
    return key


def queue_backward(epilogue, A, B, tensors, numbers, kinds, out_dtypes, options, needs):
    """Have a worker compile the kernels this forward call's backward will run, as they are
    once every visible floating-point output receives a contiguous gradient (a backward seeded
    otherwise compiles its own at its first call), while this thread runs the forward. Plain
    tensors only: a DTensor's local problems differ from its global layout. Returns the job's
    key, or None where nothing was queued."""
    if any(type(t) not in callsite.PLAIN_TENSOR_TYPES for t in (A, B, *tensors)):
        return None
    key = ahead_key(epilogue, A, B, tensors, numbers, kinds, out_dtypes, options, needs)
    layouts = [layout(t) for t in (A, B, *tensors)]
    ahead.soon(key, lambda: backward_from_stand_ins(epilogue, layouts, list(numbers), kinds, out_dtypes,
                                                     options, needs))
    return key


def settle(ctx, grads, seeded) -> None:
    """Before a backward compiles: wait for the job its forward queued (ctx.ahead_key), if it
    is the one planned (every visible floating-point output seeded, with contiguous gradients),
    rather than compile the same kernels a second time beside it. Not while torch.compile traces."""
    if seeded != ctx.float_visible or torch.compiler.is_compiling() or \
            any(g is not None and not g.is_contiguous() for g in grads):
        return
    ahead.settle(ctx.ahead_key)


def backward_from_stand_ins(epilogue, layouts, numbers, kinds, out_dtypes, options, needs,
                            launch=None) -> list:
    """Plan and compile the kernels of the backward of a forward call given by its tensors'
    layouts (A, B, then the tensor operands), from stand-ins (stand_in.py): what torch_ops._backward would run
    once every visible floating-point output has a gradient. Every call is planned first, in
    this thread; then all their kernels compile at once in runtime/ahead.py's pool, and this
    returns when they have. `launch` (tests) replaces the planning and compile of each call.
    Returns (GemmArguments of stand-ins, kernel) for each kernel compiled, in call order."""
    e = resolve(epilogue)
    device = layouts[0][4]
    planned: list = []
    compile_call = launch or (lambda *call: compile_only(*call, planned=planned))
    with stand_ins(), torch.no_grad(), torch.autocast(device.type, enabled=False), target.on_device(device):
        A, B, *tensors = [stand_in(*layout) for layout in layouts]
        forward_values = unpack(e.program.operands, tensors, numbers, kinds)
        specs, _ = planned_outputs(epilogue, e, A, B, forward_values, out_dtypes, options[0])
        outputs = [empty_stand_in(shape, dtype, device) for shape, dtype in specs]
        up = outputs[-1] if e.saved == 2 else None
        accum = outputs[-e.saved] if e.saved else None
        _, graph, accum_shape, values, roles = bind_operands(e.user, A, B, unpack(e.user.operands, tensors, numbers, kinds))
        _, _, wrt = differentiated(e, kinds, needs)
        seeded = tuple(name for name, (_, dtype) in zip(e.output_names[:e.visible], specs) if dtype.is_floating_point)
        if not wrt or not seeded:
            return []
        plan = backward_plan(epilogue, roles, len(accum_shape), wrt, seeded)
        grads = {name: outputs[k] for k, name in enumerate(e.output_names) if name in seeded}
        Step(options, graph, accum_shape, values, accum, A, B, up, launch=compile_call).run(plan, grads)
    return ahead.compile_planned(planned)


def compile_only(epilogue, A, B, program, values, out_dtypes, options, planned: list) -> list:
    """A backward call as torch_ops._run makes it, planned from stand-ins: its kernel chosen (where that
    needs no timing) and planned, and its compile appended to `planned` as (args, kernel, job),
    job None where nothing is left to compile; nothing launched. Its outputs are stand-ins too."""
    compute_dtype, deterministic, precision = options
    specs, names = planned_outputs(epilogue, resolve(epilogue), A, B, values, out_dtypes, compute_dtype)
    outs = [empty_stand_in(shape, dtype, A.device) for shape, dtype in specs]
    epi = EpilogueArguments(program, deterministic=deterministic, compute_dtype=compute_dtype,
                            **values, **dict(zip(names, outs)))
    args = GemmArguments(A, B, epilogue=epi, precision=precision)
    ahead.plan_compiles(args, kernels_to_compile(args, time_heavy=epilogue in _TIME_HEAVY), planned)
    return outs
