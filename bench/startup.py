"""Start-up cost (issue 5 targets: first compile <= 5 s per kernel, warm start <= 0.2 s).

Each measurement runs in a fresh process with its own epifuse and Triton cache directories:
  cold_compile_s   kernel.compile(args) of one kernel with empty caches (generate, compile)
  cold_gemm_s      the first epifuse.gemm call with empty caches, under the default tuning policy
                   (EPIFUSE_TUNE=fast: the shipped choice where one is near; bench.first_call
                   measures every workload and shape, and EPIFUSE_TUNE=full the old cost)
  warm_gemm_s      the first epifuse.gemm call of a new process whose caches hold the above
  warm_run_s       kernel.run(args) of a new process, caches warm, tuning skipped
  import_s         `import epifuse` in each process
  loaded_from_index  kernels taken from epifuse's index of compiled kernels (runtime/compiled.py)
Run on a GPU:
    PYTHONPATH=src:. python -m bench.startup [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r'''
import json, sys, time
start = time.perf_counter()
import torch
import epifuse
imported = time.perf_counter() - start
mode = sys.argv[1]
torch.manual_seed(0)
A = torch.randn(8192, 1024, device="cuda", dtype=torch.float16)
B = torch.randn(1024, 4096, device="cuda", dtype=torch.float16)
bias = torch.randn(4096, device="cuda", dtype=torch.float16)
src = "def bias_gelu(accum, bias):\n    D = gelu(accum + bias, approximate='tanh')\n    return D\n"
torch.cuda.synchronize()
import cProfile, io, pstats
profiler = cProfile.Profile()
profiler.enable()
t = time.perf_counter()
if mode in ("compile", "run"):
    D = torch.empty(8192, 4096, device="cuda", dtype=torch.float16)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, bias=bias, D=D))
    kernel = epifuse.get_kernels(args)[0]
    kernel.compile(args) if mode == "compile" else kernel.run(args)
else:
    D = epifuse.gemm(A, B, src, bias=bias)
torch.cuda.synchronize()
elapsed = time.perf_counter() - t
profiler.disable()
text = io.StringIO()
pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(30)
top = [ln for ln in text.getvalue().splitlines() if ln.strip()][-30:]
expected = torch.nn.functional.gelu(A.float() @ B.float() + bias.float(), approximate="tanh")
ok = mode == "compile" or bool(torch.allclose(D.float(), expected, rtol=2e-2, atol=2e-2))
from epifuse.runtime import compiled
print("STARTUP " + json.dumps({"seconds": elapsed, "import_s": imported, "ok": ok, "profile": top,
                              "loaded_from_index": compiled.LOADED[0]}))
'''


def _child(mode: str, caches: dict) -> dict:
    env = dict(os.environ, **caches)
    env.pop("EPIFUSE_TUNE", None)
    if "PYTHONPYCACHEPREFIX" in caches:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if mode in ("compile", "run"):
        env["EPIFUSE_TUNE"] = "0"
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=env,
                         timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if line is None:
        raise RuntimeError(f"{mode} child failed:\n{out.stderr[-2000:]}")
    return json.loads(line[len("STARTUP "):])


def measure(bytecode_cache: bool = True) -> dict:
    """With `bytecode_cache`, the processes share a PYTHONPYCACHEPREFIX, so the warm ones
    import Python modules from bytecode as on a normal installation (the GPU machine's
    site-packages holds no .pyc files and cannot be written: without it every process
    compiles the sources it imports, 0.12 s of them for Gluon)."""
    result = {"bytecode_cache": bytecode_cache}
    with tempfile.TemporaryDirectory() as compile_dir, tempfile.TemporaryDirectory() as gemm_dir:
        pyc = {"PYTHONPYCACHEPREFIX": os.path.join(compile_dir, "pycache")} if bytecode_cache else {}
        compile_caches = {"EPIFUSE_CACHE_DIR": os.path.join(compile_dir, "epifuse"),
                          "TRITON_CACHE_DIR": os.path.join(compile_dir, "triton"), **pyc}
        gemm_caches = {"EPIFUSE_CACHE_DIR": os.path.join(gemm_dir, "epifuse"),
                       "TRITON_CACHE_DIR": os.path.join(gemm_dir, "triton"), **pyc}
        for name, mode, caches in (("cold_compile", "compile", compile_caches),
                                   ("warm_run", "run", compile_caches),
                                   ("cold_gemm", "gemm", gemm_caches),
                                   ("warm_gemm", "gemm", gemm_caches)):
            row = _child(mode, caches)
            result[f"{name}_s"] = row["seconds"]
            result[f"{name}_import_s"] = row["import_s"]
            result[f"{name}_ok"] = row["ok"]
            result[f"{name}_profile"] = row["profile"]
            result[f"{name}_loaded_from_index"] = row["loaded_from_index"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="let every process compile the Python sources it imports (see measure)")
    ns = p.parse_args(argv)
    import torch
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              **measure(not ns.no_bytecode_cache)}
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_profile")}, indent=1))
    if ns.out:
        with open(os.path.join(ns.out, "startup.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
