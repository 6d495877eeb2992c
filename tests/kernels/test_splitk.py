"""The split-K kernel: each output tile's K loop shared by SPLIT_K programs, the last of which
adds the partials in a fixed order and runs the epilogue.

On CPU these run through Triton's interpreter with small tiles and ragged edges; integer-valued
inputs make every result exact, so most checks are equality with the float64 reference. The
interpreter runs programs one at a time in grid order, so one test shuffles that order to make
any program of a tile the last one. The `gpu` test runs the S4 benchmark shape.
"""
import itertools
import random

import pytest
import torch

import epifuse
from epifuse.backends import select
from epifuse.backends.triton import device as target
from epifuse.backends.triton.configs import TileConfig
from epifuse.backends.triton.families import SPLIT_K
from epifuse.backends.triton.kernels import TritonKernel
from epifuse.backends.triton.device import interpreter_requested
from helpers import integer_tensor, reference_outputs, rel_error

BIAS_RELU_TWO_OUTPUTS = ("def epi(accum, alpha, bias):\n    F = accum * alpha + bias\n"
                         "    D = relu(F)\n    return D, F\n")
ROW_SUM_COLUMN_MAX = ("def epi(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n"
                      "    c = max(D, dim=0)\n    return D, r, c\n")


def kernel(block_m=16, block_n=16, block_k=16, split_k=2) -> TritonKernel:
    return TritonKernel(SPLIT_K, TileConfig(block_m, block_n, block_k, group_m=2, num_warps=1, num_stages=1,
                                            split_k=split_k))


def split_k_candidates(args) -> list:
    return [k for k in select.candidates(args) if k.family is SPLIT_K]


def bias_relu_args(M, N, K, device, dtype=torch.float16, L=None):
    batch = () if L is None else (L,)
    A = integer_tensor(*batch, M, K, device=device, dtype=dtype)
    B = integer_tensor(*batch, K, N, low=-1, high=2, device=device, dtype=dtype)
    bias = integer_tensor(N, device=device, dtype=torch.float32)
    D = torch.empty(*batch, M, N, device=device, dtype=torch.float16)
    F = torch.empty(*batch, M, N, device=device)
    epi = epifuse.EpilogueArguments(BIAS_RELU_TWO_OUTPUTS, alpha=2.0, bias=bias, D=D, F=F)
    return epifuse.GemmArguments(A, B, epilogue=epi, precision="highest")


def run_exact(k, args):
    assert k.supports(args), k.supports(args)
    for dest in args.outputs.values():
        dest.fill_(float("nan"))  # poison: every element must be written
    k.run(args)
    for name, ref in reference_outputs(args).items():
        out = args.outputs[name]
        assert torch.equal(out, ref.to(out.dtype)), (k, name, (out.double() - ref).abs().max())


