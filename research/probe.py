"""Where does a fused epilogue's time go? Time each kernel config on a set of epilogues of
rising cost at one shape, with the compiler's register, spill and shared-memory report.

    PYTHONPATH=src:. python -m research.probe [--shape 16384 4096 1024] [--dtype bfloat16] [--b-kmajor]

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
    # the torch.compile backend's heavy epilogues (issue 33), as it writes them: Linear + BCE's
    # forward (fp32 targets Lf, the logits kept for the backward, the loss's mean) and BERT's
    # GELU backward with its bias gradient; then each with one ingredient left out
    "bce_backend": "def e(accum, bias, Lf, w):\n    f = accum + bias\n"
                   "    t = (1.0 - Lf) * f - (minimum(w, f) - log1p(exp(-abs(f))))\n"
                   "    loss = mean(t)\n    return f, loss\n",
    "bce_backend_no_targets": "def e(accum, bias, w):\n    f = accum + bias\n"
                              "    t = f - (minimum(w, f) - log1p(exp(-abs(f))))\n"
                              "    loss = mean(t)\n    return f, loss\n",
    "bce_backend_no_loss": "def e(accum, bias, Lf):\n    f = accum + bias\n    g = f * Lf\n    return f, g\n",
    "load_f32_tile": "def e(accum, Lf):\n    f = accum + Lf\n    return f\n",
    "gelu_backward": "def e(accum, P):\n    g = accum * ((erf(P * 0.7071067811865476) + 1.0) * 0.5"
                     " + P * (exp(P * P * -0.5) * 0.3989422804014327))\n"
                     "    D = to(g, dtype='{dtype}')\n    db = sum(D, dim=(0,), keepdim=True)\n    return D, db\n",
    "gelu_backward_no_sum": "def e(accum, P):\n    g = accum * ((erf(P * 0.7071067811865476) + 1.0) * 0.5"
                            " + P * (exp(P * P * -0.5) * 0.3989422804014327))\n    return g\n",
    "gelu_backward_no_math": "def e(accum, P):\n    D = accum * P\n    db = sum(D, dim=(0,), keepdim=True)\n"
                             "    return D, db\n",
}
REDUCED = {"r": "rows", "r2": "rows", "s": "scalar", "loss": "scalar", "loss2": "scalar",
           "db": "columns"}  # not (M, N) tiles


def _compiler_report(args, kernel) -> dict:
    """Registers, spills and shared memory of the kernel's launch, where Triton's warmup gives them."""
    plan = args._plans[kernel]
    report = {"stages": plan.meta.get("num_stages", plan.meta.get("STAGES"))}  # as launched, not as configured
    try:
        compiled = plan.kernel.warmup(*plan.jit_values(plan.values), grid=plan.grid, **plan.meta)
        tma = sorted(k for k, v in plan.meta.items() if k.endswith("_TMA") and v)
        return dict(report, regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared, tma=tma)
    except Exception as exc:  # noqa: BLE001 - a report, not a result
        return dict(report, report_error=type(exc).__name__)


def make_operands(M, N, K, dev="cuda", dtype=torch.float16, b_kmajor=False):
    """A, B and every operand the EPILOGUES read, random (labels in {0, 1}); B laid out (N, K)
    row-major and transposed where `b_kmajor` (nn.Linear's weight, as the backend calls it)."""
    A = torch.randn(M, K, device=dev, dtype=dtype)
    if b_kmajor:
        B = (torch.randn(N, K, device=dev, dtype=dtype) / math.sqrt(K)).t()
    else:
        B = torch.randn(K, N, device=dev, dtype=dtype) / math.sqrt(K)
    operands = {"bias": torch.randn(N, device=dev, dtype=dtype),
                "C": torch.randn(M, N, device=dev, dtype=dtype),
                "C2": torch.randn(M, N, device=dev, dtype=dtype),
                "P": torch.randn(M, N, device=dev, dtype=dtype),
                "L": torch.randint(0, 2, (M, N), device=dev).to(dtype),  # labels
                "Lf": torch.randint(0, 2, (M, N), device=dev).to(torch.float32),
                "w": torch.zeros((), device=dev, dtype=torch.float32)}  # BCE's min(0, f)
    return A, B, operands


def make_args(name, A, B, operands):
    """GemmArguments for EPILOGUES[name], with fresh outputs."""
    M, N = A.shape[0], B.shape[1]
    src = EPILOGUES[name].replace("{dtype}", str(A.dtype).removeprefix("torch."))
    program = epifuse.frontend.parse(src)
    tensors = {k: operands[k] for k in program.operands}
    for out, _ in program.outputs:
        shape = {"rows": (M,), "columns": (1, N), "scalar": ()}.get(REDUCED.get(out), (M, N))
        tensors[out] = torch.empty(shape, dtype=torch.float32 if out in REDUCED else A.dtype, device=A.device)
    return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, **tensors))


def extra_kernels(text: str) -> list:
    """Kernels tuning does not offer at this shape, to time beside those it does:
    "pingpong:64,128,64,8,4,8,1;cooperative:128,256,64,8,8,3,4", a Gluon family and its
    TileConfig's block_m, block_n, block_k, group_m, num_warps, num_stages, epilogue_pieces."""
    from epifuse.backends.triton.configs import TileConfig
    from epifuse.backends.triton.families import COOPERATIVE, PINGPONG
    from epifuse.backends.triton.kernels import TritonKernel
    families = {"pingpong": PINGPONG, "cooperative": COOPERATIVE}
    kernels = []
    for item in filter(None, text.split(";")):
        family, numbers = item.split(":")
        m, n, k, group, warps, stages, pieces = (int(x) for x in numbers.split(","))
        kernels.append(TritonKernel(families[family], TileConfig(m, n, k, group, warps, stages, epilogue_pieces=pieces)))
    return kernels


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=3, default=(16384, 4096, 1024))
    parser.add_argument("--epilogues", default=",".join(EPILOGUES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=0, help="only the first N supported kernels (0: all)")
    parser.add_argument("--kernels", default="", help="only these kernels, by repr, ';'-separated")
    parser.add_argument("--extra", default="", help="more Gluon kernels to time (extra_kernels)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--b-kmajor", action="store_true", help="B as the transpose of an (N, K) weight")
    ns = parser.parse_args(argv)
    M, N, K = ns.shape
    A, B, operands = make_operands(M, N, K, dtype=getattr(torch, ns.dtype), b_kmajor=ns.b_kmajor)
    cublas = do_bench(lambda: A @ B, return_mode="median")
    rows = []
    print(f"cublas {cublas * 1e3:.1f} us at {M}x{N}x{K}")
    for name in ns.epilogues.split(","):
        args = make_args(name, A, B, operands)
        kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
        kernels += [k for k in extra_kernels(ns.extra) if k.supports(args).ok]
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
