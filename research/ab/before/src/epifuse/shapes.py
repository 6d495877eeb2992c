"""Shapes, roles and strides: how each tensor lines up with accum's (L, M, N).

Roles follow torch broadcasting against accum: a number or one-element tensor is a scalar;
(N,), (1, N), (L, 1, N) a row; (M, 1), (L, M, 1) a column; (M, N), (L, M, N) a tile;
(L, 1, 1) a per-batch scalar. A role is the set of accum axes the operand varies along.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake

from .errors import ShapeError
from .ir import AXES, Operand
from .stand_in import StandIn


HALF_ACCUMULATING = (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def accumulator_types(a_dtype: torch.dtype, b_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The accumulator types a GEMM of these input dtypes may use, the default first."""
    if not a_dtype.is_floating_point:
        return (torch.int32,)
    if a_dtype in HALF_ACCUMULATING and b_dtype in HALF_ACCUMULATING:
        return (torch.float32, torch.float16)
    return (torch.float32,)


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_stand_in(t: torch.Tensor) -> bool:
    """Whether `t` is a planning stand-in without memory: a meta tensor, a StandIn (stand_in.py)
    or a fake tensor (FakeTensor, and functional wrappers of one). Kernels are chosen and
    compiled from its metadata; it is never read or written."""
    if type(t) in _PLAIN:
        return t.is_meta
    return t.is_meta or isinstance(t, StandIn) or is_fake(t)


def misalignment(t: torch.Tensor) -> int:
    """How many bytes past a 16-byte boundary `t`'s first element lies. A stand-in has no
    address: it is planned as the real tensor of its metadata lies, at its storage offset
    from an allocation's aligned start."""
    if is_stand_in(t):
        return (t.storage_offset() * t.element_size()) % 16
    return t.data_ptr() % 16


def check_tensor(label: str, t: torch.Tensor) -> None:
    """What kernels need of any tensor they read or write: dense strided memory (not sparse,
    mkldnn, nested or quantized), no lazy sign bit, and a storage that holds the whole view.
    Kernels index memory by strides and read or write it as it is."""
    if t.is_nested:
        raise ShapeError(f"{label} is a nested tensor; epifuse needs dense (strided) tensors.",
                         hint="Run each of its components as a GEMM of its own, or pad it "
                              "(.to_padded_tensor(0)).")
    if t.layout != torch.strided:
        raise ShapeError(f"{label} has layout {t.layout}; epifuse needs dense (strided) tensors.",
                         hint="Convert it first, e.g. with .to_dense().")
    if t.is_quantized:
        raise ShapeError(f"{label} is a quantized tensor ({t.dtype}); epifuse needs plain "
                         "floating-point or integer tensors.", hint="Dequantize it first (.dequantize()).")
    for bit, is_set, resolve in (("negative", t.is_neg, "resolve_neg"), ("conjugate", t.is_conj, "resolve_conj")):
        if is_set():
            raise ShapeError(f"{label} has torch's {bit} bit set (a lazy view such as x.conj().imag or "
                             "torch._neg_view(x)): its memory holds the values without that sign, and "
                             "kernels read and write memory as it is.",
                             hint=f"Pass .{resolve}() of it (a plain copy); an output must be a plain "
                                  "tensor, since the kernel writes its memory directly.")
    if t.numel() and not is_stand_in(t):
        size = t.element_size()
        reach = (t.storage_offset() + span(t)) * size
        held = t.untyped_storage().nbytes()
        if reach > held:
            raise ShapeError(f"{label}'s storage holds {held} bytes but the tensor reaches {reach}: its "
                             "storage was freed or shrunk (untyped_storage().resize_()), so it has no "
                             "data there.",
                             hint="Give the storage its size back (untyped_storage().resize_(n)) or pass "
                                  "another tensor.")


def accum_shape_of(A, B) -> tuple[tuple[int, ...], tuple[int, int, int, int]]:
    """accum's shape ((M, N) or (L, M, N)) and (L, M, N, K); checks A and B against each other."""
    for label, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{label} must be a torch.Tensor, but got {type(t).__name__}.")
        check_tensor(label, t)
        if t.dim() not in (2, 3):
            raise ShapeError(f"{label} must be 2-D or 3-D (batched), but has shape {_shape(t.shape)}.")
        if t.is_complex() or t.dtype == torch.bool:
            raise ShapeError(f"{label} has dtype {t.dtype}; use a real floating-point or integer type.")
    if A.device != B.device:
        raise ShapeError(f"A is on {A.device} but B is on {B.device}; move them to one device.")
    M, K = A.shape[-2:]
    K2, N = B.shape[-2:]
    if K != K2:
        raise ShapeError(f"A {_shape(A.shape)} and B {_shape(B.shape)} do not multiply: "
                         f"A has K={K} columns but B has {K2} rows.")
    LA = A.shape[0] if A.dim() == 3 else 1
    LB = B.shape[0] if B.dim() == 3 else 1
    if LA != LB and 1 not in (LA, LB):
        raise ShapeError(f"A has batch {LA} but B has batch {LB}; batch sizes must match (or be 1).")
    L = max(LA, LB)
    batched = A.dim() == 3 or B.dim() == 3
    shape = (L, M, N) if batched else (M, N)
    return shape, (L, M, N, K)


