"""Which of the levers RESULTS.md names for the remaining misses this Triton exposes, checked
by compiling, not by reading release notes. No GPU is needed: the kernels are compiled offline
for sm_90 and their PTX is read.

- multicast: a Gluon TMA load in a cluster of two CTAs whose shared layout gives both CTAs the
  same tile (`cga_layout=[[0, 0]]`). With TMA multicast one CTA's load would fill both (PTX
  `.multicast::cluster`); without it each CTA loads the tile itself, as from L2 now.
- cache hints: whether a TMA load takes an L2 eviction policy, in Gluon
  (`tma.async_copy_global_to_shared`) or in Triton (`tl.load_tensor_descriptor`), so that
  streamed C, D and F tiles could leave A and B in L2.

    PYTHONPATH=src:. python -m benchmarks.toolchain_probe
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

CLUSTER_KERNEL = '''
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier


@gluon.jit
def shared_tile(a_ptr, out_ptr, M, K):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2,
                                                cga_layout=[[0, 0]])
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [128, 64], layout)
    out_desc = tma.make_tensor_descriptor(out_ptr, [M, K], [K, 1], [128, 64], layout)
    tile = gl.allocate_shared_memory(gl.float16, [128, 64], layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [0, 0], bar, tile)
    mbarrier.wait(bar, 0)
    tma.async_copy_shared_to_global(out_desc, [0, 0], tile)
    tma.store_wait(0)
'''


def cluster_ptx(num_ctas: int = 2) -> str:
    """The PTX of the shared tile's kernel, compiled for a cluster of `num_ctas`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    with tempfile.TemporaryDirectory() as folder:   # gluon.jit reads its function's source file
        path = Path(folder) / "toolchain_probe_kernel.py"
        path.write_text(CLUSTER_KERNEL)
        spec = importlib.util.spec_from_file_location("toolchain_probe_kernel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        source = GluonASTSource(module.shared_tile, {"a_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "K": "i32"}, {})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_ctas": num_ctas})
    return compiled.asm["ptx"]


def tma_loads(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line and ".global.mbarrier" in line]


def takes_argument(fn, *names: str) -> bool:
    """Whether `fn`'s signature has any of `names`."""
    return any(name in inspect.signature(fn).parameters for name in names)


def probe() -> dict:
    import triton
    import triton.language as tl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    ptx = cluster_ptx()
    loads = tma_loads(ptx)
    cache_args = ("eviction_policy", "cache_hint", "cache_modifier")
    return {"triton": triton.__version__,
            "cluster_of_two": ".reqnctapercluster 2" in ptx,
            "cluster_load_ptx": loads,
            "multicast": any(".multicast::cluster" in line for line in loads),
            "gluon_tma_load_cache_hint": takes_argument(tma.async_copy_global_to_shared, *cache_args),
            "gluon_tma_load_multicast_arg": takes_argument(tma.async_copy_global_to_shared, "multicast", "mask"),
            "triton_descriptor_load_cache_hint": takes_argument(tl.load_tensor_descriptor, *cache_args)}


def main() -> int:
    result = probe()
    print(f"Triton {result['triton']}, sm_90, offline")
    print(f"  compiled as a 2-CTA cluster: {'yes' if result['cluster_of_two'] else 'no'}; its shared tile is loaded by:")
    for line in result["cluster_load_ptx"]:
        print(f"    {line}")
    for key in ("multicast", "gluon_tma_load_multicast_arg", "gluon_tma_load_cache_hint",
                "triton_descriptor_load_cache_hint"):
        print(f"  {key}: {'yes' if result[key] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
