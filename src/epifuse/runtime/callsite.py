"""Repeated `epifuse.gemm` calls: the second call with the same signature skips everything
but allocating its outputs and launching.

A signature is everything the checks, the kernel choice and Triton's specialization of the
launch read: the epilogue (a function by the code the parser reads, so a redefined function,
whose `__code__` changed, is a new signature), every tensor's shape, strides, dtype, device and
16-byte alignment, every number's type and value, and the options. It is looked up in two
steps, so that a repeated call costs little host time: a dict keyed by its head (the epilogue,
the options, the stream, the keywords' names, the numbers), then, among the sites kept under
that head, the one whose guard takes the call's tensors (torch's C++ check of tensor metadata,
the one torch.compile's guards make, where this torch has it; the same check in Python where
not) and whose alignment and storages match. The first call of a signature runs the full path
(checks, tuning, compile); if every tensor its launch took is one the caller passed, epifuse
allocated or the kernel owns, the launch's argument list is kept with the positions of the
caller's tensors, and with the plan's reduction steps (initialize the atomic reductions, sums
and amax, that the kernel does not zero itself before the launch; fold the partials into the
destinations after it). A later call with the same signature copies the list, puts its own
tensors in those positions, and runs the steps and the launch. Tensors that share storage (an
in-place update, an output aliasing an input), and tensors the checks refuse (a sign bit, a
storage too small for the view, other layouts) always take the full path, which checks them.
An empty tensor is matched by its metadata alone: nothing is read through it (the K = 0
factors of the backward's epilogue pass are empty views of the accum it reads), and a launch
whose grid is empty is never kept.

Calls of one site may run at once, from threads, on streams, or into a CUDA graph. Each call
gets reduction work buffers of its own (the fp32 buffers and per-program partials its before-
and after-steps prepare and fold): one shared buffer would be zeroed by one call while another
call's kernel still adds into it. The other buffers the plan owns (split-K's workspace and
counters, in-kernel zeroing's words) are used by the kernel alone and left as each launch
found them, so launches one after another may share them: the signature includes the current
CUDA stream, on which launches run in order (the interpreter runs one at a time), and a call
on a stream that is capturing a CUDA graph takes the full path, so nothing a graph holds is
shared with later calls.
"""
from __future__ import annotations

import inspect
import math
import threading
import types
from collections import OrderedDict

import torch

from . import tune

MAX_SITES = 256        # sites kept in all (each holds its plan's own buffers: split-K's workspace)
SITES_PER_HEAD = 16    # per head (a call's epilogue, options, stream, names and numbers): its layouts
_SITES: OrderedDict = OrderedDict()
_LOCK = threading.Lock()
HITS = [0]  # calls served from a kept launch (for tests and the overhead benchmark)


# the tensor types a call may pass without going through epifuse.torch_ops (subclasses do)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NUMBER_TYPES = (int, float)


_UNREADABLE = object()
_HASHABLE_IDENTITIES = (str, type(None), types.CodeType)


def epilogue_identity(epilogue):
    """What the parser reads of an epilogue: a string or Program as it is; a function by the code
    of what `inspect` unwraps it to (its source), not by the function object, whose `__code__`
    IPython's autoreload and a notebook's re-run replace, and not by a decorator's wrapper,
    whose code every function it wraps shares."""
    if epilogue is None or isinstance(epilogue, str):
        return epilogue
    source = epilogue
    if hasattr(epilogue, "__wrapped__"):
        try:
            source = inspect.unwrap(epilogue)
        except ValueError:   # a __wrapped__ cycle: the full path names it
            return _UNREADABLE
    code = getattr(source, "__code__", None)
    return epilogue if code is None else code


class Call:
    """A call's signature in two parts: `head`, the dict key of its sites (the epilogue, the
    options, the stream, the keywords' names in order, the numbers' types and values), and
    `tensors` (A, B and the tensor keywords in order), which a kept site's guard matches."""

    __slots__ = ("head", "tensors")

    def __init__(self, head: tuple, tensors: tuple):
        self.head, self.tensors = head, tensors


