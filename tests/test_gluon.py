"""The Gluon ping-pong kernel (Hopper only).

On CPUs its kernels are compiled for sm_90 (Triton's code generator and ptxas, no GPU): every
epilogue shape the code generator handles must build. With `-m gpu` they run, on ragged shapes
that give every CTA several tiles (both consumer warpgroups and the turn barriers), against the
float64 reference: integer-valued inputs exactly, random ones by relative error.
"""
import dataclasses
import math

import pytest
import torch

import epifuse
from epifuse.backends.reference import saturate
from epifuse.backends.triton import pingpong
from helpers import integer_tensor, reference_outputs, rel_error

GELU = "def epi(accum, bias):\n    D = gelu(accum + bias, approximate='tanh')\n    return D\n"
AUX = ("def epi(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
       "    D = clamp(relu(F), 0.0, 200.0)\n    return D, F\n")
LOSS = ("def epi(accum, bias, C):\n    f = accum + bias\n"
        "    loss = sum((1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))\n    return loss\n")
ROWS = ("def epi(accum, alpha, rb):\n    D = accum * alpha + rb\n    r = sum(D * D, dim=1)\n"
        "    c = amax(D, dim=0)\n    return D, r, c\n")


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
                          c=torch.empty(N, dtype=torch.float16, **empty))}[src]
    return A, B, tensors


def test_refuses_cpu_tensors_with_a_reason():
    A, B, tensors = _problem(GELU, 64, 64, 64)
    status = pingpong.GluonPingPong(pingpong.CUDA_CONFIGS[0]).supports(_args(GELU, A, B, **tensors))
    assert not status and "Hopper GPUs only" in status.reason


def test_other_devices_get_reasons_not_errors():
    """Tensors on a device that is neither CPU nor CUDA: every generated kernel says why not,
    the reference kernel stays (the Gluon kernel asks no CUDA question first)."""
    A, B, tensors = _problem(GELU, 64, 64, 64, device="meta")
    args = _args(GELU, A, B, **tensors)
    status = pingpong.GluonPingPong(pingpong.CUDA_CONFIGS[0]).supports(args, cc=90)
    assert not status and "Hopper GPUs only" in status.reason
    assert [k.name for k, s in epifuse.kernel_statuses(args) if s] == ["reference"]


@pytest.mark.parametrize("src,deterministic,kmajor,dtype,config", [
    (GELU, False, False, torch.float16, pingpong.CUDA_CONFIGS[0]),
    (AUX, False, True, torch.bfloat16, pingpong.CUDA_CONFIGS[1]),
    (LOSS, True, False, torch.float16, dataclasses.replace(pingpong.CUDA_CONFIGS[0], epilogue_pieces=4)),
    (ROWS, False, False, torch.bfloat16, pingpong.CUDA_CONFIGS[1]),
], ids=["gelu", "aux-kmajor-bf16", "loss-deterministic", "rows-bf16"])
def test_compiles_for_sm90_without_a_gpu(src, deterministic, kmajor, dtype, config):
    """Two TMA-stored tile outputs do not fit next to the ring: AUX stores F through pointers;
    LOSS and ROWS reduce (atomics, partials). An epilogue in column blocks keeps the
    accumulator's registers (no layout conversion through shared memory) and stores each
    block with its own TMA store."""
    A, B, tensors = _problem(src, 1000, 744, 520, dtype=dtype, kmajor=kmajor)
    args = _args(src, A, B, deterministic=deterministic, **tensors)
    compiled = pingpong.compile_offline(pingpong.GluonPingPong(config), args)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
    assert ("cp.async.bulk.tensor" in ptx)   # the TMA loads (and stores where used)
    assert compiled.metadata.shared <= 227 * 1024
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
    assert stores == (0 if src == LOSS else 2 * config.epilogue_pieces)  # two consumers' copies
    shared_traffic = ptx.count("st.shared") + ptx.count("stmatrix")
    whole = pingpong.compile_offline(pingpong.GluonPingPong(pingpong.CUDA_CONFIGS[0]), args).asm["ptx"]
    assert shared_traffic <= whole.count("st.shared") + whole.count("stmatrix") + 8 * config.epilogue_pieces


