"""Named epilogues: CUTLASS's classic epilogue functors, built on the one epifuse pipeline.

Each named epilogue is generated as epilogue *source* from templates over the ops registry's
names, so it is parsed, bound, optimized and lowered exactly like a user's function. It is a
`str` (its own source), which makes it usable wherever an epilogue function or string is:

>>> import torch, epifuse
>>> from epifuse.epilogues import LinearCombinationRelu
>>> epi = LinearCombinationRelu()
>>> print(epi, end="")
def linear_combination_relu(accum, alpha, beta, C):
    F = alpha * accum + beta * C
    D = relu(F)
    return D
>>> A, B, C = torch.ones(2, 3), -torch.ones(3, 2), torch.full((2, 2), 5.0)
>>> epi(A, B, alpha=1.0, beta=1.0, C=C)          # or epifuse.gemm(A, B, epi, ...)
tensor([[2., 2.],
        [2., 2.]])

    LinearCombination(scale, activation)   D = activation(alpha * accum + beta * C)
    LinearCombination{Relu,GELU,Sigmoid,Silu,Hardswish,LeakyRelu,Clamp}
    BiasElementwise(activation)            D = activation(alpha * accum + beta * C + bias)
    LinearCombinationBiasRelu()            D = max(alpha * accum + beta * C + bias, threshold), T the mask
    LinearCombinationTensorBroadcast(...)  D = unary(bin1(bin0(act(alpha * accum + bias), beta * C0), beta * C1))
    LinearCombinationPlanarComplex()       D = alpha * accum + beta * C in complex arithmetic (planar complex GEMMs)
    Generic(activation)                    a user's `def act(x): ...`, parsed (never run) and inlined

`scale` is a `ScaleType` (CUTLASS's names): DEFAULT (alpha and beta), NO_BETA_SCALING
(D = alpha * accum + C), ONLY_ALPHA_SCALING (no C), NOTHING (D = accum). alpha and beta may
be numbers, one-element tensors (read at run time), per-channel vectors ((N,) or (M, 1)), or
per-batch (L,) arrays: calling the epilogue (`epi(A, B, ...)`, `epi.arguments(A, B, ...)`)
reshapes a per-batch (L,) array to (L, 1, 1). Called that way, alpha and beta default to 1.0
(as in torch.addmm). `D` may be the very tensor `C` (an in-place update).

Unlike torch.addmm, `beta * C` is plain arithmetic: with beta = 0, NaN and Inf in C still
propagate (the epilogue means what its source says).
"""
from __future__ import annotations

import enum
from typing import Any, Callable

import torch

from .activations import (CUTLASS_NAMES, GELU, Activation, Clamp, Hardswish, Identity, LeakyRelu,  # noqa: F401
                          Relu, Sigmoid, Silu, Tanh, as_activation)  # (CUTLASS's names, re-exported here)
from .activations import activation_prefix
from .api import gemm
from .planar import gemm_planar_complex, planar_arguments
from .allocation import allocate_outputs
from .arguments import EpilogueArguments, GemmArguments
from .errors import EpilogueArgumentError, flag
from .frontend import parse
from .shapes import accum_shape_of


# ---- scale types -----------------------------------------------------------------------------


