"""Prototype: warp-specialized "ping-pong" persistent GEMM + epilogue in Gluon (Hopper, sm_90).

    python -m benchmarks.gluon_pingpong                # on an H100: ragged correctness checks + timing table
    python -m benchmarks.gluon_pingpong --skip-ragged   # timing table only
    python -m benchmarks.gluon_pingpong --compile-only  # offline AOT compile for sm_90 (default without CUDA)

Design (one CTA per SM, persistent, grid = min(#SMs, #tiles), 12 warps = 3 warpgroups):
  * producer   : worker partition 1, 1 warp (+3 idle padding warps Triton adds to fill the
                 warpgroup), setmaxnreg 40.  Walks the CTA's tiles (grouped GROUP_M order) and
                 their K-steps; ring index i -> slot i % STAGES, phase (i // STAGES) & 1:
                 wait empty[s] (parity ph^1), expect(ready[s], A+B bytes), 2 TMA loads.
  * consumer 0 : default partition (num_warps=4 = warpgroup 0), setmaxnreg 232 (the leftover).
  * consumer 1 : worker partition 0 (4 warps = warpgroup 1), setmaxnreg 232.
    Consumer c takes the CTA-local tiles t = 2*j + c.  Every tile has k_tiles K-steps, so tile
    t uses ring indices t*k_tiles .. t*k_tiles + k_tiles - 1.  Per K-step: wait ready[s],
    async wgmma, wgmma_wait(1), arrive empty[slot of the previous step]; after the loop:
    arrive turn[1-c], wgmma_wait(0), arrive empty[last slot], then the epilogue in registers.
  * turn[0], turn[1] (count 1): consumer c waits turn[c] (parity (j+c+1)&1, skipped for t=0)
    before touching the ring for tile t; the other consumer arrives on it after it has passed
    all ready-waits of tile t-1.  Without this, consumer 1 would wait on ready[s] k_tiles/STAGES
    phases ahead of time and the parity test would pass on a stale phase.  It also produces the
    ping-pong: one warpgroup's epilogue overlaps the other warpgroup's wgmma main loop.
  * mbarrier arrivals are single-thread (Triton emits bar.sync of the partition + thread-0
    arrive), so every barrier is initialised with count 1.

Findings (triton 3.6.0):
  * Triton-language spellings work unchanged inside @gluon.jit: tl.load / tl.store (pointer
    tensors carrying the acc-derived layouts), tl.where, tl.exp/exp2/log/abs/sqrt/rsqrt/erf,
    tl.maximum/minimum/clamp/fma, tl.sum/tl.max, .to(), tl.sigmoid and any @triton.jit helper
    (it is re-generated with the Gluon semantic).  Ops that *create* a tensor from nothing need
    the gl. spelling with an explicit layout: tl.arange / tl.zeros / tl.zeros_like / tl.full
    fail ("GluonSemantic.arange() missing ... 'layout'").
  * An argument tuple stored in a variable turns its constexpr members into i32 runtime values;
    the tuples passed to gl.warp_specialize are therefore written inline.
"""
import argparse
import sys
import time

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    tma,
    mbarrier,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _wgmma_instr_n(BLOCK_N):
    BLOCK_N = getattr(BLOCK_N, "value", BLOCK_N)
    n = 256
    while n > BLOCK_N or BLOCK_N % n != 0:
        n -= 8
    return n


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    # grouped ("super-row") ordering for L2 reuse, same as the classic Triton matmul tutorial
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


# ----------------------------------------------------------------------------------------------
# EPILOGUE  -- written in plain Triton-language (tl.*) spelling, exactly as the epifuse code
# generator would emit it: inputs are the fp32 accumulator `acc` (registers, wgmma layout),
# index vectors rm (BLOCK_M,) / rn (BLOCK_N,) whose layouts are SliceLayouts of the acc layout,
# and the ragged-edge mask.  Returns the value to be stored (fp32).
# ----------------------------------------------------------------------------------------------
@triton.jit
def _gelu_tanh(x):
    u = 0.7978845608 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@gluon.jit
