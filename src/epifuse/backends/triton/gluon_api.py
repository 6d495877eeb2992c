"""What the Gluon kernels need from the installed Triton and at launch: the names of its TMA
calls, the shared-memory plan of a launch, and host TMA descriptors.

Triton 3.9 renamed `tma.async_copy_global_to_shared` and `tma.async_copy_shared_to_global` to
`tma.async_load` and `tma.async_store` (the old names raise), and `gl.thread_barrier` became
`gl.barrier`: the generated source is written for whichever Triton is installed. Gluon itself
is imported only when a Gluon kernel is rendered or launched (importing it costs 0.1 s).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ...shapes import misalignment
from .layout import OperandParams
from .rules import TL_TYPES

# Of the 227 KiB a Hopper CTA may use: the ring and the tile buffers take at most RING_BUDGET
# (the rest for barriers), or BUFFER_BUDGET where the epilogue reduces (its scratch needs a few
# KB more); a tile buffer is given only where three stages fit beside it in BUFFER_BUDGET:
# beside a second 64 KB buffer the ping-pong ring would fall to three stages, which costs more
# than the buffer saves.
RING_BUDGET = 224 * 1024
BUFFER_BUDGET = 220 * 1024
CONSUMER_REGS, PRODUCER_REGS = 232, 40
# (M, N) operands loaded by TMA into shared memory: the types the epilogue reads there as
# floats (two- and four-byte ones; others are loaded through pointers)
TMA_OPERAND_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GluonApi:
    load: str          # the call that copies a tile from global to shared memory by TMA
    store: str         # the call that copies a tile from shared to global memory by TMA
    barrier: str       # the call that synchronizes the threads of a CTA


@functools.lru_cache(maxsize=None)
def gluon_api() -> GluonApi:
    # Gluon is imported on first use, here and below: ~60 ms of start-up that only Hopper's
    # Gluon kernels need.
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    barrier = "gl.thread_barrier" if hasattr(gl, "thread_barrier") else "gl.barrier"
    if not hasattr(tma, "async_load"):
        return GluonApi("tma.async_copy_global_to_shared", "tma.async_copy_shared_to_global", barrier)
    return GluonApi("tma.async_load", "tma.async_store", barrier)


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """How a launch uses shared memory next to the ring: `slots` (the prefixes of
    Layout.tile_slots), for each whether TMA moves it (`tma`) and the index of the slot whose
    buffer it uses (`owner`), for each tile output whether an earlier output stores from that
    buffer too (`wait`), the ring's depth and the bytes one tile's operand loads bring."""
    slots: tuple
    tma: dict
    owner: dict
    wait: dict
    stages: int
    load_bytes: int


def buffer_plan(args, cfg, layout, consumers: int) -> BufferPlan:
    """A buffer holds a (BLOCK_M, BLOCK_N) tile for each of the `consumers`. Tile outputs come
    first (a TMA store saves more than a TMA load): each takes the buffer of the first output
    of its dtype, one TMA store after the other, or its own. Then each (M, N) operand takes a
    buffer of its dtype that no other operand has (all are loaded when a tile starts, and read
    before any output is stored), or its own. What TMA cannot move, or whose buffer does not
    fit next to a ring of at least three stages, goes through pointers."""
    size = args.A.element_size()
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * size
    slots = layout.tile_slots()
    tma, owner, wait, used, load_bytes = {}, {}, {}, 0, 0
    by_dtype: dict = {}   # dtype -> the buffers (owner indices) of that dtype, in order
    loaded_into: set = set()
    for k, slot in sorted(enumerate(slots), key=lambda ks: isinstance(ks[1], OperandParams)):
        p, operand = slot.prefix, isinstance(slot, OperandParams)
        t, strides = (args.operands if operand else args.outputs)[slot.name], args.strides[slot.name]
        movable = tma_mode(t, strides, False) == 2 and (
            not operand or (t.dtype in TMA_OPERAND_DTYPES and strides["M"] >= args.N))
        free = [b for b in by_dtype.get(t.dtype, ()) if not (operand and b in loaded_into)]
        need = consumers * cfg.block_m * cfg.block_n * t.element_size()
        if movable and free:
            tma[p], owner[p] = True, free[0]
        elif movable and 3 * stage + used + need <= BUFFER_BUDGET:
            tma[p], owner[p] = True, k
            by_dtype.setdefault(t.dtype, []).append(k)
            used += need
        else:
            tma[p], owner[p] = False, k
        if operand and tma[p]:
            loaded_into.add(owner[p])
            load_bytes += cfg.block_m * cfg.block_n * t.element_size()
        if not operand:
            wait[p] = tma[p] and owner[p] != k
    budget = BUFFER_BUDGET if any(y.reduce for y in layout.outputs) else RING_BUDGET
    stages = max(2, min(cfg.num_stages, (budget - used) // stage))
    return BufferPlan(tuple(slot.prefix for slot in slots), tma, owner, wait, stages, load_bytes)


def tma_mode(t: torch.Tensor, strides: dict, batched: bool) -> int:
    """2 or 3 (a (M, N) or (L, M, N) descriptor) when TMA can move `t`, else 0 (pointers)."""
    size = t.element_size()
    leading = [strides["M"]] + ([strides["L"]] if batched else [])
    if strides.get("N") != 1 or misalignment(t) or any((s * size) % 16 for s in leading):
        return 0
    return 3 if batched else 2


class Described:
    """What Triton's launcher reads of a TensorDescriptor after the first launch."""

    __slots__ = ("base", "shape", "strides")
    padding = "zero"
    round_f32_to_tf32 = False  # read by Triton 3.9's launcher

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides = base, shape, strides


