"""Tuned choices shipped with epifuse, so that a first call on a known GPU compiles and runs one
kernel instead of timing every candidate (EPIFUSE_TUNE=fast, the default; runtime/tune.py).

A table is data: epifuse/data/tuned/<GPU name>.json, written by `python -m bench.choices` from
the tuning records of a full benchmark run on that GPU model (every candidate's time for every
workload at every shape) and checked in. Each entry is one input type (16-bit floats, fp8,
int8) at one shape, and ranks the kernels timed there by their geometric-mean time relative to
the fastest over the workloads, fastest first; a kernel timed for fewer workloads than the most
comes after those timed for all (its mean covers less). An epilogue's own candidates may lack
a ranked kernel (a reduction's, an int8 input's): the first ranked one it has is taken.

`ranked(args, kernels, gpu)` orders `kernels` by the entry nearest to args' shape, where the
distance is the sum over M, N and K of |log2| of the ratio (M counting every batch's rows) and
near is at most NEAR_OCTAVES; None where no table names the GPU, the input type, or a near
entry. There `short_list` gives the kernels to time instead (tune.SHORT_LIST of them): the
first choice of each entry of the input type, nearest entry first. Measured on an H200
(2026-11-27, bench.first_call --extra): at 8192 x 11008 x 4096, 1.4 octaves from S3, S3's choice
ran at 0.965x full tuning's; at 4096 x 4096 x 1024 and 2048 x 14336 x 4096, far from every
entry, full tuning picked S2's choice (a ping-pong 128 x 128 kernel) or its group-8 twin, which
the untimed order's first three (all Triton persistent kernels) missed by up to 19 %.
"""
from __future__ import annotations

import functools
import json
import math
import re
import warnings
from pathlib import Path

import torch

from .cache import CacheWarning

TABLES = Path(__file__).resolve().parent.parent / "data" / "tuned"
NEAR_OCTAVES = 1.0  # the sum over M, N, K of |log2 ratio|: one dimension within 2x, or two within 1.4x


def gpu_file_name(gpu: str) -> str:
    """The table file of a GPU model, from torch.cuda.get_device_name: 'NVIDIA H200' ->
    'NVIDIA-H200.json'."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-") + ".json"


def input_class(dtype: torch.dtype) -> str | None:
    """The input types that share a table entry: the kernels' configs are chosen by item size
    and kind, so fp16 and bf16 share one."""
    if dtype in (torch.float16, torch.bfloat16):
        return "16-bit float"
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return "fp8"
    if dtype == torch.int8:
        return "int8"
    return None


def _valid(table) -> bool:
    entries = table.get("entries") if isinstance(table, dict) else None
    return isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("input"), str)
        and all(isinstance(e.get(d), int) and e[d] > 0 for d in "MNK")
        and isinstance(e.get("order"), list) and all(isinstance(k, str) for k in e["order"])
        for e in entries)


@functools.lru_cache(maxsize=None)
def table(gpu: str) -> dict | None:
    """The shipped table of GPU model `gpu`, or None. A table that is not what bench.choices
    writes is passed over with a warning (tuning then times, as for an unknown GPU)."""
    path = TABLES / gpu_file_name(gpu)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        data = error
    if isinstance(data, dict) and data.get("gpu") == gpu and _valid(data):
        return data
    warnings.warn(f"epifuse's shipped tuning table {path} is not a table of {gpu!r} as bench.choices "
                  "writes one; it is not used (reinstall epifuse, or run python -m bench.choices)",
                  CacheWarning, stacklevel=2)
    return None


def distance(entry: dict, M: int, N: int, K: int) -> list[float]:
    """|log2| of the ratio of each of M, N, K to the entry's."""
    return [abs(math.log2(max(n, 1) / entry[d])) for n, d in ((M, "M"), (N, "N"), (K, "K"))]


def by_distance(gpu: str, dtype: torch.dtype, M: int, N: int, K: int) -> list[tuple[float, dict]]:
    """(distance, entry) of every entry of `gpu`'s table for `dtype`'s input type, nearest to
    M x N x K first."""
    found, kind = table(gpu), input_class(dtype)
    if found is None or kind is None:
        return []
    return sorted(((sum(distance(e, M, N, K)), e) for e in found["entries"] if e["input"] == kind),
                  key=lambda pair: pair[0])


def nearest(gpu: str, dtype: torch.dtype, M: int, N: int, K: int) -> dict | None:
    """The entry of `gpu`'s table for `dtype` nearest to M x N x K, if within NEAR_OCTAVES."""
    entries = by_distance(gpu, dtype, M, N, K)
    return entries[0][1] if entries and entries[0][0] <= NEAR_OCTAVES else None


def ranked(args, kernels: list, gpu: str) -> list | None:
    """`kernels` that the nearest entry ranks, in its order (the others left out), or None
    where no entry is near or it ranks none of them."""
    entry = nearest(gpu, args.A.dtype, args.L * args.M, args.N, args.K)
    if entry is None:
        return None
    by_name = {repr(k): k for k in kernels}
    order = [by_name[name] for name in entry["order"] if name in by_name]
    return order or None


def short_list(args, kernels: list, gpu: str, count: int) -> list:
    """Up to `count` of `kernels` to time where no entry is near: each entry's first choice
    among `kernels`, nearest entry first, each once; empty without a table for the GPU."""
    by_name = {repr(k): k for k in kernels}
    picked: list = []
    for _, entry in by_distance(gpu, args.A.dtype, args.L * args.M, args.N, args.K):
        first = next((by_name[name] for name in entry["order"] if name in by_name), None)
        if first is not None and first not in picked:
            picked.append(first)
    return picked[:count]