def signature(epilogue, A, B, tensors: dict, options: tuple) -> Call | None:
    """The call's signature, or None when it must take the full path: an unhashable epilogue,
    anything but plain tensors and numbers (bools, tensor subclasses, nested tensors), or a
    stream capturing a CUDA graph. What the tensors must be for a kept launch to take them (their metadata, no
    shared storage, a storage that holds each view, no sign bit, not requiring grad while grad
    is enabled) is checked by lookup against each site kept under the head. Keyword order is
    part of the head."""
    identity = epilogue_identity(epilogue)
    if identity is _UNREADABLE or type(A) not in PLAIN_TENSOR_TYPES or type(B) not in PLAIN_TENSOR_TYPES or \
            A.is_nested or B.is_nested:
        return None
    if type(identity) not in _HASHABLE_IDENTITIES:   # a string, None and code hash; another object may not
        try:
            hash(identity)
        except TypeError:
            return None
    head = [identity, options]
    if A.is_cuda:   # kernel-owned buffers (split-K's workspace) are kept per site: one stream each
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        head.append(torch._C._cuda_getCurrentRawStream(A.get_device()))
    given = [A, B]
    for name, value in tensors.items():
        kind = type(value)
        if kind in PLAIN_TENSOR_TYPES:
            if value.is_nested:   # torch's guard aborts the process reading its strides: the full path names it
                return None
            head.append(name)
            given.append(value)
        elif kind in _NUMBER_TYPES:
            # a float by its bits as well: -0.0 == 0.0, but 1 / x tells them apart
            head.append((name, kind, value, math.copysign(1.0, value)) if kind is float else (name, kind, value))
        else:
            return None
    return Call(tuple(head), tuple(given))


