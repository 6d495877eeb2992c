"""Repeated `epifuse.gemm` calls: the second call with the same signature skips everything
but allocating its outputs and launching.

A signature is everything the checks, the kernel choice and Triton's specialization of the
launch read: the epilogue (a function by the code the parser reads, so a redefined function,
whose `__code__` changed, is a new signature), every tensor's shape, strides, dtype, device and
16-byte alignment, every number's type and value, and the options. The first call of a signature
runs the full path (checks, tuning, compile); if every tensor its launch took is one the caller
passed, epifuse allocated or the kernel owns, the launch's argument list is kept with the
positions of the caller's tensors, and with the plan's reduction steps (initialize the atomic
reductions, sums and amax, that the kernel does not zero itself before the launch; fold the
partials into the destinations after it). A later call with the same signature copies the
list, puts its own tensors in those positions, and runs the steps and the launch. Tensors that
share storage (an in-place update, an output aliasing an input), and tensors the
checks refuse (a sign bit, a storage too small for the view, other layouts) always take the full
path, which checks them. An empty tensor is keyed by its metadata alone: nothing is read through
it (the K = 0 factors of the backward's epilogue pass are empty views of the accum it reads),
and a launch whose grid is empty is never kept.

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
from collections import OrderedDict

import torch

from . import tune

MAX_SITES = 256
_SITES: OrderedDict = OrderedDict()
_LOCK = threading.Lock()
HITS = [0]  # calls served from a kept launch (for tests and the overhead benchmark)


# the tensor types a call may pass without going through epifuse.torch_ops (subclasses do)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NUMBER_TYPES = (int, float)


_UNREADABLE = object()


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


def signature(epilogue, A, B, tensors: dict, options: tuple) -> tuple | None:
    """The call's signature, or None when it must take the full path: an unhashable epilogue,
    anything but plain tensors and numbers (bools, tensor subclasses), non-empty tensors
    sharing storage, a tensor the checks refuse (a negative bit, a storage that does not hold
    the view, sparse and other layouts), a tensor that requires grad while grad is enabled
    (that call goes through epifuse.torch_ops), or a stream capturing a CUDA graph. Keyword
    order is part of it."""
    identity = epilogue_identity(epilogue)
    try:
        hash(identity)
    except TypeError:
        return None
    if identity is _UNREADABLE:
        return None
    if type(A) not in PLAIN_TENSOR_TYPES:
        return None
    parts = [identity, options]
    if A.is_cuda:   # kernel-owned buffers (split-K's workspace) are kept per site: one stream each
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        parts.append(torch._C._cuda_getCurrentRawStream(A.device.index))
    grad = torch.is_grad_enabled()
    storages = set()
    try:
        for name, t in (("A", A), ("B", B), *tensors.items()):
            kind = type(t)
            if kind in PLAIN_TENSOR_TYPES:
                requires_grad = t.requires_grad
                numel = t.numel()
                if (grad and requires_grad) or t.is_neg():
                    return None
                if numel == 0:   # nothing is read or written through it: no storage to check
                    parts.append((name, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16,
                                  requires_grad))
                    continue
                storage = t.untyped_storage()   # sparse, mkldnn and nested tensors raise here or below
                base = storage.data_ptr()
                if base in storages:
                    return None
                storages.add(base)
                address, shape, strides = t.data_ptr(), t.shape, t.stride()
                reach = numel
                if not t.is_contiguous():   # how many elements apart its first and last lie, plus one
                    reach = 1
                    for size, stride in zip(shape, strides):
                        reach += (size - 1) * stride
                if address - base + reach * t.itemsize > storage.nbytes():
                    return None   # freed or shrunk storage: the full path says so
                # the address modulo 16, not only whether it is aligned: a view the launch takes
                # of it (a gated GEMM's second half of B) is aligned or not by it and the strides
                parts.append((name, shape, strides, t.dtype, t.device, address % 16, requires_grad))
            elif kind in _NUMBER_TYPES:
                # a float by its bits as well: -0.0 == 0.0, but 1 / x tells them apart
                parts.append((name, kind, t, math.copysign(1.0, t)) if kind is float else (name, kind, t))
            else:
                return None
    except (RuntimeError, NotImplementedError):   # a layout without storage or strides: the full path names it
        return None
    return tuple(parts)


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
        for name, shape, dtype in self.allocate:
            current[name] = torch.empty(shape, dtype=dtype, device=self.device)
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
        outputs = tuple(current[name] for name in self.returns)
        return outputs[0] if len(outputs) == 1 else outputs


def lookup(key) -> Site | None:
    return _SITES.get(key) if key is not None else None


def remember(key, args, kernel, allocated: tuple, returns: tuple) -> Site | None:
    """Keep the launch of `kernel` on `args` for `key`, if its tensors are all accounted for;
    the Site kept, or None."""
    if key is None:
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
    allocate = tuple((name, tuple(args.outputs[name].shape), args.outputs[name].dtype)
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
    with _LOCK:
        _SITES[key] = site
        while len(_SITES) > MAX_SITES:
            _SITES.popitem(last=False)
    return site


def clear() -> None:
    with _LOCK:
        _SITES.clear()


tune.LISTENERS.append(clear)   # a kernel tuned in the background replaces the one kept launches run
