"""The ops registry: one `OpDef` per op, read by every part of epifuse.

The parser's vocabulary, the binder, the passes, the reference interpreter, autodiff, every
backend's lowering table, the op reference in the docs and the "did you mean" suggestions all
come from `OPS`. A reduction is an op too: its `Reduction` record says what it folds and how
partial results combine, which is all a backend reads to accumulate it. A backend that has no
rule for an op reports the op as unsupported, never a KeyError.

IR nodes hold their `OpDef` (`node.op is ops.relu`); ops compare by identity only, and
comparing one with a string raises, so a stale `node.op == "relu"` cannot silently be False.

Derivative rules (`vjp`) are written with the ops themselves: applied to a `Symbolic` value
(an IR node in disguise, `epifuse.ir.Sym`) an op builds a node instead of running torch, so a
backward is itself a Graph that every backend lowers (`epifuse.autodiff`).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Cost:
    """Per-element cost of an op: plain arithmetic and special-function (exp, log, ...) ops."""

    flops: int = 1
    special: int = 0


# How two partial results of a reduction fold, as the torch function that folds a tensor along
# dims and the one that folds two tensors elementwise (NaN propagates through both, as in torch).
_FOLDS = {"add": (torch.sum, torch.add), "maximum": (torch.amax, torch.maximum),
          "minimum": (torch.amin, torch.minimum),
          # a partial is the log-sum-exp of its elements; log-sum-exps of disjoint parts fold
          # into the whole's by a log-sum-exp of theirs
          "logsumexp": (torch.logsumexp, torch.logaddexp)}


@dataclass(frozen=True)
class Reduction:
    """What a reduction op computes, for every backend.

    combine     how partial results fold: "add", "maximum", "minimum" or "logsumexp"
    identity    what an element outside the problem contributes (a masked edge of a tile)
    magnitude   folds |x| rather than x (amax)
    mean        the result is divided by the number of elements folded
    needs_elements  an empty fold has no value (a maximum of nothing): refused up front
    """

    combine: str
    identity: float
    magnitude: bool = False
    mean: bool = False
    needs_elements: bool = False

    def __post_init__(self):
        if self.combine not in _FOLDS:
            raise ValueError(f"unknown combine {self.combine!r}; one of {sorted(_FOLDS)}")

    def fold(self, x: torch.Tensor, dims) -> torch.Tensor:
        """Partial results `x` folded along `dims` (no division for a mean)."""
        return _FOLDS[self.combine][0](x, dim=dims)

    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Two results folded into one (what `accumulate=True` does with a destination)."""
        return _FOLDS[self.combine][1](a, b)