class ScaleType(enum.Enum):
    """How alpha and beta enter `alpha * accum + beta * C` (CUTLASS's ScaleType::Kind)."""

    DEFAULT = "default"                        # alpha * accum + beta * C
    NO_BETA_SCALING = "no_beta_scaling"        # alpha * accum + C
    ONLY_ALPHA_SCALING = "only_alpha_scaling"  # alpha * accum
    NOTHING = "nothing"                        # accum
    # CUTLASS's per-channel kinds are the same templates with (N,) alpha/beta tensors:
    PER_CHANNEL_SCALING = "default"
    ONLY_ALPHA_PER_CHANNEL_SCALING = "only_alpha_scaling"

    @classmethod
    def of(cls, value) -> "ScaleType":
        """A ScaleType from itself or a name: "default", "NoBetaScaling", "only_alpha_scaling"."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = "".join(c for c in value.lower() if c.isalnum())
            for member in cls.__members__.values():
                if key == member.value.replace("_", ""):
                    return member
        raise EpilogueArgumentError(f"Unknown scale type {value!r}.",
                                    hint="Use epifuse.epilogues.ScaleType.DEFAULT, NO_BETA_SCALING, "
                                         "ONLY_ALPHA_SCALING or NOTHING.")


_LINEAR = {
    ScaleType.DEFAULT: (("alpha", "beta", "C"), "alpha * accum + beta * C"),
    ScaleType.NO_BETA_SCALING: (("alpha", "C"), "alpha * accum + C"),
    ScaleType.ONLY_ALPHA_SCALING: (("alpha",), "alpha * accum"),
    ScaleType.NOTHING: ((), "accum"),
}
#: Roles a picture of the DAG (`epifuse show`) assumes for the template operands.
_ROLES = {"alpha": "number", "beta": "number", "C": "tile", "bias": "row", "C0": "tile", "C1": "tile",
          "threshold": "number"}


# ---- the named epilogues ----------------------------------------------------------------------


def _restore(cls, source: str, state: dict):
    obj = str.__new__(cls, source)
    obj.__dict__.update(state)
    return obj


class NamedEpilogue(str):
    """An epilogue built from a template. Its string value is its source (so it goes wherever
    an epilogue function or string goes); calling it runs the GEMM with it fused.

    Attributes: `title` (the CUTLASS-style name), `operands`, `outputs`, `roles` (the operand
    roles `epifuse show` draws), `per_batch` (operands that may be per-batch (L,) arrays).
    """

    def __new__(cls, *args, **kwargs):
        if cls is NamedEpilogue:
            raise TypeError("NamedEpilogue is built by its subclasses (LinearCombination, ...).")
        return super().__new__(cls, *args, **kwargs)

    @classmethod
    def _build(cls, source: str, title: str, description: str, per_batch=("alpha", "beta")):
        self = str.__new__(cls, source)
        self.title = title
        self.description = description
        self.program = parse(source)       # validates now: errors surface at construction
        self.operands = self.program.operands
        self.outputs = tuple(n for n, _ in self.program.outputs)
        self.roles = {n: _ROLES[n] for n in self.operands if n in _ROLES}
        self.per_batch = tuple(n for n in per_batch if n in self.operands)
        return self

    def __reduce__(self):
        return (_restore, (type(self), str(self), dict(self.__dict__)))

    def __repr__(self) -> str:
        return self.description

    @property
    def source(self) -> str:
        return str(self)

    # ---- running -----------------------------------------------------------------------------
    def prepare(self, A: torch.Tensor, B: torch.Tensor, tensors: dict) -> dict:
        """The keyword tensors with defaults (alpha = beta = 1.0, threshold = 0.0) and
        per-batch (L,) alpha/beta reshaped to (L, 1, 1)."""
        tensors = dict(tensors)
        for name, default in (("alpha", 1.0), ("beta", 1.0), ("threshold", 0.0)):
            if name in self.operands:
                tensors.setdefault(name, default)
        return per_batch_scalars(tensors, self.per_batch, A, B)

    def __call__(self, A: torch.Tensor, B: torch.Tensor, **kwargs):
        """`epifuse.gemm(A, B, self, **kwargs)` after `prepare`: returns D (or D and Z)."""
        return gemm(A, B, self, **self.prepare(A, B, kwargs))

    def arguments(self, A: torch.Tensor, B: torch.Tensor, *, accumulator_type=torch.float32,
                  precision: str = "default", compute_dtype: torch.dtype | None = None,
                  out_dtype: torch.dtype | None = None, **tensors):
        """GemmArguments for `get_kernels` / `kernel.run`; outputs not passed are allocated."""
        tensors = allocate_outputs(self.program, A, B, self.prepare(A, B, tensors), out_dtype, compute_dtype)
        epi = EpilogueArguments(self, compute_dtype=compute_dtype, **tensors)
        return GemmArguments(A, B, out=tensors.get("D"), accumulator_type=accumulator_type,
                             epilogue=epi, precision=precision)


def per_batch_scalars(tensors: dict, names, A: torch.Tensor, B: torch.Tensor) -> dict:
    """Reshape each (L,) tensor among `names` to (L, 1, 1), a per-batch scalar, for a batched
    GEMM. (L,) is ambiguous when L == N (it is also a row); that raises with the fix."""
    accum_shape, (L, M, N, K) = accum_shape_of(A, B)
    if len(accum_shape) != 3:
        return tensors
    out = dict(tensors)
    for name in names:
        value = out.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == L and L > 1:
            if L == N:
                raise EpilogueArgumentError(
                    f"{name} has shape ({L},), which is both one value per batch (L={L}) and one "
                    f"per column (N={N}).",
                    hint=f"Pass {name}.reshape({L}, 1, 1) for per-batch or {name}.reshape(1, {N}) "
                         "for per-column values.")
            out[name] = value.reshape(L, 1, 1)
    return out


def _linear_source(fname: str, scale: ScaleType, activation: Activation, bias: bool,
                   store_preactivation: bool) -> str:
    operands, expression = _LINEAR[scale]
    params = ["accum", *operands] + (["bias"] if bias else [])
    if bias:
        expression = f"{expression} + bias" if expression != "accum" else "accum + bias"
    pre = "Z" if store_preactivation else "F"
    if activation.is_identity and not store_preactivation:
        body = [f"D = {expression}"]
    else:
        body = [f"{pre} = {expression}", *activation.statements(pre, "D")]
    outputs = "D, Z" if store_preactivation else "D"
    lines = [f"def {fname}({', '.join(params)}):", *(f"    {s}" for s in body), f"    return {outputs}"]
    return "\n".join(lines) + "\n"


def _snake(title: str) -> str:
    out = []
    for i, c in enumerate(title):
        if c.isupper() and i and (not title[i - 1].isupper() or (i + 1 < len(title) and title[i + 1].islower())):
            out.append("_")
        out.append(c.lower())
    return "".join(out)


class LinearCombination(NamedEpilogue):
    """D = activation(alpha * accum + beta * C), per `scale` (a ScaleType or its name)."""

    def __new__(cls, scale: ScaleType | str = ScaleType.DEFAULT, activation: Any = None):
        scale = ScaleType.of(scale)
        act = as_activation(activation)
        title = cls.__name__
        source = _linear_source(_snake(title), scale, act, bias=False, store_preactivation=False)
        args = [] if scale is ScaleType.DEFAULT else [f"scale=ScaleType.{scale.name}"]
        if cls is LinearCombination and not act.is_identity:
            args.append(f"activation={act!r}")
        return cls._build(source, title, f"{title}({', '.join(args)})")


def _variant(name: str, make: Callable[..., Activation], doc: str, params: str = ""):
    """A LinearCombination<Activation> class whose constructor takes the activation's
    parameters (keywords) and `scale`."""

    def __new__(cls, *args, scale: ScaleType | str = ScaleType.DEFAULT, **kwargs):
        act = make(*args, **kwargs)
        scale = ScaleType.of(scale)
        source = _linear_source(_snake(name), scale, act, bias=False, store_preactivation=False)
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        return cls._build(source, name, f"{name}({', '.join(shown)})")

    return type(name, (LinearCombination,), {"__new__": __new__, "__doc__": doc, "__module__": __name__})


LinearCombinationRelu = _variant("LinearCombinationRelu", Relu, "D = relu(alpha * accum + beta * C)")
LinearCombinationGELU = _variant("LinearCombinationGELU", GELU,
                                 'D = gelu(alpha * accum + beta * C); approximate="none" (erf) or "tanh"')
LinearCombinationSigmoid = _variant("LinearCombinationSigmoid", Sigmoid, "D = sigmoid(alpha * accum + beta * C)")
LinearCombinationSilu = _variant("LinearCombinationSilu", Silu, "D = silu(alpha * accum + beta * C)")
LinearCombinationHardswish = _variant("LinearCombinationHardswish", Hardswish,
                                      "D = hardswish(alpha * accum + beta * C)")
LinearCombinationLeakyRelu = _variant("LinearCombinationLeakyRelu", LeakyRelu,
                                      "D = leaky_relu(alpha * accum + beta * C, slope) (slope default 0.01)")
LinearCombinationClamp = _variant("LinearCombinationClamp", Clamp,
                                  "D = clamp(alpha * accum + beta * C, min, max)")


class BiasElementwise(NamedEpilogue):
    """D = activation(alpha * accum + beta * C + bias); with `store_preactivation=True` also
    the pre-activation Z (returned as D, Z), as CUTLASS's LinearCombinationBiasElementwise."""

    def __new__(cls, activation: Any = None, scale: ScaleType | str = ScaleType.DEFAULT,
                store_preactivation: bool = False):
        scale = ScaleType.of(scale)
        act = as_activation(activation)
        source = _linear_source("bias_elementwise", scale, act, bias=True,
                                store_preactivation=flag("store_preactivation", store_preactivation))
        shown = [] if act.is_identity else [repr(act)]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        if store_preactivation:
            shown.append("store_preactivation=True")
        return cls._build(source, "BiasElementwise", f"BiasElementwise({', '.join(shown)})")