def epilogue_compute(acc, rm, rn, mask, M, N, bias_ptr, c_ptr, stride_cm, EPILOGUE: gl.constexpr):
    if EPILOGUE == 0:
        out = acc
    elif EPILOGUE == 1:
        # bias + GELU(tanh approx) computed as x * sigmoid(2u)
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        x = acc + bias[None, :]
        out = _gelu_tanh(x)
    else:
        # lincomb: D = 1.5 * acc + 0.5 * C
        c = tl.load(c_ptr + rm[:, None] * stride_cm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        out = 1.5 * acc + 0.5 * c
    return out


# ----------------------------------------------------------------------------------------------
# partitions
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _producer_partition(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K,
                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BLOCK_K)

    i = 0  # global ring index (same numbering as the consumers)
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            s = i % STAGES
            ph = (i // STAGES) & 1
            # slot free?  (fresh barrier: waiting on parity 1 passes immediately)
            mbarrier.wait(empty_bars.index(s), ph ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(s))
            if B_KMAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar, b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], bar, b_bufs.index(s))
            i += 1


@gluon.jit
def _consumer_partition(CID: gl.constexpr, a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc,
                        d_ptr, bias_ptr, c_ptr, M, N, K, stride_dm, stride_cm,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                        EPILOGUE: gl.constexpr, TMA_STORE: gl.constexpr):
    # one warpgroup; accumulator layout of wgmma (m64nNk16 atoms, 4 warps stacked along M)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, _wgmma_instr_n(BLOCK_N), 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BLOCK_K)

    j = 0  # this consumer's tile counter; CTA-local tile index t = 2*j + CID
    for tile in range(pid + CID * nprog, num_tiles, 2 * nprog):
        t = 2 * j + CID
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        # ---- wait for my turn: the other consumer has passed all ready-waits of tile t-1 ----
        # consumer 0 waits for the j-th arrival (phase j-1), consumer 1 for the (j+1)-th (phase j)
        mbarrier.wait(turn_bars.index(CID), (j + CID + 1) & 1, pred=t > 0)

        # ---- main loop: wgmma out of the shared ring, 1 wgmma group kept in flight ----
        base = t * k_tiles
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_tiles):
            i = base + kk
            s = i % STAGES
            mbarrier.wait(ready_bars.index(s), (i // STAGES) & 1)
            if B_KMAJOR:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=kk > 0, is_async=True)
            # <= 1 outstanding: the wgmma of step kk-1 has completed -> release its slot
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((i + STAGES - 1) % STAGES), pred=kk > 0)
        # all ready-waits of this tile are done: hand the tensor cores to the other consumer
        mbarrier.arrive(turn_bars.index(1 - CID))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((base + k_tiles - 1) % STAGES))

        # ---- epilogue (overlaps with the other consumer's main loop) ----
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        out = epilogue_compute(acc, rm, rn, mask, M, N, bias_ptr, c_ptr, stride_cm, EPILOGUE)
        if TMA_STORE:
            d_smem = d_bufs.index(CID)
            tma.store_wait(pendings=0)  # previous TMA store out of d_smem has finished reading it
            d_smem.store(out.to(d_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(d_desc, [off_m, off_n], d_smem)
        else:
            tl.store(d_ptr + rm[:, None] * stride_dm + rn[None, :], out.to(d_ptr.dtype.element_ty), mask=mask)
        j += 1
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _consumer1_partition(a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc,
                         d_ptr, bias_ptr, c_ptr, M, N, K, stride_dm, stride_cm,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                         EPILOGUE: gl.constexpr, TMA_STORE: gl.constexpr):
    _consumer_partition(1, a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc,
                        d_ptr, bias_ptr, c_ptr, M, N, K, stride_dm, stride_cm,
                        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_KMAJOR, EPILOGUE, TMA_STORE)


@gluon.jit
def _consumer0_partition(a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc,
                         d_ptr, bias_ptr, c_ptr, M, N, K, stride_dm, stride_cm,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                         EPILOGUE: gl.constexpr, TMA_STORE: gl.constexpr):
    _consumer_partition(0, a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc,
                        d_ptr, bias_ptr, c_ptr, M, N, K, stride_dm, stride_cm,
                        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_KMAJOR, EPILOGUE, TMA_STORE)


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------
@gluon.jit
def ws_pingpong_gemm_kernel(a_desc, b_desc, d_desc, d_ptr, bias_ptr, c_ptr, M, N, K, stride_dm, stride_cm,
                            EPILOGUE: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(num_warps == 4, "default partition is consumer 0: exactly one warpgroup")
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(s), count=1)  # producer's expect + TMA tx bytes
        mbarrier.init(empty_bars.index(s), count=1)  # one arrive by the consumer that used the slot
    for c in gl.static_range(2):
        mbarrier.init(turn_bars.index(c), count=1)
    if TMA_STORE:
        d_bufs = gl.allocate_shared_memory(d_desc.dtype, [2] + d_desc.block_type.shape, d_desc.layout)
    else:
        d_bufs = turn_bars  # placeholder, never touched

    # NB: argument tuples must be written inline: a tuple stored in a variable turns its constexpr
    # members into runtime i32 values (observed with triton 3.6).
    gl.warp_specialize([
        (_consumer0_partition, (a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc, d_ptr, bias_ptr,
                                c_ptr, M, N, K, stride_dm, stride_cm, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                                B_KMAJOR, EPILOGUE, TMA_STORE)),
        (_consumer1_partition, (a_bufs, b_bufs, ready_bars, empty_bars, turn_bars, d_bufs, d_desc, d_ptr, bias_ptr,
                                c_ptr, M, N, K, stride_dm, stride_cm, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                                B_KMAJOR, EPILOGUE, TMA_STORE)),
        (_producer_partition, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K, GROUP_M, STAGES,
                               B_KMAJOR)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------
_TORCH2GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}

DEFAULT_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, GROUP_M=8, TMA_STORE=False,
                      CONSUMER_REGS=232, PRODUCER_REGS=40)


def _descs(A, B_op, D, b_kmajor, BLOCK_M, BLOCK_N, BLOCK_K):
    gdt = _TORCH2GL[A.dtype]
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gdt)
    a_desc = TensorDescriptor.from_tensor(A, [BLOCK_M, BLOCK_K], a_layout)
    b_block = [BLOCK_N, BLOCK_K] if b_kmajor else [BLOCK_K, BLOCK_N]
    b_layout = gl.NVMMASharedLayout.get_default_for(b_block, gdt)
    b_desc = TensorDescriptor.from_tensor(B_op, b_block, b_layout)
    d_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], _TORCH2GL[D.dtype])
    d_desc = TensorDescriptor.from_tensor(D, [BLOCK_M, BLOCK_N], d_layout)
    return a_desc, b_desc, d_desc


