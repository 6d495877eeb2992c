"""The backward of an `epifuse::gemm` call (docs/autograd.md): its plan (the backward epilogue
autodiff.py derives from the bound graph, registered in the epilogue table, and the epilogue
recomputing the max/min/amax values its rules read) and its steps (each one call of the same
op, on the saved accum or recomputing A @ B). torch_ops.py registers the autograd formula that
runs them; backward_ahead.py runs the same steps from stand-ins to compile their kernels early."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import sharding
from .allocation import reduction_dtype
from .arguments import bound_graph
from .autodiff import derive, restrict
from .epilogue_table import Entry, entry, register_epilogue, resolve
from .ir import AXES
from .op_planning import pack
from .ops import dtype_name
from .printing import FreshNames, graph_source


@dataclass(frozen=True)
class BackwardPlan:
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


_PLANS: dict[tuple, BackwardPlan] = {}


def backward_plan(epilogue: str, roles, rank, wrt, seeded) -> BackwardPlan:
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
    plan = BackwardPlan(key_b, backward.sources, backward.grads,
                         tuple(kinds), saved, pre_key, extremes, saved_up)
    _PLANS[key] = plan
    return plan


def differentiated(e: Entry, kinds: str, needs) -> tuple:
    """(the tensor operands' names, the accumulators, `wrt`: what the backward differentiates
    with respect to) for a forward of `e` whose inputs need grad as `needs` says."""
    need_a, need_b, need_ops = needs
    tensor_names = [name for name, kind in zip(e.user.operands, kinds) if kind == "t"]
    accumulators = ("accum", "accum_up") if e.gated else ("accum",)
    wrt = (accumulators if need_a or need_b else ()) + tuple(
        name for name, need in zip(tensor_names, need_ops) if need)
    return tensor_names, accumulators, wrt


class Step:
    """One backward call: runs the backward epilogue (after the extremes it reads, if any)."""

    def __init__(self, options, graph, accum_shape, values, accum, A, B, up=None, launch=None):
        self.options, self.values, self.accum, self.up = options, values, accum, up
        self.launch = launch or launch_op   # compile_only: choose and plan from stand-ins
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

    def run(self, plan: BackwardPlan, grads: dict) -> dict:
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

    def extremes(self, plan: BackwardPlan, special: dict) -> dict:
        """The max/min/amax values the rules compare against, recomputed like the backward
        recomputes their inputs (so equality picks the same elements)."""
        outs = self.call(plan.pre_key, special, "")
        return {name: self.keepdim(value, self.reductions[name])
                for name, value in zip(plan.pre_outputs, outs)}

    def dtypes(self, plan: BackwardPlan) -> list[str]:
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


def launch_op(epilogue, A, B, program, values, out_dtypes, options):
    compute_dtype, deterministic, precision = options
    tensors, numbers, kinds = pack(program.operands, values)
    return torch.ops.epifuse.gemm(epilogue, A, B, tensors, numbers, kinds, out_dtypes, compute_dtype,
                                  deterministic, precision)