class Generic(NamedEpilogue):
    """D = activation(alpha * accum + beta * C) for a user's one-argument activation function
    (`def act(x): ...; return y`), parsed, never called, and inlined into the epilogue."""

    def __new__(cls, activation: Any, scale: ScaleType | str = ScaleType.DEFAULT):
        if activation is None:
            raise EpilogueArgumentError("Generic needs an activation function.",
                                        hint="Pass `def act(x): y = ...; return y` (or use LinearCombination).")
        scale = ScaleType.of(scale)
        act = as_activation(activation)
        source = _linear_source("linear_combination_generic", scale, act, bias=False,
                                store_preactivation=False)
        shown = [act.label if act.function is not None else repr(act)]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        return cls._build(source, "Generic", f"Generic({', '.join(shown)})")


LinearCombinationGeneric = Generic


class LinearCombinationBiasRelu(NamedEpilogue):
    """CUTLASS's LinearCombinationBiasRelu: z = alpha * accum + beta * C + bias, D = z where
    z >= threshold, else threshold (fmax's reading: NaN gives threshold), and, with `store_mask`
    (CUTLASS's StoreT, default on), T = 1 where z is not below threshold (NaN too), else 0, the
    mask a ReLU backward reads (one value per element in T's dtype, where CUTLASS packs bits).
    threshold is an operand (default 0.0). z is compared before rounding to D's dtype."""

    def __new__(cls, store_mask: bool = True, scale: ScaleType | str = ScaleType.DEFAULT):
        scale = ScaleType.of(scale)
        operands, expression = _LINEAR[scale]
        store = flag("store_mask", store_mask)
        params = ["accum", *operands, "bias", "threshold"]
        lines = [f"def linear_combination_bias_relu({', '.join(params)}):",
                 f"    z = {expression} + bias" if expression != "accum" else "    z = accum + bias",
                 "    D = where(z >= threshold, z, threshold)"]
        if store:
            lines.append("    T = where(z < threshold, 0.0, 1.0)")
        lines.append(f"    return {'D, T' if store else 'D'}")
        shown = [] if store else ["store_mask=False"]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        return cls._build("\n".join(lines) + "\n", "LinearCombinationBiasRelu",
                          f"LinearCombinationBiasRelu({', '.join(shown)})")


