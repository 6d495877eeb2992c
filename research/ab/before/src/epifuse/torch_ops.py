"""epifuse GEMMs as PyTorch operators: torch.library custom ops, fake impls, autograd.

Two operators, generic over epilogues:

    epifuse::gemm(str epilogue, Tensor A, Tensor B, Tensor[] tensors, float[] numbers,
                  str kinds, str out_dtypes, ScalarType compute_dtype, bool deterministic,
                  str precision) -> Tensor[]                        allocates its outputs
    epifuse::gemm_out(str epilogue, Tensor A, Tensor B, Tensor[] tensors, float[] numbers,
                      str kinds, Tensor(a!)[] outputs, ScalarType compute_dtype,
                      bool accumulate, bool deterministic, str precision) -> ()

The operators exist once this module loads, which `import epifuse` does: a saved graph or an
exported program naming them loads after `import epifuse`.

`epilogue` is the epilogue's key (epilogue_table.py: `Entry.key`), readable in any process.

`kinds` has one letter per operand of the epilogue, in order: "t" takes the next of `tensors`,
"n" the next of `numbers` (a plain tensor list, so autograd sees every tensor operand).
`out_dtypes`: "" (the defaults of `epifuse.gemm`: tiles in A's dtype, reductions in float32,
or float64 when computing in float64), "tiles=float16" (the caller's tile outputs), or one
name per output ("bfloat16,,float32"; empty for a default).

The fake impls give every output's shape and dtype from the epilogue and the input shapes
alone, so FakeTensorMode and torch.compile(fullgraph=True) trace without running anything.
The launch path allocates its outputs with torch (a CUDA graph's private pool when
capturing) and never synchronizes with the host, so captured calls replay correctly.

Autograd (`epifuse::gemm` only; see docs/autograd.md): the backward is derived from the graph
(`epifuse.autodiff`) and is itself an epilogue run by the same kernels, followed by two torch
matmuls for dA and dB. By default the forward also stores accum (the epilogue gets one extra
output, dropped before the caller sees it) and the backward reads it; `recompute=True` keeps
no accum and the backward kernel recomputes A @ B instead. The backward's epilogue runs through
the same op, so it is differentiable in turn (create_graph=True, gradgradcheck): the saved
accum is an output of the forward, and the gradient it receives is accum's.

>>> import torch, epifuse
>>> from epifuse import torch_ops
>>> A = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
>>> B = torch.randn(3, 5, dtype=torch.float64)
>>> bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
>>> D = torch_ops.gemm(A, B, "def e(accum, bias):\\n    D = relu(accum + bias)\\n    return D\\n",
...                    bias=bias, compute_dtype=torch.float64)
>>> D.sum().backward()
>>> torch.allclose(bias.grad, ((A @ B + bias) > 0).double().sum(0).detach())
True
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import Tensor

from . import backward_ahead, sharding
from .arguments import EpilogueArguments, GemmArguments, check_keywords, default_compute_dtype
from .backends.select import choose_kernel
from .epilogue_table import _TIME_HEAVY, Entry, _describe, entry, read_key, register_epilogue, resolve
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError
from .op_backward import Step, backward_plan, differentiated
from .op_planning import bind_operands, op_output_specs, pack, planned_outputs, unpack
from .ops import dtype_name
from .runtime import ahead, callsite, tune
from .shapes import check_tensor


def _run(key, program, A, B, values, outputs, compute_dtype, deterministic, precision, accumulate):
    """Write `outputs` of the program registered as `key`. A repeated call (the same key,
    options, and tensors of the same metadata: runtime/callsite.py) takes the launch kept from
    the first one, as a repeated epifuse.gemm does: a training step calls each op once per
    layer and step, and building the arguments, the plan and Triton's first launch again costs
    a millisecond of host time, as long as the GEMM itself at a rank's share of a large layer."""
    tensors = {**values, **outputs}
    backward_request = backward_ahead.take_request()
    call = callsite.signature(key, A, B, tensors, ("op", compute_dtype, deterministic, precision, accumulate))
    site = callsite.lookup(call)
    if site is not None:
        if backward_request is not None and not site.backward_queued:   # kept by a call without grad
            backward_ahead.queue_requested(backward_request)
            site.backward_queued = True
        site.call(A, B, tensors)
        return
    if backward_request is not None:   # the first call of this layout: its backward compiles meanwhile
        backward_ahead.queue_requested(backward_request)
    with torch.autocast(A.device.type, enabled=False):  # the epilogue owns its dtypes
        epi = EpilogueArguments(program, accumulate=accumulate, deterministic=deterministic,
                                compute_dtype=compute_dtype, **values, **outputs)
        args = GemmArguments(A, B, epilogue=epi, precision=precision)
        chosen_in = tune.generation()
        kernel = choose_kernel(args, time_heavy=True) if key in _TIME_HEAVY else choose_kernel(args)
        kernel.run(args)
    if tune.generation() == chosen_in:   # else a background winner landed meanwhile: keep nothing stale
        site = callsite.remember(call, args, kernel, (), tuple(outputs))
        if site is not None and backward_request is not None:
            site.backward_queued = True


