"""The Gluon ping-pong kernel (Hopper only).

On CPUs its kernels are compiled for sm_90 (Triton's code generator and ptxas, no GPU): every
epilogue shape the code generator handles must build. With `-m gpu` they run, on ragged shapes
that give every CTA several tiles (both consumer warpgroups and the turn barriers), against the
float64 reference: integer-valued inputs exactly, random ones by relative error.
"""
import dataclasses
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import epifuse
from epifuse.reference import saturate
from epifuse.backends.triton import configs, device, epilogue, gluon_api, source
from epifuse.backends.triton.families import COOPERATIVE, PINGPONG, gluon_problem_check
from epifuse.backends.triton.kernels import TritonKernel
from epifuse.backends.triton.layout import launch_layout
from fuzz_harness import build, describe, seeded
from fuzz_strategies import Example, examples
from helpers import fast, integer_tensor, reference_outputs, rel_error
from offline import compile_offline

GELU = "def epi(accum, bias):\n    D = gelu(accum + bias, approximate='tanh')\n    return D\n"
AUX = ("def epi(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
       "    D = clamp(relu(F), 0.0, 200.0)\n    return D, F\n")
LOSS = ("def epi(accum, bias, C):\n    f = accum + bias\n"
        "    loss = sum((1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))\n    return loss\n")
ROWS = ("def epi(accum, alpha, rb):\n    D = accum * alpha + rb\n    r = sum(D * D, dim=1)\n"
        "    c = amax(D, dim=0)\n    m = max(D, dim=0)\n    return D, r, c, m\n")


def _args(src, A, B, deterministic=False, **tensors):
    epi = epifuse.EpilogueArguments(src, deterministic=deterministic, **tensors)
    return epifuse.GemmArguments(A, B, epilogue=epi)


def _problem(src, M, N, K, dtype=torch.float16, device="cpu", kmajor=False, out=torch.float16):
    A = integer_tensor(M, K, dtype=dtype, device=device)
    B = integer_tensor(N, K, low=-1, high=2, dtype=dtype, device=device)
    B = B.t() if kmajor else B.t().contiguous()
    C = integer_tensor(M, N, dtype=torch.float16, device=device)
    bias = integer_tensor(N, dtype=torch.float32, device=device)
    rb = integer_tensor(M, 1, dtype=torch.float16, device=device)
    empty = dict(device=device)
    tensors = {GELU: dict(bias=bias, D=torch.empty(M, N, dtype=out, **empty)),
               AUX: dict(alpha=2.0, C=C, bias=bias, D=torch.empty(M, N, dtype=out, **empty),
                         F=torch.empty(M, N, dtype=torch.float32, **empty)),
               LOSS: dict(bias=bias, C=C.clamp(0, 1), loss=torch.empty((), dtype=torch.float32, **empty)),
               ROWS: dict(alpha=0.5, rb=rb, D=torch.empty(M, N, dtype=out, **empty),
                          r=torch.empty(M, dtype=torch.float32, **empty),
                          c=torch.empty(N, dtype=torch.float16, **empty),
                          m=torch.empty(N, dtype=torch.float32, **empty))}[src]
    return A, B, tensors


def test_refuses_cpu_tensors_with_a_reason():
    A, B, tensors = _problem(GELU, 64, 64, 64)
    status = TritonKernel(PINGPONG, configs.PINGPONG[0]).supports(_args(GELU, A, B, **tensors))
    assert not status and "Hopper GPUs only" in status.reason


def test_other_devices_get_reasons_not_errors():
    """Tensors on a device that is neither CPU nor CUDA: every generated kernel says why not,
    the reference kernel stays (the Gluon kernel asks no CUDA question first)."""
    A, B, tensors = _problem(GELU, 64, 64, 64, device="meta")
    args = _args(GELU, A, B, **tensors)
    status = TritonKernel(PINGPONG, configs.PINGPONG[0]).supports(args, cc=90)
    assert not status and "Hopper GPUs only" in status.reason
    assert [k.name for k, s in epifuse.kernel_statuses(args) if s] == ["reference"]


EVERY_CONFIG = ([(PINGPONG, c) for c in configs.PINGPONG + configs.SMALL_GRID + configs.ROW_ORDER]
                + [(COOPERATIVE, c) for c in configs.COOPERATIVE])


def pingpong_configs(dtype):
    return configs.by_dtype(dtype, configs.PINGPONG, configs.PINGPONG_BYTES)


def small_grid_configs(dtype):
    return configs.by_dtype(dtype, configs.SMALL_GRID, configs.SMALL_GRID_BYTES)