#: CUTLASS's binary functors for LinearCombinationTensorBroadcast, as epilogue source
BINARY_OPS = {"plus": "{a} + {b}", "minus": "{a} - {b}", "multiplies": "{a} * {b}", "divides": "{a} / {b}",
              "maximum": "maximum({a}, {b})", "minimum": "minimum({a}, {b})"}


def _binary(name, which: str) -> str | None:
    if name is None or name == "none":
        return None
    if name not in BINARY_OPS:
        raise EpilogueArgumentError(f"{which} {name!r} is not one of CUTLASS's binary ops epifuse names.",
                                    hint=f"Use one of {', '.join(BINARY_OPS)}, or None for no operation.")
    return BINARY_OPS[name]


class LinearCombinationTensorBroadcast(NamedEpilogue):
    """CUTLASS's LinearCombinationTensorBroadcast:
        O0 = activation(alpha * accum + bias)
        O1 = binary_op0(O0, beta * C0)        (None: no C0)
        O2 = binary_op1(O1, beta * C1)        (None: no C1)
        D  = unary_op(O2)
    Binary ops by CUTLASS's functor names: plus, minus, multiplies, divides, maximum, minimum.
    `scale` DEFAULT, or NO_BETA_SCALING (C0 and C1 unscaled)."""

    def __new__(cls, activation: Any = None, binary_op0: str | None = "plus", binary_op1: str | None = None,
                unary_op: Any = None, scale: ScaleType | str = ScaleType.DEFAULT):
        scale = ScaleType.of(scale)
        if scale not in (ScaleType.DEFAULT, ScaleType.NO_BETA_SCALING):
            raise EpilogueArgumentError(
                f"LinearCombinationTensorBroadcast takes scale DEFAULT or NO_BETA_SCALING, not {scale.name}.",
                hint="Without beta the sources enter as they are (NO_BETA_SCALING); for no sources, pass "
                     "binary_op0=None.")
        act, unary = as_activation(activation), as_activation(unary_op)
        ops = [_binary(binary_op0, "binary_op0"), _binary(binary_op1, "binary_op1")]
        beta = scale is ScaleType.DEFAULT and any(ops)
        sources = [f"C{i}" for i, op in enumerate(ops) if op]
        params = ["accum", "alpha", *(["beta"] if beta else []), "bias", *sources]
        body = ["O0 = alpha * accum + bias" if act.is_identity else "Z = alpha * accum + bias"]
        inlined = 0   # functions inlined so far: each one's locals get a prefix of their own
        if not act.is_identity:
            body += act.statements("Z", "O0", activation_prefix(inlined))
            if act.function is not None:
                inlined += 1
        current = "O0"
        for i, op in enumerate(ops):
            if op:
                source = f"(beta * C{i})" if beta else f"C{i}"
                body.append(f"O{i + 1} = {op.format(a=current, b=source)}")
                current = f"O{i + 1}"
        body += unary.statements(current, "D", activation_prefix(inlined)) if not unary.is_identity \
            else [f"D = {current}"]
        source = "\n".join([f"def linear_combination_tensor_broadcast({', '.join(params)}):",
                            *(f"    {line}" for line in body), "    return D"]) + "\n"
        shown = [] if act.is_identity else [f"activation={act!r}"]
        if binary_op0 != "plus":
            shown.append(f"binary_op0={binary_op0!r}")
        if binary_op1 is not None:
            shown.append(f"binary_op1={binary_op1!r}")
        if not unary.is_identity:
            shown.append(f"unary_op={unary!r}")
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        return cls._build(source, "LinearCombinationTensorBroadcast",
                          f"LinearCombinationTensorBroadcast({', '.join(shown)})")

