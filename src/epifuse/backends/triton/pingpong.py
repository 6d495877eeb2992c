"""GluonPingPong and GluonCooperative: the warp-specialized GEMMs of `gluon_codegen`, for Hopper.

Ping-pong: one consumer warpgroup runs a tile's epilogue while the other runs the next tile's
wgmma main loop, so the epilogue's latency no longer adds to the GEMM as it does in the Triton
kernels (its instructions still take issue slots from the main loop: benchmarks/RESULTS.md).
Cooperative: both warpgroups share a (128, 256) tile, for main loops that read less shared
memory per MMA and epilogues on eight warps. They take fp16 and bf16 inputs (fp32
accumulation), fp8 (fp32) and int8 (int32, ping-pong only) with B contiguous along K, one batch
(L = 1), A contiguous along K, B along N or K, everything TMA moves 16-byte aligned; tile
outputs that fit in shared memory leave through TMA stores, the others through pointer stores.
Triton's interpreter cannot run Gluon, so on CPUs the kernels are compiled for sm_90 (tests)
but never launched.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import torch
import triton

from ..base import Status, supported, unsupported
from .codegen import OperandParams, launch_layout
from .gluon_api import L2_NONE, gluon_api
from .gluon_codegen import emit_gluon_kernel
from .persistent import TritonPersistent, _sm_count, _tma_mode
from .tiled import TL_TYPES, TileConfig, _conversion_meta, epilogue_values, uses_interpreter

# The same kernel with its epilogue over the whole tile, or over its two column halves in turn:
# fewer registers live at once (a loss epilogue spilled 1.6 KB whole), twice the reduction
# atomics (benchmarks/RESULTS.md, 2026-11-23 10:48: four pieces never won). In halves also with
# a fifth stage where it fits beside the tile buffer: lincomb and relu_aux 5-8 % faster at S2,
# identity, bias_gelu and rowsumsq 2-5 % slower (RESULTS.md, 2026-11-24 18:05). Inputs of one
# byte (fp8, int8) take K tiles of 128, so that a stage's rows are 128 bytes as for fp16.
CUDA_CONFIGS = (*(TileConfig(128, 128, 64, 8, 4, 4, epilogue_pieces=p) for p in (1, 2)),
                TileConfig(128, 128, 64, 8, 4, 5, epilogue_pieces=2))
BYTE_CONFIGS = tuple(TileConfig(128, 128, 128, 8, 4, 4, epilogue_pieces=p) for p in (1, 2))
# The cooperative kernel with its epilogue over the whole tile, or in two pieces: since C is
# loaded by TMA, the loss epilogue's fastest kernel (RESULTS.md, 2026-11-24 17:45; in four
# pieces through two buffers, beside a fourth stage, it never won: 2026-11-23 14:18).
COOPERATIVE_CONFIGS = tuple(TileConfig(128, 256, 64, 8, 8, 3, epilogue_pieces=p) for p in (1, 2))
COOPERATIVE_BYTE_CONFIGS = (TileConfig(128, 256, 128, 8, 8, 3),)
# Where the 128x128 tiles leave SMs idle (fewer tiles than SMs: a decode-like M of a few
# hundred rows), tiles of 64 rows put twice the CTAs on B's stream, each with a deeper ring
# (up to eight 24 KB stages): at 128x8192x8192, which reads B at DRAM speed, 63.3 -> 59.8 us for
# identity against cuBLAS's 59.2, fp8 47.4 -> 39.4 (RESULTS.md, 2026-11-25).
SMALL_GRID_CONFIGS = (TileConfig(64, 128, 64, 8, 4, 8),)
SMALL_GRID_BYTE_CONFIGS = (TileConfig(64, 128, 128, 8, 4, 8),)
# Tiles taken two rows at a time instead of eight, offered where all of B fits in a quarter of
# L2 (persistent.b_fits_l2): at 16384x4096x1024 a group of eight rows of 128x128 tiles spans
# every column of B, so B is read again for each group, after the group's 256 C, D and F tiles
# have streamed through L2; two rows re-read it after 64 tiles. There DRAM reads 273 -> 227 MB
# for relu_aux's two outputs and relu_aux 3 % faster, bias_gelu unchanged, lincomb within its
# spread (benchmarks/RESULTS.md, 2026-11-26 14:15-14:41).
ROW_ORDER_CONFIGS = (TileConfig(128, 128, 64, 2, 4, 5, epilogue_pieces=2),)
GLUON_INPUTS = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# Of the 227 KiB a Hopper CTA may use: the ring and the tile buffers take at most RING_BUDGET
# (the rest for barriers), or BUFFER_BUDGET where the epilogue reduces (its scratch needs a few
# KB more); a tile buffer is given only where three stages fit beside it in BUFFER_BUDGET:
# beside a second 64 KB buffer the ping-pong ring would fall to three stages, which costs more
# than the buffer saves (RESULTS.md, 2026-11-24 17:45).
RING_BUDGET = 224 * 1024
BUFFER_BUDGET = 220 * 1024
CONSUMER_REGS, PRODUCER_REGS = 232, 40
OFFLINE_SMS = 132  # the grid of a compile_offline (an H100's SM count; it changes no code)


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton ships Gluon's Hopper module: looked up, not imported (importing
    Gluon costs 0.1 s, a warm start's budget, and only a launch of this kernel needs it)."""
    spec = importlib.util.find_spec("triton.experimental")
    roots = spec.submodule_search_locations if spec is not None else None
    return any(os.path.exists(os.path.join(root, "gluon", "nvidia", "hopper", "__init__.py")) or
               os.path.exists(os.path.join(root, "gluon", "nvidia", "hopper.py")) for root in roots or ())


