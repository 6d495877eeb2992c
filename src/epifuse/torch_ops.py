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

import math
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import sharding
from .allocation import epilogue_accum_shape, output_specs, reduction_dtype
from .arguments import EpilogueArguments, GemmArguments, bound_graph, check_keywords, default_compute_dtype
from .autodiff import derive, restrict
from .backends.select import choose_kernel, kernels_to_compile
from .epilogue_table import _TIME_HEAVY, Entry, _describe, entry, read_key, register_epilogue, resolve
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError
from .frontend import Program
from .ir import AXES
from .ops import dtype_from_name, dtype_name
from .printing import FreshNames, graph_source
from .backends.triton import device as target
from .runtime import ahead, callsite, tune
from .shapes import check_tensor, classify_operand
from .stand_in import empty as empty_stand_in
from .stand_in import stand_in, stand_ins


# ---- planning: roles, bound graph, output shapes (shared by the real and the fake impls) -----

def pack(names, values: dict) -> tuple[list, list, str]:
    """Operands by name -> (tensors, numbers, kinds) as the ops take them."""
    tensors, numbers, kinds = [], [], ""
    for name in names:
        value = values[name]
        if isinstance(value, Tensor):
            tensors.append(value)
            kinds += "t"
        else:
            numbers.append(float(value))
            kinds += "n"
    return tensors, numbers, kinds


def unpack(names, tensors, numbers, kinds: str) -> dict:
    if len(kinds) != len(names) or kinds.count("t") != len(tensors) \
            or kinds.count("n") != len(numbers):
        raise EpilogueArgumentError(
            f"epifuse::gemm got operands {kinds!r} ({len(tensors)} tensors, {len(numbers)} "
            f"numbers) for {', '.join(names) or 'no operands'}.")
    t, n = iter(tensors), iter(numbers)
    return {name: next(t) if kind == "t" else next(n) for name, kind in zip(names, kinds)}


def _plan(program: Program, A: Tensor, B: Tensor, values: dict):
    accum_shape = epilogue_accum_shape(program, A, B)
    roles = tuple(classify_operand(name, values[name], accum_shape, A.device)[0]
                  for name in program.operands)
    graph, _ = bound_graph(program, roles, len(accum_shape))
    return program, graph, tuple(accum_shape), values, roles


def _output_specs(e: Entry, graph, accum_shape, A: Tensor, out_dtypes: str, compute_dtype) -> list:
    """(shape, dtype) of each output: epifuse.gemm's (allocation.output_specs), or as `out_dtypes`
    says: "" (those), "tiles=float16" (the caller's tile outputs), or one name per output,
    comma-separated ("" for the default)."""
    tiles = out_dtypes.removeprefix("tiles=") if out_dtypes.startswith("tiles=") else ""
    named = out_dtypes.split(",") if out_dtypes and not tiles else [""] * len(graph.outputs)
    if len(named) != len(graph.outputs):
        raise EpilogueArgumentError(f"out_dtypes {out_dtypes!r} names {len(named)} dtypes for "
                                    f"{len(graph.outputs)} outputs.")
    defaults = output_specs(graph, accum_shape, A, None, compute_dtype)
    specs = []
    for k, (out, spelled) in enumerate(zip(graph.outputs, named)):
        shape, dtype = defaults[out.name]
        if tiles and k < e.visible and not out.node.op.is_reduction:
            dtype = _dtype(tiles)
        specs.append((shape, _dtype(spelled) if spelled else dtype))
    return specs


def _dtype(name: str) -> torch.dtype:
    dtype = dtype_from_name(name)
    if dtype is None:
        raise EpilogueArgumentError(f"epifuse::gemm got the output dtype {name!r}, which names no torch dtype.")
    return dtype


