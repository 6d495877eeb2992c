"""TritonSplitK: the tiled kernel with each output tile's K loop shared by SPLIT_K programs.

For grids too small to fill the GPU: 128x8192x8192 has 64 tiles of 128x128 for 132 SMs, so
the tiled and persistent kernels leave half the machine idle however long K is. Here the grid
is (tiles, L, SPLIT_K); program (tile, s) multiplies over the s-th share of the K tiles and
stores its fp32 (int32 for int8 inputs) partial to a workspace; the last of a tile's programs
to finish, found with a counter per tile, adds the partials and runs the epilogue that the
tiled kernel emits, reductions included. One launch, no host synchronization.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..base import Status, supported, unsupported
from .persistent import _sm_count, few_tiles, gpu_sms, output_tiles
from .tiled import TileConfig, TritonTiled, uses_interpreter


@dataclass(frozen=True)
class SplitKConfig(TileConfig):
    split_k: int = 2

    def __str__(self) -> str:
        return f"{TileConfig.__str__(self)}, split {self.split_k}"


INTERPRETER_CONFIG = SplitKConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1, split_k=2)
CUDA_CONFIGS = (
    SplitKConfig(128, 128, 64, 8, 8, 3, split_k=2),
    SplitKConfig(128, 128, 64, 8, 8, 3, split_k=4),
    SplitKConfig(64, 128, 64, 8, 4, 4, split_k=2),
    SplitKConfig(64, 128, 64, 8, 4, 4, split_k=4),
)
# fp8 and int8: K tiles of 128, so that a stage's rows are 128 bytes as for fp16
BYTE_CONFIGS = tuple(replace(c, block_k=128) for c in CUDA_CONFIGS)
LONG_K = 2048  # the untimed ranking puts split-K first from this K on, on a small grid


class TritonSplitK(TritonTiled):
    """Split-K GEMM with the fused epilogue; the result is bitwise the same run to run.

    Each plan (one per GemmArguments and kernel, see TritonTiled._plan) owns its workspace:
    the partials, (tiles, SPLIT_K, BLOCK_M, BLOCK_N), and one int32 counter per tile, zeroed
    once when the plan is made. Every launch leaves each counter where it found it, so no
    launch re-initializes anything and a captured CUDA graph replays as is.

    Concurrency: launches of one plan must not overlap. Two GemmArguments never share a
    workspace, and launches on one stream run in order; but running the same GemmArguments
    from two streams at once (two threads with their own current streams, or a graph replay
    beside an eager call) makes both launches share the partials and counters, and their
    results may be wrong. That is a race on the outputs with any kernel; here the counters
    still come back to their starting values afterwards, so later launches are correct.

    The config is used as given, under Triton's interpreter too: kernel_statuses lists a
    small one there. `supports` refuses problems split-K does not pay off on (a K too short
    to split, a grid that already fills the GPU); the kernel itself is correct for any shape.
    """

    name = "triton_splitk"
    shape = "splitk"

    def __repr__(self) -> str:
        return f"<triton_splitk {self.config}>"

    def supports(self, args, cc: int | None = None) -> Status:
        refusal = self._common_support(args, cc)
        if refusal is not None:
            return refusal
        cfg = self.config
        interpret = uses_interpreter(args.A.device)
        if not interpret:
            capability = cc if cc is not None else _capability(args.A.device)
            if capability < 80:
                return unsupported(f"split-K runs on compute capability 8.0 or newer, not {capability}")
        least_k = 2 * cfg.split_k * cfg.block_k
        if args.K < least_k:
            return unsupported(f"K = {args.K} is too short to split {cfg.split_k} ways: two "
                               f"{cfg.block_k}-deep K tiles per split need K >= {least_k}")
        if not interpret:
            tiles = output_tiles(args, cfg)
            sms = _sm_count(args.A.device.index or 0)
            if tiles >= sms:
                return unsupported(f"{tiles} output tiles of {cfg.block_m}x{cfg.block_n} already fill "
                                   f"the {sms} SMs; split-K is for smaller grids")
        return supported(f"split-K {cfg}")

    def _config(self, args) -> SplitKConfig:
        return self._fallback.get((args.key, self.config), self.config)

    def workspace(self, args) -> tuple[torch.Tensor, torch.Tensor]:
        """The partials and counters of `args`' plan (made here if it was not yet)."""
        values = self._plan(args).values
        start = len(super()._gemm_values(args))
        return values[start], values[start + 1]

    def owned_buffers(self, args) -> tuple[torch.Tensor, torch.Tensor]:
        """What the launch carries besides the caller's tensors (see epifuse.callsite)."""
        return self.workspace(args)

    def _gemm_values(self, args) -> list:
        return [*super()._gemm_values(args), *self._workspace(args)]

    def _workspace(self, args) -> list[torch.Tensor]:
        """The partials and the per-tile counters; made with each plan, kept by its values."""
        cfg = self._config(args)
        integer = args.A.dtype == torch.int8 and not uses_interpreter(args.A.device)  # ACC_INT
        tiles = output_tiles(args, cfg)
        partials = torch.empty((tiles, cfg.split_k, cfg.block_m, cfg.block_n), device=args.A.device,
                               dtype=torch.int32 if integer else torch.float32)
        counters = torch.zeros(tiles, device=args.A.device, dtype=torch.int32)
        return [partials, counters]

    def _shape_meta(self, args, cfg, layout) -> tuple[dict, tuple]:
        meta, grid = super()._shape_meta(args, cfg, layout)
        meta["SPLIT_K"] = cfg.split_k
        return meta, (*grid, cfg.split_k)


def _capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def small_grid(args, sms: int) -> bool:
    """The cheap model for the untimed order: split-K first when the usual 128x128 tiles
    cannot fill the GPU and K is long enough for the split main loops to outweigh the fix-up."""
    return few_tiles(args, sms) and args.K >= LONG_K


def candidates(args) -> list[TritonSplitK]:
    """The split-K kernels kernel_statuses lists for `args`' device."""
    if uses_interpreter(args.A.device):
        return [TritonSplitK(INTERPRETER_CONFIG)]
    return [TritonSplitK(c) for c in cuda_configs(args.A.dtype)]


def cuda_configs(dtype: torch.dtype) -> tuple:
    return BYTE_CONFIGS if dtype.itemsize == 1 else CUDA_CONFIGS


def ranks_first(args) -> bool:
    """Whether kernel_statuses puts the split-K kernels before the others (never under the
    interpreter, where the tiled kernel stays the default)."""
    sms = gpu_sms(args)
    return sms is not None and small_grid(args, sms)