def classify_operand(name: str, value, accum_shape, device) -> tuple[Operand, dict]:
    """The operand's role and its strides per varying axis ({"M": ..., "N": ...})."""
    if not isinstance(value, torch.Tensor):
        _check_number(name, value)
        return Operand(name, "number", ()), {}
    check_tensor(f"Operand {name}", value)
    if value.device != device:
        raise ShapeError(f"Operand {name} is on {value.device} but A and B are on {device}.")
    if value.numel() == 1:
        return Operand(name, "tensor", ()), {}
    acc_axes = AXES[3 - len(accum_shape):]
    if value.dim() > len(accum_shape):
        _no_broadcast(name, value, accum_shape)
    axes, strides = [], {}
    offset = len(accum_shape) - value.dim()
    for d, size in enumerate(value.shape):
        axis = acc_axes[offset + d]
        target = accum_shape[offset + d]
        if size == target and size != 1:
            axes.append(axis)
            strides[axis] = value.stride(d)
        elif size != 1:
            _no_broadcast(name, value, accum_shape)
    return Operand(name, "tensor", tuple(a for a in AXES if a in axes)), strides


def _check_number(name: str, value) -> None:
    """A number operand is passed to kernels as a float: it must be one (10**400 is not)."""
    try:
        float(value)
    except (OverflowError, TypeError, ValueError):
        raise ShapeError(f"Operand {name} = {_short(value)} cannot be converted to a float.",
                         hint="Pass a number within float range (or a tensor).") from None


def _short(value) -> str:
    text = repr(value) if not isinstance(value, int) else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."


def _no_broadcast(name, value, accum_shape):
    raise ShapeError(f"Operand {name} with shape {_shape(value.shape)} does not broadcast against "
                     f"accum {_shape(accum_shape)}",
                     hint="Operands must be scalars, rows (N,), columns (M, 1), tiles (M, N) or "
                          "their batched forms (L, 1, N), (L, M, 1), (L, M, N), (L, 1, 1).")


@functools.lru_cache(maxsize=None)
def _storable(dtype: torch.dtype) -> bool:
    """Whether a float32 value converts to `dtype` elementwise (not packed sub-byte types such
    as int4 or float4_e2m1fn_x2, nor bit patterns): the conversion every kernel's store is."""
    try:
        with warnings.catch_warnings():   # whatever torch says of an exotic dtype: only failure counts
            warnings.simplefilter("ignore")
            torch.ones(2, dtype=torch.float32).to(dtype)
        if not (dtype == torch.bool or dtype.is_floating_point):
            torch.iinfo(dtype)   # bit patterns (bits8, ...) convert but are no integers
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def output_strides(name: str, dest: torch.Tensor, accum_shape, device, dims, op) -> dict:
    """Strides of an output per stored axis; checks its shape (and reduction dims), dtype, device
    and that no two of its elements share memory. `op` is the reduction's OpDef, None for a tile."""
    check_tensor(f"Output {name}", dest)
    if dest.device != device:
        raise ShapeError(f"Output {name} is on {dest.device} but A and B are on {device}.")
    if dest.is_complex():
        raise ShapeError(f"Output {name} has dtype {dest.dtype}; epilogue values are real, so "
                         "outputs must be real floating-point (or integer) tensors.")
    if not _storable(dest.dtype):
        raise ShapeError(f"Output {name} has dtype {dest.dtype}, which torch cannot convert a "
                         "float32 value to elementwise, so no kernel can store into it.",
                         hint="Use a floating-point, integer or bool output.")
    if self_overlaps(dest):
        raise ShapeError(f"Output {name} has elements that share memory (shape {_shape(dest.shape)}, "
                         f"strides {_shape(dest.stride())}), so writes to it would collide.",
                         hint="Pass a tensor whose elements are distinct in memory: an expanded "
                              "or as_strided view cannot be written; use torch.empty(...) or .clone().")
    acc_axes = AXES[3 - len(accum_shape):]
    if op is None:
        if tuple(dest.shape) != tuple(accum_shape):
            raise ShapeError(f"Output {name} has shape {_shape(dest.shape)} but accum is "
                             f"{_shape(accum_shape)}; an elementwise output must match accum.")
        strides = dict(zip(acc_axes, dest.stride()))
        return {a: strides.get(a, 0) for a in AXES}
    kept = [a for a in acc_axes if a not in dims]
    empty = [str(acc_axes.index(a)) for a in dims if accum_shape[acc_axes.index(a)] == 0]
    kind = op.name
    if empty and op.reduction.needs_elements:
        raise ShapeError(f"Output {name}: {kind}() over dim {', '.join(empty)} of accum "
                         f"{_shape(accum_shape)} reduces an empty dimension, which has no "
                         f"{op.reduction.combine} (torch raises here too).",
                         hint="Skip the GEMM for empty problems, or reduce with sum().")
    kept_shape = tuple(s for a, s in zip(acc_axes, accum_shape) if a in kept)
    keep_shape = tuple(1 if a in dims else s for a, s in zip(acc_axes, accum_shape))
    reduced = ", ".join(str(acc_axes.index(a)) for a in dims)
    if not kept:
        if dest.numel() != 1:
            raise ShapeError(f"Output {name} has shape {_shape(dest.shape)} but {kind}(dim=({reduced})) "
                             f"over accum {_shape(accum_shape)} gives one value: pass a one-element tensor.")
        return {a: 0 for a in AXES if a not in dims}
    # torch broadcasting: the result (kept_shape) or its keepdim form, less any leading ones
    forms = {}
    for axes, shape in ((kept, kept_shape), (acc_axes, keep_shape)):
        start = 0
        while True:
            forms.setdefault(shape[start:], axes[start:])
            if start == len(shape) - 1 or shape[start] != 1:
                break
            start += 1
    axes = forms.get(tuple(dest.shape))
    if axes is None:
        shapes = [_shape(f) for f in forms]
        raise ShapeError(f"Output {name} has shape {_shape(dest.shape)} but {kind}(dim=({reduced})) "
                         f"over accum {_shape(accum_shape)} gives {_shape(kept_shape)}: expected "
                         f"{', '.join(shapes[:-1])} or {shapes[-1]}.")
    strides = {a: dest.stride(i) for i, a in enumerate(axes) if a in kept}
    sizes = dict(zip(acc_axes, accum_shape))
    return {a: (strides[a] if sizes.get(a, 1) > 1 and a in strides else 0)
            for a in AXES if a not in dims}