def cuda_configs(dtype: torch.dtype) -> tuple:
    return BYTE_CONFIGS if dtype.itemsize == 1 else CUDA_CONFIGS


def row_order_configs(dtype: torch.dtype) -> tuple:
    """The configs offered besides cuda_configs' where all of B fits in a quarter of L2."""
    return ROW_ORDER_CONFIGS if dtype.itemsize == 2 else ()


def small_grid_configs(dtype: torch.dtype) -> tuple:
    """The configs offered besides cuda_configs' where the 128x128 tiles leave SMs idle."""
    return SMALL_GRID_BYTE_CONFIGS if dtype.itemsize == 1 else SMALL_GRID_CONFIGS


class GluonPingPong(TritonPersistent):
    name = "gluon_pingpong"
    schedule = "pingpong"
    gluon = True
    consumers = 2  # consumer partitions, each with its own output buffers in shared memory
    num_warps = 4  # of each consumer; the kernel is launched with this many

    @property
    def shape(self) -> str:  # names the generated module, which differs with the pieces
        stem = "gluon" if self.schedule == "pingpong" else "gluonc"
        return stem if self.config.epilogue_pieces == 1 else f"{stem}{self.config.epilogue_pieces}"

    @property
    def subtiles(self) -> int:
        return self.config.epilogue_pieces

    def __repr__(self) -> str:
        hints = f", L2 hints {self.l2_hints}" if self.l2_hints != L2_NONE else ""
        return f"<{self.name} {self.config}{hints}>"

    _fallback: dict = {}  # its own smaller configs after an out-of-resources failure
    zeroes_reductions = True  # gluon_codegen emits zeroing for every schedule
    # gluon_api's L2 policies where this Triton has them: none, as evict-first streams did not
    # move any row beyond its spread (benchmarks/RESULTS.md, 2026-11-26 17:53)
    l2_hints = L2_NONE

    def _arrivals(self, grid) -> int:
        return grid[0] * self.consumers

    def supports(self, args, cc: int | None = None) -> Status:
        if args.A.device.type != "cuda" or uses_interpreter(args.A.device):
            return unsupported("the Gluon kernel runs on Hopper GPUs only (Triton's interpreter cannot run it)")
        major = (cc // 10) if cc is not None else torch.cuda.get_device_capability(args.A.device)[0]
        if major != 9:
            return unsupported(f"the Gluon kernel uses wgmma, which only compute capability 9.x has; this GPU is {major}.x")
        if not gluon_available():
            return unsupported(f"triton {triton.__version__} has no Gluon Hopper support")
        return self.supports_problem(args, cc)

    def supports_problem(self, args, cc: int | None = None) -> Status:
        """Whether the kernel takes these dtypes, shapes and layouts on a Hopper GPU, whatever
        device the tensors are on: the question before an offline compile (compile_offline)."""
        status = super().supports(args, cc)
        if not status:
            return status
        if args.A.dtype not in GLUON_INPUTS:
            return unsupported(f"the Gluon kernel takes fp16, bf16, fp8 or int8 inputs, not {args.A.dtype}")
        if args.A.dtype.itemsize == 1 and not _b_kmajor(args):
            return unsupported(f"{args.A.dtype} inputs need B contiguous along K in the Gluon kernel "
                               "(wgmma reads 8-bit operands K-major only)")
        accumulator = torch.int32 if args.A.dtype == torch.int8 else torch.float32
        if args.accumulator_type != accumulator:
            return unsupported(f"the Gluon kernel accumulates {args.A.dtype} in {accumulator} only")
        if args.L != 1:
            return unsupported(f"the Gluon kernel runs one GEMM, not a batch of {args.L}")
        if 0 in (args.M, args.N, args.K):
            return unsupported(f"an empty GEMM ({args.M}x{args.N}x{args.K}): TMA descriptors need every "
                               "dimension positive; the other kernels take it")
        return supported(f"Gluon {self.schedule} {self.config}")

    def _source(self, args, target: str) -> str:
        return emit_gluon_kernel(args.graph, args.key, args.deterministic, self.config.epilogue_pieces,
                                 self.schedule)

    def _config(self, args) -> TileConfig:
        return self._fallback.get((args.key, self.config), self.config)

    def _launch_args(self, args, layout, buffers):
        cfg = self._config(args)
        tiles = [y for y in layout.outputs if y.mode == "tile"]
        # A, B and each TMA-moved operand and output are passed as tensors; _argument_converter
        # makes the descriptors, so a kept launch (epifuse.callsite) can swap in new tensors.
        values = [args.A, args.B, args.M, args.N, args.K, *epilogue_values(args, layout, buffers)]
        plan = _buffer_plan(args, cfg, layout, self.consumers)
        values += [(args.operands[s.name] if isinstance(s, OperandParams) else buffers[s.name][0])
                   if plan.tma[s.prefix] else None for s in layout.tile_slots()]
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    EPI_N=cfg.block_n // cfg.epilogue_pieces, GROUP_M=cfg.group_m, STAGES=plan.stages,
                    B_KMAJOR=_b_kmajor(args), INSTR_K=32 if args.A.dtype.itemsize == 1 else 16,
                    ACC_INT=args.A.dtype == torch.int8, EVEN_M=args.M % cfg.block_m == 0,
                    EVEN_N=args.N % cfg.block_n == 0, CONSUMER_REGS=CONSUMER_REGS,
                    PRODUCER_REGS=PRODUCER_REGS, num_warps=self.num_warps, LOAD_BYTES=plan.load_bytes,
                    L2_HINTS=self.l2_hints if gluon_api().l2_policies else L2_NONE)
        for p in plan.slots:
            meta[f"{p.upper()}_TMA"] = plan.tma[p]
            meta[f"{p.upper()}_BUF"] = plan.owner[p]
        for y in tiles:
            meta.update(_conversion_meta(y.prefix, args.outputs[y.name].dtype))
            meta[f"{y.prefix.upper()}_WAIT"] = plan.wait[y.prefix]
        tiles_total = triton.cdiv(args.M, cfg.block_m) * triton.cdiv(args.N, cfg.block_n)
        programs = _sm_count(args.A.device.index or 0) if args.A.is_cuda else OFFLINE_SMS
        return values, meta, (max(1, min(programs, tiles_total)),)

    def _argument_converter(self, args, layout, values, meta):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        BM, BN, BK, EN = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], meta["EPI_N"]
        A, B = args.A, args.B
        if meta["B_KMAJOR"]:  # B = Bt.t() with Bt (N, K) contiguous along K
            b_spec = (1, [args.N, args.K], [B.stride(-1), 1], [BN, BK])
        else:
            b_spec = (1, [args.K, args.N], [B.stride(-2), 1], [BK, BN])
        specs = [(0, [args.M, args.K], [A.stride(-2), 1], [BM, BK]), b_spec]
        slots = layout.tile_slots()
        first = len(values) - len(slots)
        specs += [(first + k, [args.M, args.N], [args.strides[slot.name]["M"], 1], [BM, EN])
                  for k, slot in enumerate(slots) if values[first + k] is not None]
        specs = [(i, shape, strides, block, _shared_layout(block, values[i].dtype))
                 for i, shape, strides, block in specs]

        def convert(current, jit: bool) -> list:
            current = list(current)
            for i, shape, strides, block, shared_layout in specs:
                t = current[i]
                current[i] = (TensorDescriptor(t, shape, strides, block, shared_layout) if jit
                              else _Described(t, shape, strides))
            return current
        return convert


