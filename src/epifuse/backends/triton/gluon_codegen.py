"""Emit the Gluon source of a warp-specialized GEMM whose epilogue is a Graph.

Hopper only (wgmma, TMA, mbarriers). One program per SM loops over output tiles. A producer
warp issues the TMA loads of A and B into a ring of shared-memory stages. In the "pingpong"
schedule two consumer warpgroups take alternate tiles, so one runs its epilogue while the
other runs its wgmma main loop; in the "cooperative" one a single 8-warp consumer takes every
tile, each warpgroup half of its rows, and only the producer's loads of the next tile overlap
its epilogue. The epilogue is the same code the Triton kernels run
(`codegen._emit_epilogue` in its "gluon" style) over the whole (BLOCK_M, BLOCK_N) tile in the
wgmma accumulator's layout; tile outputs leave through shared memory and TMA stores when their
launch says so (Y*_TMA), else through pointer stores. Tile operands (a C of shape (M, N)) that
the launch loads by TMA (X*_TMA) are fetched into shared memory when a consumer starts the tile,
so they arrive during its main loop; the epilogue waits on load_bars[CID] and reads them there.

Ring protocol (per CTA): ring index i -> stage i % STAGES, phase (i // STAGES) & 1; the CTA's
t-th tile uses ring indices t k_tiles ... (t + 1) k_tiles - 1. In the ping-pong schedule
consumer c takes the CTA's tiles t = 2 j + c, and turn[c] orders the consumers: c waits on it
before its tile's first ready-wait, and the other consumer arrives on it once it has passed
all ready-waits of the tile before (otherwise the later consumer could test a stage's parity a
whole ring ahead and pass on a stale phase).
Every barrier counts one arrival (Gluon arrives once per partition).
"""
from __future__ import annotations

from ...ir import Graph
from .codegen import _HEADER, _emit_epilogue, launch_layout, zeroing
from .gluon_api import POLICY_SOURCE, gluon_api, policy_argument
from .rules import helper_source

_GLUON_IMPORTS = '''from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.constexpr_function
def _wgmma_instr_n(BLOCK_N):
    BLOCK_N = getattr(BLOCK_N, "value", BLOCK_N)
    n = 256
    while n > BLOCK_N or BLOCK_N % n != 0:
        n -= 8
    return n


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (tile % group_size_m), (tile % num_pid_in_group) // group_size_m


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, L2_HINTS: gl.constexpr):
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    i = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(empty_bars.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes
            mbarrier.expect(ready_bars.index(s), nbytes)
            {load}(a_desc, [pid_m * BLOCK_M, kk * BLOCK_K], ready_bars.index(s), a_bufs.index(s))
            if B_KMAJOR:
                {load}(b_desc, [pid_n * BLOCK_N, kk * BLOCK_K], ready_bars.index(s), b_bufs.index(s){b_policy})
            else:
                {load}(b_desc, [kk * BLOCK_K, pid_n * BLOCK_N], ready_bars.index(s), b_bufs.index(s){b_policy})
            i += 1
'''

_CONSUMER = '''

@gluon.jit
def _consumer(CID: gl.constexpr, {params}):
{layouts}    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
{zero_start}    j = 0
    for tile in range(pid + CID * nprog, num_pid_m * num_pid_n, 2 * nprog):
        t = 2 * j + CID
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        mbarrier.wait(turn_bars.index(CID), (j + CID + 1) & 1, pred=t > 0)
        base = t * k_tiles
{prefetch}{zeros}        for kk in range(k_tiles):
            i = base + kk
{k_step}        mbarrier.arrive(turn_bars.index(1 - CID))
{zero_poll}        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((base + k_tiles - 1) % STAGES), pred=k_tiles > 0)
{tile_rows}{wait}{pieces}        j += 1
{drain}{zero_end}

@gluon.jit
def _consumer0({params}):
    _consumer(0, {args})


@gluon.jit
def _consumer1({params}):
    _consumer(1, {args})


@gluon.jit
def epifuse_kernel(
    {kernel_params},
):
{ring}    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn_bars.index(c), count=1)
{load_bars}{allocate}    # The argument tuples are written out: a tuple kept in a variable turns its constexpr
    # members into runtime values.
    gl.warp_specialize([
        (_consumer0, ({args})),
        (_consumer1, ({args})),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_KMAJOR, L2_HINTS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
'''

