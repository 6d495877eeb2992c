"""The `epifuse` command: demo, bench, show, kernels. Thin: parse arguments, call the API, print."""
from __future__ import annotations

import argparse
import sys

import torch


def _load_epilogue(spec: str):
    """A file path, `module:function`, or the epilogue source itself."""
    import importlib
    import os
    if os.path.exists(spec):
        with open(spec) as f:
            return f.read()
    if ":" in spec and "\n" not in spec and "(" not in spec:
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)
    return spec


def _cmd_demo(ns) -> int:
    from .demo import run_demo
    return 0 if run_demo() else 1


def _cmd_show(ns) -> int:
    from .binding import bind
    from .frontend import parse
    from .ir import Operand
    from .passes import canonical_hash, optimize
    program = parse(_load_epilogue(ns.epilogue))
    roles = {name: Operand(name, "tensor", ("M", "N")) for name in program.operands}
    graph = optimize(bind(program, roles, 2))
    print(f"# {program.name}: operands shown as (M, N) tiles; hash {canonical_hash(graph)}")
    print(graph)
    return 0


def _cmd_kernels(ns) -> int:
    import epifuse
    from .frontend import parse
    program = parse(_load_epilogue(ns.epilogue))
    M, N, K = ns.shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, ns.dtype)
    A = torch.empty(M, K, device=device, dtype=dtype)
    B = torch.empty(K, N, device=device, dtype=dtype)
    tensors = {name: torch.empty(M, N, device=device) for name in program.operands}
    tensors.update({name: torch.empty(M, N, device=device, dtype=dtype) for name, _ in program.outputs})
    try:
        args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(program, **tensors))
    except epifuse.EpilogueError as exc:
        print(f"epifuse: {exc}", file=sys.stderr)
        return 2
    for kernel, status in epifuse.kernel_statuses(args):
        print(f"{'yes' if status.ok else 'no ':3s}  {kernel!r:55s} {status.reason}")
    return 0


def _cmd_bench(ns) -> int:
    try:
        from benchmarks.run import main as bench_main
    except ImportError:
        print("epifuse: the benchmark harness lives in the source tree's benchmarks/ folder; "
              "run this from a checkout (PYTHONPATH=src:. epifuse bench).", file=sys.stderr)
        return 2
    return bench_main(ns.rest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="epifuse", description="Fuse Python epilogues into GEMM kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run CUTLASS's epilogue-notebook examples and check them against torch")
    show = sub.add_parser("show", help="print the optimized DAG of an epilogue")
    show.add_argument("epilogue", help="a file, module:function, or the epilogue source")
    kernels = sub.add_parser("kernels", help="which kernels support an epilogue, and why not")
    kernels.add_argument("epilogue")
    kernels.add_argument("--shape", type=int, nargs=3, default=(1024, 1024, 1024), metavar=("M", "N", "K"))
    kernels.add_argument("--dtype", default="float16")
    bench = sub.add_parser("bench", help="run the benchmark suite (GPU)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    from .errors import EpilogueError
    try:
        return {"demo": _cmd_demo, "show": _cmd_show, "kernels": _cmd_kernels,
                "bench": _cmd_bench}[ns.command](ns)
    except EpilogueError as exc:
        print(f"epifuse: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