def cooperative_configs(dtype):
    return () if dtype == torch.int8 else configs.by_dtype(dtype, configs.COOPERATIVE, configs.COOPERATIVE_BYTES)


def _config_id(kernel_config):
    family, config = kernel_config
    rows = "" if config.block_m == 128 else f"-m{config.block_m}"
    group = "" if config.group_m == 8 else f"-g{config.group_m}"
    return f"{family.name.removeprefix('gluon_')}{rows}-{config.epilogue_pieces}-s{config.num_stages}{group}"


def test_row_order_configs_differ_from_the_usual_only_in_tile_order():
    """The config offered where B fits in L2 is the five-stage ping-pong taken two tile rows at a
    time; one-byte inputs are not offered it (their configs were not measured with it)."""
    (row,) = configs.ROW_ORDER
    assert row.group_m == 2 and dataclasses.replace(row, group_m=8) in configs.PINGPONG
    assert len({_config_id(k) for k in EVERY_CONFIG}) == len(EVERY_CONFIG)


def test_an_unreported_l2_size_offers_no_row_order(monkeypatch):
    """torch before 2.5 has no L2_cache_size in the device properties: the size reads as 0, so
    no B fits (and nothing raises)."""
    class OldProperties:
        multi_processor_count = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: OldProperties())
    device.l2_bytes.cache_clear()
    try:
        assert device.l2_bytes(0) == 0
    finally:
        device.l2_bytes.cache_clear()


@pytest.mark.parametrize("src,deterministic,kmajor,dtype,family,config", fast([
    (GELU, False, False, torch.float16, PINGPONG, configs.PINGPONG[0]),
    (AUX, False, True, torch.bfloat16, PINGPONG, configs.PINGPONG[1]),
    (LOSS, True, False, torch.float16, PINGPONG, dataclasses.replace(configs.PINGPONG[0], epilogue_pieces=4)),
    (ROWS, False, False, torch.bfloat16, PINGPONG, configs.PINGPONG[1]),
    (AUX, False, False, torch.float16, PINGPONG, configs.PINGPONG[2]),
    (ROWS, False, False, torch.float16, PINGPONG, configs.PINGPONG[2]),
    (GELU, False, True, torch.float16, COOPERATIVE, configs.COOPERATIVE[0]),
    (AUX, False, False, torch.bfloat16, COOPERATIVE, dataclasses.replace(configs.COOPERATIVE[0], epilogue_pieces=2)),
    (LOSS, True, True, torch.float16, COOPERATIVE, dataclasses.replace(configs.COOPERATIVE[0], epilogue_pieces=4)),
    (ROWS, False, False, torch.float16, COOPERATIVE, configs.COOPERATIVE[0]),
    (AUX, False, True, torch.float16, PINGPONG, configs.SMALL_GRID[0]),
    (LOSS, False, False, torch.bfloat16, PINGPONG, configs.SMALL_GRID[0]),
], keep={3, 8}, ids=["gelu", "aux-kmajor-bf16", "loss-deterministic", "rows-bf16", "aux-5-stages",
                     "rows-5-stages", "coop-gelu-kmajor", "coop-aux-bf16", "coop-loss-deterministic", "coop-rows",
                     "small-grid-aux-kmajor", "small-grid-loss-bf16"]))
