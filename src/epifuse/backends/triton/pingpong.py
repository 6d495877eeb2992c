"""GluonPingPong: the warp-specialized ping-pong GEMM of `gluon_codegen`, for Hopper.

One consumer warpgroup runs a tile's epilogue while the other runs the next tile's wgmma main
loop, so the epilogue's latency no longer adds to the GEMM as it does in the Triton kernels
(its instructions still take issue slots from the main loop: benchmarks/RESULTS.md). It takes
fp16 and bf16 inputs with fp32 accumulation, one batch (L = 1), A contiguous along K, B along
N or K, everything TMA moves 16-byte aligned; tile outputs that fit in shared memory leave
through TMA stores, the others through pointer stores. Triton's interpreter cannot run Gluon,
so on CPUs the kernel is compiled for sm_90 (tests) but never launched.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
import triton

from ..base import Status, supported, unsupported
from .codegen import launch_layout
from .gluon_codegen import emit_gluon_kernel
from .grouped import TL_TYPES
from .persistent import TritonPersistent, _sm_count, _tma_mode
from .tiled import TileConfig, _conversion_meta, epilogue_values, uses_interpreter

# The same kernel with its epilogue over the whole tile, or over its two column halves in turn:
# fewer registers live at once (a loss epilogue spilled 1.6 KB whole), twice the reduction
# atomics (benchmarks/RESULTS.md, 2026-11-23 10:48: four pieces never won).
CUDA_CONFIGS = tuple(TileConfig(128, 128, 64, 8, 4, 4, epilogue_pieces=p) for p in (1, 2))
SHARED_MEMORY = 220 * 1024  # of the 227 KiB a Hopper CTA may use; the rest for barriers and scratch
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


class GluonPingPong(TritonPersistent):
    name = "gluon_pingpong"

    @property
    def shape(self) -> str:  # names the generated module, which differs with the pieces
        return "gluon" if self.config.epilogue_pieces == 1 else f"gluon{self.config.epilogue_pieces}"

    @property
    def subtiles(self) -> int:
        return self.config.epilogue_pieces

    def __repr__(self) -> str:
        return f"<gluon_pingpong {self.config}>"

    _fallback: dict = {}  # its own smaller configs after an out-of-resources failure

    def supports(self, args, cc: int | None = None) -> Status:
        if args.A.device.type != "cuda" or uses_interpreter(args.A.device):
            return unsupported("the Gluon kernel runs on Hopper GPUs only (Triton's interpreter cannot run it)")
        major = (cc // 10) if cc is not None else torch.cuda.get_device_capability(args.A.device)[0]
        if major != 9:
            return unsupported(f"the Gluon kernel uses wgmma, which only compute capability 9.x has; this GPU is {major}.x")
        if not gluon_available():
            return unsupported(f"triton {triton.__version__} has no Gluon Hopper support")
        status = super().supports(args, cc)
        if not status:
            return status
        if args.A.dtype not in (torch.float16, torch.bfloat16):
            return unsupported(f"the Gluon kernel takes fp16 or bf16 inputs, not {args.A.dtype}")
        if args.accumulator_type != torch.float32:
            return unsupported("the Gluon kernel accumulates in float32 only")
        if args.L != 1:
            return unsupported(f"the Gluon kernel runs one GEMM, not a batch of {args.L}")
        if 0 in (args.M, args.N, args.K):
            return unsupported(f"an empty GEMM ({args.M}x{args.N}x{args.K}): TMA descriptors need every "
                               "dimension positive; the other kernels take it")
        return supported(f"Gluon ping-pong {self.config}")

    def _source(self, args, target: str) -> str:
        return emit_gluon_kernel(args.graph, args.key, args.deterministic, self.config.epilogue_pieces)

    def _config(self, args) -> TileConfig:
        return self._fallback.get((args.key, self.config), self.config)

    def _launch_args(self, args, layout, buffers):
        cfg = self._config(args)
        tiles = [y for y in layout.outputs if y.mode == "tile"]
        # A, B and each TMA-stored output are passed as tensors; _argument_converter makes
        # the descriptors, so a kept launch (epifuse.callsite) can swap in new tensors.
        values = [args.A, args.B, args.M, args.N, args.K, *epilogue_values(args, layout, buffers)]
        stages, tma, owner = _stages_and_stores(args, cfg, tiles)
        values += [buffers[y.name][0] if tma[y.prefix] else None for y in tiles]
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    EPI_N=cfg.block_n // cfg.epilogue_pieces, GROUP_M=cfg.group_m, STAGES=stages, B_KMAJOR=_b_kmajor(args),
                    CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
        for y in tiles:
            meta.update(_conversion_meta(y.prefix, args.outputs[y.name].dtype))
            meta[f"{y.prefix.upper()}_TMA"] = tma[y.prefix]
            meta[f"{y.prefix.upper()}_BUF"] = owner[y.prefix]
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
        tiles = [y for y in layout.outputs if y.mode == "tile"]
        first = len(values) - len(tiles)
        specs += [(first + k, [args.M, args.N], [args.strides[y.name]["M"], 1], [BM, EN])
                  for k, y in enumerate(tiles) if values[first + k] is not None]
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

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides = base, shape, strides


def _shared_layout(block, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    gl_dtype = getattr(gl, TL_TYPES[dtype].removeprefix("tl."))
    return gl.NVMMASharedLayout.get_default_for(block, gl_dtype)


def _b_kmajor(args) -> bool:
    return args.B.stride(-1) != 1


def _stages_and_stores(args, cfg: TileConfig, tiles) -> tuple[int, dict, dict]:
    """The ring's depth, which tile outputs TMA stores, and whose shared-memory buffer each
    uses (the number of that output's prefix). A buffer holds a (BLOCK_M, BLOCK_N) tile for
    each consumer; outputs of one dtype share it, one TMA store after the other. Outputs TMA
    cannot move, or whose buffer does not fit next to a ring of at least three stages, are
    stored through pointers."""
    size = args.A.element_size()
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * size
    stores, owner, by_dtype, used = {}, {}, {}, 0
    for y in tiles:
        dest = args.outputs[y.name]
        number = int(y.prefix[1:])
        if _tma_mode(dest, args.strides[y.name], False) != 2:
            stores[y.prefix], owner[y.prefix] = False, number
            continue
        if dest.dtype in by_dtype:
            stores[y.prefix], owner[y.prefix] = True, by_dtype[dest.dtype]
            continue
        need = 2 * cfg.block_m * cfg.block_n * dest.element_size()
        fits = 3 * stage + used + need <= SHARED_MEMORY
        stores[y.prefix], owner[y.prefix] = fits, number
        if fits:
            by_dtype[dest.dtype] = number
            used += need
    stages = max(2, min(cfg.num_stages, (SHARED_MEMORY - used) // stage))
    return stages, stores, owner


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
    values, meta, _ = kernel._launch_args(args, layout, buffers)
    values = kernel._argument_converter(args, layout, values, meta)(values, True)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = module.epifuse_kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*values, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
