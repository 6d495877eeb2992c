"""The Gluon calls whose names changed between Triton releases, as the installed one spells
them, and whether its TMA copies take an L2 eviction policy.

Triton 3.9 renamed `tma.async_copy_global_to_shared` and `tma.async_copy_shared_to_global` to
`tma.async_load` and `tma.async_store` (the old names raise) and gave both a `cache_policy`,
which marks the lines a copy brings into L2 to be evicted first or last; `gl.thread_barrier`
became `gl.barrier`. The generated Gluon source is written for whichever Triton is installed;
the policies are used only where it has them.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect


@dataclasses.dataclass(frozen=True)
class GluonApi:
    load: str          # the call that copies a tile from global to shared memory by TMA
    store: str         # the call that copies a tile from shared to global memory by TMA
    barrier: str       # the call that synchronizes the threads of a CTA
    l2_policies: bool  # whether both copies take cache_policy


@functools.lru_cache(maxsize=None)
def gluon_api() -> GluonApi:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    barrier = "gl.thread_barrier" if hasattr(gl, "thread_barrier") else "gl.barrier"
    if not hasattr(tma, "async_load"):
        return GluonApi("tma.async_copy_global_to_shared", "tma.async_copy_shared_to_global", barrier, False)
    takes = all("cache_policy" in inspect.signature(f).parameters for f in (tma.async_load, tma.async_store))
    return GluonApi("tma.async_load", "tma.async_store", barrier, takes)


# L2_HINTS, the launch's choice of policies (a constexpr of kernels whose Triton has them):
# NONE leaves every copy unhinted; STREAMS marks what each tile streams through once (C's
# loads, the outputs' stores) evict-first, so that they leave A and B in L2; STREAMS_KEEP_B
# also marks B's loads evict-last.
L2_NONE, L2_STREAMS, L2_STREAMS_KEEP_B = 0, 1, 2

# Module source of the generated kernels where the policies exist: _l2_policy(L2_HINTS, role)
# with role "stream" (C's loads, the outputs' stores) or "b" (B's loads).
POLICY_SOURCE = f'''from triton.experimental.gluon.language.nvidia.ampere import CachePolicy, FractionalEvictionPolicy


@gluon.constexpr_function
def _l2_policy(hints, role):
    hints = getattr(hints, "value", hints)
    role = getattr(role, "value", role)
    if role == "stream" and hints in ({L2_STREAMS}, {L2_STREAMS_KEEP_B}):
        return CachePolicy(l2=FractionalEvictionPolicy("evict_first", 1.0))
    if role == "b" and hints == {L2_STREAMS_KEEP_B}:
        return CachePolicy(l2=FractionalEvictionPolicy("evict_last", 1.0))
    return None
'''


def policy_argument(role: str) -> str:
    """The keyword argument a TMA copy of `role` takes ("" where this Triton has no policies)."""
    return f', cache_policy=_l2_policy(L2_HINTS, "{role}")' if gluon_api().l2_policies else ""