_LAYOUTS = """    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[{warps}, 1], instr_shape=[16, _wgmma_instr_n(BLOCK_N), INSTR_K])
    # the epilogue's piece of the tile, (BLOCK_M, EPI_N): the same registers, fewer columns
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[{warps}, 1], instr_shape=[16, _wgmma_instr_n(EPI_N), INSTR_K])
"""

_ZEROS = """        if ACC_INT:
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, mma_layout)
        else:
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
"""

# The cooperative schedule: one consumer partition of two warpgroups shares each (BLOCK_M,
# BLOCK_N) tile (each warpgroup's wgmma takes BLOCK_M / 2 rows) and runs its epilogue on all
# eight warps; only the producer's loads of the next tile and the TMA stores overlap it.
_COOPERATIVE = '''

@gluon.jit
def _consumer({params}):
{layouts}    CID: gl.constexpr = 0
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
{zero_start}    i = 0
    j = 0
    for tile in range(pid, num_pid_m * num_pid_n, nprog):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
{prefetch}{zeros}        for kk in range(k_tiles):
{k_step}            i += 1
{zero_poll}        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((i + STAGES - 1) % STAGES), pred=k_tiles > 0)
{tile_rows}{wait}{pieces}        j += 1
{drain}{zero_end}

@gluon.jit
def epifuse_kernel(
    {kernel_params},
):
{ring}    for s in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=1)
    turn_bars = ready_bars  # the consumer's signature is the ping-pong one's; it has no turns
{load_bars}{allocate}    gl.warp_specialize([
        (_consumer, ({args})),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_KMAJOR, L2_HINTS)),
    ], [1], [PRODUCER_REGS])
'''

# Shared by both schedules: one K step of a consumer's main loop at ring index i (the stage is
# released once the wgmma after it is issued), the tile's rows for the epilogue, and the ring.
_K_STEP = """            s = i % STAGES
            mbarrier.wait(ready_bars.index(s), (i // STAGES) & 1)
            if B_KMAJOR:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((i + STAGES - 1) % STAGES), pred=kk > 0)
"""
_TILE_ROWS = """        offs_m = pid_m * BLOCK_M
        pid_l = 0
        rm = offs_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        if EVEN_M:  # every tile is whole: a constant mask the compiler folds away
            mask_m = gl.full([BLOCK_M], 1, gl.int1, gl.SliceLayout(1, acc_layout))
        else:
            mask_m = rm < M
"""
_RING = """    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
"""

# One (BLOCK_M, EPI_N) piece of the tile: its accumulator values (a split of the wgmma
# accumulator's registers: no data moves), columns, and shared-memory buffers.
_PIECE = """        acc_e = gl.convert_layout({value}, acc_layout)
        offs_en = pid_n * BLOCK_N + {index} * EPI_N
        pid_en = pid_n * {pieces} + {index}
        rn = offs_en + gl.arange(0, EPI_N, layout=gl.SliceLayout(0, acc_layout))
        if EVEN_N:
            mask_n = gl.full([EPI_N], 1, gl.int1, gl.SliceLayout(0, acc_layout))
        else:
            mask_n = rn < N
        mask = mask_m[:, None] & mask_n[None, :]
"""


