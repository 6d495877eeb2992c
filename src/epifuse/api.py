"""The public API: EpilogueArguments, GemmArguments, get_kernels, gemm.

    epi = EpilogueArguments(fn_or_string, alpha=3.0, C=C, D=D, F=F)
    args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi)
    kernels = get_kernels(args)          # every kernel that supports args, best first
    kernels[0].run(args)

    D, F = epifuse.gemm(A, B, fn, alpha=3.0, C=C)   # allocates outputs, picks a kernel

Everything a user can get wrong is checked here, before any kernel compiles or any output is
touched, and raised as an EpilogueError subclass that names the problem.
"""
from __future__ import annotations

import difflib
import math
import threading
from typing import Any, Callable

import torch

from . import callsite
from .binding import bind
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError, did_you_mean, flag
from .frontend import Program, parse
from .ir import AXES, Graph, Operand
from .ops import OPS
from .passes import canonical_hash, optimize
from .shapes import (accum_shape_of, accumulator_types, classify_operand, layout_class, operand_layouts,
                     output_strides, overlaps, span)

IDENTITY_EPILOGUE = "def identity(accum):\n    D = accum\n    return D\n"


class EpilogueArguments:
    """An epilogue and the tensors and numbers its names refer to.

    Keyword arguments name every operand (the function's parameters other than accum) and
    every output (each returned name). Options: `accumulate=True` folds reduction results into
    what the destinations hold; `deterministic=True` asks for run-to-run identical reductions;
    `compute_dtype` (default torch.float32) is the type the epilogue math runs in.
    """

    def __init__(self, epilogue: Callable | str | Program, /, *, accumulate: bool = False,
                 deterministic: bool = False, compute_dtype: torch.dtype = torch.float32,
                 **tensors: Any):
        self.program = epilogue if isinstance(epilogue, Program) else parse(epilogue)
        self.accumulate = flag("accumulate", accumulate)
        self.deterministic = flag("deterministic", deterministic)
        self.compute_dtype = compute_dtype
        program = self.program
        expected = list(program.operands) + [name for name, _ in program.outputs]
        places = dict(zip(program.params, program.param_locs))
        places.update(program.outputs)
        unexpected = [n for n in tensors if n not in expected]
        for name in expected:
            if name not in tensors:
                role = "an operand" if name in program.operands else "an output tensor"
                hint = f"Pass {name}=... ({role})."
                close = difflib.get_close_matches(name, unexpected, n=1, cutoff=0.6)
                if close:
                    hint += f" The keyword {close[0]!r} you passed looks like a misspelling of it."
                raise EpilogueArgumentError(
                    f"Argument {name} is not provided in the kwargs of the EpilogueArguments "
                    "constructor", places.get(name), hint)
        for name in tensors:
            if name not in expected:
                raise EpilogueArgumentError(f"Unexpected keyword argument '{name}'",
                                            hint=did_you_mean(name, expected) or
                                            f"The epilogue's operands and outputs are: {', '.join(expected)}.")
        self.operands = {n: tensors[n] for n in program.operands}
        self.outputs = {n: tensors[n] for n, _ in program.outputs}
        for name, value in self.outputs.items():
            if not isinstance(value, torch.Tensor):
                raise EpilogueArgumentError(
                    f"Output {name} must be a torch.Tensor, but got {type(value).__name__}.")
            _check_not_tracked_by_autograd(name, value)
        for name, value in self.operands.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                raise EpilogueArgumentError(
                    f"Operand {name} must be a number or a torch.Tensor, but got {type(value).__name__}.")
            if isinstance(value, torch.Tensor) and (value.is_complex() or value.dtype == torch.bool):
                raise EpilogueArgumentError(f"Operand {name} has dtype {value.dtype}; use a real "
                                            "floating-point or integer tensor.")


def _check_not_tracked_by_autograd(name: str, output: torch.Tensor) -> None:
    """Kernels write outputs in place, behind autograd's back; as with torch's out=, an output
    that requires grad is refused while grad mode is on (torch.no_grad() allows it)."""
    if output.requires_grad and torch.is_grad_enabled():
        raise EpilogueArgumentError(
            f"Output {name} requires grad: epifuse writes outputs in place, which autograd cannot "
            "track (and torch forbids writing in place into a leaf that requires grad).",
            hint=f"For differentiable outputs call epifuse.gemm(A, B, epilogue, ...) without passing "
                 f"{name}; to just fill the tensor, pass {name}.detach() or build the arguments "
                 "under torch.no_grad().")