class _Described:
    """What Triton's launcher reads of a TensorDescriptor after the first launch."""

    __slots__ = ("base", "shape", "strides")
    padding = "zero"
    round_f32_to_tf32 = False  # read by Triton 3.9's launcher

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides = base, shape, strides


def _shared_layout(block, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    gl_dtype = getattr(gl, TL_TYPES[dtype].removeprefix("tl."))
    return gl.NVMMASharedLayout.get_default_for(block, gl_dtype)


def _b_kmajor(args) -> bool:
    return args.B.stride(-1) != 1


# (M, N) operands loaded by TMA into shared memory: the types the epilogue reads there as
# floats (two- and four-byte ones; others are loaded through pointers)
TMA_OPERAND_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """How a launch uses shared memory next to the ring: `slots` (the prefixes of Layout.tile_slots),
    for each whether TMA moves it (`tma`) and the index of the slot whose buffer it uses
    (`owner`), for each tile output whether an earlier output stores from that buffer too
    (`wait`), the ring's depth and the bytes one tile's operand loads bring."""
    slots: tuple
    tma: dict
    owner: dict
    wait: dict
    stages: int
    load_bytes: int


def _buffer_plan(args, cfg: TileConfig, layout, consumers: int = 2) -> BufferPlan:
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
        movable = _tma_mode(t, strides, False) == 2 and (
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


class GluonCooperative(GluonPingPong):
    """The same kernel with one 8-warp consumer per (128, 256) tile: each warpgroup's wgmma
    takes 64 rows of it, which reads less shared memory per MMA than the ping-pong's 128x128
    tiles, and the epilogue runs on all eight warps while the producer loads the next tile."""
    name = "gluon_cooperative"
    schedule = "cooperative"
    consumers = 1
    num_warps = 8

    def supports_problem(self, args, cc: int | None = None) -> Status:
        status = super().supports_problem(args, cc)
        if status and args.A.dtype == torch.int8:
            # Triton 3.6 fails to lower its m64n256k32 s8 wgmma (ConvertNVGPUToLLVM); the
            # ping-pong kernel's n128 one builds
            return unsupported("int8 inputs take the ping-pong Gluon kernel, not the cooperative one")
        return status


def cooperative_configs(dtype: torch.dtype) -> tuple:
    if dtype == torch.int8:
        return ()
    return COOPERATIVE_BYTE_CONFIGS if dtype.itemsize == 1 else COOPERATIVE_CONFIGS


def compile_offline(kernel: GluonPingPong, args, capability: int = 90):
    """Compile `kernel`'s launch for `args` to a cubin for compute capability `capability`
    without a GPU: `args` may hold CPU tensors, which stand in for CUDA tensors of the same
    shapes, strides, dtypes and alignment. Triton's own argument binder and specializer run
    as at a launch, then triton.compile (which runs ptxas). Returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from ...runtime.cache import load_kernel_module
    source = kernel._source(args, "cuda")
    module = load_kernel_module(f"{kernel.shape}_{args.key}_offline" + ("_det" if args.deterministic else ""),
                                source, False)
    layout = launch_layout(args.graph, args.deterministic)
    buffers, _ = kernel._reduction_buffers(args, layout)
    launch = kernel._complete_launch(args, layout, buffers)
    values, meta = launch.convert(launch.values, True), launch.meta
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = module.epifuse_kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*values, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