# ---- the operators ----------------------------------------------------------------------------

@torch.library.custom_op("epifuse::gemm", mutates_args=())
def _gemm(epilogue: str, A: Tensor, B: Tensor, tensors: list[Tensor], numbers: list[float],
          kinds: str, out_dtypes: str, compute_dtype: torch.dtype, deterministic: bool,
          precision: str) -> list[Tensor]:
    e = resolve(epilogue)
    values = unpack(e.program.operands, tensors, numbers, kinds)
    specs, names = planned_outputs(epilogue, e, A, B, values, out_dtypes, compute_dtype)
    outs = [torch.empty(shape, dtype=dtype, device=A.device) for shape, dtype in specs]
    _run(epilogue, e.program, A, B, values, dict(zip(names, outs)), compute_dtype, deterministic,
         precision, False)
    return outs


@_gemm.register_fake
def _gemm_fake(epilogue, A, B, tensors, numbers, kinds, out_dtypes, compute_dtype, deterministic,
               precision):
    e = resolve(epilogue)
    _, graph, accum_shape, _, _ = bind_operands(e.program, A, B, unpack(e.program.operands, tensors,
                                                               numbers, kinds))
    return [A.new_empty(shape, dtype=dtype)
            for shape, dtype in op_output_specs(e, graph, accum_shape, A, out_dtypes, compute_dtype)]


@torch.library.custom_op("epifuse::gemm_out", mutates_args=("outputs",))
def _gemm_out(epilogue: str, A: Tensor, B: Tensor, tensors: list[Tensor], numbers: list[float],
              kinds: str, outputs: list[Tensor], compute_dtype: torch.dtype, accumulate: bool,
              deterministic: bool, precision: str) -> None:
    e = resolve(epilogue)
    program = e.program
    values = unpack(program.operands, tensors, numbers, kinds)
    named = dict(zip(e.output_names, outputs))
    _run(epilogue, program, A, B, values, named, compute_dtype, deterministic, precision, accumulate)


@_gemm_out.register_fake
def _gemm_out_fake(epilogue, A, B, tensors, numbers, kinds, outputs, compute_dtype, accumulate,
                   deterministic, precision):
    e = resolve(epilogue)
    bind_operands(e.program, A, B, unpack(e.program.operands, tensors, numbers, kinds))
    for name, t in zip(e.output_names, outputs):
        check_tensor(f"Output {name}", t)
    return None


# ---- autograd: the backward (op_backward.py), its kernels compiled ahead (backward_ahead.py) ---