class LinearCombinationPlanarComplex(NamedEpilogue):
    """CUTLASS's LinearCombinationPlanarComplex: D = alpha * accum + beta * C in complex
    arithmetic, for a planar complex GEMM (epifuse.gemm_planar_complex): accum, C and D complex
    (C and D as (re, im) pairs of real tensors or torch complex tensors), alpha and beta complex
    numbers, one-element complex tensors or anything real (default 1.0). `scale` as for
    LinearCombination. Called as `epi(Ar, Ai, Br, Bi, **kwargs)`."""

    def __new__(cls, scale: ScaleType | str = ScaleType.DEFAULT):
        scale = ScaleType.of(scale)
        operands, expression = _LINEAR[scale]
        source = (f"def linear_combination_planar_complex({', '.join(['accum', *operands])}):\n"
                  f"    D = {expression}\n    return D\n")
        shown = "" if scale is ScaleType.DEFAULT else f"scale=ScaleType.{scale.name}"
        return cls._build(source, "LinearCombinationPlanarComplex", f"LinearCombinationPlanarComplex({shown})",
                          per_batch=())

    def __call__(self, Ar: torch.Tensor, Ai: torch.Tensor, Br: torch.Tensor, Bi: torch.Tensor, **kwargs):
        """`epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, self, **kwargs)` with alpha = beta = 1.0
        by default: returns D."""
        return gemm_planar_complex(Ar, Ai, Br, Bi, self, **self.prepare(Ar, Br, kwargs))

    def arguments(self, Ar: torch.Tensor, Ai: torch.Tensor, Br: torch.Tensor, Bi: torch.Tensor, *,
                  accumulator_type=torch.float32, precision: str = "default",
                  compute_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None, **tensors):
        """GemmArguments (planar complex) for `get_kernels` / `kernel.run`; D is allocated if not passed."""
        args, _ = planar_arguments(Ar, Ai, Br, Bi, self, out_dtype=out_dtype, compute_dtype=compute_dtype,
                                   precision=precision, accumulator_type=accumulator_type,
                                   **self.prepare(Ar, Br, tensors))
        return args


#: Every named epilogue class, by name (the docs and `epifuse show module:Name` read it).
NAMED = {c.__name__: c for c in (
    LinearCombination, LinearCombinationRelu, LinearCombinationGELU, LinearCombinationSigmoid,
    LinearCombinationSilu, LinearCombinationHardswish, LinearCombinationLeakyRelu,
    LinearCombinationClamp, BiasElementwise, Generic, LinearCombinationBiasRelu,
    LinearCombinationTensorBroadcast, LinearCombinationPlanarComplex)}

__all__ = ["ScaleType", "Activation", "as_activation", "NamedEpilogue", "per_batch_scalars",
           *CUTLASS_NAMES, *NAMED, "LinearCombinationGeneric", "NAMED"]