class DescriptorConverter:
    """values -> arguments for the Gluon kernels, whose A, B and TMA-moved slots are host TMA
    descriptors: `descriptors` holds, per such argument, its position among the values and the
    shape and strides its descriptor describes (fixed for a plan: a kept launch swaps in tensors
    of the same layout). Called with `jit=True`, the tensors become TensorDescriptors for
    Triton's JIT; with `jit=False`, `Described` stand-ins for Triton's launcher (a direct launch
    that does not encode the descriptors itself, launch.described_launcher)."""

    __slots__ = ("descriptors", "_blocks")

    def __init__(self, descriptors: tuple, blocks: tuple):
        self.descriptors = descriptors   # ((position, shape, strides), ...), shape and strides lists
        self._blocks = blocks            # per descriptor: (block shape, shared layout)

    def __call__(self, current, jit: bool) -> list:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        current = list(current)
        for (i, shape, strides), (block, shared_layout) in zip(self.descriptors, self._blocks):
            t = current[i]
            current[i] = (TensorDescriptor(t, shape, strides, block, shared_layout) if jit
                          else Described(t, shape, strides))
        return current


def descriptor_converter(args, layout, names: list, meta: dict) -> DescriptorConverter:
    """The converter of a Gluon kernel's launch: the tensors of A, B and each TMA-moved slot (by
    their parameter `names`: a_desc, b_desc, x1_desc, ...) as host TMA descriptors."""
    BM, BN, BK, EN = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], meta["EPI_N"]
    A, B = args.A, args.B
    if meta["B_KMAJOR"]:  # B = Bt.t() with Bt (N, K) contiguous along K
        b_spec = ([args.N, args.K], [B.stride(-1), 1], [BN, BK], B.dtype)
    else:
        b_spec = ([args.K, args.N], [B.stride(-2), 1], [BK, BN], B.dtype)
    specs = {"a_desc": ([args.M, args.K], [A.stride(-2), 1], [BM, BK], A.dtype), "b_desc": b_spec}
    for slot in layout.tile_slots():
        if meta[f"{slot.prefix.upper()}_TMA"]:
            t = (args.operands if isinstance(slot, OperandParams) else args.outputs)[slot.name]
            specs[f"{slot.prefix}_desc"] = ([args.M, args.N], [args.strides[slot.name]["M"], 1], [BM, EN], t.dtype)
    items = list(specs.items())
    return DescriptorConverter(tuple((names.index(name), shape, strides) for name, (shape, strides, _, _) in items),
                               tuple((block, _shared_layout(block, dtype)) for _, (_, _, block, dtype) in items))


def _shared_layout(block, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    gl_dtype = getattr(gl, TL_TYPES[dtype].removeprefix("tl."))
    return gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