def _split_lines(pieces: int) -> tuple[str, list[str]]:
    """Lines splitting `acc` into `pieces` (a power of two) column blocks by halving every block
    in turn, and the blocks' names in column order."""
    if pieces < 1 or pieces & (pieces - 1):
        raise ValueError(f"an epilogue in {pieces} pieces: a power of two is needed")
    names, lines = ["acc"], ""
    while len(names) < pieces:
        half = f"{pieces // (2 * len(names))} * EPI_N"
        for name in names:
            lines += (f"        {name}_0, {name}_1 = gl.split({name}.reshape([BLOCK_M, 2, {half}])"
                      f".permute((0, 2, 1)))\n")
        names = [f"{name}_{i}" for name in names for i in (0, 1)]
    return lines, names


GEMM_META = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "EPI_N", "GROUP_M", "STAGES", "B_KMAJOR", "INSTR_K", "ACC_INT",
             "EVEN_M", "EVEN_N", "CONSUMER_REGS", "PRODUCER_REGS", "L2_HINTS"]
SCHEDULES = ("pingpong", "cooperative")


def tile_outputs(layout) -> list[str]:
    return [y.prefix for y in layout.outputs if y.mode == "tile"]


def _buffer_of(q: str, slots: list[str], pieces: int, index: int, indent: int) -> str:
    """Lines naming `q`_smem: piece `index` of this consumer's part of the buffer slot q
    uses (`slots`: the tile slots' prefixes), which is that of slot Q_BUF: its own, or
    another's of the same dtype (pingpong._buffer_plan), which an output reuses once the
    operand loaded into it has been read or the TMA store out of it has read it."""
    pad = " " * indent
    return "".join(f"{pad}{'if' if k == 0 else 'elif'} {q.upper()}_BUF == {k}:\n"
                   f"{pad}    {q}_smem = {p}_bufs.index(CID * {pieces} + {index})\n"
                   for k, p in enumerate(slots))