def test_compiles_for_sm90_without_a_gpu(src, deterministic, kmajor, dtype, family, config):
    """Two TMA-stored tile outputs do not fit next to the ring of 128-row tiles: AUX stores F
    (fp32) through pointers, but beside the 64-row tiles' smaller stages it has a buffer;
    LOSS and ROWS reduce (atomics, partials). An epilogue in column blocks keeps the
    accumulator's registers (no layout conversion through shared memory) and stores each
    block with its own TMA store. The cooperative kernel's 128x256 tile is two warpgroups'
    64x256 wgmmas, four per 64-deep K step."""
    A, B, tensors = _problem(src, 1000, 744, 520, dtype=dtype, kmajor=kmajor)
    args = _args(src, A, B, deterministic=deterministic, **tensors)
    compiled = compile_offline(TritonKernel(family, config), args)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
    assert ("cp.async.bulk.tensor" in ptx)   # the TMA loads (and stores where used)
    assert compiled.metadata.shared <= 227 * 1024
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
    layout = launch_layout(args.graph, deterministic)
    plan = gluon_api.buffer_plan(args, config, layout, family.consumers)
    stored = sum(plan.tma[y.prefix] for y in layout.outputs if y.mode == "tile")
    # AUX's fp32 F fits beside the 64-row tiles' stages, not beside the 128-row ones
    assert stored == {GELU: 1, ROWS: 1, LOSS: 0, AUX: 2 if config.block_m == 64 else 1}[src]
    assert stores == stored * family.consumers * config.epilogue_pieces  # each consumer's copies
    # reductions fold with relaxed atomics: an acq_rel one costs a GPU-wide fence and an L1
    # invalidation per atomic (rowsumsq S2 1.19 -> 1.06 of cuBLAS, research/NOTEBOOK.md 2026-11-24)
    if src in (LOSS, ROWS) and not deterministic:
        assert "atom.global.gpu.relaxed.add.f32" in ptx or "red.global.gpu.relaxed.add.f32" in ptx
    if src == ROWS:  # amax folds with an integer atomic max (layout.reduction_mode)
        assert "atom.global.gpu.relaxed.max.s32" in ptx or "red.global.gpu.relaxed.max.s32" in ptx
    assert "acq_rel" not in ptx and "membar.gl" not in ptx
    # the kernel zeroes its atomic reductions (templates/macros.j2): the first consumer
    # releases its zeros, every consumer acquires them before its first atomic
    zeroes = src in (LOSS, ROWS) and not deterministic
    assert ("atom.global.gpu.release.exch.b64" in ptx) == zeroes
    assert ("ld.global.acquire.gpu.b64" in ptx) == zeroes
    if src == LOSS:  # 1 + exp(...): the exp flushes subnormal results (rules.ADD_EXP_FLUSHED)
        assert "ex2.approx.ftz.f32" in ptx and not re.search(r"ex2\.approx\.f32\s", ptx)
    if family is COOPERATIVE:
        assert f".reqntid {32 * (8 + 4)}" in ptx  # two consumer warpgroups and the producer's
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16") == 4
    shared_traffic = ptx.count("st.shared") + ptx.count("stmatrix")
    whole = compile_offline(TritonKernel(family, dataclasses.replace(config, epilogue_pieces=1)), args).asm["ptx"]
    assert shared_traffic <= whole.count("st.shared") + whole.count("stmatrix") + 8 * config.epilogue_pieces


@pytest.mark.slow
@pytest.mark.parametrize("family,config", [(PINGPONG, configs.PINGPONG[0]),
                                           (COOPERATIVE, configs.COOPERATIVE[0])], ids=["pingpong", "coop"])
@pytest.mark.parametrize("src", [LOSS, ROWS], ids=["loss", "rows"])
def test_whole_tiles_drop_the_reductions_masks(src, family, config):
    """Where the tiles divide M and N, the reductions select no masked elements (EVEN_M and
    EVEN_N make the masks constants): the loss's two selects per element and the row sum's
    one are gone; a ragged axis keeps them."""
    selects = {}
    for M, N in ((1024, 768), (1000, 768), (1024, 744)):
        A, B, tensors = _problem(src, M, N, 512)
        ptx = compile_offline(TritonKernel(family, config), _args(src, A, B, **tensors)).asm["ptx"]
        selects[M, N] = ptx.count("selp.")
    assert selects[1024, 768] == 0 and selects[1000, 768] > 0 and selects[1024, 744] > 0, selects


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype", [(PINGPONG, torch.float8_e4m3fn), (PINGPONG, torch.int8),
                                          (COOPERATIVE, torch.float8_e4m3fn)], ids=["fp8", "int8", "coop-fp8"])