def test_output_stores_fit_shared_memory():
    """D (fp16) has its own buffer; F (fp32) would not fit next to a 3-stage ring and is stored
    through pointers; as fp16 it shares D's buffer; a misaligned D goes through pointers."""
    A, B, tensors = _problem(AUX, 256, 256, 64, out=torch.float16)
    cfg = pingpong.CUDA_CONFIGS[0]

    def plan(**outputs):
        args = _args(AUX, A, B, **dict(tensors, **outputs))
        tiles = [y for y in pingpong.launch_layout(args.graph).outputs if y.mode == "tile"]
        stages, stores, owner = pingpong._stages_and_stores(args, cfg, tiles)
        return stages, {y.name: (stores[y.prefix], owner[y.prefix]) for y in tiles}

    assert plan() == (4, {"D": (True, 0), "F": (False, 1)})
    assert plan(F=torch.empty(256, 256, dtype=torch.float16)) == (4, {"D": (True, 0), "F": (True, 0)})
    misaligned = torch.empty(256 * 256 + 1, dtype=torch.float16)[1:].view(256, 256)
    assert plan(D=misaligned) == (4, {"D": (False, 0), "F": (False, 1)})
    assert plan(D=misaligned, F=torch.empty(256, 256, dtype=torch.float16)) == (4, {"D": (False, 0), "F": (True, 1)})


def _gpu_kernel(args, config=pingpong.CUDA_CONFIGS[0]):
    kernel = pingpong.GluonPingPong(config)
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
@pytest.mark.parametrize("config", pingpong.CUDA_CONFIGS, ids=str)
def test_matches_the_reference(M, N, K, src, kmajor, config):
    """Exact where the epilogue is (integer inputs, AUX and ROWS's D); GELU and the loss by
    relative error. Several tiles per CTA, K both below and above the ring's depth."""
    dtype = torch.bfloat16 if kmajor else torch.float16
    A, B, tensors = _problem(src, M, N, K, dtype=dtype, device="cuda", kmajor=kmajor)
    if src in (GELU, LOSS):
        A = torch.randn(M, K, device="cuda", dtype=dtype) / math.sqrt(K)
    for deterministic in (False, True):
        args = _args(src, A, B, deterministic=deterministic, **tensors)
        kernel = _gpu_kernel(args, config)
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
@pytest.mark.parametrize("config", pingpong.CUDA_CONFIGS, ids=str)
def test_output_dtypes(out, config):
    """F as the same dtype as D: both TMA-stored through one shared buffer (fp32 does not fit
    next to the ring and goes through pointers). N = 512 keeps every row 16-byte aligned."""
    A, B, tensors = _problem(AUX, 777, 512, 96, device="cuda", out=out)
    args = _args(AUX, A, B, **dict(tensors, F=torch.empty(777, 512, dtype=out, device="cuda")))
    kernel = _gpu_kernel(args, config)
    kernel.run(args)
    assert args._plans[kernel].meta["Y0_TMA"] == (out != torch.float32)
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(0, 128), (128, 0)])
def test_empty_gemms_are_refused_and_run_elsewhere(M, N):
    A, B, tensors = _problem(GELU, M, N, 64, device="cuda")
    args = _args(GELU, A, B, **tensors)
    status = pingpong.GluonPingPong(pingpong.CUDA_CONFIGS[0]).supports(args)
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
    from epifuse import api, callsite
    kernel = pingpong.GluonPingPong(pingpong.CUDA_CONFIGS[0])
    monkeypatch.setattr(api, "_choose_kernel", lambda args: kernel)
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
def test_tile_operand_layouts(layout):
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
    _gpu_kernel(args).run(args)
    torch.cuda.synchronize()
    _check(args, reference_outputs(args))