def _run(key, program, A, B, values, outputs, compute_dtype, deterministic, precision, accumulate):
    """Write `outputs` of the program registered as `key`. A repeated call (the same key,
    options, and tensors of the same metadata: runtime/callsite.py) takes the launch kept from
    the first one, as a repeated epifuse.gemm does: a training step calls each op once per
    layer and step, and building the arguments, the plan and Triton's first launch again costs
    a millisecond of host time, as long as the GEMM itself at a rank's share of a large layer."""
    tensors = {**values, **outputs}
    backward_request = _take_backward_request()
    signature = callsite.signature(key, A, B, tensors, ("op", compute_dtype, deterministic, precision, accumulate))
    site = callsite.lookup(signature)
    if site is not None:
        if backward_request is not None and not site.backward_queued:   # kept by a call without grad
            _AHEAD_REQUEST.queued = _compile_backward_ahead(*backward_request)
            site.backward_queued = True
        site.call(A, B, tensors)
        return
    if backward_request is not None:   # the first call of this layout: its backward compiles meanwhile
        _AHEAD_REQUEST.queued = _compile_backward_ahead(*backward_request)
    with torch.autocast(A.device.type, enabled=False):  # the epilogue owns its dtypes
        epi = EpilogueArguments(program, accumulate=accumulate, deterministic=deterministic,
                                compute_dtype=compute_dtype, **values, **outputs)
        args = GemmArguments(A, B, epilogue=epi, precision=precision)
        chosen_in = tune.generation()
        kernel = choose_kernel(args, time_heavy=True) if key in _TIME_HEAVY else choose_kernel(args)
        kernel.run(args)
    if tune.generation() == chosen_in:   # else a background winner landed meanwhile: keep nothing stale
        site = callsite.remember(signature, args, kernel, (), tuple(outputs))
        if site is not None and backward_request is not None:
            site.backward_queued = True


# ---- the operators ----------------------------------------------------------------------------

@torch.library.custom_op("epifuse::gemm", mutates_args=())
def _gemm(epilogue: str, A: Tensor, B: Tensor, tensors: list[Tensor], numbers: list[float],
          kinds: str, out_dtypes: str, compute_dtype: torch.dtype, deterministic: bool,
          precision: str) -> list[Tensor]:
    e = resolve(epilogue)
    values = unpack(e.program.operands, tensors, numbers, kinds)
    specs, names = _planned_outputs(epilogue, e, A, B, values, out_dtypes, compute_dtype)
    outs = [torch.empty(shape, dtype=dtype, device=A.device) for shape, dtype in specs]
    _run(epilogue, e.program, A, B, values, dict(zip(names, outs)), compute_dtype, deterministic,
         precision, False)
    return outs


_LOCK = threading.Lock()   # the output plans'
_OUTPUT_PLANS: OrderedDict = OrderedDict()   # (epilogue, tensors' metadata, options) -> (specs, names)
OUTPUT_PLANS_KEPT = 512


def _planned_outputs(epilogue, e: Entry, A: Tensor, B: Tensor, values: dict, out_dtypes: str, compute_dtype):
    """(shape, dtype) and name of each output of a call, remembered per epilogue and the
    metadata of its tensors (a compiled graph calls the op with the same metadata every step,
    and planning costs about 25 us of its host time). Only what was planned without error is
    remembered; the call itself is checked as every call is (_run)."""
    def meta(t):
        return (t.shape, t.stride(), t.dtype, t.device, t.layout) if isinstance(t, Tensor) else None
    key = (epilogue, meta(A), meta(B), tuple(meta(v) for v in values.values()), out_dtypes, compute_dtype)
    with _LOCK:
        found = _OUTPUT_PLANS.get(key)
    if found is not None:
        return found
    program, graph, accum_shape, _, _ = _plan(e.program, A, B, values)
    found = (_output_specs(e, graph, accum_shape, A, out_dtypes, compute_dtype), [o.name for o in graph.outputs])
    with _LOCK:
        _OUTPUT_PLANS[key] = found
        while len(_OUTPUT_PLANS) > OUTPUT_PLANS_KEPT:
            _OUTPUT_PLANS.popitem(last=False)
    return found


@_gemm.register_fake
def _gemm_fake(epilogue, A, B, tensors, numbers, kinds, out_dtypes, compute_dtype, deterministic,
               precision):
    e = resolve(epilogue)
    _, graph, accum_shape, _, _ = _plan(e.program, A, B, unpack(e.program.operands, tensors,
                                                               numbers, kinds))
    return [A.new_empty(shape, dtype=dtype)
            for shape, dtype in _output_specs(e, graph, accum_shape, A, out_dtypes, compute_dtype)]


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
    _plan(e.program, A, B, unpack(e.program.operands, tensors, numbers, kinds))
    for name, t in zip(e.output_names, outputs):
        check_tensor(f"Output {name}", t)
    return None


