"""Tile configs: what each kernel family is tried with, per input dtype.

A kernel is a family (families.py) and one of these configs. The order within a list is the
untimed order (EPIFUSE_TUNE=0, the interpreter); tuning times them all. Inputs of one byte (fp8,
int8) take K tiles of 128, so that a pipeline stage's rows are 128 bytes as for fp16's 64.
docs/design/kernels.md says where each config came from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8              # tiles run in groups of this many rows (_tile_coords)
    num_warps: int = 4
    num_stages: int = 3
    flatten: bool = False         # persistent: fuse the tile and K loops for pipelining
    warp_specialize: bool = False  # persistent: Triton's producer/consumer warps
    epilogue_pieces: int = 1      # Gluon: the epilogue runs on this many column blocks in turn
    split_k: int = 1              # split-K: programs sharing each tile's K loop

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} group {self.group_m}, "
                f"{self.num_warps} warps, {self.num_stages} stages" + (", flat" if self.flatten else "")
                + (", ws" if self.warp_specialize else "")
                + (f", epilogue in {self.epilogue_pieces}" if self.epilogue_pieces > 1 else "")
                + (f", split {self.split_k}" if self.split_k > 1 else ""))


# The widest tile of any config: an epilogue whose reduction over N feeds later math runs in
# one kernel where a tile spans N, so N at most this; wider, as passes (staging.py).
WIDEST_N = 256
NARROWEST_N = 16   # tl.dot's least N


def spanning(config: TileConfig, n: int, widest: int = WIDEST_N) -> TileConfig:
    """`config` with tiles as wide as a row of `n` columns (the power of two at or above n, at
    least NARROWEST_N) where that is at most `widest`; else `config` unchanged (whose tiles a
    row then spans only if it is already wide enough)."""
    width = max(NARROWEST_N, 1 << max(n - 1, 0).bit_length())
    return replace(config, block_n=width) if width <= widest else config


def smaller(config: TileConfig, keep_n: bool = False) -> TileConfig | None:
    """The next config down after an out-of-resources failure: fewer pipeline stages, then
    narrower tiles (shorter ones only, with `keep_n`: a tile that spans a row keeps it); None
    at the bottom."""
    if config.num_stages > 2:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 64 and not keep_n:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 64:
        return replace(config, block_m=config.block_m // 2)
    return None


def _byte_sized(configs) -> tuple:
    return tuple(replace(c, block_k=2 * c.block_k) for c in configs)


# The planar complex and gated kernels hold two accumulators and load three or four tiles per K
# step: 128 x 128 tiles at most (a 128 x 256 pair would spill), and K tiles of 32 for fp32 inputs,
# whose four 128 x 64 tiles would fill a stage's shared memory.
TWO_ACCUMULATORS = (TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 128, 32, 8, 8, 4),
                    TileConfig(64, 128, 64, 8, 4, 3))
TWO_ACCUMULATORS_FP32 = (TileConfig(128, 128, 32, 8, 8, 3), TileConfig(64, 128, 32, 8, 4, 3))
TWO_ACCUMULATORS_BYTES = _byte_sized(TWO_ACCUMULATORS[:1] + TWO_ACCUMULATORS[2:])

# Under Triton's interpreter small tiles keep CPU tests fast (each program and K step costs
# milliseconds); the persistent kernel runs INTERPRETER_PROGRAMS programs, fewer than its
# tiles, so its tile loop is exercised.
INTERPRETER = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)
INTERPRETER_SPLIT_K = replace(INTERPRETER, split_k=2)
INTERPRETER_PROGRAMS = 3

TILED = (
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(64, 128, 64, 8, 4, 4),
)
PERSISTENT = (
    TileConfig(128, 256, 64, 8, 8, 3, flatten=True),
    TileConfig(128, 128, 64, 8, 8, 4, flatten=True),
    TileConfig(128, 128, 64, 8, 4, 4, flatten=False),
    TileConfig(128, 256, 64, 8, 8, 3, flatten=True, warp_specialize=True),
)
PERSISTENT_FP32 = (TileConfig(128, 128, 32, 8, 8, 3, flatten=True),)
PERSISTENT_BYTES = (
    TileConfig(128, 256, 128, 8, 8, 3, flatten=True),
    TileConfig(128, 128, 128, 8, 8, 4, flatten=True),
    TileConfig(128, 256, 128, 8, 8, 3, flatten=True, warp_specialize=True),
)
SPLIT_K = (
    TileConfig(128, 128, 64, 8, 8, 3, split_k=2),
    TileConfig(128, 128, 64, 8, 8, 3, split_k=4),
    TileConfig(64, 128, 64, 8, 4, 4, split_k=2),
    TileConfig(64, 128, 64, 8, 4, 4, split_k=4),
)
# The ping-pong with its epilogue over the whole tile, or over its two column halves in turn
# (fewer registers live at once: a loss epilogue spilled whole; twice the reduction atomics),
# and in halves with a fifth stage, where it fits beside the tile buffer (faster with C tiles
# and second outputs, slower with light epilogues: tuning picks).
PINGPONG = (*(TileConfig(128, 128, 64, 8, 4, 4, epilogue_pieces=p) for p in (1, 2)),
            TileConfig(128, 128, 64, 8, 4, 5, epilogue_pieces=2))
PINGPONG_BYTES = tuple(TileConfig(128, 128, 128, 8, 4, 4, epilogue_pieces=p) for p in (1, 2))
# The cooperative kernel's 128 x 256 tiles, its epilogue whole, in two or in four pieces. Four
# leave no spills where a BCE loss or a GELU backward spilled in two (erf, exp and log1p over a
# 64-column piece), and ran those 4-18 % faster on an H200, light epilogues within 3 %
# (research/results/epilogue_pieces_20261128/).
COOPERATIVE = tuple(TileConfig(128, 256, 64, 8, 8, 3, epilogue_pieces=p) for p in (1, 2, 4))
COOPERATIVE_BYTES = (TileConfig(128, 256, 128, 8, 8, 3),)
# Where 128-row tiles leave SMs idle (a decode-like M of a few hundred rows), tiles of 64
# rows put twice the CTAs on B's stream, each with a deeper ring.
SMALL_GRID = (TileConfig(64, 128, 64, 8, 4, 8),)
SMALL_GRID_BYTES = (TileConfig(64, 128, 128, 8, 4, 8),)
# Tiles taken two rows at a time instead of eight, where all of B fits in a quarter of L2: a
# group of eight rows of tiles can span every column of B, so B is read again for each group
# after the group's C and output tiles have streamed through L2; two rows re-read it sooner.
ROW_ORDER = (TileConfig(128, 128, 64, 2, 4, 5, epilogue_pieces=2),)


def by_dtype(dtype: torch.dtype, wide: tuple, one_byte: tuple, fp32: tuple | None = None) -> tuple:
    """`wide` for 2-byte inputs, `one_byte` for fp8 and int8, `fp32` (default `wide`) for fp32."""
    if dtype == torch.float32 and fp32 is not None:
        return fp32
    return one_byte if dtype.itemsize == 1 else wide


SPLIT_K_BYTES = _byte_sized(SPLIT_K)
TILED_BYTES = (
    TileConfig(128, 128, 128, 8, 8, 3),
    TileConfig(128, 256, 128, 8, 8, 3),
    TileConfig(64, 128, 128, 8, 4, 4),
)