class Symbolic:
    """A value that builds IR when an op is applied to it (`epifuse.ir.Sym` is the one kind).

    Subclasses implement `apply(op, args, params)`; the registry only recognizes them, so it
    does not depend on the IR.
    """

    __slots__ = ()

    @classmethod
    def apply(cls, op: "OpDef", args: tuple, params: dict) -> "Symbolic":
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class OpDef:
    """One op.

    name       canonical name (torch's where torch has one)
    arity      number of tensor inputs
    ref        torch reference: ref(*tensors, **params)
    params     compile-time parameters with their defaults, in torch's positional order
    kind       "elementwise", "compare" (bool result), "logical" (bool in and out), "cast",
               "reduce" (with `reduction`), "index" (no inputs: the position of each element
               along `axis`), "composite" (written as other ops: `expand`), "join" (a gated
               epilogue's two half-width tiles side by side, as an output of full width: the
               kernel's store writes each piece), or "leaf" (accum, literals and operands: IR only)
    aliases    other names a user may write (torch.multiply, torch.clip, ...)
    doc        one line for the op reference
    commutative, identity   algebraic traits the rewrite rules read
    selects    the inputs the result is always one of (where's a and b, maximum's two): where
               they all are conditions, so is the result, as in torch
    vjp        derivative rule: vjp(g, *inputs, y, **params) -> one gradient per input (a Sym,
               or None where no gradient flows), built from ops on `Sym` values; g is the
               gradient of the result y. Reductions also get `count=` (a Sym: how many
               elements each result folds). Every op has one (comparisons return Nones).
    reduction  for kind "reduce": what it folds and how (see Reduction)
    axis       for kind "index": the accum axis ("M" or "N") it counts along
    expand     for kind "composite": expand(call, *inputs, **params) builds the op from others
               with call(name, *args, **params), in the parser, so nothing after it sees the op
    sequence   the tensor inputs are written as one tuple, as torch.cat takes them:
               cat((a, b), dim=-1)
    complex    the op's meaning on complex values (a planar complex GEMM's epilogue, rewritten
               over real and imaginary parts by epifuse.complex_parts): complex(call, *inputs,
               **params), each input an (re, im) pair, builds the result from real ops with
               call(name, *args, **params) and returns an (re, im) pair, or one value where the
               result is real (abs). A part that is None is exactly zero (a real value's
               imaginary part). None here: the op refuses complex inputs.
    """

    name: str
    arity: int
    ref: Callable[..., torch.Tensor] | None
    params: tuple[tuple[str, Any], ...] = ()
    kind: str = "elementwise"
    aliases: tuple[str, ...] = ()
    doc: str = ""
    commutative: bool = False
    identity: float | None = None
    selects: tuple[int, ...] = ()
    cost: Cost = field(default_factory=Cost)
    vjp: Callable[..., tuple] | None = None
    reduction: Reduction | None = None
    axis: str | None = None
    expand: Callable[..., Any] | None = None
    sequence: bool = False
    complex: Callable[..., Any] | None = None

    def __post_init__(self):
        if (self.kind == "reduce") != (self.reduction is not None):
            raise ValueError(f"op {self.name}: a reduction needs kind 'reduce' and a Reduction, and only it")
        if (self.kind == "index") != (self.axis in ("M", "N")) or (self.kind == "index" and self.arity):
            raise ValueError(f"op {self.name}: an index takes no inputs and counts along axis 'M' or 'N', "
                             "and only it has an axis")
        if (self.kind == "composite") != (self.expand is not None):
            raise ValueError(f"op {self.name}: a composite needs an expand, and only it")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.params)

    @property
    def input_names(self) -> str:
        """How the op reference names its tensor inputs: "x", "a, b", "cond, a, b", ..."""
        return _INPUT_NAMES.get(self.name) or _INPUTS_BY_ARITY.get(
            self.arity, ", ".join(f"x{i}" for i in range(self.arity)))

    @property
    def is_reduction(self) -> bool:
        return self.reduction is not None

    @property
    def is_leaf(self) -> bool:
        return self.kind == "leaf"

    @property
    def makes_bool(self) -> bool:
        """Whether the result is a condition (a comparison or logic)."""
        return self.kind in ("compare", "logical")

    def __eq__(self, other):
        if isinstance(other, str):
            raise TypeError(f"an OpDef compared with the string {other!r}: compare ops by identity "
                            f"(node.op is ops.{other}) or by name (node.op.name == {other!r})")
        return self is other

    __hash__ = object.__hash__

    def __call__(self, *args, **kwargs):
        """Run the op on torch tensors (or numbers), so an epilogue is its own reference.

        The same reading as the parser's: max(a, b) / min(a, b) with a second operand that is
        not an int dim are elementwise; clamp bounds may be tensors.
        """
        if self.kind == "index":   # col(accum): the positions in accum's shape
            return self.ref(*args, **kwargs)
        if self.sequence:   # cat((a, b), dim): the tensors as one tuple
            if not args or not isinstance(args[0], (tuple, list)) or len(args[0]) != self.arity:
                raise TypeError(f"{self.name}() takes its {self.arity} tensors as one tuple: "
                                f"{self.name}(({self.input_names}), ...)")
            args = (*args[0], *args[1:])
        symbolic = next((a for a in args[:self.arity] if isinstance(a, Symbolic)), None)
        if symbolic is not None:
            params = dict(zip(self.param_names, args[self.arity:]))
            params.update(kwargs)
            return type(symbolic).apply(self, args[:self.arity], params)
        if self.name in ("max", "min") and len(args) == 2 and not kwargs and not isinstance(args[1], (int, tuple)):
            return OPS["maximum" if self.name == "max" else "minimum"](*args)
        tensors = [a if isinstance(a, torch.Tensor) else torch.as_tensor(a) for a in args[:self.arity]]
        params = dict(self.params)
        for name, value in zip(self.param_names, args[self.arity:]):
            params[name] = value
        params.update(kwargs)
        return self.ref(*tensors, **params)

    def __repr__(self) -> str:
        return f"OpDef({self.name})"


class _OpDoc:
    """OpDef's `__doc__`: the class's docstring on the class, and on each op its own, written
    from its registry entry (op_doc) when asked for, so `help(epifuse.ops.gelu)` says what gelu
    computes."""

    def __init__(self, class_doc: str):
        self.class_doc = class_doc

    def __get__(self, op, owner=None):
        return self.class_doc if op is None else op_doc(op)


OpDef.__doc__ = _OpDoc(OpDef.__doc__)

_INPUTS_BY_ARITY = {0: "", 1: "x", 2: "a, b", 3: "a, b, c"}
_INPUT_NAMES = {"where": "cond, a, b", "prelu": "x, weight", "multiply_add": "a, b, c"}
_KINDS = {"elementwise": "an elementwise op", "compare": "a comparison (a boolean result)",
          "logical": "logic on conditions (a boolean result)", "cast": "a rounding through a narrower type",
          "reduce": "a reduction over accum's dims", "index": "an index (where each element of accum is)",
          "composite": "a composite (the parser writes it as other ops)",
          "join": "a join of a gated epilogue's two half-width tiles into one output of full width",
          "complex": "a part of a complex value (complex epilogues only: epifuse.gemm_planar_complex)",
          "leaf": "an IR leaf (not an op a user writes)"}