def _setup_context(ctx, inputs, output):
    epilogue, A, B, tensors, numbers, kinds, out_dtypes, compute_dtype, deterministic, precision = inputs
    e = resolve(epilogue)
    ctx.epilogue, ctx.numbers, ctx.kinds, ctx.out_dtypes = epilogue, list(numbers), kinds, out_dtypes
    # the job compiling this call's backward ahead, if its forward queued one (_run), and the
    # outputs it expects gradients for (backward_ahead.backward_from_stand_ins)
    ctx.ahead_key = backward_ahead.take_queued_key()
    ctx.float_visible = tuple(name for name, o in zip(e.output_names[:e.visible], output) if o.is_floating_point())
    ctx.options = (compute_dtype, deterministic, precision)
    ctx.needs = (A.requires_grad, B.requires_grad, tuple(t.requires_grad for t in tensors))
    saved = [A, B, *tensors]
    if e.saved:
        saved.extend(output[-e.saved:])
    ctx.save_for_backward(*saved)
    ctx.set_materialize_grads(False)   # unused outputs stay None: their gradients are not read


def _backward(ctx, grads):
    e = resolve(ctx.epilogue)
    A, B, *tensors = ctx.saved_tensors
    up = tensors.pop() if e.saved == 2 else None
    accum = tensors.pop() if e.saved else None
    user = e.user
    values = unpack(user.operands, tensors, ctx.numbers, ctx.kinds)
    _, graph, accum_shape, values, roles = bind_operands(user, A, B, values)
    need_a, need_b, need_ops = ctx.needs
    tensor_names, accumulators, wrt = differentiated(e, ctx.kinds, ctx.needs)
    seeded = tuple(name for name, g in zip(e.output_names[:e.visible], grads) if g is not None)
    if ctx.ahead_key is not None and ahead.pending():
        backward_ahead.settle(ctx, grads[:e.visible], seeded)
    # The saved accum is an output too: differentiating the backward (create_graph=True) sends
    # it a gradient, which is accum's own (saved_accum = accum; a gated one's saved_up = accum_up).
    saved_grads = dict(zip(accumulators, grads[len(grads) - e.saved:])) if e.saved else {}
    saved_grads = {name: g for name, g in saved_grads.items() if g is not None}
    result_ops = [None] * len(tensors)
    # The structure must mirror the inputs': an empty float list reads as an empty tensor list.
    no_numbers = [] if not ctx.numbers else None
    if not wrt or not (seeded or (saved_grads and "accum" in wrt)):
        return (None, None, None, result_ops, no_numbers) + (None,) * 5
    step = Step(ctx.options, graph, accum_shape, values, accum, A, B, up)
    plan, results = None, {}
    if seeded:
        plan = backward_plan(ctx.epilogue, roles, len(accum_shape), wrt, seeded)
        results = step.run(plan, dict(zip(e.output_names, grads)))
    grad_a = grad_b = None
    if "accum" in wrt:
        halves = []
        for name in accumulators:   # a gated GEMM's accum is [gate | up] along B's columns
            d = results.get(plan.grads[name]) if plan is not None and plan.grads[name] is not None else None
            saved_grad = saved_grads.get(name)
            if saved_grad is not None:
                d = saved_grad if d is None else d + saved_grad.to(d.dtype)
            halves.append(d)
        dtype = next((d.dtype for d in halves if d is not None), step.accum_dtype)
        halves = [torch.zeros(accum_shape, dtype=dtype, device=A.device) if d is None else d.to(dtype)
                  for d in halves]
        d_accum = halves[0] if len(halves) == 1 else torch.cat(halves, dim=-1)
        if need_a:
            grad_a = torch.matmul(d_accum, B.mT.to(d_accum.dtype)).sum_to_size(A.shape).to(A.dtype)
        if need_b:
            grad_b = torch.matmul(A.mT.to(d_accum.dtype), d_accum).sum_to_size(B.shape).to(B.dtype)
    for i, (name, need) in enumerate(zip(tensor_names, need_ops)):
        if need:
            t, out_name = values[name], plan.grads[name] if plan is not None else None
            grad = torch.zeros_like(t) if out_name is None else results[out_name].reshape(t.shape)
            result_ops[i] = grad.to(t.dtype)
    return (None, grad_a, grad_b, result_ops, no_numbers) + (None,) * 5


torch.library.register_autograd("epifuse::gemm", _backward, setup_context=_setup_context)