def bytes_per_output(tensors, output_elements: int) -> float:
    """The bytes `tensors` hold per element of an output of `output_elements` elements (a
    broadcast operand counts by its own size): what an epilogue moves for them."""
    return sum(t.element_size() * t.numel() for t in tensors) / max(output_elements, 1)


def span(t: torch.Tensor) -> int:
    """How many elements apart the first and last element of `t` lie, plus one."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0) + 1


_EXACT_OVERLAP_LIMIT = 1 << 22


def self_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` lie at the same address (an expanded or as_strided view)."""
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride()) if s > 1), key=lambda d: abs(d[0]))
    if not dims or math.prod(s for _, s in dims) != t.numel():
        return False  # zero or one element
    reach = 0  # how far apart the elements of the dims seen so far lie, at most
    for stride, size in dims:
        if stride == 0:
            return True
        if abs(stride) <= reach:
            break  # interleaved dims: settle it exactly below
        reach += (size - 1) * abs(stride)
    else:
        return False
    if t.numel() > _EXACT_OVERLAP_LIMIT:
        return True  # too large to check exactly; refuse rather than risk racing writes
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride)
    return torch.unique(offsets).numel() != t.numel()


def address(t: torch.Tensor) -> tuple[int, int]:
    """(memory, byte address) of `t`'s first element: memory 0 and the address for a real
    tensor; for a stand-in (meta, fake), which has no address, its storage's identity and its
    offset into it, so that only views of one storage can meet."""
    if is_stand_in(t):
        return t.untyped_storage()._cdata, t.storage_offset() * t.element_size()
    return 0, t.data_ptr()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any byte of memory (by the spans their strides reach)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (memory_a, a0), (memory_b, b0) = address(a), address(b)
    if memory_a != memory_b:
        return False
    a1, b1 = a0 + span(a) * a.element_size(), b0 + span(b) * b.element_size()
    return a0 < b1 and b0 < a1 and not _interleaved(a, a0, b, b0)


def _interleaved(a: torch.Tensor, a0: int, b: torch.Tensor, b0: int) -> bool:
    """Whether spans that meet still share no byte: every element of each starts at its first
    byte plus a multiple of g (the gcd of both tensors' strides in bytes), and the elements of
    one fill byte offsets modulo g that the other's never reach. The real and imaginary planes
    of one complex tensor (torch.view_as_real(z).unbind(-1)) are such a pair."""
    steps = [s * t.element_size() for t in (a, b) for s, n in zip(t.stride(), t.shape) if n > 1]
    g = math.gcd(*steps) if steps else 0
    if g == 0:
        return False
    d = (b0 - a0) % g
    return a.element_size() <= d and d + b.element_size() <= g


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are one view of one memory: the same first element, shape and strides."""
    return address(a) == address(b) and a.shape == b.shape and a.stride() == b.stride()


def layout_class(t: torch.Tensor) -> tuple:
    """What the TMA kernels' support and plans read of a tensor's layout: which of its last two
    dimensions is contiguous, and whether its base and leading strides are 16-byte aligned."""
    size = t.element_size()
    return (t.stride(-1) == 1, t.dim() > 1 and t.stride(-2) == 1, misalignment(t) == 0,
            all((s * size) % 16 == 0 for s in t.stride()[:-1]))


def operand_layouts(args) -> tuple:
    """layout_class of each tensor operand of at least two dimensions (a C tile, a column):
    whether a kernel loads it by TMA or through pointers, which changes which kernel is fastest."""
    return tuple((name, layout_class(t)) for name, t in args.operands.items()
                 if isinstance(t, torch.Tensor) and t.dim() > 1)