def torch_reference(op: OpDef) -> str | None:
    """The torch function an op's reference is, by name ("torch.nn.functional.gelu"), or None
    where it is a formula of several: read from the reference itself (a torch function, or a
    function of epifuse's that calls one of the op's name), never kept by hand."""
    if op.reduction is not None:
        r = op.reduction
        fold = torch.mean if r.mean else _FOLDS[r.combine][0]
        return f"torch.{fold.__name__}({'x.abs()' if r.magnitude else 'x'}, dim, keepdim)"
    ref = op.ref
    if ref is None:
        return None
    name, module = getattr(ref, "__name__", ""), getattr(ref, "__module__", None) or ""
    if module.split(".")[0] == "torch" and name.isidentifier():
        return f"{module}.{name}"
    code, scope = getattr(ref, "__code__", None), getattr(ref, "__globals__", {})
    if code is None:
        return None
    modules = [scope[n] for n in code.co_names
               if isinstance(scope.get(n), types.ModuleType) and scope[n].__name__.split(".")[0] == "torch"]
    for spelling in (op.name, *op.aliases):
        for m in modules:
            if spelling in code.co_names and hasattr(m, spelling):
                return f"{m.__name__}.{spelling}"
    return None


def op_doc(op: OpDef) -> str:
    """The docstring of one op, from its registry entry: what it computes, its arguments, its
    torch reference, its other spellings, its derivative rule and its cost."""
    inputs = f"({op.input_names})" if op.sequence else op.input_names
    args = ", ".join(filter(None, [inputs, *(f"{p}={v!r}" for p, v in op.params)]))
    lines = [f"{op.name}({args}): {_KINDS.get(op.kind, op.kind)}.", ""]
    if op.doc:
        lines += [f"Computes: {op.doc}", ""]
    inputs = "a tensor" if op.arity == 1 else "tensors"
    described = [f"{op.input_names}: {inputs} (in an epilogue, its values)"] if op.input_names else []
    if op.reduction is not None:
        described.append("dim: accum's dims to reduce (None: all of them, a 0-d result as torch "
                         "gives); keepdim: accepted, but the shape is the destination's: pass one with the "
                         "reduced dims as size 1 to keep them (an allocated output drops them)")
    else:
        described += [f"{p}: a literal (default {v!r})" for p, v in op.params]
    if described:
        lines.append("Arguments: " + "; ".join(described) + ".")
    if op.ref is not None:
        reference = torch_reference(op)
        lines.append((f"Torch reference: {reference}. " if reference else "")
                     + f"Called on torch tensors, epifuse.ops.{op.name} runs its torch reference; "
                     "inside an epilogue the name is parsed, never called.")
    if op.aliases:
        lines.append("Also spelled: " + ", ".join(op.aliases) + ".")
    if op.complex is not None and op.kind != "complex":
        lines.append("Complex values: yes (in a planar complex GEMM's epilogue).")
    if op.makes_bool:
        lines.append("Derivative: none (a boolean result carries no gradient).")
    elif op.kind == "index":
        lines.append("Derivative: none (a position carries no gradient).")
    elif op.kind == "composite":
        lines.append("Derivative: that of the ops it is written as.")
    elif op.kind == "complex":
        lines.append("Derivative: none (complex epilogues run without autograd).")
    elif op.kind == "join":
        lines.append("Derivative: none (autograd through epifuse refuses it; call under torch.no_grad()).")
    elif op.kind != "leaf":
        lines.append("Derivative: " + ("yes (autograd through epifuse differentiates it)." if op.vjp
                                       else "none (autograd through it raises)."))
    if op.kind != "leaf":
        special = op.cost.special
        cost = _count(op.cost.flops, "flop") + (f" + {_count(special, 'special-function op')}" if special else "")
        lines += [f"Cost: {cost} per element.", "",
                  "The op reference, with which kernels lower each op: docs/ops.md."]
    return "\n".join(lines).rstrip()


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


OPS: dict[str, OpDef] = {}
_SPELLINGS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.is_leaf:
        raise ValueError(f"{op.name} is an IR leaf, not an op a user may write")
    for spelling in (op.name, *op.aliases):
        if spelling in _SPELLINGS:
            raise RuntimeError(f"op spelling {spelling!r} registered twice")
        _SPELLINGS[spelling] = op
    OPS[op.name] = op
    return op


def lookup(spelling: str) -> OpDef | None:
    """The op a user-written name means, or None."""
    return _SPELLINGS.get(spelling)


def spellings() -> list[str]:
    return sorted(_SPELLINGS)


def reductions() -> list[OpDef]:
    """Every reduction op, in registration order."""
    return [op for op in OPS.values() if op.is_reduction]