def _b_operand(B):
    """Returns (tensor handed to TMA, b_kmajor).  B is logically (K, N)."""
    if B.stride(1) == 1:
        return B, False  # (K, N) row-major
    if B.stride(0) == 1:
        return B.t(), True  # B = Bt.t() with Bt (N, K) contiguous -> K-major
    return B.contiguous(), False


_NUM_SMS = {}


def _num_sms(dev):
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _NUM_SMS[dev]


def _kernel_args(A, B, epilogue, bias, C, D, cfg, num_sms):
    """Positional args, keyword args and grid of one launch (shared by the GPU path and the
    offline compile path, so the offline check binds exactly what the GPU launch binds)."""
    M, K = A.shape
    K2, N = B.shape
    assert K == K2 and A.dtype == B.dtype and A.dtype in _TORCH2GL and A.stride(1) == 1
    B_op, b_kmajor = _b_operand(B)
    if epilogue == 1:
        assert bias is not None and bias.shape == (N, ) and bias.is_contiguous()
    if epilogue == 2:
        assert C is not None and C.shape == (M, N) and C.stride(1) == 1
    bias_t = bias if bias is not None else D  # dummies keep the kernel signature stable
    c_t = C if C is not None else D
    stride_cm = C.stride(0) if C is not None else 0
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc, b_desc, d_desc = _descs(A, B_op, D, b_kmajor, BM, BN, BK)
    num_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    grid = (min(num_sms, num_tiles), )
    args = (a_desc, b_desc, d_desc, D, bias_t, c_t, M, N, K, D.stride(0), stride_cm)
    kwargs = dict(EPILOGUE=epilogue, B_KMAJOR=b_kmajor, GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"],
                  TMA_STORE=cfg["TMA_STORE"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
                  PRODUCER_REGS=cfg["PRODUCER_REGS"], num_warps=4)
    return args, kwargs, grid


def prepare(A, B, epilogue=0, bias=None, C=None, D=None, **config):
    """Builds descriptors once and returns (launch_fn, D); launch_fn() computes D = epilogue(A @ B)
    and returns the CompiledKernel.  A (M, K) row-major; B (K, N) row-major or a K-major view
    (B = Bt.t() with Bt (N, K) contiguous).  bias (N,) any float dtype; C (M, N) with unit column stride."""
    cfg = dict(DEFAULT_CONFIG, **config)
    if D is None:
        D = torch.empty((A.shape[0], B.shape[1]), device=A.device, dtype=A.dtype)
    args, kwargs, grid = _kernel_args(A, B, epilogue, bias, C, D, cfg, _num_sms(A.device))

    def launch():
        return ws_pingpong_gemm_kernel[grid](*args, **kwargs)

    return launch, D


def run(A, B, epilogue=0, bias=None, C=None, D=None, **config):
    launch, D = prepare(A, B, epilogue, bias=bias, C=C, D=D, **config)
    launch()
    return D


def reference(A, B, epilogue, bias=None, C=None):
    acc = A.float() @ B.float()
    if epilogue == 0:
        return acc
    if epilogue == 1:
        x = acc + bias.float()[None, :]
        u = 0.7978845608 * (x + 0.044715 * x * x * x)
        return x * torch.sigmoid(2.0 * u)
    return 1.5 * acc + 0.5 * C.float()


# configs tried per case (name, overrides)
CONFIGS = [
    ("128x128x64 s4", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4)),
    ("128x128x64 s6", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=6)),
    ("64x256x64 s4", dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, STAGES=4)),
    ("128x128x64 s4 tmastore", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, TMA_STORE=True)),
]
# compiled offline only (expected to be register-limited: 256 fp32 acc regs per thread)
EXTRA_COMPILE_CONFIGS = [
    ("128x256x64 s3", dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=3)),
    ("64x256x64 s4 kmajorB", dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, STAGES=4, _kmajor=True)),
    ("128x128x64 s4 kmajorB", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, _kmajor=True)),
]