_BIND_CACHE: dict[tuple, tuple[Program, Graph, str]] = {}
_BIND_LOCK = threading.Lock()


def _bound_graph(program: Program, roles: tuple[Operand, ...], rank: int) -> tuple[Graph, str]:
    key = (id(program), roles, rank)
    hit = _BIND_CACHE.get(key)
    if hit is not None and hit[0] is program:
        return hit[1], hit[2]
    graph = optimize(bind(program, {o.name: o for o in roles}, rank))
    entry = (program, graph, canonical_hash(graph))
    with _BIND_LOCK:
        _BIND_CACHE[key] = entry
    return entry[1], entry[2]


class GemmArguments:
    """A GEMM `accum = A @ B` and its epilogue, bound and checked.

    A is (M, K) or (L, M, K); B is (K, N) or (L, K, N); either may be 2-D while the other is
    batched (it is then shared across L). `out` is the main output (the epilogue's D); without
    an epilogue, `D = accum` is stored into `out`.
    """

    def __init__(self, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None,
                 accumulator_type: torch.dtype | None = None,
                 epilogue: EpilogueArguments | None = None, precision: str = "default"):
        if epilogue is not None and not isinstance(epilogue, EpilogueArguments):
            raise EpilogueArgumentError(
                f"GemmArguments' epilogue must be an EpilogueArguments, not {type(epilogue).__name__}.",
                hint="Wrap it with its tensors: epilogue=EpilogueArguments(epi, C=C, D=D).")
        if epilogue is None:
            if out is None:
                raise EpilogueArgumentError("GemmArguments needs `out` or an `epilogue`.")
            epilogue = EpilogueArguments(IDENTITY_EPILOGUE, D=out)
        elif out is not None and "D" in epilogue.outputs and epilogue.outputs["D"] is not out:
            raise EpilogueArgumentError("`out` and the epilogue's output D are different tensors.",
                                        hint="Pass the same tensor as out=D and D=... (or leave out `out`).")
        if precision not in ("default", "highest"):
            raise EpilogueArgumentError(f"precision must be 'default' or 'highest', got {precision!r}.")
        self.A, self.B = A, B
        self.out = out
        self.epilogue = epilogue
        if accumulator_type is None:
            accumulator_type = torch.float32 if not isinstance(A, torch.Tensor) or A.is_floating_point() \
                else torch.int32
        self.accumulator_type = accumulator_type
        self.precision = precision
        self.accumulate = epilogue.accumulate
        self.deterministic = epilogue.deterministic
        self.compute_dtype = epilogue.compute_dtype
        self.accum_shape, (self.L, self.M, self.N, self.K) = accum_shape_of(A, B)
        self.rank = len(self.accum_shape)
        self.a_strides = _gemm_strides(A)
        self.b_strides = _gemm_strides(B)
        self._check_accumulator()
        roles, self.strides = [], {}
        self.operands = {}
        for name, value in epilogue.operands.items():
            role, strides = classify_operand(name, value, self.accum_shape, A.device)
            roles.append(role)
            self.operands[name] = value
            self.strides[name] = strides
        self.graph, self.key = _bound_graph(epilogue.program, tuple(roles), self.rank)
        self.outputs = dict(epilogue.outputs)
        self.reductions = {}
        for out_ in self.graph.outputs:
            dest = self.outputs[out_.name]
            reduction = out_.node.op if out_.node.op.is_reduction else None
            if reduction is not None:
                self.reductions[out_.name] = reduction.name
            self.strides[out_.name] = output_strides(
                out_.name, dest, self.accum_shape, A.device,
                out_.node.dims if reduction else None, reduction)
        self._check_aliasing()
        tensors = [A, B, *self.outputs.values(),
                   *(v for v in self.operands.values() if isinstance(v, torch.Tensor))]
        self.largest_span = max(span(t) for t in tensors)

    def _check_accumulator(self) -> None:
        A, B = self.A, self.B
        if A.dtype.is_floating_point != B.dtype.is_floating_point:
            raise ShapeError(f"A is {A.dtype} and B is {B.dtype}: both must be floating point or both integer.")
        allowed = accumulator_types(A.dtype, B.dtype)
        if self.accumulator_type not in allowed:
            inputs = A.dtype if A.dtype == B.dtype else f"{A.dtype} x {B.dtype}"
            raise ShapeError(f"accumulator_type {self.accumulator_type} does not fit {inputs} inputs; "
                             f"use {' or '.join(str(t) for t in allowed)}.")
        if self.compute_dtype not in (torch.float32, torch.float64):
            raise ShapeError(f"compute_dtype must be torch.float32 or torch.float64, got {self.compute_dtype}.")

    def _check_aliasing(self) -> None:
        outs = list(self.outputs.items())
        for i, (name, dest) in enumerate(outs):
            for label, t in (("A", self.A), ("B", self.B)):
                if overlaps(dest, t):
                    raise ShapeError(f"Output {name} overlaps the GEMM input {label}.",
                                     hint="Write the epilogue's outputs to separate tensors.")
            for other, t in outs[i + 1:]:
                if overlaps(dest, t):
                    raise ShapeError(f"Outputs {name} and {other} overlap in memory.")
            for op_name, value in self.operands.items():
                if isinstance(value, torch.Tensor) and overlaps(dest, value):
                    same_view = (dest.data_ptr() == value.data_ptr() and dest.shape == value.shape
                                 and dest.stride() == value.stride() and name not in self.reductions)
                    if not same_view:
                        raise ShapeError(f"Output {name} partly overlaps operand {op_name}.",
                                         hint="An output may alias an operand only as the very same "
                                              "view (an in-place update such as D = C).")

    def reduction_op(self, name: str):
        """The reduction OpDef of output `name`, or None for a tile output."""
        node = self.graph.output(name).node
        return node.op if node.op.is_reduction else None

    def reduced_count(self, name: str) -> int:
        """How many elements one value of reduction output `name` folds together."""
        dims = next(o.node.params["dim"] for o in self.graph.outputs if o.name == name)
        sizes = dict(zip(AXES, (self.L, self.M, self.N)))
        return math.prod(sizes[a] for a in dims)