def emit_gluon_kernel(graph: Graph, key: str, deterministic: bool = False, pieces: int = 1,
                      schedule: str = "pingpong") -> str:
    """The module source of the Gluon `epifuse_kernel` for `graph` (CUDA, compute capability 9.0).

    Its parameters: a_desc, b_desc, M, N, K, the epilogue's (launch_layout order), then
    *_desc for each tile slot (`Layout.tile_slots`; None when that operand or output moves through
    pointers), then the constexprs: GEMM_META, LOAD_BYTES (the bytes one tile's operand loads
    bring), each slot's TMA flag and BUF, and each tile output's KIND/LO/HI and WAIT (an
    earlier output of the tile stores from its buffer). The epilogue runs on `pieces` column
    blocks of the tile in turn (EPI_N = BLOCK_N / pieces). `schedule`: "pingpong" (two 4-warp
    consumers on alternate tiles, launched with 4 warps) or "cooperative" (one 8-warp consumer
    per tile, launched with 8 warps)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown Gluon schedule {schedule!r}; one of {SCHEDULES}")
    consumers = 2 if schedule == "pingpong" else 1
    api = gluon_api()
    layout = launch_layout(graph, deterministic)
    warps = 4 if schedule == "pingpong" else 8
    # the first program's first consumer zeroes; every consumer arrives, with tiles or without
    zero = zeroing(layout, "pid == 0 and CID == 0", "gluon", warps)
    lines, helpers = _emit_epilogue(graph, layout, "gluon")
    helpers |= zero.helpers
    tiles = tile_outputs(layout)
    slots = layout.tma_candidates()
    loads = [p for p in slots if p not in tiles]
    meta = (GEMM_META + ["LOAD_BYTES"] + [f"{p.upper()}_{part}" for p in slots for part in ("TMA", "BUF")]
            + [f"{p.upper()}_{part}" for p in tiles for part in ("KIND", "LO", "HI", "WAIT")]
            + list(zero.meta))
    runtime = ["M", "N", "K", *layout.param_names(), *(f"{p}_desc" for p in slots), *zero.params]
    consumer_runtime = ["a_bufs", "b_bufs", "ready_bars", "empty_bars", "turn_bars", "load_bars",
                        *runtime, *(f"{p}_bufs" for p in slots)]
    params = ", ".join([*consumer_runtime, *(f"{m}: gl.constexpr" for m in meta)])
    args = ", ".join([*consumer_runtime, *meta])
    kernel_params = ",\n    ".join(["a_desc", "b_desc", *runtime, *(f"{m}: gl.constexpr" for m in meta)])
    any_store = " or ".join(f"{p.upper()}_TMA" for p in tiles) or "False"
    any_load = " or ".join(f"{p.upper()}_TMA" for p in loads) or "False"
    # The operands' loads start with the tile, once the TMA stores of this consumer's tile
    # before have read the buffers they may share.
    copies = "".join(f"            if {p.upper()}_TMA:\n" + _buffer_of(p, slots, pieces, i, 16) +
                     f"                {api.load}({p}_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N + {i} * EPI_N], "
                     f"load_bars.index(CID), {p}_smem{policy_argument('stream')})\n"
                     for p in loads for i in range(pieces))
    prefetch = (f"        if {any_load}:\n"
                f"            if {any_store}:\n"
                "                tma.store_wait(pendings=0)\n"
                "            mbarrier.expect(load_bars.index(CID), LOAD_BYTES)\n" + copies) if loads else ""
    # One wait for this consumer's stores of the tile before (issued a whole main loop ago, and
    # already waited for where operands were loaded) covers every output's shared-memory
    # buffer; then the wait for this tile's operands.
    wait = (f"        if {any_store}:\n            tma.store_wait(pendings=0)\n"
            f"        if {any_load}:\n            mbarrier.wait(load_bars.index(CID), j & 1)\n")
    drain = f"    if {any_store}:\n        tma.store_wait(pendings=0)\n"
    load_bars = ("    load_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())\n"
                 "    for c in gl.static_range(2):\n"
                 "        mbarrier.init(load_bars.index(c), count=1)\n")
    allocate = "".join(
        f"    if {p.upper()}_TMA and {p.upper()}_BUF == {k}:\n"
        f"        {p}_bufs = gl.allocate_shared_memory({p}_desc.dtype, [{consumers * pieces}] + {p}_desc.block_type.shape, "
        f"{p}_desc.layout)\n"
        f"    else:\n"
        f"        {p}_bufs = turn_bars  # never used\n" for k, p in enumerate(slots))
    body = "".join(" " * 8 + line + "\n" for line in lines)
    split, values = _split_lines(pieces)
    pieces_text = split + "".join(_PIECE.format(value=v, index=i, pieces=pieces)
                                  + "".join(_buffer_of(q, slots, pieces, i, 8) for q in slots) + body
                                  for i, v in enumerate(values))
    template = _CONSUMER if schedule == "pingpong" else _COOPERATIVE
    zero_start = "".join("    " + line + "\n" for line in zero.start)
    zero_end = "".join("    " + line + "\n" for line in zero.end)
    # asked as the last wgmmas finish, waited for with the tile's operands
    zero_poll = "".join(" " * 8 + line + "\n" for line in zero.poll)
    wait += "".join(" " * 8 + line + "\n" for line in zero.wait)
    return (_HEADER.format(key=key, target=f"cuda (Gluon {schedule}, sm_90)",
                           libdevice="from triton.language.extra import libdevice\n")
            + _GLUON_IMPORTS.replace("{load}", api.load).replace("{b_policy}", policy_argument("b"))
            + (POLICY_SOURCE if api.l2_policies else "") + helper_source(helpers, "cuda")
            + template.format(params=params, args=args, kernel_params=kernel_params, wait=wait,
                              pieces=pieces_text, drain=drain, allocate=allocate, zeros=_ZEROS,
                              k_step=_K_STEP, tile_rows=_TILE_ROWS, ring=_RING, prefetch=prefetch,
                              load_bars=load_bars, zero_start=zero_start, zero_end=zero_end, zero_poll=zero_poll,
                              layouts=_LAYOUTS.format(warps=warps)))
