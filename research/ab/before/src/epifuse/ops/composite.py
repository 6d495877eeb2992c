"""Composite ops: the parser writes them as other registry ops (OpDef.expand), so the passes,
the kernels and autodiff see only those. softmax and log_softmax go through logsumexp, whose
value then feeds later math: epifuse.gemm runs them as passes of the GEMM (epifuse.staging).
Called on torch tensors they run torch's own."""
from __future__ import annotations

import torch

from .registry import Cost, OpDef, register


def _log_softmax(call, x, dim=-1):
    return call("sub", x, call("logsumexp", x, dim=dim))


def _softmax(call, x, dim=-1):
    return call("exp", _log_softmax(call, x, dim=dim))


softmax = register(OpDef("softmax", 1, torch.softmax, params=(("dim", -1),), kind="composite", expand=_softmax,
                         doc="exp(x - logsumexp(x, dim)): the softmax along dim (a statistics pass, then the "
                             "epilogue: two GEMMs)", cost=Cost(5, 2)))
log_softmax = register(OpDef("log_softmax", 1, torch.log_softmax, params=(("dim", -1),), kind="composite",
                             expand=_log_softmax, doc="x - logsumexp(x, dim): the log-softmax along dim (two GEMMs)",
                             cost=Cost(4, 1)))

__all__ = ["softmax", "log_softmax"]
