"""What an epilogue adds to a Gluon kernel's machine code, per thread and tile, without a GPU.

Compiles each kernel for sm_90 offline (tests/offline.py's compile_offline: Triton and ptxas on the CPU),
disassembles it with the cuobjdump Triton ships, and prints the SASS instructions each epilogue
adds over the identity epilogue in the same kernel, by opcode (MUFU by function):

    PYTHONPATH=src:. python -m research.sass_probe [--shape 4096 4096 4096] [--epilogues row_bias,bias_gelu]

The epilogue is straight-line code run once per tile (the ping-pong kernel holds one copy per
consumer, so its counts are twice a tile's), so the static counts are the dynamic ones: with
the tile's elements per thread they give the SFU and issue time per tile (NOTEBOOK.md).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from epifuse.backends.triton.configs import TileConfig
from epifuse.backends.triton.families import COOPERATIVE, PINGPONG
from epifuse.backends.triton.kernels import TritonKernel

from .probe import EPILOGUES, make_args, make_operands

KERNELS = {
    "coop": TritonKernel(COOPERATIVE, TileConfig(128, 256, 64, 8, 8, 3)),
    "coop2": TritonKernel(COOPERATIVE, TileConfig(128, 256, 64, 8, 8, 3, epilogue_pieces=2)),
    "coop4": TritonKernel(COOPERATIVE, TileConfig(128, 256, 64, 8, 8, 3, epilogue_pieces=4)),
    "pingpong2": TritonKernel(PINGPONG, TileConfig(128, 128, 64, 8, 4, 5, epilogue_pieces=2)),
}
TESTS = Path(__file__).resolve().parent.parent / "tests"  # offline.py: the offline Gluon compile
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


def cuobjdump() -> str:
    import triton.backends.nvidia as nvidia
    return os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")


def opcode_counts(sass: str) -> collections.Counter:
    """Instructions by opcode; MUFU by its function (MUFU.EX2, MUFU.RCP, ...)."""
    counts: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            opcode, suffixes = match.groups()
            if opcode == "MUFU" and suffixes:
                opcode += "." + suffixes.split(".")[1]
            counts[opcode] += 1
    return counts


def compile_offline(kernel, args):
    """The CompiledKernel of `kernel`'s launch for `args` on sm_90, compiled without a GPU by
    the tests' helper (tests/offline.py)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from offline import compile_offline as compile_for_hopper
    return compile_for_hopper(kernel, args, capability=90)


def kernel_counts(kernel, epilogue: str, A, B, operands) -> collections.Counter:
    compiled = compile_offline(kernel, make_args(epilogue, A, B, operands))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    return opcode_counts(sass)


def added(kernel, epilogue: str, A, B, operands) -> dict:
    """Opcode -> instructions `epilogue` adds over the identity epilogue in `kernel`."""
    base = kernel_counts(kernel, "identity", A, B, operands)
    counts = kernel_counts(kernel, epilogue, A, B, operands)
    return {op: counts[op] - base[op] for op in sorted(set(counts) | set(base)) if counts[op] != base[op]}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=3, default=(4096, 4096, 4096))
    parser.add_argument("--epilogues", default="row_bias,sigmoid,bias_gelu")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    ns = parser.parse_args(argv)
    A, B, operands = make_operands(*ns.shape, dev="cpu")  # stand-ins for CUDA tensors
    for name in ns.kernels.split(","):
        kernel = KERNELS[name]
        for epilogue in ns.epilogues.split(","):
            if epilogue not in EPILOGUES:
                raise SystemExit(f"unknown epilogue {epilogue!r}; one of {', '.join(EPILOGUES)}")
            delta = added(kernel, epilogue, A, B, operands)
            top = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:10]
            print(f"{name:10s} {epilogue:12s} +{sum(delta.values()):5d}  " + " ".join(f"{op} {n:+d}" for op, n in top))


if __name__ == "__main__":
    main()
