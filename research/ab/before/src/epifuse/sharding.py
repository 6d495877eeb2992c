"""epifuse's ops on DTensors: sharding strategies derived from the epilogue's graph.

A DTensor passed to `epifuse.gemm` (or straight to `torch.ops.epifuse.gemm` / `gemm_out`) is
run by DTensor's dispatch: it asks the strategy registered here which placements the op takes
and gives, redistributes the inputs to the cheapest of those, runs the op on each rank's local
tensors and wraps the outputs. Along one mesh dim an op runs in one of these ways:

- replicated: every input and output Replicate (always exact);
- split along M: A Shard on its M dim, B Replicate; tile outputs, and operands and reductions
  that vary along M, are Shard along M; a reduction over M is a Partial;
- split along N: B Shard on its N dim, A Replicate; likewise along N;
- split along L (batched): A and B, whichever has the batch, Shard(0); likewise along L;
- split along K: A Shard on K and B Shard on K make each rank's accum a partial sum, so only
  the identity epilogue (every output is accum itself) runs this way, its outputs
  Partial("sum").

A reduction over the split axis combines across ranks as a DTensor Partial: sum -> "sum",
max and amax -> "max", min -> "min", mean -> "avg" (the mean of the ranks' means, exact only
when the axis splits evenly), logsumexp -> `LogSumExpPartial`, a Partial whose ranks hold the
log-sum-exps of their parts and which combines them as the kernels combine tiles' (the
maximum across ranks, then the log of the sum of exp relative to it): a vocabulary split
across ranks gives each row's log-sum-exp over the whole vocabulary, and an epilogue that
normalizes by it (softmax, log-softmax) runs as two passes (staging.py), the second reading
the combined statistic. An axis is refused when the epilogue reads its global index (`col()`
along N, `row()` along M: each rank would count from 0), takes a mean over it that splits
unevenly, folds a max/min over a shard that is empty on some rank, or, in one pass, feeds a
value reduced over it into more math (the whole reduction is on no rank).

Refused, not replicated: when A and B are sharded only along axes the epilogue refuses, the
op raises UnsupportedError naming the op and the reason, rather than offering DTensor the
replicated way, which it would take by all-gathering A or B. That all-gather (of a weight, on
every call) is the cost tensor parallelism exists to avoid, and hidden inside an op it is hard
to find; the error names the redistribution that gives the same result, in plain sight.
Inputs sharded along an axis the epilogue takes run that way; replicated A and B run
replicated (the operands are gathered), and Partial ones in whichever legal way DTensor's cost
model picks. epifuse.gemm and torch_ops.gemm check
the placements before DTensor dispatches (`check`), so the refusal is epifuse's own error;
straight calls of the op get it from the strategy, wrapped in DTensor's RuntimeError.

For gemm_out, whose outputs are written in place and so cannot be redistributed, only the
ways whose output placements are the given outputs' own are offered.

Registration is lazy: torch.distributed.tensor takes about 0.4 s to import, more than
`import epifuse` may add (tests/unit/test_startup.py). torch_ops registers the strategies
when it loads if torch.distributed.tensor is loaded already, and otherwise on the first
DTensor that reaches its Python entry (`torch_ops.gemm`, which `epifuse.gemm` calls); a
straight call of `torch.ops.epifuse.gemm` on DTensors before either finds no strategy.
"""
from __future__ import annotations

import itertools
import math
import sys
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from .arguments import bound_graph
from .errors import UnsupportedError
from .ir import ACCUM, AXES, Graph, Node
from .shapes import accum_shape_of, classify_operand

# A placement along one mesh dim, without importing torch.distributed: ("R",) replicated,
# ("S", dim) sharded along a dim, ("P", reduce_op) a partial value of that DTensor reduce op.
REPLICATE = ("R",)

# How partial results of each Reduction.combine fold across ranks, as a DTensor Partial op.
_PARTIAL = {"add": "sum", "maximum": "max", "minimum": "min", "logsumexp": "logsumexp"}