# ---- autograd -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _BackwardPlan:
    """The registered backward epilogue of one forward (and, for max/min/amax outputs whose
    rule reads the reduced value, the epilogue that recomputes those values first)."""

    key: str | None
    sources: dict
    grads: dict
    out_dtypes: tuple            # per backward output: "accum" | ("operand", name) | "reduce"
    saved_name: str | None       # the operand that reads the saved accum (None: recompute)
    pre_key: str | None
    pre_outputs: tuple
    saved_up_name: str | None = None   # a gated epilogue's: the operand reading the saved up half


_PLANS: dict[tuple, _BackwardPlan] = {}


def _backward_plan(epilogue: str, roles, rank, wrt, seeded) -> _BackwardPlan:
    key = (epilogue, roles, rank, wrt, seeded)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    e = resolve(epilogue)
    user = e.user
    graph, _ = bound_graph(user, roles, rank)
    backward = derive(graph, wrt, seeded, rank)
    taken = {"accum", *user.params, *backward.sources, *(o.name for o in backward.graph.outputs)}
    fresh = FreshNames(taken)
    saved = fresh.fresh("saved_accum") if e.saves_accum else None
    saved_up = fresh.fresh("saved_up") if e.saves_accum and e.gated else None
    source = graph_source(backward.graph, rank, f"{user.name}_backward", accum=saved or "accum", up=saved_up)
    kinds = []
    for out in backward.graph.outputs:
        wrt_name = next(n for n, o in backward.grads.items() if o == out.name)
        if wrt_name in ("accum", "accum_up"):
            kinds.append("accum")
        elif out.node.op.is_reduction:
            kinds.append("reduce")
        else:
            kinds.append(("operand", wrt_name))
    extremes = tuple(n for kind, n in backward.sources.values() if kind == "value")
    pre_key = None
    if extremes:
        pre = restrict(graph, extremes)
        pre_source = graph_source(pre, rank, f"{user.name}_extremes", accum=saved or "accum", up=saved_up)
        pre_key = entry(register_epilogue(pre_source)).key
    key_b = entry(register_epilogue(source)).key if backward.graph.outputs else None  # None: all zero
    plan = _BackwardPlan(key_b, backward.sources, backward.grads,
                         tuple(kinds), saved, pre_key, extremes, saved_up)
    _PLANS[key] = plan
    return plan


def _setup_context(ctx, inputs, output):
    epilogue, A, B, tensors, numbers, kinds, out_dtypes, compute_dtype, deterministic, precision = inputs
    e = resolve(epilogue)
    ctx.epilogue, ctx.numbers, ctx.kinds, ctx.out_dtypes = epilogue, list(numbers), kinds, out_dtypes
    # the job compiling this call's backward ahead, if its forward queued one (_run), and the
    # outputs it expects gradients for (backward_from_stand_ins)
    ctx.ahead_key = _take_queued_key()
    ctx.float_visible = tuple(name for name, o in zip(e.output_names[:e.visible], output) if o.is_floating_point())
    ctx.options = (compute_dtype, deterministic, precision)
    ctx.needs = (A.requires_grad, B.requires_grad, tuple(t.requires_grad for t in tensors))
    saved = [A, B, *tensors]
    if e.saved:
        saved.extend(output[-e.saved:])
    ctx.save_for_backward(*saved)
    ctx.set_materialize_grads(False)   # unused outputs stay None: their gradients are not read


def _differentiated(e: Entry, kinds: str, needs) -> tuple:
    """(the tensor operands' names, the accumulators, `wrt`: what the backward differentiates
    with respect to) for a forward of `e` whose inputs need grad as `needs` says."""
    need_a, need_b, need_ops = needs
    tensor_names = [name for name, kind in zip(e.user.operands, kinds) if kind == "t"]
    accumulators = ("accum", "accum_up") if e.gated else ("accum",)
    wrt = (accumulators if need_a or need_b else ()) + tuple(
        name for name, need in zip(tensor_names, need_ops) if need)
    return tensor_names, accumulators, wrt


