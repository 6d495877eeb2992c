"""Stand-in tensors: metadata on a device, no memory. Kernels are planned and compiled from them
before their real tensors exist (runtime/ahead.py compiles a backward's kernels while its
forward runs).

torch's FakeTensor does this too, but its mode imports torch._dynamo (with sympy and
torch.distributed: seconds of a first call, longer on a host without .pyc files). A StandIn is a
meta tensor that reports a GPU device: every op on it runs on its meta tensor (shapes, strides,
offsets and views as the real op would give them) and comes back as a StandIn on that device.
Inside `stand_ins()`, a factory call on a GPU device (torch.empty(..., device="cuda"),
zeros_like of a StandIn) makes a StandIn too, so planning code allocates nothing and launches
nothing; ops on real tensors run as they are. Work on StandIns inside `stand_ins()`: outside a
mode, torch's dispatch of a tensor subclass first imports torch.distributed.tensor (with sympy,
seconds on a host without .pyc files) to look for DTensors; inside, the mode takes every op first.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode

_META = torch.device("meta")


class StandIn(torch.Tensor):
    """A tensor of `meta`'s shape, strides, offset and dtype that says it lives on `device`."""

    meta: torch.Tensor
    where: torch.device

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device):
        self = torch.Tensor._make_subclass(cls, meta, False, dispatch_device=True,
                                           device_for_backend_keys=device)
        self.meta, self.where = meta, device
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _on_meta(func, args, kwargs or {})

    def __repr__(self) -> str:
        return (f"StandIn(shape={tuple(self.shape)}, stride={self.stride()}, offset={self.storage_offset()}, "
                f"dtype={self.dtype}, device={self.where})")


def layout(t: torch.Tensor) -> tuple:
    """What a stand-in needs of a tensor (stand_in's arguments): shape, strides, storage
    offset, dtype, device."""
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


def stand_in(shape, stride, offset: int, dtype: torch.dtype, device: torch.device) -> StandIn:
    """A StandIn laid out as a real tensor of this metadata would be."""
    span = offset + (1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0)
    meta = torch.empty(span, dtype=dtype, device=_META).as_strided(tuple(shape), tuple(stride), offset)
    return StandIn(meta, torch.device(device))


def empty(shape, dtype: torch.dtype, device: torch.device) -> StandIn:
    """A StandIn laid out as torch.empty(shape, dtype=dtype, device=device) would be."""
    return StandIn(torch.empty(shape, dtype=dtype, device=_META), torch.device(device))


def _on_meta(func, args, kwargs):
    if func is torch.ops.prim.device.default:
        return args[0].where
    devices = []

    def unwrap(x):
        if isinstance(x, StandIn):
            devices.append(x.where)
            return x.meta
        return x
    args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    device = kwargs.get("device")
    if device is not None and torch.device(device).type not in ("cpu", "meta"):
        devices.append(torch.device(device))
        kwargs = {**kwargs, "device": _META}
    if not devices:
        return func(*args, **kwargs)
    where = devices[0]
    return tree_map(lambda x: StandIn(x, where) if isinstance(x, torch.Tensor) and x.is_meta else x,
                    func(*args, **kwargs))


class _StandInMode(TorchDispatchMode):
    pass


def _mode_dispatch(self, func, types, args=(), kwargs=None):
    return _on_meta(func, args, kwargs or {})


# Set after the class is made: torch wraps a __torch_dispatch__ defined in a mode's class body in
# torch._disable_dynamo, whose first call imports torch._dynamo, which stand-ins are here to avoid.
_StandInMode.__torch_dispatch__ = _mode_dispatch


def stand_ins():
    """A context (of this thread) in which GPU factory calls make StandIns."""
    return _StandInMode()


__all__ = ["StandIn", "layout", "stand_in", "empty", "stand_ins"]