def _tensor_guard_type():
    """torch's guard of tensor metadata in C++ (the check torch.compile's guards make: exact
    type, dispatch keys, so the sign and conjugate bits, dtype, device, requires_grad, sizes
    and strides), if this torch has it as this module calls it; else None (the Python guard)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
        probe = torch.ones(2, 3, dtype=torch.float32)
        guard = TensorGuards(probe, dynamic_dims_sizes=[[2, 3]], dynamic_dims_strides=[[3, 1]])
        # each field a false hit would get wrong, requires_grad above all: a site kept for calls
        # without autograd serving one that needs it would return outputs without gradients
        if guard.check(torch.zeros(2, 3, dtype=torch.float32)) and \
                not guard.check(torch.ones(3, 2, dtype=torch.float32).t()) and \
                not guard.check(torch.ones(2, 3, dtype=torch.float64)) and not guard.check(probe._neg_view()) and \
                not guard.check(torch.ones(2, 3, dtype=torch.float32, requires_grad=True)) and \
                not guard.check(torch.ones(1, 3, dtype=torch.float32)) and \
                not guard.check(torch.ones(2, 3, dtype=torch.float32, device="meta")) and \
                not guard.check(torch.nn.Parameter(torch.ones(2, 3, dtype=torch.float32), requires_grad=False)):
            return TensorGuards
    except Exception:  # noqa: BLE001 - a torch without it, or with another signature: the Python guard
        pass
    return None


class PythonGuard:
    """The guard's check written in Python: each tensor's exact type, sizes, strides, dtype,
    device, requires_grad, and sign and conjugate bits."""

    __slots__ = ("expected",)

    def __init__(self, *tensors):
        self.expected = tuple(self._describe(t) for t in tensors)

    @staticmethod
    def _describe(t):
        return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_neg(), t.is_conj())

    def check(self, *tensors) -> bool:
        if len(tensors) != len(self.expected):
            return False
        try:
            return all(self._describe(t) == expected for t, expected in zip(tensors, self.expected))
        except (AttributeError, RuntimeError, NotImplementedError):
            return False


_GUARD_TYPE: list = []   # [the guard class], decided on the first site kept


def _guard(tensors: tuple):
    if not _GUARD_TYPE:
        _GUARD_TYPE.append(_tensor_guard_type() or PythonGuard)
    guard_type = _GUARD_TYPE[0]
    if guard_type is PythonGuard:
        return PythonGuard(*tensors)
    return guard_type(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                      dynamic_dims_strides=[list(t.stride()) for t in tensors])


class _Kept:
    """A site and what a call's tensors must be for it: its guard, and per tensor its address
    modulo 16 and the bytes its view reaches from its first element (None for an empty tensor:
    nothing is read or written through it, so its storage is not checked)."""

    __slots__ = ("site", "guard", "aligned", "reach", "needs_grad", "layout")

    def __init__(self, site, tensors: tuple):
        self.site, self.guard = site, _guard(tensors)
        # what the guard checks, for telling a second site for the same calls from a new one
        self.layout = tuple(PythonGuard._describe(t) for t in tensors)
        self.aligned, self.reach = _placement(tensors)
        self.needs_grad = any(t.requires_grad for t in tensors)


def _placed(tensors: tuple, aligned: tuple, reach: tuple) -> bool:
    """Whether each tensor lies at its address modulo 16 in `aligned` and, unless its `reach`
    is None (empty), in a storage of its own that holds the `reach` bytes of its view: not a
    storage shared with another tensor, nor one freed or shrunk since (the full path says so).
    A layout without storage takes the full path too, which names it."""
    bases = []
    try:
        for t, alignment, span in zip(tensors, aligned, reach):
            address = t.data_ptr()
            if address % 16 != alignment:
                return False
            if span is None:
                continue
            storage = t.untyped_storage()   # sparse, mkldnn and nested tensors raise here or below
            base = storage.data_ptr()
            if base in bases or address - base + span > storage.nbytes():
                return False
            bases.append(base)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _placement(tensors: tuple) -> tuple[tuple, tuple]:
    """Per tensor, its address modulo 16 (not only whether it is aligned: a view the launch
    takes of it, a gated GEMM's second half of B, is aligned or not by it and the strides) and
    the bytes its view reaches (_reach_bytes): what _placed compares a later call's with."""
    return tuple(t.data_ptr() % 16 for t in tensors), tuple(_reach_bytes(t) for t in tensors)


def _reach_bytes(t) -> int | None:
    """The bytes from t's first element to the end of its last (None when it is empty)."""
    if t.numel() == 0:
        return None
    reach = 1
    for size, stride in zip(t.shape, t.stride()):
        reach += (size - 1) * stride
    return reach * t.itemsize


def _keepable(tensors: tuple) -> bool:
    """Whether a launch on these tensors may be kept: none requires grad while grad is enabled
    (those calls go through epifuse.torch_ops), none has a sign or conjugate bit, their
    non-empty storages are distinct, each holds its view, and every layout has storage and
    strides."""
    grad = torch.is_grad_enabled()
    try:
        if any((grad and t.requires_grad) or t.is_neg() or t.is_conj() for t in tensors):
            return False
        aligned, reach = _placement(tensors)
    except (RuntimeError, NotImplementedError):
        return False
    return _placed(tensors, aligned, reach)


class Site:
    """A kept launch: its argument list, where each tensor goes, what to allocate, and the
    reduction work buffers each call gets (name, position in the list, shape, strides, dtype)."""

    __slots__ = ("values", "positions", "launch_with", "allocate", "returns", "device", "before", "after",
                 "work", "gated", "backward_queued")

    def __init__(self, values, positions, launch_with, allocate, returns, device, before=None, after=None,
                 work=(), gated=False):
        self.values, self.positions, self.launch_with = values, positions, launch_with
        self.allocate, self.returns, self.device = allocate, returns, device
        self.before, self.after = before, after  # the reductions' steps, given the outputs
        self.work = work
        self.gated = gated   # the launch takes B's two column halves (a gated epilogue's gate and up)
        self.backward_queued = False   # torch_ops: this forward's backward was queued to compile ahead

    def call(self, A, B, tensors: dict):
        current = dict(tensors)
        for name, shape, strides, dtype in self.allocate:   # the first call's layout (empty_strided: the cheaper call)
            current[name] = torch.empty_strided(shape, strides, dtype=dtype, device=self.device)
        current["\0A"], current["\0B"] = A, B
        if self.gated:
            half = B.shape[-1] // 2
            current["\0B"], current["\0B_up"] = B[..., :half], B[..., half:]
        values = list(self.values)
        for index, name in self.positions:
            values[index] = current[name]
        buffers = None
        if self.work:
            buffers = {}
            for name, index, shape, strides, dtype in self.work:
                buffers[name] = values[index] = torch.empty_strided(shape, strides, dtype=dtype, device=self.device)
        if self.before is not None:
            self.before(current, buffers)
        self.launch_with(values)
        if self.after is not None:
            self.after(current, buffers)
        HITS[0] += 1
        returns = self.returns
        if len(returns) == 1:
            return current[returns[0]]
        return tuple([current[name] for name in returns])


def lookup(call: Call | None) -> Site | None:
    """The site kept for `call`: one kept under its head whose guard takes its tensors."""
    if call is None:
        return None
    try:
        kept = _SITES.get(call.head)
    except TypeError:   # an option that does not hash: the full path names it
        return None
    if kept is None:
        return None
    tensors = call.tensors
    for entry in kept:   # whether the entry takes the call's tensors
        if entry.guard.check(*tensors) and not (entry.needs_grad and torch.is_grad_enabled()) and \
                _placed(tensors, entry.aligned, entry.reach):
            return entry.site
    return None


def remember(call: Call | None, args, kernel, allocated: tuple, returns: tuple) -> Site | None:
    """Keep the launch of `kernel` on `args` for `call`, if its tensors may be kept and are all
    accounted for; the Site kept, or None."""
    if call is None or not _keepable(call.tensors):
        return None
    plan = getattr(args, "_plans", {}).get(kernel)
    if plan is None or plan.launch_with is None or not all(g > 0 for g in plan.grid):
        return None
    by_identity = {id(args.A): "\0A", id(args.B): "\0B"}
    gated = getattr(args, "gated", False)
    if gated:
        by_identity[id(args.B_up)] = "\0B_up"
    by_identity.update({id(t): n for n, t in args.operands.items() if isinstance(t, torch.Tensor)})
    by_identity.update({id(t): n for n, t in args.outputs.items()})
    owned = {id(t) for t in plan.owned}
    positions = [(i, by_identity.get(id(v))) for i, v in enumerate(plan.values)
                 if isinstance(v, torch.Tensor) and id(v) not in owned]
    if any(name is None for _, name in positions):
        return None  # the kernel launches with a view or a buffer of unknown owner: keep the full path
    written_after = {y.name for y, _ in plan.finish}  # outputs the after-step writes, not the kernel
    if {name for _, name in positions} | written_after != set(by_identity.values()):
        return None
    allocate = tuple((name, tuple(args.outputs[name].shape), args.outputs[name].stride(), args.outputs[name].dtype)
                     for name in allocated)
    steps = (None, None) if plan.simple else plan.problems[0].detached_steps()
    index = {id(v): i for i, v in enumerate(plan.values) if isinstance(v, torch.Tensor)}
    if any(id(buffer) not in index for _, buffer in plan.finish):
        return None  # a work buffer the launch does not take as it is: keep the full path
    work = tuple((y.name, index[id(buffer)], tuple(buffer.shape), buffer.stride(), buffer.dtype)
                 for y, buffer in plan.finish)
    values = list(plan.values)
    for i, _ in positions:   # the first call's tensors are not kept alive by the site (each call puts its own)
        values[i] = None
    for _, i, *_ in work:
        values[i] = None
    site = Site(values, tuple(positions), plan.launch_with, allocate, returns, args.A.device, *steps,
                work=work, gated=gated)
    _file(call, site)
    return site


def _file(call: Call, site: Site) -> None:
    """Keep `site` for calls like `call`: first among those of its head, replacing one kept for
    the same layout (threads that made the same first call at once), at most SITES_PER_HEAD
    per head (the least recently kept dropped) and MAX_SITES in all (the least recently kept
    heads dropped)."""
    entry = _Kept(site, call.tensors)
    with _LOCK:
        others = [e for e in _SITES.pop(call.head, ()) if (e.layout, e.aligned) != (entry.layout, entry.aligned)]
        _SITES[call.head] = [entry, *others][:SITES_PER_HEAD]
        total = sum(map(len, _SITES.values()))
        while total > MAX_SITES and len(_SITES) > 1:
            total -= len(_SITES.popitem(last=False)[1])


def sites() -> list:
    """Every kept site, the most recently kept head's last (for tests)."""
    with _LOCK:
        return [entry.site for kept in _SITES.values() for entry in reversed(kept)]


def clear() -> None:
    with _LOCK:
        _SITES.clear()


tune.LISTENERS.append(clear)   # a kernel tuned in the background replaces the one kept launches run
