"""TritonPersistent: one program per SM looping over output tiles, A and B through TMA.

For Hopper (compute capability 9.0), and for tests under Triton's interpreter, which runs
device-side tensor descriptors too. TMA needs the innermost dimension of A contiguous, B
contiguous along N or along K (a transposed weight), 16-byte aligned base pointers and
leading strides; anything else is left to TritonTiled, and `supports` says why.
"""
from __future__ import annotations

import functools

import torch
import triton

from ..base import Status, supported, unsupported
from .tiled import TileConfig, TritonTiled, uses_interpreter

INTERPRETER_CONFIG = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)
INTERPRETER_PROGRAMS = 3  # fewer programs than tiles, so the persistent loop is exercised
CUDA_CONFIGS = (
    TileConfig(128, 256, 64, 8, 8, 3, flatten=True),
    TileConfig(128, 128, 64, 8, 8, 4, flatten=True),
    TileConfig(128, 128, 64, 8, 4, 4, flatten=False),
    TileConfig(128, 256, 64, 8, 8, 3, flatten=True, warp_specialize=True),
)
FP32_CONFIGS = (TileConfig(128, 128, 32, 8, 8, 3, flatten=True),)
# fp8 and int8: K tiles of 128, so that a stage's rows are 128 bytes as for fp16
BYTE_CONFIGS = (
    TileConfig(128, 256, 128, 8, 8, 3, flatten=True),
    TileConfig(128, 128, 128, 8, 8, 4, flatten=True),
    TileConfig(128, 256, 128, 8, 8, 3, flatten=True, warp_specialize=True),
)


def cuda_configs(dtype: torch.dtype) -> tuple:
    if dtype == torch.float32:
        return FP32_CONFIGS
    return BYTE_CONFIGS if dtype.itemsize == 1 else CUDA_CONFIGS


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


USUAL_TILE = TileConfig(128, 128, 64)  # the tiles most configs take: what decides a small grid


def output_tiles(args, cfg: TileConfig) -> int:
    return args.L * triton.cdiv(args.M, cfg.block_m) * triton.cdiv(args.N, cfg.block_n)


def few_tiles(args, sms: int) -> bool:
    """Whether the usual 128x128 output tiles are fewer than the GPU's `sms`."""
    return output_tiles(args, USUAL_TILE) < sms


def gpu_index(args) -> int | None:
    """The index of the GPU args' kernels run on; None on a CPU or under the interpreter."""
    device = args.A.device
    if device.type != "cuda" or uses_interpreter(device):
        return None
    return device.index or 0


def gpu_sms(args) -> int | None:
    """The SM count of args' GPU; None on a CPU or under the interpreter."""
    index = gpu_index(args)
    return None if index is None else _sm_count(index)


def leaves_sms_idle(args) -> bool:
    """Whether the usual 128x128 tiles leave SMs of args' GPU without a tile (never on a CPU
    or under the interpreter): where the split-K kernels and the 64-row ping-pong come first."""
    sms = gpu_sms(args)
    return sms is not None and few_tiles(args, sms)


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    """The GPU's L2 size; 0 where torch does not report it (before torch 2.5)."""
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)


def b_fits_l2(args) -> bool:
    """Whether B of one GEMM takes at most a quarter of L2 on args' GPU while the usual tiles
    fill it (never on a CPU, under the interpreter or for a batch): where a tile order two rows
    deep lets B stay in L2 between rows (pingpong.row_order_configs)."""
    index = gpu_index(args)
    if index is None or args.L != 1 or leaves_sms_idle(args):
        return False
    return args.N * args.K * args.B.element_size() <= _l2_bytes(index) // 4


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _install_allocator() -> None:
    """Device-side descriptors need scratch memory, which Triton asks this allocator for. The
    allocator is a context variable, so it is set in the launching thread every time (autograd
    runs backward kernels on its own threads)."""
    triton.set_allocator(_scratch)


def _operand_a(args) -> torch.Tensor:
    """A as the kernel sees it: batched only when it really varies along L."""
    A = args.A
    return A[0] if A.dim() == 3 and A.shape[0] == 1 else A


def _operand_b(args) -> torch.Tensor:
    B = args.B
    return B[0] if B.dim() == 3 and B.shape[0] == 1 else B