def _backward(ctx, grads):
    e = resolve(ctx.epilogue)
    A, B, *tensors = ctx.saved_tensors
    up = tensors.pop() if e.saved == 2 else None
    accum = tensors.pop() if e.saved else None
    user = e.user
    values = unpack(user.operands, tensors, ctx.numbers, ctx.kinds)
    _, graph, accum_shape, values, roles = _plan(user, A, B, values)
    need_a, need_b, need_ops = ctx.needs
    tensor_names, accumulators, wrt = _differentiated(e, ctx.kinds, ctx.needs)
    seeded = tuple(name for name, g in zip(e.output_names[:e.visible], grads) if g is not None)
    if ctx.ahead_key is not None and ahead.pending():
        _settle_ahead(ctx, grads[:e.visible], seeded)
    # The saved accum is an output too: differentiating the backward (create_graph=True) sends
    # it a gradient, which is accum's own (saved_accum = accum; a gated one's saved_up = accum_up).
    saved_grads = dict(zip(accumulators, grads[len(grads) - e.saved:])) if e.saved else {}
    saved_grads = {name: g for name, g in saved_grads.items() if g is not None}
    result_ops = [None] * len(tensors)
    # The structure must mirror the inputs': an empty float list reads as an empty tensor list.
    no_numbers = [] if not ctx.numbers else None
    if not wrt or not (seeded or (saved_grads and "accum" in wrt)):
        return (None, None, None, result_ops, no_numbers) + (None,) * 5
    step = _Step(ctx.options, graph, accum_shape, values, accum, A, B, up)
    plan, results = None, {}
    if seeded:
        plan = _backward_plan(ctx.epilogue, roles, len(accum_shape), wrt, seeded)
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


class _Step:
    """One backward call: runs the backward epilogue (after the extremes it reads, if any)."""

    def __init__(self, options, graph, accum_shape, values, accum, A, B, up=None, launch=None):
        self.options, self.values, self.accum, self.up = options, values, accum, up
        self.launch = launch or _call   # _compile_only: choose and plan from stand-ins
        self.accum_shape = accum_shape
        self.axes = AXES[3 - len(accum_shape):]
        self.reductions = {o.name: o.node.dims for o in graph.outputs if o.node.op.is_reduction}
        if accum is not None:
            self.A, self.B = sharding.zero_k_factors(accum)     # K = 0: accum is an operand
            self.accum_dtype = accum.dtype
        else:
            self.A, self.B = A, B                                # the kernel recomputes A @ B
            self.accum_dtype = A.dtype if A.is_floating_point() else options[0]

    def keepdim(self, t: Tensor, dims) -> Tensor:
        return t.reshape([1 if a in dims else s for a, s in zip(self.axes, self.accum_shape)])

    def run(self, plan: _BackwardPlan, grads: dict) -> dict:
        """{backward output name: tensor}."""
        if plan.key is None:
            return {}
        special = {plan.saved_name: self.accum} if plan.saved_name else {}
        if plan.saved_up_name:
            special[plan.saved_up_name] = self.up
        extremes = self.extremes(plan, special) if plan.pre_key is not None else {}
        for name, (kind, out_name) in plan.sources.items():
            if kind == "grad":
                g = grads[out_name]
                special[name] = self.keepdim(g, self.reductions[out_name]) \
                    if out_name in self.reductions else g
            elif kind == "value":
                special[name] = extremes[out_name]
            elif kind == "count":
                dims = self.reductions[out_name]
                special[name] = float(math.prod(s for a, s in zip(self.axes, self.accum_shape)
                                                if a in dims))
        outs = self.call(plan.key, special, ",".join(self.dtypes(plan)))
        return dict(zip((o for o in plan.grads.values() if o is not None), outs))

    def extremes(self, plan: _BackwardPlan, special: dict) -> dict:
        """The max/min/amax values the rules compare against, recomputed like the backward
        recomputes their inputs (so equality picks the same elements)."""
        outs = self.call(plan.pre_key, special, "")
        return {name: self.keepdim(value, self.reductions[name])
                for name, value in zip(plan.pre_outputs, outs)}

    def dtypes(self, plan: _BackwardPlan) -> list[str]:
        compute = self.options[0]
        names = []
        for kind in plan.out_dtypes:
            if kind == "accum":
                names.append(dtype_name(self.accum_dtype))
            elif kind == "reduce":
                names.append(dtype_name(reduction_dtype(compute)))
            else:
                t = self.values[kind[1]]
                names.append(dtype_name(t.dtype if t.is_floating_point() else compute))
        return names

    def call(self, epilogue: str, special: dict, out_dtypes: str) -> list:
        program = resolve(epilogue).program
        values = {n: special[n] if n in special else self.values[n] for n in program.operands}
        return self.launch(epilogue, self.A, self.B, program, values, out_dtypes, self.options)