# ----------------------------------------------------------------------------------------------
# offline AOT compile for sm_90
# ----------------------------------------------------------------------------------------------
def compile_sm90(epilogue, dtype=torch.float16, b_kmajor=False, M=16384, N=4096, K=1024, **config):
    """AOT-compiles the kernel for sm_90 exactly as a launch with these (CPU-allocated) arguments
    would: runs the JIT's own argument binder/specializer (signature, constexprs, divisibility
    attrs) for a CUDA sm_90 target, then triton.compile(GluonASTSource).  Needs no GPU/driver."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    cfg = dict(DEFAULT_CONFIG, **config)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    # CPU tensors only provide shapes/strides/dtypes/alignment; their memory is never touched
    A = torch.empty((M, K), dtype=dtype)
    B = torch.empty((N, K), dtype=dtype).t() if b_kmajor else torch.empty((K, N), dtype=dtype)
    D = torch.empty((M, N), dtype=dtype)
    bias = torch.empty((N, ), dtype=dtype)
    C = torch.empty((M, N), dtype=torch.float16)
    args, kwargs, _ = _kernel_args(A, B, epilogue, bias, C, D, cfg, 132)
    fn = ws_pingpong_gemm_kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _ptx_facts(ck):
    """Re-runs Triton's ptxas with -v on the generated PTX (no driver needed) to get
    registers / spills; the launch-time n_regs/n_spills attributes need a GPU driver."""
    import os
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    ptx = ck.asm["ptx"]
    facts = dict(setmaxnreg=sorted(set(f"{a}{b}" for a, b in
                                       re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                 maxnreg=(re.findall(r"\.maxnreg\s+(\d+)", ptx) or ["-"])[0])
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    m = re.search(r"Used (\d+) registers", log)
    facts["regs"] = int(m.group(1)) if m else None
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    facts["spill_st"], facts["spill_ld"] = (int(st.group(1)), int(st.group(2))) if st else (None, None)
    sf = re.search(r"(\d+) bytes stack frame", log)
    facts["stack"] = int(sf.group(1)) if sf else None
    return facts


def compile_only():
    print(f"triton {triton.__version__}, torch {torch.__version__}; AOT compile for sm_90 (ptxas)")
    all_cfgs = CONFIGS + EXTRA_COMPILE_CONFIGS
    ok = 0
    total = 0
    for name, cfg in all_cfgs:
        cfg = dict(cfg)
        kmajor = cfg.pop("_kmajor", False)
        for dtype in (torch.float16, torch.bfloat16):
            for ep in (0, 1, 2):
                total += 1
                t0 = time.time()
                try:
                    ck = compile_sm90(ep, dtype=dtype, b_kmajor=kmajor, **cfg)
                    md = ck.metadata
                    facts = _ptx_facts(ck)
                    print(f"OK   {name:<24} {str(dtype)[6:]:<8} ep{ep}  regs={facts['regs']} "
                          f"spill_st/ld={facts['spill_st']}/{facts['spill_ld']}B stack={facts['stack']}B "
                          f"shared={md.shared}B maxnreg={facts['maxnreg']} setmaxnreg={facts['setmaxnreg']} "
                          f"({time.time() - t0:.1f}s)")
                    ok += 1
                except Exception as e:  # noqa: BLE001
                    print(f"FAIL {name:<24} {str(dtype)[6:]:<8} ep{ep}  {_err_line(e)}")
    # the ragged shapes used by the GPU sanity check specialize differently (no %16 divisibility)
    for name, cfg in CONFIGS[:1]:
        for ep in (0, 1, 2):
            total += 1
            try:
                ck = compile_sm90(ep, M=3000, N=2504, K=200, **cfg)
                facts = _ptx_facts(ck)
                print(f"OK   {name:<24} ragged 3000x2504x200 ep{ep}  regs={facts['regs']} "
                      f"spill_st/ld={facts['spill_st']}/{facts['spill_ld']}B shared={ck.metadata.shared}B")
                ok += 1
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {name:<24} ragged ep{ep}  {_err_line(e)}")
    print(f"{ok}/{total} compiled")
    return ok == total


# ----------------------------------------------------------------------------------------------
# GPU benchmark
# ----------------------------------------------------------------------------------------------
def _sync_or_die(what, timeout_s=20.0):
    """torch.cuda.synchronize() with a watchdog: a barrier-phase bug shows up as a hung kernel,
    which would otherwise block the whole run; report it and hard-exit instead."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > timeout_s:
            print(f"HANG: {what} did not finish within {timeout_s:.0f}s -> aborting (mbarrier deadlock?)", flush=True)
            import os
            os._exit(3)
        time.sleep(0.001)
    torch.cuda.synchronize()