@pytest.mark.parametrize("M,N,K,block_k,split_k", [
    (16, 32, 128, 16, 2),    # whole tiles, K split evenly
    (40, 70, 300, 32, 3),    # ragged M, N and K (the last K tile is partial)
    (33, 50, 256, 32, 4),    # ragged M and N, whole K tiles
    (24, 48, 208, 16, 4),    # 13 K tiles: shares of 3, 3, 3 and 4
])
def test_bias_activation_two_outputs_exact(M, N, K, block_k, split_k, device):
    run_exact(kernel(block_k=block_k, split_k=split_k), bias_relu_args(M, N, K, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_input_dtypes(dtype, device):
    if dtype == torch.float8_e4m3fn and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    A = integer_tensor(24, 200, device=device, dtype=dtype)
    B = integer_tensor(200, 40, low=-1, high=2, device=device, dtype=dtype)
    D = torch.empty(24, 40, device=device)
    scale = integer_tensor(40, device=device, dtype=torch.float32)
    epi = epifuse.EpilogueArguments("def epi(accum, scale):\n    D = accum * scale\n    return D\n",
                                    scale=scale, D=D)
    args = epifuse.GemmArguments(A, B, epilogue=epi, precision="highest")
    run_exact(kernel(block_k=32, split_k=3), args)   # 32 deep: int8 and fp8 MMAs need it on GPUs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_listed_byte_configs_exact(dtype):
    """The configs kernel_statuses lists for one-byte inputs (128-deep K tiles), each run on a
    ragged problem whose K splits into shares of whole and partial tiles."""
    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    A = integer_tensor(100, 1200, device="cuda", dtype=dtype)
    B = integer_tensor(1200, 200, low=-1, high=2, device="cuda", dtype=dtype)
    scale = integer_tensor(200, device="cuda", dtype=torch.float32)
    epi = epifuse.EpilogueArguments("def epi(accum, scale):\n    D = accum * scale\n    return D\n",
                                    scale=scale, D=torch.empty(100, 200, device="cuda"))
    args = epifuse.GemmArguments(A, B, epilogue=epi)
    listed = split_k_candidates(args)
    assert listed and all(k.config.block_k == 128 for k in listed)
    for k in listed:
        run_exact(k, args)


def test_batched_with_transposed_b(device):
    A = integer_tensor(2, 20, 130, device=device)
    B = integer_tensor(2, 36, 130, low=-1, high=2, device=device).transpose(1, 2)
    C = integer_tensor(2, 20, 36, device=device, dtype=torch.float32)
    D = torch.empty(2, 20, 36, device=device)
    epi = epifuse.EpilogueArguments("def epi(accum, C):\n    D = accum - C\n    return D\n", C=C, D=D)
    run_exact(kernel(split_k=2), epifuse.GemmArguments(A, B, epilogue=epi))


@pytest.mark.parametrize("deterministic", [False, True])
def test_row_sum_and_column_max(deterministic, device):
    A = integer_tensor(40, 200, device=device)
    B = integer_tensor(200, 70, low=-1, high=2, device=device)
    bias = integer_tensor(70, device=device, dtype=torch.float32)
    D = torch.empty(40, 70, device=device)
    r, c = torch.empty(40, device=device), torch.empty(70, device=device)
    epi = epifuse.EpilogueArguments(ROW_SUM_COLUMN_MAX, deterministic=deterministic,
                                    bias=bias, D=D, r=r, c=c)
    run_exact(kernel(block_k=16, split_k=3), epifuse.GemmArguments(A, B, epilogue=epi))


def test_listed_config_with_mean_amax_and_accumulate(device):
    A = integer_tensor(70, 256, device=device)
    B = integer_tensor(256, 40, low=-1, high=2, device=device)
    mean, peak = integer_tensor(70, device=device, dtype=torch.float32), torch.zeros(40, device=device)
    src = "def epi(accum):\n    m = mean(accum, dim=1)\n    p = amax(accum, dim=0)\n    return m, p\n"
    epi = epifuse.EpilogueArguments(src, accumulate=True, m=mean, p=peak)
    args = epifuse.GemmArguments(A, B, epilogue=epi)
    k = split_k_candidates(args)[0]   # as kernel_statuses lists it (32x32x32, split in two, on CPU)
    before = mean.clone()
    k.run(args)
    refs = reference_outputs(args)
    assert rel_error(mean, before + refs["m"]) < 1e-6
    assert torch.equal(peak, torch.maximum(torch.zeros(40, device=device), refs["p"].float()))


def test_running_twice_on_new_data_leaves_the_counters_at_zero(device):
    k, args = kernel(split_k=3), bias_relu_args(40, 70, 300, device)
    for _ in range(2):
        run_exact(k, args)
        plan = k.plan(args)
        partials, counters = plan.argument("ws_ptr"), plan.argument("counter_ptr")
        assert partials.shape == (3 * 5, 3, 16, 16) and counters.shape == (3 * 5,)
        assert torch.count_nonzero(counters) == 0
        args.A.copy_(integer_tensor(*args.A.shape, device=device))   # the same plan on new inputs


@pytest.mark.slow   # one of the longest: the README's run leaves it to -m slow (CI runs it)
def test_bitwise_deterministic_on_random_inputs(device):
    first = bias_relu_args(40, 70, 300, device)
    first.A.copy_(torch.randn(40, 300, device=device))
    first.B.copy_(torch.randn(300, 70, device=device))
    results = []
    for args in (first, epifuse.GemmArguments(first.A, first.B, epilogue=first.epilogue)):
        k = kernel(split_k=4)   # new arguments, a new kernel: a new plan and workspace
        k.run(args)
        k.run(args)
        results.append(args.outputs["F"].clone())
        assert rel_error(args.outputs["F"], reference_outputs(args)["F"]) < 1e-6
    assert torch.equal(results[0], results[1])


@pytest.fixture
def shuffled_programs(monkeypatch):
    """Run the interpreter's programs in a random order: any program of a tile may be the last."""
    if not interpreter_requested():
        pytest.skip("needs Triton's interpreter")
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    order = {}

    def shuffled_dim(nx, ny, nz):
        cells = list(itertools.product(range(nx), range(ny), range(nz)))
        order.clear()
        order.update(zip(cells, random.Random(torch.randint(1 << 30, ()).item()).sample(cells, len(cells))))
        set_dim(nx, ny, nz)

    monkeypatch.setattr(builder, "set_grid_dim", shuffled_dim)
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_idx(*order[(x, y, z)]))


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_result_does_not_depend_on_which_program_ends_last(shuffled_programs):
    args = bias_relu_args(40, 70, 300, "cpu")
    args.A.copy_(torch.randn(40, 300))
    k = kernel(block_k=16, split_k=4)
    results = []
    for _ in range(3):
        k.run(args)
        results.append(args.outputs["F"].clone())
        assert torch.count_nonzero(k.plan(args).argument("counter_ptr")) == 0
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    assert rel_error(results[0], reference_outputs(args)["F"]) < 1e-6


def test_unsupported_cases_say_why(device):
    k = kernel(block_k=32, split_k=4)
    short = bias_relu_args(32, 32, 255, device)
    assert not k.supports(short) and "K >= 256" in k.supports(short).reason
    assert k.supports(bias_relu_args(32, 32, 256, device))
    assert "compute capability 75" in k.supports(bias_relu_args(32, 32, 256, device), cc=75).reason
    A = torch.randint(0, 3, (32, 256), dtype=torch.uint8, device=device)
    B = torch.randint(0, 3, (256, 32), dtype=torch.uint8, device=device)
    D = torch.empty(32, 32, device=device)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def epi(accum):\n    D = accum\n    return D\n", D=D))
    assert "uint8" in k.supports(args).reason


def test_listed_after_the_tiled_kernel_under_the_interpreter():
    if not interpreter_requested():
        pytest.skip("needs Triton's interpreter")
    args = bias_relu_args(64, 64, 256, "cpu")
    names = [k.name for k, status in epifuse.kernel_statuses(args) if status.ok]
    assert "triton_splitk" in names and names[0] != "triton_splitk"
    assert names.index("triton_tiled") < names.index("triton_splitk")


def test_cheap_model_prefers_split_k_only_on_small_grids_with_long_k():
    def args_of(M, N, K):   # broadcast views: the shapes without the memory
        A = torch.zeros(1, dtype=torch.float16).expand(M, K)
        B = torch.zeros(1, dtype=torch.float16).expand(K, N)
        epi = epifuse.EpilogueArguments("def epi(accum):\n    s = sum(accum)\n    return s\n",
                                        s=torch.empty(1))
        return epifuse.GemmArguments(A, B, epilogue=epi)
    assert select.split_k_first(args_of(128, 8192, 8192), sms=132)
    assert not select.split_k_first(args_of(128, 8192, 1024), sms=132)      # K too short
    assert not select.split_k_first(args_of(4096, 4096, 8192), sms=132)     # 1024 tiles fill the GPU
    # the 64-row ping-pong is offered wherever the 128x128 tiles leave SMs idle, K short or long
    assert target.few_tiles(args_of(128, 8192, 1024), sms=132)
    assert target.few_tiles(args_of(256, 8320, 64), sms=132)          # 2 x 65 = 130 tiles
    assert not target.few_tiles(args_of(256, 8448, 64), sms=132)      # 2 x 66 = 132: every SM has one
    assert not target.leaves_sms_idle(args_of(128, 8192, 8192))       # a CPU has no SMs to leave idle
    assert not select.split_k_first(args_of(128, 8192, 8192))


@pytest.mark.gpu
def test_s4_shape_on_the_gpu(device):
    M, N, K = 128, 8192, 8192
    A = integer_tensor(M, K, device=device)
    B = integer_tensor(K, N, low=-1, high=2, device=device)
    bias = integer_tensor(N, device=device, dtype=torch.float32)
    D, r, c = torch.empty(M, N, device=device), torch.empty(M, device=device), torch.empty(N, device=device)
    epi = epifuse.EpilogueArguments(ROW_SUM_COLUMN_MAX, bias=bias, D=D, r=r, c=c)
    args = epifuse.GemmArguments(A, B, epilogue=epi)
    statuses = epifuse.kernel_statuses(args)
    kernels = [k for k, status in statuses if status.ok and k.name == "triton_splitk"]
    # the untimed order on a small grid with a long K: split-K first, after the 64-row
    # ping-pong where the GPU runs Gluon (test_gluon.test_small_grids_take_64_row_tiles_first)
    others = [k for k in epifuse.get_kernels(args) if not (k.name == "gluon_pingpong" and k.config.block_m == 64)]
    assert kernels and others[0].name == "triton_splitk", statuses
    refs = reference_outputs(args)
    for k in kernels:
        for _ in range(2):
            for dest in args.outputs.values():
                dest.fill_(float("nan"))
            k.run(args)
            torch.cuda.synchronize()
            assert torch.equal(D, refs["D"].float()) and torch.equal(c, refs["c"].float()), k
            assert rel_error(r, refs["r"]) < 1e-6, k
            assert torch.count_nonzero(k.plan(args).argument("counter_ptr")) == 0, k
    # random inputs: bitwise repeatable, and a CUDA graph replays with the counters it left
    A.copy_(torch.randn(M, K, device=device))
    k = kernels[0]
    k.run(args)
    first = D.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.run(args)
    for _ in range(3):
        D.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(D, first)
    assert rel_error(D, reference_outputs(args)["D"]) < 1e-5