def _call(epilogue, A, B, program, values, out_dtypes, options):
    compute_dtype, deterministic, precision = options
    tensors, numbers, kinds = pack(program.operands, values)
    return torch.ops.epifuse.gemm(epilogue, A, B, tensors, numbers, kinds, out_dtypes, compute_dtype,
                                  deterministic, precision)


torch.library.register_autograd("epifuse::gemm", _backward, setup_context=_setup_context)


# ---- the backward's kernels compiled while the forward runs (runtime/ahead.py) -----------------

def _layout(t: Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


def _ahead_key(epilogue, A, B, tensors, numbers, kinds, out_dtypes, options, needs) -> tuple:
    """What decides the backward's problems of a forward call: the forward's epilogue, its
    tensors' layouts, numbers and options, and which inputs need grad."""
    return ("backward", epilogue, tuple(_layout(t) for t in (A, B, *tensors)), tuple(numbers), kinds,
            out_dtypes, tuple(options), tuple(needs[:2]) + (tuple(needs[2]),))


_AHEAD_REQUEST = threading.local()   # .call: the forward's request, taken by its op's first _run;
                                     # .queued: the key that _run queued, taken by _setup_context


def _compiles_ahead(A: Tensor) -> bool:
    """Whether a forward on A's device has its backward's kernels compiled ahead: on a GPU, not
    under the interpreter (which compiles nothing), unless EPIFUSE_COMPILE_AHEAD=0."""
    return A.device.type == "cuda" and not target.uses_interpreter(A.device) and ahead.enabled()


def _request_backward_ahead(*call) -> None:
    """gemm(), before a forward that records autograd: the op's _run queues the backward's
    compile (_compile_backward_ahead(*call)) only where the forward itself is not a kept launch,
    that is, the first call of its layout; later steps pay nothing for it."""
    _AHEAD_REQUEST.call = call


def _take_backward_request():
    call = getattr(_AHEAD_REQUEST, "call", None)
    if call is not None:
        _AHEAD_REQUEST.call = None
    return call


def _take_queued_key():
    """The key of the job _run queued for the forward whose autograd context is being set up
    (the same thread, right after it), kept on the context: the backward settles on that key,
    not on one rebuilt from its saved tensors, which saved-tensor hooks may lay out anew."""
    key = getattr(_AHEAD_REQUEST, "queued", None)
    if key is not None:
        _AHEAD_REQUEST.queued = None
    return key


def _compile_backward_ahead(epilogue, A, B, tensors, numbers, kinds, out_dtypes, options, needs):
    """Have a worker compile the kernels this forward call's backward will run, as they are
    once every visible floating-point output receives a contiguous gradient (a backward seeded
    otherwise compiles its own at its first call), while this thread runs the forward. Plain
    tensors only: a DTensor's local problems differ from its global layout. Returns the job's
    key, or None where nothing was queued."""
    if any(type(t) not in callsite.PLAIN_TENSOR_TYPES for t in (A, B, *tensors)):
        return None
    key = _ahead_key(epilogue, A, B, tensors, numbers, kinds, out_dtypes, options, needs)
    layouts = [_layout(t) for t in (A, B, *tensors)]
    ahead.soon(key, lambda: backward_from_stand_ins(epilogue, layouts, list(numbers), kinds, out_dtypes,
                                                     options, needs))
    return key


def _settle_ahead(ctx, grads, seeded) -> None:
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
    layouts (A, B, then the tensor operands), from stand-ins (stand_in.py): what `_backward` would run
    once every visible floating-point output has a gradient. Every call is planned first, in
    this thread; then all their kernels compile at once in runtime/ahead.py's pool, and this
    returns when they have. `launch` (tests) replaces the planning and compile of each call.
    Returns (GemmArguments of stand-ins, kernel) for each kernel compiled, in call order."""
    e = resolve(epilogue)
    device = layouts[0][4]
    planned: list = []
    compile_call = launch or (lambda *call: _compile_only(*call, planned=planned))
    with stand_ins(), torch.no_grad(), torch.autocast(device.type, enabled=False), target.on_device(device):
        A, B, *tensors = [stand_in(*layout) for layout in layouts]
        forward_values = unpack(e.program.operands, tensors, numbers, kinds)
        specs, _ = _planned_outputs(epilogue, e, A, B, forward_values, out_dtypes, options[0])
        outputs = [empty_stand_in(shape, dtype, device) for shape, dtype in specs]
        up = outputs[-1] if e.saved == 2 else None
        accum = outputs[-e.saved] if e.saved else None
        _, graph, accum_shape, values, roles = _plan(e.user, A, B, unpack(e.user.operands, tensors, numbers, kinds))
        _, _, wrt = _differentiated(e, kinds, needs)
        seeded = tuple(name for name, (_, dtype) in zip(e.output_names[:e.visible], specs) if dtype.is_floating_point)
        if not wrt or not seeded:
            return []
        plan = _backward_plan(epilogue, roles, len(accum_shape), wrt, seeded)
        grads = {name: outputs[k] for k, name in enumerate(e.output_names) if name in seeded}
        _Step(options, graph, accum_shape, values, accum, A, B, up, launch=compile_call).run(plan, grads)
    jobs = [job for _, _, job in planned if job is not None]
    errors = iter([future.exception() for future in ahead.compile_all(jobs)] if jobs else [])
    compiled = []
    for args, kernel, job in planned:
        error = next(errors) if job is not None else None
        if error is None:
            compiled.append((args, kernel))
        else:
            ahead.note_failure(("compile", repr(kernel)), error)
    return compiled


def _compile_only(epilogue, A, B, program, values, out_dtypes, options, planned: list) -> list:
    """A backward call as `_run` makes it, planned from stand-ins: its kernel chosen (where that
    needs no timing) and planned, and its compile appended to `planned` as (args, kernel, job),
    job None where nothing is left to compile; nothing launched. Its outputs are stand-ins too."""
    compute_dtype, deterministic, precision = options
    specs, names = _planned_outputs(epilogue, resolve(epilogue), A, B, values, out_dtypes, compute_dtype)
    outs = [empty_stand_in(shape, dtype, A.device) for shape, dtype in specs]
    epi = EpilogueArguments(program, deterministic=deterministic, compute_dtype=compute_dtype,
                            **values, **dict(zip(names, outs)))
    args = GemmArguments(A, B, epilogue=epi, precision=precision)
    for kernel in kernels_to_compile(args, time_heavy=epilogue in _TIME_HEAVY):
        try:
            job = kernel.compile_job(args)
        except Exception as error:  # noqa: BLE001 - the real call plans it again and raises there
            ahead.note_failure(("compile", repr(kernel)), error)
            continue
        planned.append((args, kernel, job))
    return outs


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
        if wants_grad and not torch.compiler.is_compiling() and _compiles_ahead(A):
            needs = (A.requires_grad, B.requires_grad, tuple(t.requires_grad for t in operands))
            _request_backward_ahead(key, A, B, operands, numbers, kinds, dtypes,
                                    (compute_dtype, deterministic, precision), needs)
        try:
            outs = torch.ops.epifuse.gemm(key, A, B, operands, numbers, kinds, dtypes, compute_dtype,
                                          deterministic, precision)[:visible]
        finally:
            _AHEAD_REQUEST.call = _AHEAD_REQUEST.queued = None
    outs = tuple(outs)
    return outs[0] if len(outs) == 1 else outs


__all__ = ["gemm", "register_epilogue", "entry", "resolve", "read_key", "Entry"]