def _dynamo_disabled_once_imported(op) -> None:
    """torch.library.custom_op runs an op's implementation through torch._disable_dynamo, which
    imports torch._dynamo (with sympy and torch.distributed: 1-3 s, most of a first training
    step whose kernels are cached) on the op's first call, so that dynamo never traces into the
    implementation. Dynamo traces only once imported: until then the implementation runs as it
    is, and from then on through torch._dynamo.disable as torch runs it. The hook is the
    attribute torch's wrapper reads (`__dynamo_disable` on the function it wraps); a torch whose
    custom ops are built otherwise is left as it is (tests/unit/test_startup.py checks both)."""
    for wrapper in getattr(op, "_backend_fns", {}).values():
        fn = getattr(wrapper, "__wrapped__", None)
        if not callable(fn) or getattr(fn, "__dynamo_disable", None) is not None:
            continue
        disabled: list = []

        def run(*args, _fn=fn, _disabled=disabled, **kwargs):
            dynamo = sys.modules.get("torch._dynamo")
            if not _disabled and getattr(dynamo, "disable", None) is None:
                # not imported, or still being imported by another thread (its module is in
                # sys.modules before it has `disable`): dynamo traces nothing until it has finished
                return _fn(*args, **kwargs)
            if not _disabled:
                try:
                    _disabled.append(dynamo.disable(_fn, True, wrapping=False))
                except TypeError:   # a torch whose disable takes no `wrapping`
                    _disabled.append(dynamo.disable(_fn, True))
            return _disabled[0](*args, **kwargs)
        setattr(fn, "__dynamo_disable", run)


_dynamo_disabled_once_imported(_gemm)
_dynamo_disabled_once_imported(_gemm_out)


# ---- DTensors ------------------------------------------------------------------------------------

def _dtensor_rules(op: str, key: str, A, B, operands: list, kinds: str, outputs) -> None:
    """Where a DTensor reaches the op: its sharding rules registered with DTensor's dispatch
    (once; epifuse.sharding) and the placements checked against the epilogue before DTensor
    dispatches, so a refusal is epifuse's own error. Nothing while torch.compile traces."""
    if torch.compiler.is_compiling() or not sharding.any_dtensor(A, B, *operands, *outputs):
        return
    sharding.register(resolve)
    sharding.check(op, resolve(key).program, kinds, A, B, operands, list(outputs))


if sharding.distributed_tensor_loaded():   # already imported: registering costs nothing
    sharding.register(resolve)


# ---- the Python entry points --------------------------------------------------------------------

def _check_tensors(A, B, tensors: dict, outputs) -> None:
    """shapes.check_tensor on A, B and every tensor keyword (an operand, or one of `outputs`),
    labelled as epifuse.gemm labels them, before autograd or the op's dispatch reads any of them:
    torch's own handling there is no answer for the layouts kernels cannot take (a jagged nested
    tensor fails deep in its dispatch, a negative or conjugate bit is resolved on inputs but not
    on outputs). Stand-ins (fake tensors while torch.compile traces, meta tensors) have no
    storage to check, which check_tensor knows."""
    for label, t in (("A", A), ("B", B)):
        if not isinstance(t, Tensor):
            raise ShapeError(f"{label} must be a torch.Tensor, but got {type(t).__name__}.")
        check_tensor(label, t)
    for name, value in tensors.items():
        if isinstance(value, Tensor):
            check_tensor(f"Output {name}" if name in outputs else f"Operand {name}", value)


