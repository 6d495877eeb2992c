"""Why fp32 planes are slow in the planar complex kernel (issue 37): the planar kernel at
4096^3 with fp32 planes (tf32 products) over tile configs, beside the real tiled and
persistent kernels on one fp32 GEMM of the same size (a quarter of the planar work).

    PYTHONPATH=src:. python -m research.planar_fp32_probe [--size 4096]

Prints one line per kernel: ms, TFLOP/s (8 M N K for planar, 2 M N K for real).
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import epifuse
from epifuse.backends.triton import configs
from epifuse.backends.triton.families import PERSISTENT, PLANAR, TILED
from epifuse.backends.triton.kernels import TritonKernel
from epifuse.planar import planar_arguments

PLANAR_CONFIGS = [configs.TileConfig(*c) for c in (
    (128, 128, 32, 8, 8, 2), (128, 128, 32, 8, 8, 3), (128, 128, 32, 8, 8, 4), (128, 128, 16, 8, 8, 4),
    (128, 64, 32, 8, 4, 3), (64, 128, 32, 8, 4, 3), (64, 128, 32, 8, 4, 4), (64, 64, 32, 8, 4, 4),
    (128, 128, 32, 8, 4, 3))]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=4096)
    n = p.parse_args(argv).size
    planes = [torch.randn(n, n, device="cuda") for _ in range(4)]
    args, _ = planar_arguments(*planes)
    rows = []
    for config in PLANAR_CONFIGS:
        kernel = TritonKernel(PLANAR, config)
        try:
            kernel.run(args)
            ms = do_bench(lambda: kernel.run(args), warmup=25, rep=100, return_mode="median")
        except Exception as exc:   # a config that does not fit: say so and go on
            rows.append({"kernel": repr(kernel), "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append({"kernel": repr(kernel), "ms": ms, "tflops": 8 * n ** 3 / ms / 1e9})
    A, B = planes[0], planes[2]
    real = epifuse.GemmArguments(A, B, out=torch.empty(n, n, device="cuda"))
    for family, cfgs in ((TILED, configs.TILED), (PERSISTENT, configs.PERSISTENT_FP32)):
        for config in cfgs:
            kernel = TritonKernel(family, config)
            if not kernel.supports(real):
                continue
            try:
                kernel.run(real)
                ms = do_bench(lambda: kernel.run(real), warmup=25, rep=100, return_mode="median")
            except Exception as exc:
                rows.append({"kernel": repr(kernel), "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            rows.append({"kernel": repr(kernel) + " (real, one GEMM)", "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9})
    torch.backends.cuda.matmul.allow_tf32 = True
    ms = do_bench(lambda: A @ B, warmup=25, rep=100, return_mode="median")
    rows.append({"kernel": "cuBLAS tf32 (real, one GEMM)", "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9})
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "size": n, "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['kernel'][:70]:70} " + (f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s" if "ms" in r else r["error"]))


if __name__ == "__main__":
    main()