def test_eight_bit_inputs_compile_without_a_gpu(family, dtype):
    """fp8 and int8 take 128-deep K tiles (128-byte rows as fp16's 64) and K-major wgmmas of
    depth 32; int8 accumulates in int32 (the ping-pong kernel only: Triton 3.6 cannot lower
    the cooperative kernel's m64n256k32 s8 wgmma)."""
    A, B, tensors = _problem(GELU, 1000, 744, 512, kmajor=True)
    A, B = A.to(dtype), B.t().contiguous().to(dtype).t()
    args = _args(GELU, A, B, **tensors)
    if family is PINGPONG:  # and the 64-row tiles of small grids
        tried = (pingpong_configs(dtype)[0], *small_grid_configs(dtype))
    else:
        tried = cooperative_configs(dtype)
    for config in tried:
        assert config.block_k == 128
        ptx = compile_offline(TritonKernel(family, config), args).asm["ptx"]
        shape = "k32.f32.e4m3.e4m3" if dtype == torch.float8_e4m3fn else "k32.s32.s8.s8"
        assert f"m64n{config.block_n}{shape}" in ptx
        if family is PINGPONG:  # per K step, each consumer's copy: a wgmma per 32 of K per 64 rows
            assert ptx.count("wgmma.mma_async") == 2 * (config.block_k // 32) * (config.block_m // 64)




def test_tile_buffers_fit_shared_memory():
    """Slots: C (an (M, N) fp16 operand) 0, D 1, F 2. Outputs first: D (fp16) has its own
    buffer; F (fp32) would not fit next to a 3-stage ring and is stored through pointers; as
    fp16 it shares D's buffer after D's store (WAIT). C is loaded into D's buffer when the
    tile starts. A misaligned D goes through pointers: C takes a buffer of its own, or F's.
    C in fp32 does not fit: pointer loads. Operands TMA cannot load (unaligned rows, an integer
    type, a broadcast along M) are loaded through pointers. Beside one buffer the ring takes
    five stages where the config asks for them (224 KB in all). The cooperative kernel's
    (128, 256) tiles leave room for three 48 KB stages next to one 64 KB buffer; the 64-row
    tiles' 24 KB stages leave room for F's fp32 buffer too."""
    A, B, tensors = _problem(AUX, 256, 256, 64, out=torch.float16)
    cfg = configs.PINGPONG[0]

    def plan(kernel=TritonKernel(PINGPONG, cfg), **changed):
        args = _args(AUX, A, B, **dict(tensors, **changed))
        layout = launch_layout(args.graph)
        p = gluon_api.buffer_plan(args, kernel.config, layout, kernel.family.consumers)
        names = {slot.prefix: slot.name for slot in layout.tile_slots()}
        slots = {names[s]: (p.tma[s], p.owner[s]) + ((p.wait[s],) if s in p.wait else ()) for s in p.slots}
        return p.stages, p.load_bytes, slots

    tile = 128 * 128 * 2
    fp16 = dict(F=torch.empty(256, 256, dtype=torch.float16))
    assert plan() == (4, tile, {"C": (True, 1), "D": (True, 1, False), "F": (False, 2, False)})
    assert plan(**fp16) == (4, tile, {"C": (True, 1), "D": (True, 1, False), "F": (True, 1, True)})
    misaligned = torch.empty(256 * 256 + 1, dtype=torch.float16)[1:].view(256, 256)
    assert plan(D=misaligned) == (4, tile, {"C": (True, 0), "D": (False, 1, False), "F": (False, 2, False)})
    assert plan(D=misaligned, **fp16) == (4, tile, {"C": (True, 2), "D": (False, 1, False), "F": (True, 2, False)})
    assert plan(C=tensors["C"].float()) == (4, 0, {"C": (False, 0), "D": (True, 1, False), "F": (False, 2, False)})
    assert plan(C=tensors["C"].bfloat16())[2]["C"] == (False, 0)   # no room for a second buffer
    for C in (torch.empty(256, 260, dtype=torch.float16)[:, :256],   # rows not 16-byte aligned
              tensors["C"].to(torch.int16), tensors["C"][:1].expand(256, 256)):
        assert plan(C=C)[2]["C"] == (False, 0), C.stride()
    wide = torch.empty(256, 320, dtype=torch.float16)[:, 8:264]   # 16-byte aligned rows and start
    assert plan(C=wide)[2]["C"] == (True, 1)
    five = TritonKernel(PINGPONG, configs.PINGPONG[2])
    assert five.config.num_stages == 5 and plan(five)[0] == 5
    assert plan(five, C=tensors["C"].float())[0] == 5
    A_rows, B_rows, rows = _problem(ROWS, 256, 256, 64)   # reductions: their scratch keeps 4 KB
    rows_args = _args(ROWS, A_rows, B_rows, **rows)
    rows_plan = gluon_api.buffer_plan(rows_args, five.config, launch_layout(rows_args.graph), 2)
    assert rows_plan.stages == 4 and rows_plan.tma["y0"]
    # 64-row tiles (small grids): 24 KB stages, so an fp32 F fits beside D with five of them
    small = TritonKernel(PINGPONG, configs.SMALL_GRID[0])
    assert plan(small) == (5, 64 * 128 * 2, {"C": (True, 1), "D": (True, 1, False), "F": (True, 2, False)})
    assert plan(small, **fp16)[0] == 8
    assert plan(TritonKernel(COOPERATIVE, configs.COOPERATIVE[0])) == \
        (3, 128 * 256 * 2, {"C": (True, 1), "D": (True, 1, False), "F": (False, 2, False)})


def _gpu_kernel(args, config=configs.PINGPONG[0], family=PINGPONG):
    kernel = TritonKernel(family, config)
    status = kernel.supports(args)
    assert status, status
    return kernel


def _check(args, refs, exact=True):
    for name, out in args.outputs.items():
        ref = refs[name]
        if exact:
            assert torch.equal(out.double(), saturate(ref, out.dtype).to(out.dtype).double()), name
        else:
            assert rel_error(out, ref) < 1e-2, (name, rel_error(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(3000, 2504, 200), (1000, 744, 72), (4096, 4096, 1024), (129, 8, 16)])
@pytest.mark.parametrize("src", [GELU, AUX, LOSS, ROWS])
@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("kernel_config", EVERY_CONFIG, ids=_config_id)
def test_matches_the_reference(M, N, K, src, kmajor, kernel_config):
    """Exact where the epilogue is (integer inputs, AUX and ROWS's D); GELU and the loss by
    relative error. Several tiles per CTA, K both below and above the ring's depth."""
    dtype = torch.bfloat16 if kmajor else torch.float16
    A, B, tensors = _problem(src, M, N, K, dtype=dtype, device="cuda", kmajor=kmajor)
    if src in (GELU, LOSS):
        A = torch.randn(M, K, device="cuda", dtype=dtype) / math.sqrt(K)
    for deterministic in (False, True):
        args = _args(src, A, B, deterministic=deterministic, **tensors)
        kernel = _gpu_kernel(args, kernel_config[1], kernel_config[0])
        for t in args.outputs.values():
            t.fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        refs = reference_outputs(args)
        if src == AUX:
            _check(args, refs)
        elif src == ROWS:
            assert torch.equal(args.outputs["D"].double(), refs["D"].to(args.outputs["D"].dtype).double())
            assert rel_error(args.outputs["r"], refs["r"]) < 1e-5
            assert torch.equal(args.outputs["c"].double(), refs["c"].to(torch.float16).double())
        else:
            _check(args, refs, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("out", [torch.float32, torch.int8, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("kernel_config", EVERY_CONFIG, ids=_config_id)
def test_output_dtypes(out, kernel_config):
    """F as the same dtype as D: both TMA-stored through one shared buffer (fp32 does not fit
    next to the ring of 128-row tiles and goes through pointers; beside the 64-row tiles' smaller
    stages it has a buffer of its own). N = 512 keeps every row 16-byte aligned."""
    A, B, tensors = _problem(AUX, 777, 512, 96, device="cuda", out=out)
    args = _args(AUX, A, B, **dict(tensors, F=torch.empty(777, 512, dtype=out, device="cuda")))
    kernel = _gpu_kernel(args, kernel_config[1], kernel_config[0])
    kernel.run(args)
    assert args._plans[kernel].meta["Y0_TMA"] == (out != torch.float32 or kernel.config.block_m == 64)
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["fp16", "bf16", "fp32", "int16", "wide-view", "unaligned-rows", "broadcast"])
@pytest.mark.parametrize("kernel_config", EVERY_CONFIG, ids=_config_id)
def test_tile_operands(form, kernel_config):
    """C through TMA into shared memory at each tile's start (fp16, bf16, a view whose rows are
    16-byte aligned; D and F, of its dtype, then store from its buffer) or through pointers
    (fp32 does not fit next to the ring of 128-row tiles; an integer type, unaligned rows, a
    broadcast along M),
    exact against the reference on ragged tiles, several per CTA."""
    M, N, K = 1531, 744, 200
    A, B, tensors = _problem(AUX, M, N, K, device="cuda")
    C = tensors["C"]
    C = {"fp16": C, "bf16": C.bfloat16(), "fp32": C.float(), "int16": C.to(torch.int16),
         "wide-view": torch.empty(M, N + 40, dtype=torch.float16, device="cuda")[:, 8:N + 8].copy_(C),
         "unaligned-rows": torch.empty(M, N + 4, dtype=torch.float16, device="cuda")[:, :N].copy_(C),
         "broadcast": C[:1].expand(M, N)}[form]
    out = C.dtype if C.dtype == torch.bfloat16 else torch.float16   # C's buffer is D's
    outputs = {name: torch.empty(M, N, dtype=out, device="cuda") for name in ("D", "F")}
    args = _args(AUX, A, B, **dict(tensors, C=C, **outputs))
    kernel = _gpu_kernel(args, kernel_config[1], kernel_config[0])
    for t in args.outputs.values():
        t.fill_(float("nan"))
    kernel.run(args)
    meta = args._plans[kernel].meta
    fits = ("fp16", "bf16", "wide-view") + (("fp32",) if kernel.config.block_m == 64 else ())
    assert meta.get("X1_TMA", False) == (form in fits), meta
    assert meta["Y0_TMA"] and meta["Y1_TMA"] and meta["Y1_WAIT"]
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
@pytest.mark.parametrize("M,N,K", [(3000, 2504, 384), (1000, 744, 128)])
def test_eight_bit_inputs_match_the_reference(dtype, M, N, K):
    """Integer-valued fp8 and int8 inputs (every product and sum exact), several tiles per CTA,
    through every Gluon config offered for the dtype, D and F compared exactly. A B that is
    not K-major is refused with the reason."""
    A = integer_tensor(M, K, low=-4, high=5, dtype=torch.float32, device="cuda").to(dtype)
    Bt = integer_tensor(N, K, low=-2, high=3, dtype=torch.float32, device="cuda").to(dtype)
    _, _, tensors = _problem(AUX, M, N, K, device="cuda")
    args = _args(AUX, A, Bt.t(), **tensors)
    kernels = [TritonKernel(PINGPONG, c) for c in pingpong_configs(dtype) + small_grid_configs(dtype)] + \
              [TritonKernel(COOPERATIVE, c) for c in cooperative_configs(dtype)]
    assert len(kernels) == (3 if dtype == torch.int8 else 4)
    for kernel in kernels:
        assert kernel.supports(args), kernel.supports(args)
        for t in args.outputs.values():
            t.fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        _check(args, reference_outputs(args))
    A, Bt, tensors = _problem(AUX, 256, 512, 128, device="cuda")
    status = TritonKernel(PINGPONG, pingpong_configs(dtype)[0]).supports(
        _args(AUX, A.to(dtype), Bt.to(dtype), **tensors))
    assert not status and "contiguous along K" in status.reason
    if dtype == torch.int8:
        status = TritonKernel(COOPERATIVE, configs.COOPERATIVE_BYTES[0]).supports(args)
        assert not status and "ping-pong" in status.reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=str)
def test_small_grids_take_64_row_tiles_first(dtype):
    """Where the 128x128 tiles leave SMs idle (32 tiles here), the 64-row ping-pong is offered
    first; where they fill the GPU, last (for heavy epilogues: tune.smallest_ping_pong)."""
    def kernels(M):
        A, B, tensors = _problem(GELU, M, 4096, 512, device="cuda", kmajor=True)   # B contiguous along K
        return [k for k, status in epifuse.kernel_statuses(_args(GELU, A.to(dtype), B.to(dtype), **tensors))
                if status]
    small = kernels(128)
    assert small[0].family is PINGPONG and small[0].config in small_grid_configs(dtype)
    full = [k for k in kernels(8192) if k.name != "reference"]
    assert full[-1].family is PINGPONG and full[-1].config in small_grid_configs(dtype)
    assert not any(k.name == "gluon_pingpong" and k.config.block_m == 64 for k in full[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("group_m", [2, 8])
def test_a_last_group_of_fewer_rows_is_walked_whole(group_m):
    """23 rows of tiles (the last ragged) in groups of 2 or 8 leave a last group of 1 or 7
    rows; 23 x 20 tiles give each CTA several. Exact against the reference."""
    A, B, tensors = _problem(AUX, 2900, 2504, 200, device="cuda")
    args = _args(AUX, A, B, **tensors)
    config = dataclasses.replace(configs.ROW_ORDER[0], group_m=group_m)
    kernel = _gpu_kernel(args, config)
    for t in args.outputs.values():
        t.fill_(float("nan"))
    kernel.run(args)
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))


@pytest.mark.gpu
def test_row_order_is_offered_where_b_fits_l2():
    """B of 1024x4096 fp16 (8 MB, a sixth of an H100's L2) gets the two-rows-deep tile order as
    one more candidate; B of 4096x4096 (32 MB) and a small grid do not."""
    def row_order_offered(M, N, K, dtype=torch.float16):
        A, B, tensors = _problem(GELU, M, N, K, device="cuda", kmajor=True)   # B contiguous along K
        return [k for k, status in epifuse.kernel_statuses(_args(GELU, A.to(dtype), B.to(dtype), **tensors))
                if status and k.name == "gluon_pingpong" and k.config.group_m == 2]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert 1024 * 4096 * 2 <= l2 // 4 < 4096 * 4096 * 2
    assert [k.config for k in row_order_offered(16384, 4096, 1024)] == list(configs.ROW_ORDER)
    A, B, tensors = _problem(GELU, 16384, 4096, 1024, device="cuda")
    names = [k.name for k in epifuse.get_kernels(_args(GELU, A, B, **tensors))]
    last_tiled = max(i for i, n in enumerate(names) if n == "triton_tiled")
    assert names[last_tiled + 1] == "gluon_pingpong"   # the row-order config, right after the tiled kernel's
    assert row_order_offered(16384, 4096, 1024, torch.float8_e4m3fn) == []
    assert row_order_offered(4096, 4096, 4096) == []
    assert row_order_offered(128, 4096, 1024) == []


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_config", EVERY_CONFIG[1:], ids=_config_id)
def test_cuda_graph_replays(kernel_config):
    """A launch captured in a CUDA graph (the reductions' initialization with it) recomputes
    every output from the inputs' current values at each replay."""
    M, N, K = 1000, 744, 520
    A, B, tensors = _problem(ROWS, M, N, K, device="cuda")
    args = _args(ROWS, A, B, **tensors)
    kernel = _gpu_kernel(args, kernel_config[1], kernel_config[0])
    kernel.run(args)  # compiles and keeps the launch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(args)
    for _ in range(3):
        A.copy_(integer_tensor(M, K, device="cuda"))
        for t in args.outputs.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        refs = reference_outputs(args)
        assert torch.equal(args.outputs["D"].double(), refs["D"].to(args.outputs["D"].dtype).double())
        assert rel_error(args.outputs["r"], refs["r"]) < 1e-5
        assert torch.equal(args.outputs["c"].double(), refs["c"].to(torch.float16).double())


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(0, 128), (128, 0)])
def test_empty_gemms_are_refused_and_run_elsewhere(M, N):
    A, B, tensors = _problem(GELU, M, N, 64, device="cuda")
    args = _args(GELU, A, B, **tensors)
    status = TritonKernel(PINGPONG, configs.PINGPONG[0]).supports(args)
    assert not status and "empty GEMM" in status.reason
    for kernel in epifuse.get_kernels(args):
        kernel.run(args)   # every kernel offered takes it
    assert epifuse.gemm(A, B, GELU, bias=tensors["bias"]).shape == (M, N)


