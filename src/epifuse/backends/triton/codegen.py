"""Emit the Triton source of a tiled GEMM whose epilogue is a Graph.

`launch_layout(graph)` fixes the kernel's parameters (the emitter and the launcher both read
it, so they cannot drift apart); `emit_kernel(graph, shape, target, key)` returns the module
source of a "tiled" kernel (one program per tile, pointer loads), a "persistent" one (one
program per SM looping over tiles, TMA descriptor loads) or a "splitk" one (the tiled kernel
with each tile's K loop shared by several programs); all end in the same epilogue. Every
identifier in the source is made here (v0, x1_ptr, y0_sm, ...): nothing the user wrote is
pasted in except numbers that were parsed as numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import ops
from ...errors import InternalError
from ...ir import ACCUM, AXES, CONST, INPUT, Graph, Node
from ...ops import OpDef
from .gluon_api import gluon_api, policy_argument
from .rules import LOG_OF_NORMAL, LogSum, _f, helper_source, log_sum, rule_for

# The @jit helper that folds two partial results, by the reduction's combine.
_COMBINE = {"add": "_add", "maximum": "_max_nan", "minimum": "_min_nan"}


@dataclass(frozen=True)
class OperandParams:
    name: str           # the user's operand name (the launcher's key); never emitted
    kind: str           # "number" | "tensor"
    axes: tuple         # axes it varies along (strides passed for these)
    prefix: str         # x0, x1, ...


@dataclass(frozen=True)
class OutputParams:
    """How one output is stored.

    reduce: None for a tile store, else the reduction op. mode: "tile"; "atomic" (each
    program folds its partial into the fp32 destination, or an fp32 work buffer, with an
    atomic add, or for amax an integer atomic max of the bits: see reduction_mode);
    "partials" (each program writes its partial to a (L, PM, PN) buffer that a finishing step
    reduces: run-to-run identical, and NaN-exact for max/min). axes: the axes whose strides the kernel takes.
    """

    name: str
    reduce: OpDef | None
    mode: str
    axes: tuple
    prefix: str
    dims: tuple = ()

    @property
    def scaled(self) -> bool:
        """A mean folded by atomics: each partial is scaled by 1 / count before it is added."""
        return self.mode == "atomic" and self.reduce.reduction.mean


@dataclass(frozen=True)
class Layout:
    operands: tuple[OperandParams, ...]
    outputs: tuple[OutputParams, ...]

    def param_names(self) -> list[str]:
        names = []
        for o in self.operands:
            if o.kind == "number":
                names.append(o.prefix)
            else:
                names.append(f"{o.prefix}_ptr")
                names.extend(f"{o.prefix}_s{a.lower()}" for a in o.axes)
        for y in self.outputs:
            names.append(f"{y.prefix}_ptr")
            names.extend(f"{y.prefix}_s{a.lower()}" for a in y.axes)
            if y.scaled:
                names.append(f"{y.prefix}_scale")
        return names

    def tile_slots(self) -> list:
        """The (M, N) operands, then the tile outputs: what a TMA descriptor or a shared-memory
        tile buffer could move (OperandParams and OutputParams, each with its name and prefix)."""
        return ([o for o in self.operands if {"M", "N"} <= set(o.axes)]
                + [y for y in self.outputs if y.mode == "tile"])

    def tma_candidates(self) -> list[str]:
        """Prefixes of the tile slots."""
        return [slot.prefix for slot in self.tile_slots()]


def reduction_mode(op: OpDef, deterministic: bool) -> str:
    """Sums fold with atomics unless asked to be deterministic. amax always folds with an atomic
    integer maximum of the fp32 bits: |x|, and NaN with its sign cleared, order as int32 as they
    do as floats, so the result is exact (identical run to run) and NaN where any element is.
    max and min use partials, which keep NaN exact for either sign."""
    reduction = op.reduction
    if reduction.magnitude:
        return "atomic"
    return "atomic" if reduction.combine == "add" and not deterministic else "partials"


def launch_layout(graph: Graph, deterministic: bool = False) -> Layout:
    operands = tuple(OperandParams(o.name, o.kind, tuple(o.axes), f"x{i}")
                     for i, o in enumerate(graph.operands))
    outputs = []
    for j, out in enumerate(graph.outputs):
        if out.node.op.is_reduction:
            dims = out.node.dims
            mode = reduction_mode(out.node.op, deterministic)
            axes = AXES if mode == "partials" else tuple(a for a in AXES if a not in dims)
            outputs.append(OutputParams(out.name, out.node.op, mode, axes, f"y{j}", dims))
        else:
            outputs.append(OutputParams(out.name, None, "tile", AXES, f"y{j}"))
    return Layout(operands, tuple(outputs))


# In-kernel zeroing of atomic reductions (the tiled and Gluon kernels): instead of a launch
# that zeroes a destination before the GEMM, the first program zeroes it at its start and
# publishes that in a plan-owned pair of int64 words, sync = (arrivals, done). Every program
# (every consumer partition in the Gluon kernels) reads arrivals at its start and adds one
# when it ends: launch n began with n * sync_arrivals, and a reader sees fewer than
# sync_arrivals arrivals of its own launch before it arrives itself, so arrivals //
# sync_arrivals is n wherever it is read. The first program writes n + 1 to done (a barrier,
# then a release exchange, after its zeros); every program reads done with acquire loads until
# it is n + 1 before its first reduction. Nothing is reset, so a CUDA graph replays as it is.
# Launches that share the words must not overlap (programs of two launches that read different
# n would wait forever): launches on one stream do not, and the plan gives each stream its own
# words (tiled._StreamWords). The waits assume that the first program is dispatched before the others
# (in-order dispatch, which CUDA does not promise but single-pass scans also rely on): a
# program that waits does so only before its epilogue.
ZERO_BLOCK = 1024
_ASK_DONE = "zero_seen = _load_acquire(sync_ptr + 1).to(tl.int32)"


def zeroable(layout: "Layout") -> list:
    """The outputs a launch may zero in the kernel: atomic sums, means and amax."""
    return [y for y in layout.outputs if y.mode == "atomic"]


@dataclass(frozen=True)
class Zeroing:
    """What in-kernel zeroing adds to a kernel's source (all empty without atomic outputs):
    runtime parameters after the others, constexprs, helpers, and lines for the program's
    start (read the launch's number; the first program zeroes and publishes), the question
    whether the zeros are done (asked ahead of the wait that needs the answer, before each
    tile's epilogue: a wait among the epilogue's lines made ptxas spill the loss epilogue),
    that wait, and the program's end (arrive, no reply awaited). Lines are unindented."""
    params: tuple = ()
    meta: tuple = ()
    helpers: frozenset = frozenset()
    start: tuple = ()
    poll: tuple = ()
    wait: tuple = ()
    end: tuple = ()


def zeroing(layout: "Layout", first: str, style: str, warps: int = 4) -> Zeroing:
    """The zeroing of `layout`'s atomic outputs; `first` is the condition that a program is
    the first, `style` "pointer" or "gluon" (whose consumers have `warps` warps)."""
    outputs = zeroable(layout)
    if not outputs:
        return Zeroing()
    lang = "gl" if style == "gluon" else "tl"
    barrier = f"{gluon_api().barrier}()" if style == "gluon" else "tl.debug_barrier()"
    arange = (f"gl.arange(0, {ZERO_BLOCK}, layout=gl.BlockedLayout([4], [32], [{warps}], [0]))"
              if style == "gluon" else f"tl.arange(0, {ZERO_BLOCK})")
    start = ["if ANY_ZERO:",
             f"    zero_target = ({lang}.load(sync_ptr, volatile=True) // sync_arrivals + 1).to(tl.int32)",
             f"    if {first}:"]
    for y in outputs:
        start += [f"        if {y.prefix.upper()}_ZERO:",
                  f"            for zero_from in range(0, {y.prefix}_count, {ZERO_BLOCK}):",
                  f"                zero_offs = zero_from + {arange}",
                  f"                {lang}.store({y.prefix}_ptr + zero_offs, 0.0, mask=zero_offs < {y.prefix}_count)"]
    start += [f"        {barrier}  # every thread's zeros before the release",
              f"        {lang}.atomic_xchg(sync_ptr + 1, zero_target.to(tl.int64), sem='release', scope='gpu')"]
    return Zeroing(
        params=("sync_ptr", "sync_arrivals", *(f"{y.prefix}_count" for y in outputs)),
        meta=("ANY_ZERO", *(f"{y.prefix.upper()}_ZERO" for y in outputs)),
        helpers=frozenset({"_load_acquire"}),
        start=tuple(start),
        poll=("if ANY_ZERO:", f"    {_ASK_DONE}"),
        wait=("if ANY_ZERO:", "    while zero_seen != zero_target:", f"        {_ASK_DONE}"),
        end=("if ANY_ZERO:", "    tl.atomic_add(sync_ptr, 1, sem='relaxed', scope='gpu')"))


_HEADER = '''# Generated by epifuse for graph {key} (target: {target}). Do not edit.
import triton
import triton.language as tl
{libdevice}
# Only Triton builtins and the helpers below are called: Triton's own @jit library functions
# (tl.cdiv, tl.sum, tl.zeros) are compiled or interpreted as decided when triton was first
# imported, which may predate TRITON_INTERPRET being set for CPU tensors.
_INF = tl.constexpr(float("inf"))
_NAN = tl.constexpr(float("nan"))


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _convert(x, KIND: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    # Before the cast to an output's dtype: integers round to nearest even (1.5 * 2**23 trick,
    # exact below 2**22; larger floats are integers already) and saturate, NaN becoming 0;
    # fp8 saturates to its largest finite value.
    if KIND == 1:
        r = tl.where(tl.abs(x) < 4194304.0, (x + 12582912.0) - 12582912.0, x)
        r = tl.where(r < LO, LO, tl.where(r > HI, HI, r))
        return tl.where(x != x, 0.0, r)
    elif KIND == 2:
        return tl.where(x < LO, LO, tl.where(x > HI, HI, x))
    else:
        return x
'''

_TILED_MAINLOOP = '''
    pid = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # EVEN_M / EVEN_N: every tile is whole along that axis, and its mask a constant the
    # compiler folds away (no selects in the reductions, no predicates on the stores)
    if EVEN_M:
        mask_m = tl.full((BLOCK_M,), 1, tl.int1)
    else:
        mask_m = rm < M
    if EVEN_N:
        mask_n = tl.full((BLOCK_N,), 1, tl.int1)
    else:
        mask_n = rn < N
    # Rows and columns past the edge are wrapped, not masked: they are never stored.
    a_ptrs = a_ptr + pid_l * stride_al + (rm % M)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + pid_l * stride_bl + rk[:, None] * stride_bk + (rn % N)[None, :] * stride_bn
    if ACC_INT:
        acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
    elif ACC_F16:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float16)
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if ACC_F16 and UPCAST:  # the interpreter: fp32 products, the sum rounded to fp16 each step
            acc = (acc.to(tl.float32) + tl.dot(a, b, input_precision=PRECISION)).to(tl.float16)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask = mask_m[:, None] & mask_n[None, :]
'''

_PERSISTENT_MAINLOOP = '''
    start_pid = tl.program_id(0)
    if A_BATCHED:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[L, M, K], strides=[stride_al, stride_am, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if B_KMAJOR:
        if B_BATCHED:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[L, N, K], strides=[stride_bl, stride_bn, 1],
                                               block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
    else:
        if B_BATCHED:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[L, K, N], strides=[stride_bl, stride_bk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    tiles_per_batch = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    for tile_id in tl.range(start_pid, L * tiles_per_batch, NUM_SMS, flatten=FLATTEN,
                            warp_specialize=WARP_SPECIALIZE):
        batch = tile_id // tiles_per_batch
        pid_l = batch.to(tl.int64)
        tile = tile_id % tiles_per_batch
        group_id = tile // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
        pid_n = (tile % num_pid_in_group) // group_size_m
        offs_m = pid_m * BLOCK_M
        offs_n = pid_n * BLOCK_N
        if ACC_INT:
            acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
        elif ACC_F16:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float16)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for ki in range(k_tiles):
            offs_k = ki * BLOCK_K
            if A_BATCHED:
                a = a_desc.load([batch, offs_m, offs_k]).reshape(BLOCK_M, BLOCK_K)
            else:
                a = a_desc.load([offs_m, offs_k])
            if B_KMAJOR:
                if B_BATCHED:
                    b = b_desc.load([batch, offs_n, offs_k]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = b_desc.load([offs_n, offs_k]).T
            else:
                if B_BATCHED:
                    b = b_desc.load([batch, offs_k, offs_n]).reshape(BLOCK_K, BLOCK_N)
                else:
                    b = b_desc.load([offs_k, offs_n])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if ACC_F16 and UPCAST:
                acc = (acc.to(tl.float32) + tl.dot(a, b, input_precision=PRECISION)).to(tl.float16)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)
        rm = offs_m + tl.arange(0, BLOCK_M)
        if EVEN_M:
            mask_m = tl.full((BLOCK_M,), 1, tl.int1)
        else:
            mask_m = rm < M
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, EPI_N)), (0, 2, 1)))
'''

# The persistent kernel runs its epilogue on two (BLOCK_M, EPI_N) halves of the tile in turn:
# half the registers live at once, and half the shared memory for TMA stores.
_PERSISTENT_SUBTILE = '''
        acc_e = acc_{half}
        offs_en = offs_n + {half_index} * EPI_N
        pid_en = pid_n * 2 + {half_index}
        rn = offs_en + tl.arange(0, EPI_N)
        if EVEN_N:
            mask_n = tl.full((EPI_N,), 1, tl.int1)
        else:
            mask_n = rn < N
        mask = mask_m[:, None] & mask_n[None, :]
'''

_TILED_EPILOGUE_START = '''
    acc_e = acc
    offs_en = pid_n * BLOCK_N
    pid_en = pid_n
'''

# Split-K: the tiled main loop over this program's share of the K tiles (shares differ by at
# most one tile), then the fix-up that hands the tile to whichever of its programs ends last.
_SPLITK_RANGE = '''    pid_s = tl.program_id(2)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    k_first = pid_s * k_tiles // SPLIT_K
    a_ptrs += k_first * BLOCK_K * stride_ak
    b_ptrs += k_first * BLOCK_K * stride_bk
    for k in range(k_first, (pid_s + 1) * k_tiles // SPLIT_K):
'''

_SPLITK_FIXUP = '''
    # Store this partial to its slab of the tile's workspace, then count in (the barrier puts
    # every thread's stores before the release). The last to arrive adds the slabs in split
    # order, so the sum does not depend on which program that was, and runs the epilogue.
    # Counting modulo SPLIT_K and taking SPLIT_K back leaves the counter where it started.
    tile_id = pid_l * (num_pid_m * num_pid_n) + pid
    slab = BLOCK_M * BLOCK_N
    ws_tile = (ws_ptr + tile_id * (SPLIT_K * slab)
               + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    tl.store(ws_tile + pid_s * slab, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    if arrived % SPLIT_K != SPLIT_K - 1:
        return
    tl.atomic_add(counter_ptr + tile_id, -SPLIT_K, sem="relaxed", scope="gpu")
    # Never true: it starts the sum in the MMA accumulator's register layout, as the tiled
    # kernel's epilogue runs (summing in the load layout made ptxas serialize the wgmmas).
    # The sum runs in the workspace's type (fp32 for an fp16 accumulator: the slabs are rounded).
    acc = tl.where(pid_s < 0, acc, 0).to(ws_ptr.dtype.element_ty)
    for s in range(SPLIT_K):
        acc += tl.load(ws_tile + s * slab, cache_modifier=".cg")
'''


def _split_k_mainloop(tiled: str) -> str:
    loop = "    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):\n"
    if tiled.count(loop) != 1:
        raise InternalError("the split-K kernel reuses the tiled main loop, whose K loop header changed")
    return tiled.replace(loop, _SPLITK_RANGE) + _SPLITK_FIXUP


_GEMM_PARAMS = ["a_ptr", "b_ptr", "M", "N", "K", "stride_al", "stride_am", "stride_ak",
                "stride_bl", "stride_bk", "stride_bn"]
_COMMON_META = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST", "PRECISION"]
_COMMON_META += ["EPI_N", "ACC_INT", "ACC_F16", "EVEN_M", "EVEN_N"]
KERNEL_SHAPES = {
    "tiled": (_GEMM_PARAMS, _COMMON_META + ["EVEN_K"], _TILED_MAINLOOP, 4),
    "persistent": (_GEMM_PARAMS + ["L"], _COMMON_META + ["A_BATCHED", "B_BATCHED", "B_KMAJOR",
                                                          "NUM_SMS", "FLATTEN", "WARP_SPECIALIZE"],
                   _PERSISTENT_MAINLOOP, 8),
    "splitk": (_GEMM_PARAMS + ["ws_ptr", "counter_ptr"], _COMMON_META + ["EVEN_K", "SPLIT_K"],
               _split_k_mainloop(_TILED_MAINLOOP), 4),
}


ZEROING_SHAPES = ("tiled",)  # the Triton kernels that zero their small reductions (zeroing)


def emit_kernel(graph: Graph, shape: str, target: str, key: str, deterministic: bool = False) -> str:
    """The module source of `epifuse_kernel` ("tiled", "persistent" or "splitk") for `graph` on `target`."""
    gemm_params, meta, mainloop, indent = KERNEL_SHAPES[shape]
    layout = launch_layout(graph, deterministic)
    tma = shape == "persistent"
    zero = (zeroing(layout, "tl.program_id(0) == 0 and tl.program_id(1) == 0", "pointer")
            if shape in ZEROING_SHAPES else Zeroing())
    lines, helpers = _emit_epilogue(graph, layout, "tma" if tma else "pointer")
    lines = [*zero.poll, *zero.wait, *lines, *zero.end]
    helpers |= zero.helpers
    mainloop = mainloop.replace("\n", "\n" + "".join("    " + line + "\n" for line in zero.start), 1)
    body = "".join(" " * indent + line + "\n" for line in lines)
    meta = meta + [f"{y.prefix.upper()}_{part}" for y in layout.outputs if y.mode == "tile"
                   for part in ("KIND", "LO", "HI")] + list(zero.meta)
    if tma:
        meta = meta + [f"{p.upper()}_TMA" for p in layout.tma_candidates()]
        setup = "".join("    " + line + "\n" for line in _tma_descriptors(layout))
        mainloop = mainloop.replace("    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M\n", setup + "    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M\n", 1)
        halves = "".join(_PERSISTENT_SUBTILE.format(half=h, half_index=i) + body
                         for i, h in enumerate(("lo", "hi")))
    else:
        halves = _TILED_EPILOGUE_START + body
    params = ",\n    ".join([*gemm_params, *layout.param_names(), *zero.params,
                              *(f"{m}: tl.constexpr" for m in meta)])
    libdevice = "from triton.language.extra import libdevice\n" if target == "cuda" else ""
    # With K == 1 specialized to a constexpr (a K loop of one constant trip), Triton 3.6 on Hopper
    # handed accum = 0 to an epilogue that only reduced |accum| (fp16/bf16 MMA; GPU fuzz
    # 2026-11-23): K stays a runtime value in the kernels that can see K == 1.
    jit = "@triton.jit" if tma else '@triton.jit(do_not_specialize=["K"])'
    return (_HEADER.format(key=key, target=target, libdevice=libdevice)
            + helper_source(helpers, target)
            + f"\n\n{jit}\ndef epifuse_kernel(\n    {params},\n):"
            + mainloop + halves)


def _tma_descriptors(layout: Layout) -> list[str]:
    """Descriptors for tile operands and outputs whose launch says TMA (2: (M, N), 3: (L, M, N))."""
    lines = []
    for p in layout.tma_candidates():
        lines += [f"if {p.upper()}_TMA == 2:",
                  f"    {p}_desc = tl.make_tensor_descriptor({p}_ptr, shape=[M, N], strides=[{p}_sm, 1], "
                  "block_shape=[BLOCK_M, EPI_N])",
                  f"if {p.upper()}_TMA == 3:",
                  f"    {p}_desc = tl.make_tensor_descriptor({p}_ptr, shape=[L, M, N], "
                  f"strides=[{p}_sl, {p}_sm, 1], block_shape=[1, BLOCK_M, EPI_N])"]
    return lines


STYLES = ("pointer", "tma", "gluon")


def _emit_epilogue(graph: Graph, layout: Layout, style: str = "pointer") -> tuple[list[str], set[str]]:
    """The epilogue's lines, unindented, over one (BLOCK_M, EPI_N) piece of the tile. They read
    acc_e, rm, rn, mask_m, mask_n, mask, pid_l, pid_m, pid_en, offs_m, offs_en, which the main
    loops define. `style` says how tiles move: "pointer" loads and stores; "tma" (the persistent
    kernel) also device-side descriptors, and batch; "gluon" (the warp-specialized Gluon kernel)
    stores tiles through shared memory and host descriptors (y*_smem, y*_desc), reads (M, N)
    operands its launch loads by TMA from shared memory (x*_smem), and makes tensors in the
    accumulator's layout (acc_layout)."""
    if style not in STYLES:
        raise InternalError(f"unknown epilogue style {style!r}")
    lines: list[str] = []
    helpers: set[str] = set()
    names: dict[int, str] = {}
    operand_prefix = {o.name: o for o in layout.operands}
    for i, node in enumerate(graph.nodes()):
        var = f"v{i}"
        names[id(node)] = var
        if node.op is ACCUM:
            lines.append(f"{var} = acc_e.to(tl.float32)")
        elif node.op is CONST:
            names[id(node)] = _f(node.arg)
        elif node.op is INPUT:
            lines.extend(_load_operand(var, operand_prefix[node.arg.name], style))
        elif node.op.is_reduction:
            continue  # emitted by its output's store
        else:
            rule = rule_for(node)
            if rule is None:
                raise InternalError(f"no Triton rule for {node.op.name}; supports() should have said so")
            helpers.update(rule.helpers)
            srcs = [_coerce(names[id(s.src[0])], s.src[0], s, 0) if k in rule.through else _coerce(names[id(s)], s, node, k)
                    for k, s in enumerate(node.src)]
            lines.append(f"{var} = {rule.emit(*srcs, **node.params)}")
    for y, out in zip(layout.outputs, graph.outputs):
        if y.reduce is None:
            lines.extend(_store_tile(y, names[id(out.node)], out.node, style))
        else:
            source = out.node.src[0]
            logs = log_sum(source) if y.reduce.reduction.combine == "add" and "N" in y.dims else None
            lines.extend(_store_reduction(y, names, source, style, logs, helpers))
    return lines, helpers


def _coerce(expr: str, src: Node, user: Node, position: int) -> str:
    """Bools where conditions are expected, floats everywhere else."""
    wants_bool = user.op.kind == "logical" or (user.op is ops.where and position == 0)
    if wants_bool and src.dtype == "float":
        return f"({expr} != 0)"
    if not wants_bool and src.dtype == "bool":
        return f"{expr}.to(tl.float32)"
    return expr


def _offset(prefix: str, axes) -> str:
    index = {"L": "pid_l", "M": "rm[:, None]", "N": "rn[None, :]"}
    terms = [f"{index[a]} * {prefix}_s{a.lower()}" for a in AXES if a in axes]
    return " + ".join(terms) if terms else "0"


def _mask_of(axes) -> str | None:
    if "M" in axes and "N" in axes:
        return "mask"
    if "M" in axes:
        return "mask_m[:, None]"
    if "N" in axes:
        return "mask_n[None, :]"
    return None


def _load_operand(var: str, o: OperandParams, style: str) -> list[str]:
    if o.kind == "number":
        return [f"{var} = {o.prefix}"]
    mask = _mask_of(o.axes)
    masked = f", mask={mask}, other=0.0" if mask else ""
    pointer_load = f"{var} = tl.load({o.prefix}_ptr + {_offset(o.prefix, o.axes)}{masked}).to(tl.float32)"
    if style == "pointer" or not {"M", "N"} <= set(o.axes):
        return [pointer_load]
    flag = f"{o.prefix.upper()}_TMA"
    if style == "gluon":  # loaded into shared memory when the tile started; waited for
        return [f"if {flag}:",
                f"    {var} = {o.prefix}_smem.load(acc_layout).to(tl.float32)",
                "else:",
                f"    {pointer_load}"]
    return [f"if {flag} == 2:",
            f"    {var} = {o.prefix}_desc.load([offs_m, offs_en]).to(tl.float32)",
            f"elif {flag} == 3:",
            f"    {var} = {o.prefix}_desc.load([batch, offs_m, offs_en]).reshape(BLOCK_M, EPI_N).to(tl.float32)",
            "else:",
            f"    {pointer_load}"]


def _as_full_tile(expr: str, node: Node, style: str) -> str:
    if node.dtype == "bool":
        expr = f"{expr}.to(tl.float32)"
    if {"M", "N"} <= set(node.axes):
        return expr
    if style == "gluon":  # Gluon makes tensors only with an explicit layout
        return f"({expr} + gl.full((BLOCK_M, EPI_N), 0.0, gl.float32, acc_layout))"
    return f"({expr} + tl.full((BLOCK_M, EPI_N), 0.0, tl.float32))"


def _store_tile(y: OutputParams, expr: str, node: Node, style: str) -> list[str]:
    upper = y.prefix.upper()
    value = (f"_convert({_as_full_tile(expr, node, style)}, {upper}_KIND, {upper}_LO, {upper}_HI)"
             f".to({y.prefix}_ptr.dtype.element_ty)")
    pointer_store = f"tl.store({y.prefix}_ptr + {_offset(y.prefix, y.axes)}, {value}, mask=mask)"
    flag = f"{y.prefix.upper()}_TMA"
    if style == "gluon":  # the previous tile's TMA stores were waited for before the epilogue
        api = gluon_api()
        return [f"if {flag}:",
                f"    if {upper}_WAIT:  # an earlier output of this tile stores from the same buffer",
                "        tma.store_wait(pendings=0)",
                f"    {y.prefix}_smem.store({value})",
                "    fence_async_shared()",
                f"    {api.store}({y.prefix}_desc, [offs_m, offs_en], {y.prefix}_smem{policy_argument('stream')})",
                "else:",
                f"    {pointer_store}"]
    if style != "tma":
        return [pointer_store]
    return [f"if {flag} == 2:",
            f"    {y.prefix}_desc.store([offs_m, offs_en], {value})",
            f"elif {flag} == 3:",
            f"    {y.prefix}_desc.store([batch, offs_m, offs_en], {value}.reshape(1, BLOCK_M, EPI_N))",
            "else:",
            f"    {pointer_store}"]


def _log_of_products(p: str, names: dict, logs: LogSum, style: str, helpers: set) -> list[str]:
    """Lines leaving in `p` the (BLOCK_M,) row sums of log(y) over the tile's columns, taken as
    logs of products of logs.group columns (fewer where the piece is narrow): the columns are
    halved and the halves multiplied (c times c + EPI_N / 2, ...) while the halves are at least
    8 wide, which pairs values one thread holds. Shifted: the products of y - 1 terms (log1p's
    argument itself), as (1 + a)(1 + b) - 1 (rules.LogSum). Adds the helpers the lines call to
    `helpers`."""
    y = _as_full_tile(names[id(logs.arg)], logs.arg, style)
    if not logs.shifted:
        lines = [f"{p} = tl.where(mask, {y}, 1.0)"]
    else:
        lines = [f"{p} = tl.where(mask, {y}, 0.0)" if logs.plus_one else f"{p} = tl.where(mask, {y} - 1.0, 0.0)"]
    combine = f"{p}_0 * {p}_1 + ({p}_0 + {p}_1)" if logs.shifted else f"{p}_0 * {p}_1"
    group = 1
    while group < logs.group:
        group *= 2
        # in thread: the wgmma and mma layouts give a thread 2 neighbouring columns of every 8
        lines.append(f"if EPI_N // {group} >= 8:")
        shape = f"BLOCK_M, 2, EPI_N // {group}"
        if style == "gluon":
            lines.append(f"    {p}_0, {p}_1 = gl.split({p}.reshape([{shape}]).permute((0, 2, 1)))")
        else:
            lines.append(f"    {p}_0, {p}_1 = tl.split(tl.permute(tl.reshape({p}, ({shape})), (0, 2, 1)))")
        lines.append(f"    {p} = {combine}")
    log = f"_log1p_of_excess({p})" if logs.shifted else LOG_OF_NORMAL.emit(p)
    helpers.update(("_log1p_of_excess",) if logs.shifted else LOG_OF_NORMAL.helpers)
    lines.append(f"{p} = tl.reduce({log}, 1, _add)")
    return lines


def _store_reduction(y: OutputParams, names: dict, node: Node, style: str,
                     logs: LogSum | None, helpers: set) -> list[str]:
    """Reduce the tile over its in-tile dims; fold it in atomically or store it as a partial.
    `logs`: the summand's log term, summed as logs of products (rules.LogSum; y.dims has N)."""
    r = f"r_{y.prefix}"
    reduction = y.reduce.reduction
    combine = _COMBINE[reduction.combine]

    def reduce_call(v, axis):
        return f"tl.reduce({v}, {axis}, {combine})"

    lines = []
    summed = node if logs is None else logs.rest
    if summed is not None:
        tile = _as_full_tile(names[id(summed)], summed, style)
        if reduction.magnitude:
            tile = f"tl.abs({tile})"
        lines.append(f"{r} = tl.where(mask, {tile}, {_f(reduction.identity)})")
        if "N" in y.dims:
            lines.append(f"{r} = {reduce_call(r, 1)}")   # (BLOCK_M,), or a scalar after the next line
            if "M" in y.dims:
                lines.append(f"{r} = {reduce_call(r, 0)}")
        elif "M" in y.dims:
            lines.append(f"{r} = {reduce_call(r, 0)}")   # (BLOCK_N,)
    if logs is not None:
        lines.extend(_log_of_products(f"{r}_log", names, logs, style, helpers))
        if "M" in y.dims:
            lines.append(f"{r}_log = {reduce_call(f'{r}_log', 0)}")
        elif style == "gluon":
            lines.append(f"{r}_log = gl.convert_layout({r}_log, gl.SliceLayout(1, acc_layout))")
        sign = "+" if logs.sign > 0 else "-"
        lines.append(f"{r} = {r} {sign} {r}_log" if summed is not None
                     else f"{r} = {r}_log" if logs.sign > 0 else f"{r} = {r}_log * -1.0")
    kept = tuple(a for a in ("M", "N") if a not in y.dims)
    both = kept == ("M", "N")
    index = {"L": "pid_l", "M": "rm[:, None]" if both else "rm", "N": "rn[None, :]" if both else "rn"}
    mask = {("M",): ", mask=mask_m", ("N",): ", mask=mask_n", ("M", "N"): ", mask=mask"}.get(kept, "")
    if y.mode == "atomic":
        if y.scaled:
            lines.append(f"{r} = {r} * {y.prefix}_scale")
        terms = [f"{index[a]} * {y.prefix}_s{a.lower()}" for a in y.axes]
        address = f"{y.prefix}_ptr + {' + '.join(terms) or '0'}"
        # relaxed: nothing in the kernel reads the result back, and acq_rel costs each atomic a
        # GPU-wide fence and an L1 invalidation
        if reduction.magnitude:  # see reduction_mode
            lines.append(f"tl.atomic_max(({address}).to(tl.pointer_type(tl.int32)), "
                         f"{r}.to(tl.int32, bitcast=True) & 0x7FFFFFFF{mask}, sem='relaxed')")
        else:
            lines.append(f"tl.atomic_add({address}, {r}{mask}, sem='relaxed')")
    else:
        index.update({a: {"M": "pid_m", "N": "pid_en"}[a] for a in ("M", "N") if a in y.dims})
        terms = [f"{index[a]} * {y.prefix}_s{a.lower()}" for a in AXES]
        lines.append(f"tl.store({y.prefix}_ptr + {' + '.join(terms)}, {r}{mask})")
    return lines