def gemm(A: Tensor, B: Tensor, epilogue: Callable | str | None = None, *,
         out_dtype: torch.dtype | None = None, accumulate: bool = False,
         deterministic: bool = False, compute_dtype: torch.dtype | None = None,
         precision: str = "default", recompute: bool = False, **tensors):
    """`epifuse.gemm` through the custom ops: differentiable and traceable by torch.compile.

    Outputs not passed are allocated (tile outputs in `out_dtype`, default A's dtype);
    outputs passed are written in place (no autograd through them, as torch's out=).
    `recompute=True`: the backward recomputes A @ B instead of reading a saved accum.
    `compute_dtype` defaults to the promoted dtype of A, B and the tensor operands
    (arguments.default_compute_dtype).
    """
    needing_grad = [name for name, t in (("A", A), ("B", B), *tensors.items())
                    if isinstance(t, Tensor) and t.requires_grad] if torch.is_grad_enabled() else []
    wants_grad = bool(needing_grad)
    save = wants_grad and not recompute
    key, operand_names, output_names, visible, gated, joined = _describe(epilogue, save)
    if joined is not None and wants_grad:
        raise UnsupportedError(
            f"Autograd through epifuse does not take cat of the gated halves yet ({joined} = cat((a, b), "
            f"dim=-1)), and {', '.join(needing_grad)} require{'s' if len(needing_grad) == 1 else ''} grad: "
            "its backward would split the gradient of the full-width output back into its halves.",
            hint="Call it under torch.no_grad() (inference), or return the two pieces as outputs and "
                 "torch.cat them after the call.")
    if gated and wants_grad and recompute:
        raise UnsupportedError(
            "recompute=True with a gated epilogue (gate, up = accum.chunk(2, dim=-1)): its backward reads "
            "both halves of accum, saved by the forward, and does not recompute them.",
            hint="Leave recompute off for gated epilogues.")
    if not torch.compiler.is_compiling():   # dynamo cannot trace is_neg(): the fake impls check then
        _check_tensors(A, B, tensors, output_names[:visible])
    allowed = (*operand_names, *output_names[:visible])
    if any(name not in tensors for name in operand_names) or any(name not in allowed for name in tensors):
        # plain membership tests while torch.compile traces; the full check only to raise
        check_keywords(resolve(key).program, tensors, required=operand_names, allowed=allowed)
    given = [name for name in output_names[:visible] if name in tensors]
    operands, numbers, kinds = pack(operand_names, tensors)
    if compute_dtype is None:
        compute_dtype = default_compute_dtype(A, B, *operands)
    if given:
        if wants_grad:
            raise EpilogueArgumentError(
                f"Outputs given as tensors ({', '.join(given)}) are written in place, and autograd "
                f"does not flow through them (as with torch's out=), but {', '.join(needing_grad)} "
                f"require{'s' if len(needing_grad) == 1 else ''} grad.",
                hint="Leave the outputs out to get differentiable ones, or call under torch.no_grad().")
        if len(given) != visible:
            raise EpilogueArgumentError("Pass either every output tensor or none of them.",
                                        hint=f"The epilogue's outputs are: {', '.join(output_names[:visible])}.")
        key, _, output_names, visible, _, _ = _describe(epilogue, False)
        outs = [tensors[n] for n in output_names]
        _dtensor_rules("epifuse::gemm_out", key, A, B, operands, kinds, outs)
        torch.ops.epifuse.gemm_out(key, A, B, operands, numbers, kinds, outs, compute_dtype,
                                   accumulate, deterministic, precision)
    else:
        if accumulate:
            raise EpilogueArgumentError("accumulate=True needs the output tensors to fold into.",
                                        hint="Pass them as keyword arguments (D=..., r=...).")
        dtypes = f"tiles={dtype_name(out_dtype)}" if out_dtype is not None else ""
        _dtensor_rules("epifuse::gemm", key, A, B, operands, kinds, ())
        if wants_grad and not torch.compiler.is_compiling() and backward_ahead.compiles_ahead(A):
            needs = (A.requires_grad, B.requires_grad, tuple(t.requires_grad for t in operands))
            backward_ahead.request(key, A, B, operands, numbers, kinds, dtypes,
                                    (compute_dtype, deterministic, precision), needs)
        try:
            outs = torch.ops.epifuse.gemm(key, A, B, operands, numbers, kinds, dtypes, compute_dtype,
                                          deterministic, precision)[:visible]
        finally:
            backward_ahead.clear_request()
    outs = tuple(outs)
    return outs[0] if len(outs) == 1 else outs


__all__ = ["gemm", "register_epilogue", "entry", "resolve", "read_key", "Entry"]
