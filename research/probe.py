"""Where does a fused epilogue's time go? Time each kernel config on a set of epilogues of
rising cost at one shape, with the compiler's register, spill and shared-memory report.

    PYTHONPATH=src:. python -m research.probe [--shape 16384 4096 1024]

Differences between rows with the same config isolate one epilogue ingredient (a row load,
the tanh, a second output); `identity` is the main loop alone plus a store.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench

import epifuse

EPILOGUES = {
    "identity": "def e(accum):\n    D = accum\n    return D\n",
    "row_bias": "def e(accum, bias):\n    D = accum + bias\n    return D\n",
    "sigmoid": "def e(accum, bias):\n    D = sigmoid(accum + bias)\n    return D\n",
    "tanh": "def e(accum, bias):\n    D = tanh(accum + bias)\n    return D\n",
    "bias_gelu": "def e(accum, bias):\n    D = gelu(accum + bias, approximate='tanh')\n    return D\n",
    "tile_C": "def e(accum, C):\n    D = accum * 1.5 + C * 0.5\n    return D\n",
    "two_outputs": "def e(accum, C):\n    F = accum * 1.5 + C * 2.0\n    D = relu(F)\n    return D, F\n",
    "row_sum": "def e(accum):\n    D = accum * 0.5\n    r = sum(D * D, dim=1)\n    return D, r\n",
    "bce_loss": "def e(accum, bias, L):\n    f = accum + bias\n"
                "    loss = sum((1 - L) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))\n    return loss\n",
    # the epilogue left out (one number per tile leaves the chip) and done twice
    "no_store": "def e(accum):\n    s = sum(accum, dim=(0, 1))\n    return s\n",
    "gelu_twice": "def e(accum, bias):\n    D = gelu(gelu(accum + bias, approximate='tanh') * 1.5 - 0.25, "
                  "approximate='tanh')\n    return D\n",
    "tile_C_twice": "def e(accum, C, C2):\n    D = accum * 1.5 + C * 0.5 + C2 * 0.25\n    return D\n",
    "row_sum_twice": "def e(accum):\n    D = accum * 0.5\n    r = sum(D * D, dim=1)\n"
                     "    r2 = sum(D * D * 0.25 + D, dim=1)\n    return D, r, r2\n",
    "bce_twice": "def e(accum, bias, L):\n    f = accum + bias\n    g = f * 0.5 + 0.25\n"
                 "    loss = sum((1 - L) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))\n"
                 "    loss2 = sum((1 - L) * (-g) + log(clamp(sigmoid(g), 0.001, 0.999)))\n    return loss, loss2\n",
}
REDUCED = {"r": "rows", "r2": "rows", "s": "scalar", "loss": "scalar", "loss2": "scalar"}  # not (M, N) tiles


def _compiler_report(args, kernel) -> dict:
    """Registers, spills and shared memory of the kernel's launch, where Triton's warmup gives them."""
    plan = args._plans[kernel]
    report = {"stages": plan.meta.get("num_stages", plan.meta.get("STAGES"))}  # as launched, not as configured
    try:
        compiled = plan.kernel.warmup(*plan.jit_values(plan.values), grid=plan.grid, **plan.meta)
        return dict(report, regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared)
    except Exception as exc:  # noqa: BLE001 - a report, not a result
        return dict(report, report_error=type(exc).__name__)


def make_operands(M, N, K, dev="cuda"):
    """A, B and every operand the EPILOGUES read, random (labels in {0, 1})."""
    A = torch.randn(M, K, device=dev, dtype=torch.float16)
    B = torch.randn(K, N, device=dev, dtype=torch.float16) / math.sqrt(K)
    operands = {"bias": torch.randn(N, device=dev, dtype=torch.float16),
                "C": torch.randn(M, N, device=dev, dtype=torch.float16),
                "C2": torch.randn(M, N, device=dev, dtype=torch.float16),
                "L": torch.randint(0, 2, (M, N), device=dev).to(torch.float16)}  # labels
    return A, B, operands


def make_args(name, A, B, operands):
    """GemmArguments for EPILOGUES[name], with fresh outputs."""
    M, N = A.shape[0], B.shape[1]
    src = EPILOGUES[name]
    program = epifuse.frontend.parse(src)
    tensors = {k: operands[k] for k in program.operands}
    for out, _ in program.outputs:
        shape = {"rows": (M,), "scalar": ()}.get(REDUCED.get(out), (M, N))
        tensors[out] = torch.empty(shape, dtype=torch.float32 if out in REDUCED else torch.float16, device=A.device)
    return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, **tensors))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=3, default=(16384, 4096, 1024))
    parser.add_argument("--epilogues", default=",".join(EPILOGUES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=0, help="only the first N supported kernels (0: all)")
    parser.add_argument("--kernels", default="", help="only these kernels, by repr, ';'-separated")
    ns = parser.parse_args(argv)
    M, N, K = ns.shape
    A, B, operands = make_operands(M, N, K)
    cublas = do_bench(lambda: A @ B, return_mode="median")
    rows = []
    print(f"cublas {cublas * 1e3:.1f} us at {M}x{N}x{K}")
    for name in ns.epilogues.split(","):
        args = make_args(name, A, B, operands)
        kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
        if ns.kernels:
            wanted = ns.kernels.split(";")
            unknown = set(wanted) - {repr(k) for k in kernels}
            if unknown:
                print(f"{name}: no supported kernel is named {sorted(unknown)}", flush=True)
            kernels = [k for k in kernels if repr(k) in wanted]
        for kernel in kernels[:ns.top or None]:
            try:
                kernel.run(args)
                ms = do_bench(lambda: kernel.run(args), return_mode="median")
            except Exception as exc:  # report and go on
                ms, info = float("nan"), {"error": type(exc).__name__}
            else:
                info = _compiler_report(args, kernel)
            row = dict(epilogue=name, kernel=repr(kernel), us=ms * 1e3, ratio=ms / cublas, **info)
            rows.append(row)
            print(f"{name:12s} {row['ratio']:5.2f}  {ms * 1e3:7.1f} us  {info}  {kernel!r}", flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"cublas_us": cublas * 1e3, "shape": [M, N, K],
                       "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