class TritonPersistent(TritonTiled):
    name = "triton_persistent"
    shape = "persistent"

    def __repr__(self) -> str:
        return f"<triton_persistent {self.config}>"

    def supports(self, args, cc: int | None = None) -> Status:
        refusal = self._common_support(args, cc)
        if refusal is not None:
            return refusal
        device = args.A.device
        if not uses_interpreter(device):
            major = (cc // 10) if cc is not None else torch.cuda.get_device_capability(device)[0]
            if major < 9:
                return unsupported(f"TMA needs compute capability 9.0 (Hopper); this GPU is {major}.x")
        A, B = _operand_a(args), _operand_b(args)
        size = A.element_size()
        if A.stride(-1) != 1:
            return unsupported("A's last dimension is not contiguous (TMA needs stride 1 along K)")
        if B.stride(-1) != 1 and B.stride(-2) != 1:
            return unsupported("B is contiguous along neither N nor K (TMA needs one of them)")
        leading = [A.stride(-2), *([A.stride(0)] if A.dim() == 3 else [])]
        b_kmajor = B.stride(-1) != 1  # the same test the kernel's B_KMAJOR makes
        leading += [B.stride(-1) if b_kmajor else B.stride(-2), *([B.stride(0)] if B.dim() == 3 else [])]
        for t, label in ((A, "A"), (B, "B")):
            if t.data_ptr() % 16:
                return unsupported(f"{label} is not 16-byte aligned (TMA needs aligned base pointers)")
        if any((s * size) % 16 for s in leading):
            return unsupported("a leading stride of A or B is not a multiple of 16 bytes (TMA needs it)")
        if args.A.dtype == torch.float32 and self.config.block_k > 32 and not uses_interpreter(device):
            return unsupported("fp32 inputs use 32-deep K tiles in this kernel")
        return supported(f"persistent TMA {self.config}")

    _before_launch = staticmethod(_install_allocator)

    def _config(self, args) -> TileConfig:
        if uses_interpreter(args.A.device):
            return INTERPRETER_CONFIG
        return self._fallback.get((args.key, self.config), self.config)

    def _gemm_values(self, args) -> list:
        A, B = _operand_a(args), _operand_b(args)
        stride_al = A.stride(0) if A.dim() == 3 else 0
        stride_bl = B.stride(0) if B.dim() == 3 else 0
        return [A, B, args.M, args.N, args.K, stride_al, A.stride(-2), A.stride(-1),
                stride_bl, B.stride(-2), B.stride(-1), args.L]

    subtiles = 2

    def _shape_meta(self, args, cfg, layout) -> tuple[dict, tuple]:
        A, B = _operand_a(args), _operand_b(args)
        tiles = args.L * triton.cdiv(args.M, cfg.block_m) * triton.cdiv(args.N, cfg.block_n)
        if uses_interpreter(args.A.device):
            programs = INTERPRETER_PROGRAMS
        else:
            programs = _sm_count(args.A.device.index or 0)
        meta = dict(A_BATCHED=A.dim() == 3, B_BATCHED=B.dim() == 3, B_KMAJOR=B.stride(-1) != 1,
                    NUM_SMS=programs, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize)
        for o in layout.operands:
            if {"M", "N"} <= set(o.axes):
                meta[f"{o.prefix.upper()}_TMA"] = _tma_mode(args.operands[o.name], args.strides[o.name],
                                                             "L" in o.axes)
        for y in layout.outputs:
            if y.mode == "tile":
                meta[f"{y.prefix.upper()}_TMA"] = _tma_mode(args.outputs[y.name], args.strides[y.name],
                                                             args.L > 1)
        return meta, (max(1, min(programs, tiles)),)


def _tma_mode(t: torch.Tensor, strides: dict, batched: bool) -> int:
    """2 or 3 (a (M, N) or (L, M, N) descriptor) when TMA can move `t`, else 0 (pointers)."""
    size = t.element_size()
    leading = [strides["M"]] + ([strides["L"]] if batched else [])
    if strides.get("N") != 1 or t.data_ptr() % 16 or any((s * size) % 16 for s in leading):
        return 0
    return 3 if batched else 2