@pytest.mark.gpu
def test_repeated_launches_take_new_tensors():
    """The direct launches after the first rebuild the TMA descriptors from the tensors they
    are given (what a kept epifuse.gemm call hands them), and a misaligned output is stored
    through pointers."""
    M, N, K = 1000, 744, 520
    A, B, tensors = _problem(AUX, M, N, K, device="cuda")
    args = _args(AUX, A, B, **tensors)
    kernel = _gpu_kernel(args)
    kernel.run(args)
    plan = args._plans[kernel]
    assert plan.launch_with is not None
    for _ in range(2):
        A2 = integer_tensor(M, K, device="cuda")
        C2 = integer_tensor(M, N, dtype=torch.float16, device="cuda")
        D2 = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
        F2 = torch.full((M, N), float("nan"), device="cuda")
        swap = {id(A): A2, id(tensors["C"]): C2, id(tensors["D"]): D2, id(tensors["F"]): F2}
        plan.launch_with([swap.get(id(v), v) for v in plan.values])
        new = _args(AUX, A2, B, **dict(tensors, C=C2, D=D2, F=F2))
        torch.cuda.synchronize()
        _check(new, reference_outputs(new))
    misaligned = torch.empty(M * N + 1, device="cuda", dtype=torch.float16)[1:].view(M, N)
    args = _args(AUX, A, B, **dict(tensors, D=misaligned))
    kernel.run(args)
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))