_AXIS_WORDS = {"L": "the batch", "M": "rows", "N": "columns", "K": "the inner dimension"}


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (without importing torch.distributed where no DTensor is)."""
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


def any_dtensor(*tensors) -> bool:
    return any(is_dtensor(t) for t in tensors)


@dataclass(frozen=True)
class Way:
    """One way to run the op along one mesh dim: the axis it splits ("" for none) and the
    placement of each output (in return order), of A, of B and of each tensor operand."""

    axis: str
    outputs: tuple
    a: tuple
    b: tuple
    operands: tuple


@dataclass(frozen=True)
class Problem:
    """The epilogue's bound graph over the global shapes, and where each axis lies in A, B,
    the tensor operands and accum."""

    graph: Graph
    accum_shape: tuple
    a_shape: tuple
    b_shape: tuple
    operand_shapes: tuple   # (name, shape, axes it varies along) per tensor operand, in order

    @property
    def axes(self) -> tuple:
        return AXES[3 - len(self.accum_shape):]

    def size(self, axis: str) -> int:
        if axis == "K":
            return self.a_shape[-1]
        return self.accum_shape[self.axes.index(axis)]


def problem(program, kinds: str, a_shape, b_shape, operand_shapes) -> Problem:
    """The Problem of `program` (its operands' kinds as the ops take them: "t" tensor, "n"
    number) over A, B and tensor operands of these global shapes."""
    if "accum_up" in program.params:
        raise UnsupportedError(
            "A gated epilogue (gate, up = accum.chunk(2, dim=-1)) does not run on DTensors yet: its two "
            "halves of B's columns would have to shard alike.",
            hint="Run it on each rank's local tensors (.to_local()), with each rank's B holding its own "
                 "gate and up columns.")
    A, B = torch.empty(tuple(a_shape), device="meta"), torch.empty(tuple(b_shape), device="meta")
    accum_shape, _ = accum_shape_of(A, B)
    shapes = iter(operand_shapes)
    roles, described = [], []
    for name, kind in zip(program.operands, kinds):
        if kind == "t":
            shape = tuple(next(shapes))
            role = classify_operand(name, torch.empty(shape, device="meta"), accum_shape, A.device)[0]
            described.append((name, shape, role.axes))
        else:
            role = classify_operand(name, 1.0, accum_shape, A.device)[0]
        roles.append(role)
    graph, _ = bound_graph(program, tuple(roles), len(accum_shape))
    return Problem(graph, tuple(accum_shape), tuple(a_shape), tuple(b_shape), tuple(described))


def _label(graph: Graph, node: Node) -> str:
    output = next((o.name for o in graph.outputs if o.node is node), None)
    name = output or graph.name_of(node)
    dims = ", ".join(node.dims)
    return f"{node.op.name}(dim={dims})" + (f" ({name})" if name else "")


def _chunks(size: int, ranks: int) -> list[int]:
    """Each rank's share of `size` elements, as DTensor's Shard splits them (torch.chunk)."""
    step = -(-size // ranks) if size else 0
    return [max(0, min(step, size - r * step)) for r in range(ranks)]


def _split_refusal(p: Problem, axis: str, ranks: int) -> str | None:
    """Why the epilogue cannot run split along `axis` over `ranks` ranks, or None."""
    graph = p.graph
    nodes = graph.nodes()
    size = p.size(axis)
    if size < ranks:
        return f"{axis}={size} is smaller than the {ranks} ranks"
    if axis == "K":
        if all(o.node.op is ACCUM for o in graph.outputs):
            return None
        return ("the epilogue is not the identity: each rank's A @ B over its part of K is a partial "
                "sum of accum, and the epilogue of a partial sum is not a partial of the epilogue")
    for node in nodes:
        if node.op.kind == "index" and node.op.axis == axis:
            return (f"the epilogue reads {node.op.name}(), the global index of {_AXIS_WORDS[axis]}, which each "
                    f"rank would count from its own first one")
    for node in nodes:
        if not (node.op.is_reduction and axis in node.dims):
            continue
        label = _label(graph, node)
        if any(node in user.src for user in nodes):
            return (f"its {label} over {axis} feeds more math, and no rank holds the whole reduction "
                    "(only its part)")
        reduction = node.reduction
        if reduction.combine not in _PARTIAL:
            return (f"its {label} folds {axis}, and no DTensor Partial combines the ranks' parts of a "
                    f"{reduction.combine}")
        if reduction.mean and size % ranks:
            return (f"its {label} is a mean over {axis}={size}, which does not split evenly over "
                    f"{ranks} ranks; the mean of the ranks' means (Partial('avg')) is the whole mean only "
                    "when every rank holds as many elements")
        if reduction.needs_elements and 0 in _chunks(size, ranks):
            return (f"its {label} would fold an empty shard on some rank ({axis}={size} over {ranks} "
                    "ranks), and a maximum or minimum of nothing has no value")
    return None


def _shard_along(shape: tuple, axes: tuple, axis: str) -> tuple:
    """The placement of a tensor of `shape` whose dims are the last of `axes` (right-aligned,
    as operands broadcast), split along `axis`: Shard of its dim there, or Replicate where it
    has no such dim or broadcasts along it (size 1)."""
    offset = len(axes) - len(shape)
    if axis not in axes[offset:]:
        return REPLICATE
    dim = axes.index(axis) - offset
    return ("S", dim) if shape[dim] != 1 else REPLICATE


def _way(p: Problem, axis: str) -> Way:
    graph, axes = p.graph, p.axes
    if axis == "":
        return Way("", (REPLICATE,) * len(graph.outputs), REPLICATE, REPLICATE,
                   (REPLICATE,) * len(p.operand_shapes))
    if axis == "K":
        return Way("K", (("P", "sum"),) * len(graph.outputs), ("S", len(p.a_shape) - 1),
                   ("S", len(p.b_shape) - 2), (REPLICATE,) * len(p.operand_shapes))
    outputs = []
    for out in graph.outputs:
        node = out.node
        if node.op.is_reduction and axis in node.dims:
            outputs.append(("P", "avg" if node.reduction.mean else _PARTIAL[node.reduction.combine]))
        elif node.op.is_reduction:
            kept = tuple(a for a in axes if a not in node.dims)
            outputs.append(("S", kept.index(axis)))
        else:
            outputs.append(("S", axes.index(axis)))
    a_axes = (("L",) if len(p.a_shape) == 3 else ()) + ("M", "K")
    b_axes = (("L",) if len(p.b_shape) == 3 else ()) + ("K", "N")
    operands = tuple(_shard_along(shape, axes, axis) if axis in role_axes else REPLICATE
                     for _, shape, role_axes in p.operand_shapes)
    return Way(axis, tuple(outputs), _shard_along(p.a_shape, a_axes, axis), _shard_along(p.b_shape, b_axes, axis),
               operands)


def ways(p: Problem, ranks: int) -> tuple[dict[str, Way], dict[str, str]]:
    """The ways the op runs along one mesh dim of `ranks` ranks, by the axis they split (""
    replicated), and why each axis of the problem not among them cannot be split."""
    found, refused = {"": _way(p, "")}, {}
    for axis in (*p.axes, "K"):
        reason = _split_refusal(p, axis, ranks)
        if reason is None:
            found[axis] = _way(p, axis)
        else:
            refused[axis] = reason
    return found, refused


def split_axis(placement: tuple, shape: tuple, operand: str) -> str | None:
    """The axis a placement of A or B (`operand`) splits, or None (Replicate, Partial)."""
    if placement[0] != "S":
        return None
    dims = (("L",) if len(shape) == 3 else ()) + (("M", "K") if operand == "A" else ("K", "N"))
    return dims[placement[1] % len(shape)]


def choose(op: str, p: Problem, mesh_shape: tuple, current: tuple, outputs: tuple | None = None) -> list:
    """The ways to run the op on a mesh of `mesh_shape`, one Way per mesh dim, given the inputs'
    `current` placements ((A's, B's) per mesh dim); where both are Replicate, only the
    replicated way. UnsupportedError where A and B are sharded, along some mesh dim, only along
    axes the epilogue cannot split. `outputs` (gemm_out): the
    given outputs' placements per mesh dim; only the ways that keep them are taken, and
    UnsupportedError where none does."""
    per_dim = []
    for d, ranks in enumerate(mesh_shape):
        found, refused = ways(p, ranks)
        a_place, b_place = current[d]
        split = {"A": split_axis(a_place, p.a_shape, "A"), "B": split_axis(b_place, p.b_shape, "B")}
        wanted = {axis for axis in split.values() if axis is not None}
        if wanted and not wanted & set(found):
            axis = sorted(wanted)[0]
            who = " and ".join(name for name, a in split.items() if a == axis)
            raise UnsupportedError(
                f"{op} cannot split {axis} ({_AXIS_WORDS[axis]}) across ranks, as {who} "
                f"{'is' if len(who) == 1 else 'are'} sharded along it on mesh dim {d}: {refused[axis]}.",
                hint=_hint(axis, found))
        if outputs is None and a_place == REPLICATE and b_place == REPLICATE:
            per_dim.append([found[""]])   # replicated in, replicated out, whatever the operands
        else:
            per_dim.append(list(found.values()))
    combos = [combo for combo in itertools.product(*per_dim)
              if len({w.axis for w in combo if w.axis}) == sum(1 for w in combo if w.axis)]
    if outputs is not None:
        combos = [combo for combo in combos
                  if all(tuple(w.outputs[k] for w in combo) == tuple(outputs[k]) for k in range(len(outputs)))]
        if not combos:
            raise UnsupportedError(
                f"{op} writes its outputs in place, and no way of running this epilogue on these inputs gives "
                f"outputs with the placements given ({_spell(outputs)}).",
                hint="Pass outputs placed as the op gives them: Shard along the split axis for tiles, "
                     "Partial for reductions over it, Replicate when nothing is split.")
    return combos


def _hint(axis: str, found: dict) -> str:
    others = [a for a in found if a and a != axis]
    split = f", or shard along {' or '.join(others)} instead" if others else ""
    text = ("Redistribute to Replicate (t.redistribute(mesh, [Replicate()])) to run the whole epilogue on "
            f"every rank{split}.")
    if axis == "K":
        text += (" Or run the GEMM without an epilogue (its accum comes back Partial) and the epilogue on "
                 "the reduced accum, as epifuse.nn.FusedLinear does row-parallel.")
    return text


def _spell(outputs) -> str:
    return "; ".join(", ".join(_name(p) for p in placements) for placements in outputs)


def _name(placement: tuple) -> str:
    if placement == ("P", "logsumexp"):
        return "LogSumExpPartial()"
    if placement[0] == "?":   # a placement of its own kind (a Shard or Partial subclass): its repr
        return placement[1]
    return {"R": "Replicate()", "S": f"Shard({placement[-1]})", "P": f"Partial({placement[-1]!r})"}[placement[0]]


# ---- DTensor: placements, the check before dispatch, the registered strategies ------------

def _of_placement(placement, ndim: int) -> tuple:
    if placement.is_shard():
        return ("S", placement.dim % ndim) if type(placement).__name__ == "Shard" else ("?", repr(placement))
    if getattr(placement, "combines_log_sum_exps", False):
        return ("P", "logsumexp")
    if placement.is_partial():
        return ("P", placement.reduce_op) if type(placement).__name__ == "Partial" else ("?", repr(placement))
    return REPLICATE


def _to_placement(placement: tuple):
    from torch.distributed.tensor import Partial, Replicate, Shard
    if placement[0] == "S":
        return Shard(placement[1])
    if placement == ("P", "logsumexp"):
        return log_sum_exp_partial()
    if placement[0] == "P":
        return Partial(placement[1])
    return Replicate()


_LOG_SUM_EXP: list = []


def log_sum_exp_partial():
    """The DTensor placement of a log-sum-exp over a split axis (LogSumExpPartial; its class
    is defined on first use, as it subclasses torch.distributed.tensor's Partial)."""
    if not _LOG_SUM_EXP:
        with _LOCK:
            if not _LOG_SUM_EXP:
                _LOG_SUM_EXP.append(_log_sum_exp_class())
    return _LOG_SUM_EXP[0]()


def _log_sum_exp_class():
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Partial

    def finite(top):   # a row with no finite value keeps its -inf / +inf / nan in the log term
        return torch.where(torch.isfinite(top), top, torch.zeros_like(top))

    class LogSumExpPartial(Partial):
        """Each rank holds the log-sum-exp of its part of the folded elements; the whole one is
        m + log(sum over ranks of exp(part - m)), m the largest part. Replicate -> this
        placement gives each rank v - log(ranks), whose combination is v. Gradients reach
        the parts as Replicate (torch's rule for every Partial), which epifuse's backward
        reads as the combined statistic: the softmax of the whole row."""

        combines_log_sum_exps = True

        def __init__(self):
            # its own reduce_op: DTensor's rules treat "sum" and "avg" partials as linear (a sum
            # of the parts would be taken for the sum of the whole), this one as neither
            super().__init__("logsumexp")

        def _reduce_value(self, tensor, mesh, mesh_dim):
            top = finite(funcol.all_reduce(tensor, reduceOp="max", group=(mesh, mesh_dim)))
            total = funcol.all_reduce(torch.exp(tensor - top), reduceOp="sum", group=(mesh, mesh_dim))
            return top + torch.log(total)

        def _reduce_shard_value(self, tensor, mesh, mesh_dim, shard_spec):
            top = finite(funcol.all_reduce(tensor, reduceOp="max", group=(mesh, mesh_dim)))
            total = shard_spec._reduce_shard_tensor(torch.exp(tensor - top), mesh, "sum", mesh_dim)
            # the shard of `top` this rank keeps: equal on every rank, so their maximum is it
            return shard_spec._reduce_shard_tensor(top, mesh, "max", mesh_dim) + torch.log(total)

        def _partition_value(self, tensor, mesh, mesh_dim):
            return tensor - math.log(mesh.size(mesh_dim))

        def __eq__(self, other) -> bool:
            return getattr(other, "combines_log_sum_exps", False)

        def __hash__(self) -> int:
            return hash("epifuse.LogSumExpPartial")

        def __reduce__(self):   # pickled (torch.save of a DTensor) as the call that makes it
            return (log_sum_exp_partial, ())

        def __fx_repr__(self):   # an FX graph that carries it rebuilds this placement, not a Partial
            return ("epifuse_log_sum_exp_partial()", {"epifuse_log_sum_exp_partial": log_sum_exp_partial})

        def __repr__(self) -> str:
            return "LogSumExpPartial()"

        def __str__(self) -> str:
            return "P(logsumexp)"

    return LogSumExpPartial


def check(op: str, program, kinds: str, A, B, operands: list, outputs: list = ()) -> None:
    """Before DTensor's dispatch runs `op` on DTensors: every tensor a DTensor of one mesh, and
    A's and B's placements ones the epilogue can run (`choose`). The strategy makes the same
    checks, but DTensor wraps whatever it raises in a RuntimeError."""
    tensors = {"A": A, "B": B, **{f"operand {i}": t for i, t in enumerate(operands)},
               **{f"output {i}": t for i, t in enumerate(outputs)}}
    plain = [name for name, t in tensors.items() if not is_dtensor(t)]
    if plain:
        raise UnsupportedError(f"{op} got DTensors and plain tensors ({', '.join(plain)}) together.",
                               hint="Pass every tensor as a DTensor on one mesh (distribute_tensor, "
                                    "DTensor.from_local), or every one as a plain tensor (.to_local()).")
    mesh = A.device_mesh
    if any(t.device_mesh != mesh for t in tensors.values()):
        raise UnsupportedError(f"{op} got DTensors on different meshes.",
                               hint="Put A, B and the tensor operands on one DeviceMesh.")
    p = problem(program, kinds, A.shape, B.shape, [t.shape for t in operands])
    current = tuple((_of_placement(A.placements[d], A.dim()), _of_placement(B.placements[d], B.dim()))
                    for d in range(mesh.ndim))
    given = None
    if outputs:
        given = tuple(tuple(_of_placement(t.placements[d], t.dim()) for d in range(mesh.ndim)) for t in outputs)
    choose(op, p, tuple(mesh.shape), current, given)


_REGISTERED: list = []
_LOCK = threading.Lock()


def distributed_tensor_loaded() -> bool:
    return "torch.distributed.tensor" in sys.modules


def register(resolve: Callable) -> None:
    """Register the strategies of torch.ops.epifuse.gemm and gemm_out with DTensor's dispatch,
    once. `resolve(key)` is the Entry of an epilogue key (torch_ops.resolve). Imports
    torch.distributed.tensor: call it where a DTensor is at hand, or that module is loaded."""
    if _REGISTERED:
        return
    with _LOCK:
        if _REGISTERED:
            return
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
        propagator = DTensor._op_dispatcher.sharding_propagator
        # Every argument from the first on keys DTensor's cache of decisions: the epilogue
        # (argument 0) and the operands' kinds decide the rules.
        info = RuntimeSchemaInfo(static_argnum=0, needs_pytree=True)
        propagator.register_op_strategy(torch.ops.epifuse.gemm.default, partial(_strategy, resolve, False), info)
        propagator.register_op_strategy(torch.ops.epifuse.gemm_out.default, partial(_strategy, resolve, True), info)
        _REGISTERED.append(True)


def _strategy(resolve: Callable, out_variant: bool, op_schema):
    """The OpStrategy of one call: every way `choose` allows, each with its redistribution
    costs from the inputs' current placements."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs
    args = op_schema.args_schema
    program = resolve(args[0]).program
    kinds = args[5]
    inputs = list(op_schema.args_strategy)   # A, B, the tensor operands, then gemm_out's outputs
    specs = [s.strategies[0].output_spec for s in inputs]
    n_outputs = len(program.outputs) if out_variant else 0
    n_operands = len(inputs) - 2 - n_outputs
    a, b = specs[0], specs[1]
    mesh = a.mesh
    p = problem(program, kinds, a.shape, b.shape, [s.shape for s in specs[2:2 + n_operands]])
    current = tuple((_of_placement(a.placements[d], len(a.shape)), _of_placement(b.placements[d], len(b.shape)))
                    for d in range(mesh.ndim))
    given = None
    if out_variant:
        given = tuple(tuple(_of_placement(s.placements[d], len(s.shape)) for d in range(mesh.ndim))
                      for s in specs[2 + n_operands:])
    op = "epifuse::gemm_out" if out_variant else "epifuse::gemm"
    options = []
    for combo in choose(op, p, tuple(mesh.shape), current, given):
        def placed(pick):
            return tuple(_to_placement(pick(w)) for w in combo)
        wanted = [placed(lambda w: w.a), placed(lambda w: w.b)]
        wanted += [placed(lambda w, i=i: w.operands[i]) for i in range(n_operands)]
        outs = [placed(lambda w, k=k: w.outputs[k]) for k in range(len(combo[0].outputs))]
        if out_variant:
            wanted += outs
        input_specs = [DTensorSpec(mesh, placements, tensor_meta=spec.tensor_meta)
                       for placements, spec in zip(wanted, specs)]
        costs = [generate_redistribute_costs(strategy, spec) for strategy, spec in zip(inputs, input_specs)]
        output_specs = None if out_variant else tuple(DTensorSpec(mesh, placements) for placements in outs)
        options.append(OpSpec(output_specs=output_specs, input_specs=input_specs, redistribute_cost=costs))
    return OpStrategy(options)


def zero_k_factors(accum):
    """A (..., M, 0) and B (..., 0, N) whose product is an empty sum over K, for a GEMM that
    reads `accum` as an operand: views of accum, or for a DTensor accum DTensors laid out as it
    is along L, M and N (slicing accum along a sharded dim would all-gather it first)."""
    if not is_dtensor(accum):
        return accum[..., :0], accum[..., :0, :]
    from torch.distributed.tensor import DTensor, Replicate, Shard
    nd = accum.dim()
    a_place, b_place = [], []
    for placement in accum.placements:
        dim = placement.dim % nd if placement.is_shard() and type(placement).__name__ == "Shard" else None
        a_place.append(Shard(dim) if dim is not None and dim != nd - 1 else Replicate())
        b_place.append(Shard(dim) if dim is not None and dim != nd - 2 else Replicate())
    local = accum.to_local()
    shape = tuple(accum.shape)
    a_shape, b_shape = shape[:-1] + (0,), shape[:-2] + (0, shape[-1])
    A = DTensor.from_local(local[..., :0], accum.device_mesh, a_place, run_check=False,
                           shape=torch.Size(a_shape), stride=_contiguous(a_shape))
    B = DTensor.from_local(local[..., :0, :], accum.device_mesh, b_place, run_check=False,
                           shape=torch.Size(b_shape), stride=_contiguous(b_shape))
    return A, B


def _contiguous(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


__all__ = ["Way", "Problem", "problem", "ways", "choose", "check", "register", "is_dtensor", "any_dtensor",
           "zero_k_factors", "distributed_tensor_loaded", "log_sum_exp_partial"]