def _gemm_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, column) strides; batch 0 when the operand is shared across L."""
    if t.dim() == 3:
        return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2))
    return (0, t.stride(0), t.stride(1))


def get_kernels(args: GemmArguments, cc: int | None = None) -> list:
    """Every kernel that supports `args`, best first (the reference kernel last)."""
    return [k for k, status in kernel_statuses(args, cc) if status.ok]


def kernel_statuses(args: GemmArguments, cc: int | None = None) -> list:
    """(kernel, Status) for every kernel class and config, supported or not, best first.
    `args` may also be a GroupedGemmArguments (see epifuse.grouped)."""
    from .grouped import GroupedGemmArguments, grouped_kernel_statuses
    if not isinstance(args, (GemmArguments, GroupedGemmArguments)):
        raise EpilogueArgumentError(f"Kernels are chosen for a GemmArguments; got {type(args).__name__}.",
                                    hint="epifuse.get_kernels(epifuse.GemmArguments(A, B, epilogue=epi)).")
    if cc is not None and (not isinstance(cc, int) or isinstance(cc, bool) or cc <= 0):
        raise EpilogueArgumentError(f"cc must be a compute capability as an int such as 90, not {cc!r}.")
    if isinstance(args, GroupedGemmArguments):
        return grouped_kernel_statuses(args, cc)
    from .backends.reference import ReferenceKernel
    from .backends.triton import persistent, pingpong, splitk, tiled
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
    if persistent.leaves_sms_idle(args):  # first: the fastest there (benchmarks/RESULTS.md, 2026-11-25)
        candidates = [*(pingpong.GluonPingPong(c) for c in pingpong.small_grid_configs(args.A.dtype)),
                      *candidates]
    result = [(k, k.supports(args, cc)) for k in candidates]
    reference = ReferenceKernel()
    result.append((reference, reference.supports(args)))
    return result


_CHOSEN: dict[tuple, Any] = {}


def _choose_kernel(args: GemmArguments):
    """The best supported kernel, remembered per everything its support depends on."""
    from .backends.triton.persistent import b_fits_l2, leaves_sms_idle
    from .runtime.tune import shape_bucket
    # a bucket of shapes may straddle the small-grid or B-in-L2 thresholds, which change the candidates
    key = (args.key, args.A.device, args.A.dtype, args.B.dtype, shape_bucket(args), leaves_sms_idle(args),
           b_fits_l2(args),
           args.deterministic, args.compute_dtype, args.accumulator_type, args.precision,
           tuple((n, t.dtype) for n, t in args.outputs.items()),
           args.largest_span >= 2**31, layout_class(args.A), layout_class(args.B), operand_layouts(args))
    kernel = _CHOSEN.get(key)
    if kernel is None:
        from .runtime.tune import choose
        kernels = get_kernels(args)
        if not kernels:
            raise UnsupportedError("No kernel supports these arguments.")
        kernel = _CHOSEN[key] = choose(args, kernels)
    return kernel


def gemm(A: torch.Tensor, B: torch.Tensor, epilogue: Callable | str | Program | None = None, /, *,
         out_dtype: torch.dtype | None = None, accumulate: bool = False,
         deterministic: bool = False, compute_dtype: torch.dtype = torch.float32,
         precision: str = "default", **tensors):
    """`A @ B` with the epilogue fused; allocates any output not passed; returns the outputs.

    One output comes back as a tensor, several as a tuple in return order. Tile outputs are
    allocated in `out_dtype` (default: A's dtype; float32 for integer inputs), reduction
    outputs in float32. `precision="highest"` makes float32 inputs multiply in full fp32
    rather than tf32.

    >>> import torch, epifuse
    >>> from epifuse.ops import relu
    >>> def epi(accum, bias):
    ...     D = relu(accum + bias)
    ...     return D
    >>> A, B = torch.ones(4, 3), torch.ones(3, 5)
    >>> epifuse.gemm(A, B, epi, bias=torch.full((5,), -1.0))[0]
    tensor([2., 2., 2., 2., 2.])
    """
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise EpilogueArgumentError(f"out_dtype must be a torch.dtype such as torch.float16, not {out_dtype!r}.")
    # A kept launch first: its signature admits only calls that do not go through the custom
    # ops (torch.compile traces this function: nothing is looked up while it does)
    compiling = torch.compiler.is_compiling()
    key = None if compiling else callsite.signature(
        epilogue, A, B, tensors, (out_dtype, accumulate, deterministic, compute_dtype, precision))
    if key is not None:
        site = callsite.lookup(key)
        if site is not None:
            return site.call(A, B, tensors)
    if compiling or _through_torch_ops(A, B, tensors):
        from .torch_ops import gemm as gemm_op  # autograd and torch.compile: the custom ops
        return gemm_op(A, B, epilogue, out_dtype=out_dtype, accumulate=accumulate,
                       deterministic=deterministic, compute_dtype=compute_dtype,
                       precision=precision, **tensors)
    program = epilogue if isinstance(epilogue, Program) else parse(
        epilogue if epilogue is not None else IDENTITY_EPILOGUE)
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
        raise ShapeError("A and B must be torch tensors.")
    accum_shape, _ = accum_shape_of(A, B)
    missing = [name for name, _ in program.outputs if name not in tensors]
    if missing:
        roles = tuple(classify_operand(n, tensors[n], accum_shape, A.device)[0]
                      for n in program.operands if n in tensors)
        if len(roles) == len(program.operands):
            graph, _ = _bound_graph(program, roles, len(accum_shape))
            nodes = {o.name: o.node for o in graph.outputs}
            for name in missing:
                tensors[name] = _allocate_output(nodes[name], A, accum_shape, out_dtype)
    epi = EpilogueArguments(program, accumulate=accumulate, deterministic=deterministic,
                            compute_dtype=compute_dtype, **tensors)
    args = GemmArguments(A, B, epilogue=epi, precision=precision)
    kernel = _choose_kernel(args)
    kernel.run(args)
    returns = tuple(name for name, _ in program.outputs)
    callsite.remember(key, args, kernel, tuple(missing), returns)
    outputs = tuple(epi.outputs[name] for name in returns)
    return outputs[0] if len(outputs) == 1 else outputs


def _through_torch_ops(A, B, tensors: dict) -> bool:
    """Inputs that require grad and tensor subclasses (FakeTensor, ...) go through
    epifuse.torch_ops (custom ops with fake impls and a derived backward), as does everything
    while torch.compile traces (gemm asks that first)."""
    values = [t for t in (A, B, *tensors.values()) if isinstance(t, torch.Tensor)]
    return any(type(t) not in callsite.PLAIN_TENSOR_TYPES for t in values) or (
        torch.is_grad_enabled() and any(t.requires_grad for t in values))


def _allocate_output(node, A, accum_shape, out_dtype):
    if node.op.is_reduction:
        axes = AXES[3 - len(accum_shape):]
        shape = [s for a, s in zip(axes, accum_shape) if a not in node.params["dim"]]
        return torch.empty(shape or (1,), device=A.device, dtype=torch.float32)
    dtype = out_dtype or (A.dtype if A.is_floating_point() else torch.float32)
    return torch.empty(accum_shape, device=A.device, dtype=dtype)