def _err_line(e):
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else repr(e))[:200]}"


def main_gpu(skip_ragged=False):
    from triton.testing import do_bench
    sys.stdout.reconfigure(line_buffering=True)
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}  SMs={_num_sms(dev)}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    torch.manual_seed(0)
    t_start = time.time()

    # ---- ragged-shape sanity check (masks, TMA OOB zero-fill, odd #tiles per CTA, K-major B) ----
    if not skip_ragged:
        # several tiles per CTA (so both consumers and the turn barriers are exercised), ragged
        # M/N/K edges, k_tiles == STAGES (K=200) and k_tiles < STAGES (K=72), both B layouts
        for M, N, K in ((3000, 2504, 200), (3000, 2504, 72)):
            A = torch.randn(M, K, device=dev, dtype=torch.float16)
            Bt = torch.randn(N, K, device=dev, dtype=torch.float16)
            bias = torch.randn(N, device=dev, dtype=torch.float16)
            C = torch.randn(M, N, device=dev, dtype=torch.float16)
            for B, kind in ((Bt.t().contiguous(), "rowmajor-B"), (Bt.t(), "kmajor-B")):
                for ep in (0, 1, 2):
                    ref = reference(A, B, ep, bias, C)
                    for name, cfg in CONFIGS:
                        try:
                            D = run(A, B, ep, bias=bias, C=C, **cfg)
                            _sync_or_die(f"ragged {M}x{N}x{K} {kind} ep{ep} {name}")
                            err = ((D.float() - ref).norm() / ref.norm()).item()
                            print(f"ragged {M}x{N}x{K} {kind:<10} ep{ep} {name:<24} rel_err={err:.2e} "
                                  f"{'OK' if err < 1e-2 else 'FAIL'}")
                        except Exception as e:  # noqa: BLE001
                            print(f"ragged {M}x{N}x{K} {kind:<10} ep{ep} {name:<24} ERROR {_err_line(e)}")
        print(f"(ragged checks done at {time.time() - t_start:.0f}s)")

    cases = [((16384, 4096, 1024), torch.float16), ((16384, 4096, 1024), torch.bfloat16),
             ((4096, 4096, 4096), torch.float16), ((8192, 8192, 8192), torch.float16)]
    eps = {0: "identity", 1: "bias+gelu", 2: "lincomb"}
    hdr = (f"{'shape':<16} {'dtype':<9} {'epilogue':<10} {'impl/config':<26} {'ms':>8} {'x cuBLAS':>9} "
           f"{'x own ep0':>9} {'rel_err':>9} {'spills':>6}")
    print(hdr)
    print("-" * len(hdr))
    for (M, N, K), dtype in cases:
        A = torch.randn(M, K, device=dev, dtype=dtype)
        B = torch.randn(K, N, device=dev, dtype=dtype)
        bias = torch.randn(N, device=dev, dtype=dtype)
        C = torch.randn(M, N, device=dev, dtype=torch.float16)
        shape = f"{M}x{N}x{K}"
        dts = str(dtype)[6:]
        ms_cublas = do_bench(lambda: torch.matmul(A, B), warmup=25, rep=100, return_mode="median")
        ms_ep0 = {}
        for ep in (0, 1, 2):
            ref = reference(A, B, ep, bias, C)
            rows = []
            if ep == 0:
                rows.append(("torch.matmul (cuBLAS)", ms_cublas, None, None, None))
            if ep == 1:
                ms = do_bench(lambda: torch._addmm_activation(bias, A, B, use_gelu=True), warmup=25, rep=100,
                              return_mode="median")
                rows.append(("torch._addmm_activation", ms, None, None, None))
            for name, cfg in CONFIGS:
                try:
                    launch, D = prepare(A, B, ep, bias=bias, C=C, **cfg)
                    ck = launch()
                    _sync_or_die(f"{shape} {dts} ep{ep} {name}")
                    err = ((D.float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, f"rel err {err:.3e} >= 1e-2"
                    ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
                    if ep == 0:
                        ms_ep0[name] = ms
                    rows.append((name, ms, err, ms / ms_ep0[name] if name in ms_ep0 else None,
                                 getattr(ck, "n_spills", None)))
                except Exception as e:  # noqa: BLE001
                    print(f"{shape:<16} {dts:<9} {eps[ep]:<10} {name:<26} ERROR {_err_line(e)}")
            for name, ms, err, r0, sp in rows:
                e = f"{err:9.2e}" if err is not None else f"{'':>9}"
                r0s = f"{r0:9.3f}" if r0 is not None else f"{'':>9}"
                sps = f"{sp:6d}" if isinstance(sp, int) else f"{'':>6}"
                print(f"{shape:<16} {dts:<9} {eps[ep]:<10} {name:<26} {ms:8.4f} {ms / ms_cublas:9.3f} {r0s} {e} {sps}")
            del ref
        del A, B, C, bias
        torch.cuda.empty_cache()
    print(f"total wall time {time.time() - t_start:.0f}s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true", help="AOT-compile all configs for sm_90, no GPU needed")
    ap.add_argument("--skip-ragged", action="store_true", help="skip the small ragged-shape correctness checks")
    ap.add_argument("--regs", default=None, help="consumer,producer setmaxnreg, e.g. 240,24 (default 232,40)")
    args = ap.parse_args()
    if args.regs:
        cr, pr = (int(x) for x in args.regs.split(","))
        DEFAULT_CONFIG.update(CONSUMER_REGS=cr, PRODUCER_REGS=pr)
    if args.compile_only or not torch.cuda.is_available():
        sys.exit(0 if compile_only() else 1)
    main_gpu(skip_ragged=args.skip_ragged)


if __name__ == "__main__":
    main()