@pytest.mark.gpu
def test_kept_epifuse_gemm_calls(monkeypatch):
    """epifuse.gemm with the Gluon kernel chosen: the second and third calls take the kept
    launch (epifuse.callsite) with new inputs and new outputs, and stay exact."""
    from epifuse import api
    from epifuse.runtime import callsite
    kernel = TritonKernel(PINGPONG, configs.PINGPONG[0])
    monkeypatch.setattr(api, "choose_kernel", lambda args: kernel)
    M, N, K = 1000, 744, 520
    B = integer_tensor(K, N, low=-1, high=2, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    hits = callsite.HITS[0]
    for _ in range(3):
        A = integer_tensor(M, K, device="cuda")
        C = integer_tensor(M, N, dtype=torch.float16, device="cuda")
        D, F = epifuse.gemm(A, B, AUX, alpha=2.0, C=C, bias=bias)
        F_expected = (A.double() @ B.double()) * 2.0 + C.double() * 2.0 + bias.double()
        assert torch.equal(F.double(), F_expected.to(F.dtype).double())
        assert torch.equal(D.double(), F_expected.clamp(0, 200).to(D.dtype).double())
    assert callsite.HITS[0] - hits == 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "fp32", "transposed", "broadcast", "sliced"])
@pytest.mark.parametrize("family", [PINGPONG, COOPERATIVE], ids=["pingpong", "cooperative"])
def test_tile_operand_layouts(layout, family):
    """C in every layout the epilogue's pointer loads take, with several tiles per CTA."""
    M, N, K = 3000, 2504, 200
    A, B, tensors = _problem(AUX, M, N, K, device="cuda")
    ints = dict(device="cuda")
    C = {"contiguous": integer_tensor(M, N, dtype=torch.float16, **ints),
         "fp32": integer_tensor(M, N, dtype=torch.float32, **ints),
         "transposed": integer_tensor(N, M, dtype=torch.float16, **ints).t(),
         "broadcast": integer_tensor(1, N, dtype=torch.float16, **ints).expand(M, N),
         "sliced": integer_tensor(M, N + 1, dtype=torch.float16, **ints)[:, 1:]}[layout]
    args = _args(AUX, A, B, **dict(tensors, C=C))
    tried = configs.PINGPONG if family is PINGPONG else configs.COOPERATIVE
    _gpu_kernel(args, tried[0], family).run(args)
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))


