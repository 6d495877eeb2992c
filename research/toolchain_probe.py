"""Which of the levers NOTEBOOK.md names for the remaining misses this Triton exposes, checked
by compiling, not by reading release notes. No GPU is needed: the kernels are compiled offline
for sm_90 and their PTX is read.

- multicast: a Gluon TMA load in a cluster of two CTAs whose shared layout gives both CTAs the
  same tile (`cga_layout=[[0, 0]]`), asked for multicast where the copy takes `multicast`
  (3.9 does; so do 3.7's and 3.8's copies, as read in their source, not compiled). With TMA
  multicast one CTA's load would fill both (PTX `.multicast::cluster`); without it each CTA loads the tile itself, as from L2 now.
- cache hints: whether a TMA load takes an L2 eviction policy, in Gluon (`cache_policy`, Triton
  3.9 on; the kernel then marks its load evict-first and the PTX shows `.L2::cache_hint`) or in
  Triton (`tl.load_tensor_descriptor`), so that streamed C, D and F tiles could leave A and B
  in L2.

The copies are spelled as the installed Triton names them (gluon_api: `async_copy_*` in 3.6,
`async_load` / `async_store` in 3.9). epifuse's kernels no longer set L2 policies (NOTEBOOK.md,
2026-11-26 17:53), so the probe's kernel writes its own (POLICY_SOURCE).

    PYTHONPATH=src:. python -m research.toolchain_probe
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
{policy_import}


@gluon.jit
def shared_tile(a_ptr, out_ptr, M, K):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2,
                                                cga_layout={cga_layout})
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [128, 64], layout)
    out_desc = tma.make_tensor_descriptor(out_ptr, [M, K], [K, 1], [128, 64], layout)
    tile = gl.allocate_shared_memory(gl.float16, [128, 64], layout)
    bar = {barrier}
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes)
    {load}(a_desc, [0, 0], bar, tile{load_options})
    mbarrier.wait(bar, 0)
    {store}(out_desc, [0, 0], tile)
    tma.store_wait(0)
'''


# Module source of an evict-first L2 policy for the kernel's load, where the copies take one
# (Triton 3.9): what epifuse's generated kernels defined for their streamed tiles until their L2
# hints were removed.
POLICY_SOURCE = '''from triton.experimental.gluon.language.nvidia.ampere import CachePolicy, FractionalEvictionPolicy


@gluon.constexpr_function
def _evict_first():
    return CachePolicy(l2=FractionalEvictionPolicy("evict_first", 1.0))
'''


def copies_take_policy() -> bool:
    """Whether this Triton's Gluon TMA load and store both take `cache_policy` (3.9 on)."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    from epifuse.backends.triton.gluon_api import gluon_api
    api = gluon_api()
    return all(takes_argument(getattr(tma, name.removeprefix("tma.")), "cache_policy") for name in (api.load, api.store))


def cluster_kernel_source(num_ctas: int = 2) -> str:
    """CLUSTER_KERNEL for this Triton and a cluster of `num_ctas` (1 or 2; of one CTA without a
    CGA layout, which Triton 3.9 rejects there): its copies' names, multicast and an evict-first
    policy where its copy takes them."""
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from epifuse.backends.triton.gluon_api import gluon_api
    api = gluon_api()
    load = getattr(tma, api.load.removeprefix("tma."))
    policies = copies_take_policy()
    options = (", multicast=True" if num_ctas > 1 and takes_argument(load, "multicast") else "") + \
        (", cache_policy=_evict_first()" if policies else "")
    barrier = ("mbarrier.allocate_mbarrier()" if hasattr(mbarrier, "allocate_mbarrier")  # one per CTA (3.9)
               else "gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())")
    return CLUSTER_KERNEL.format(load=api.load, store=api.store, load_options=options, barrier=barrier,
                                 cga_layout="[[0, 0]]" if num_ctas > 1 else "[]",
                                 policy_import=POLICY_SOURCE if policies else "")


def cluster_ptx(num_ctas: int = 2) -> str:
    """The PTX of the shared tile's kernel, compiled for a cluster of `num_ctas`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    with tempfile.TemporaryDirectory() as folder:   # gluon.jit reads its function's source file
        path = Path(folder) / "toolchain_probe_kernel.py"
        path.write_text(cluster_kernel_source(num_ctas))
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
    from epifuse.backends.triton.gluon_api import gluon_api
    ptx = cluster_ptx()
    loads = tma_loads(ptx)
    cache_args = ("eviction_policy", "cache_hint", "cache_modifier", "cache_policy")
    load = getattr(tma, gluon_api().load.removeprefix("tma."))
    return {"triton": triton.__version__,
            "cluster_of_two": ".reqnctapercluster 2" in ptx,
            "cluster_load_ptx": loads,
            "multicast": any(".multicast::cluster" in line for line in loads),
            "cache_hint_in_ptx": any(".L2::cache_hint" in line for line in loads),
            "gluon_tma_load_cache_hint": takes_argument(load, *cache_args),
            "gluon_tma_load_multicast_arg": takes_argument(load, "multicast", "mask"),
            "triton_descriptor_load_cache_hint": takes_argument(tl.load_tensor_descriptor, *cache_args)}


def main() -> int:
    result = probe()
    print(f"Triton {result['triton']}, sm_90, offline")
    print(f"  compiled as a 2-CTA cluster: {'yes' if result['cluster_of_two'] else 'no'}; its shared tile is loaded by:")
    for line in result["cluster_load_ptx"]:
        print(f"    {line}")
    for key in ("multicast", "gluon_tma_load_multicast_arg", "gluon_tma_load_cache_hint", "cache_hint_in_ptx",
                "triton_descriptor_load_cache_hint"):
        print(f"  {key}: {'yes' if result[key] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