# Fuzzed epilogues through the Gluon code generator: compiled for sm_90 (CPU, no GPU), which
# catches source the generator gets wrong for some combination of ops, operand roles, dtypes
# and layouts (TMA or pointer loads and stores, shared buffers, reductions). Whether the
# kernels compute the right numbers is the GPU fuzz's question (tests/gpu_fuzz.py).
GLUON_FUZZ_EXAMPLES = int(os.environ.get("EPIFUSE_GLUON_FUZZ_EXAMPLES", "8"))


@pytest.mark.slow
@seeded
@settings(max_examples=GLUON_FUZZ_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(ex=examples(), kernel_config=st.sampled_from(EVERY_CONFIG), kmajor=st.booleans(),
       sizes=st.tuples(st.sampled_from([8, 64, 136, 264]), st.sampled_from([16, 64, 72])))
def test_fuzzed_epilogues_compile_for_sm90(ex, kernel_config, kmajor, sizes):
    """A fuzz example made one the Gluon kernels take (one batch, 16-bit inputs, A contiguous,
    B contiguous along N or K, N and K multiples of 8), compiled with a random Gluon config."""
    assume(not ex.batch)
    in_dtype = ex.in_dtype if ex.in_dtype != torch.float32 else torch.float16
    ex = Example(**{**ex.__dict__, "in_dtype": in_dtype, "N": sizes[0], "K": sizes[1],
                    "layout_a": "contiguous", "layout_b": "transposed" if kmajor else "contiguous"})
    note(describe(ex))
    args, _ = build(ex, "cpu")
    family, config = kernel_config
    assume(gluon_problem_check(family.name.removeprefix("gluon_"), args, config, 90) is None)
    compiled = compile_offline(TritonKernel(family, config), args)
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_source_follows_the_installed_tritons_gluon_names(monkeypatch, schedule):
    """The generated source calls the TMA copies and the barrier by the names gluon_api gives
    (Triton 3.6's or 3.9's), and passes no cache policy to them."""
    A, B, tensors = _problem(AUX, 256, 256, 64)
    graph = _args(AUX, A, B, **tensors).graph
    versions = {"3.6": gluon_api.GluonApi("tma.async_copy_global_to_shared", "tma.async_copy_shared_to_global",
                                          "gl.thread_barrier"),
                "3.9": gluon_api.GluonApi("tma.async_load", "tma.async_store", "gl.barrier")}
    for version, api in versions.items():
        for module in (gluon_api, source, epilogue):
            monkeypatch.setattr(module, "gluon_api", lambda api=api: api)
        text = source.render(source.SourceSpec("gluon", schedule, 1, zeroes=True), graph, f"names_{version}",
                             "cuda", False)
        other = versions["3.9" if version == "3.6" else "3.6"]
        for name in (api.load, api.store):
            assert f"{name}(" in text, (version, name)
        for name in (other.load, other.store):
            assert f"{name}(" not in text, (version, name)
        assert "cache_policy" not in text
        compile(text, f"names_{version}", "exec")
