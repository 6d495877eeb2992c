"""GPU checks at realistic sizes (marker `gpu`): run with `pytest -m gpu` on the GPU machine.

Integer-valued inputs are checked exactly (bf16 and fp16 outputs included: on the GPU the
conversions round to nearest even); random inputs by relative error against float64.
"""
import math

import pytest
import torch

import epifuse
from epifuse.ops import OPS
from helpers import integer_tensor, reference_outputs, rel_error
from op_cases import ELEMENTWISE, source_for

pytestmark = pytest.mark.gpu

SIZES = [(1024, 1024, 1024), (1000, 744, 520), (64, 4096, 2048)]


def _run(A, B, src, **tensors):
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, **tensors))
    kernel = epifuse.get_kernels(args)[0]
    assert kernel.name != "reference", epifuse.kernel_statuses(args)
    for t in args.outputs.values():
        t.fill_(float("nan"))
    kernel.run(args)
    torch.cuda.synchronize()
    return args, reference_outputs(args)


@pytest.mark.parametrize("M,N,K", SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exact_multi_output(M, N, K, dtype):
    A = integer_tensor(M, K, dtype=dtype, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, dtype=dtype, device="cuda")
    C = integer_tensor(M, N, dtype=torch.float32, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    src = ("def epi(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
           "    D = clamp(relu(F), 0.0, 200.0)\n    return D, F\n")
    D = torch.empty(M, N, device="cuda", dtype=dtype)
    F = torch.empty(M, N, device="cuda", dtype=torch.float32)
    args, refs = _run(A, B, src, alpha=2.0, C=C, bias=bias, D=D, F=F)
    assert torch.equal(F, refs["F"].float())
    assert torch.equal(D, refs["D"].to(dtype))


# Ops whose result jumps where accum crosses C or 0: on random floats the GPU's fp32 accum and
# the float64 one fall on different sides now and then (eq failed so on 2026-11-23), so they
# run on integers, where both are exact and the check is equality.
DISCONTINUOUS = {n for n in ELEMENTWISE if OPS[n].kind in ("compare", "logical")} | {"sign", "where"}


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_every_op_large(name):
    M, N, K = 512, 384, 256
    D = torch.empty(M, N, device="cuda")
    if name in DISCONTINUOUS:
        A = integer_tensor(M, K, device="cuda")
        B = integer_tensor(K, N, low=-1, high=2, device="cuda")
        C = integer_tensor(M, N, low=-6, high=7, dtype=torch.float32, device="cuda")
        args, refs = _run(A, B, source_for(name), C=C, D=D)
        assert torch.equal(D.double(), refs["D"]), name
        return
    A = torch.randn(M, K, device="cuda", dtype=torch.float16) / math.sqrt(K)
    B = torch.randn(K, N, device="cuda", dtype=torch.float16)
    C = torch.rand(M, N, device="cuda") + 0.5
    args, refs = _run(A, B, source_for(name), C=C, D=D)
    tol = 2e-3 if name == "to" else 2e-5
    assert rel_error(D, refs["D"]) < tol, (name, rel_error(D, refs["D"]))
    assert name in OPS


def test_log_of_clamped_values_large():
    """The special-case-free log on the GPU (where its multiply-adds fuse), 2**18 values."""
    from test_kernels import _log_of_clamped_values
    _log_of_clamped_values("cuda", 512, 512)


def test_log1p_of_a_bounded_excess_on_the_gpu():
    """_log1p_of_excess compiled for the GPU (its multiply-adds fused), within an ulp or two."""
    from test_kernels import test_log1p_of_a_bounded_excess_within_an_ulp
    test_log1p_of_a_bounded_excess_within_an_ulp("cuda")


def test_batched_roles_large():
    L, M, N, K = 3, 640, 320, 256
    A = integer_tensor(L, M, K, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, device="cuda")
    row = integer_tensor(L, 1, N, dtype=torch.float32, device="cuda")
    col = integer_tensor(M, 1, dtype=torch.float32, device="cuda")
    per_batch = integer_tensor(L, 1, 1, dtype=torch.float32, device="cuda")
    D = torch.empty(L, M, N, device="cuda")
    src = "def epi(accum, row, col, s):\n    D = accum * s + row - col\n    return D\n"
    args, refs = _run(A, B, src, row=row, col=col, s=per_batch, D=D)
    assert torch.equal(D, refs["D"].float())


def test_fp32_inputs_tf32_and_highest():
    M, N, K = 768, 512, 1024
    A, B = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda") / math.sqrt(K)
    ref = (A.double() @ B.double())
    tf32 = epifuse.gemm(A, B)
    full = epifuse.gemm(A, B, precision="highest")
    assert rel_error(full, ref) < 1e-5
    assert rel_error(tf32, ref) < 5e-3


def test_strided_views_large():
    M, N, K = 1536, 1024, 768
    A = integer_tensor(K, M, device="cuda").t()
    B = integer_tensor(N, K, low=-1, high=2, device="cuda").t()
    C = integer_tensor(2 * M, N, dtype=torch.float32, device="cuda")[::2]
    D = torch.empty(N, M, device="cuda").t()
    args, refs = _run(A, B, "def epi(accum, C):\n    D = accum - C\n    return D\n", C=C, D=D)
    assert torch.equal(D, refs["D"].float())


@pytest.mark.parametrize("kernel_index", [0, 1, -2])
def test_repeated_runs_take_the_direct_launch_and_see_new_data(kernel_index):
    """The second and later kernel.run(args) calls skip Triton's argument binding (a direct
    launch of the compiled kernel); each must still read the operands' current contents and
    write every output, including on a side stream."""
    M, N, K = 384, 512, 256
    A = integer_tensor(M, K, dtype=torch.float16, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.float16, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    D = torch.empty(M, N, device="cuda", dtype=torch.float32)
    F = torch.empty(M, N, device="cuda", dtype=torch.float16)
    src = "def epi(accum, bias):\n    F = accum + bias\n    D = relu(F) * 2.0\n    return D, F\n"
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, bias=bias, D=D, F=F))
    kernel = epifuse.get_kernels(args)[kernel_index]
    assert kernel.name != "reference"
    stream = torch.cuda.Stream()
    for step in range(4):
        A.copy_(integer_tensor(M, K, dtype=torch.float16, device="cuda"))
        bias.copy_(integer_tensor(N, dtype=torch.float32, device="cuda"))
        D.fill_(float("nan"))
        F.fill_(float("nan"))
        stream.wait_stream(torch.cuda.current_stream())   # the copies and fills above
        with torch.cuda.stream(stream if step % 2 else torch.cuda.current_stream()):
            kernel.run(args)
        torch.cuda.synchronize()
        expected = reference_outputs(args)
        assert torch.equal(D.double(), expected["D"]), (kernel, step)
        assert torch.equal(F.double(), expected["F"]), (kernel, step)
    assert args._plans[kernel].fast is not None, "the direct launch was not taken"


def test_repeated_gemm_calls_reuse_the_launch_with_new_tensors():
    """epifuse.gemm's kept launch (epifuse.callsite) on the GPU kernels: new inputs, fresh
    outputs, a side stream, every call exact."""
    from epifuse.runtime import callsite
    src = "def epi(accum, bias, C):\n    F = accum + bias\n    D = relu(F) + C\n    return D, F\n"
    M, N, K = 640, 384, 512
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.bfloat16, device="cuda")
    hits = callsite.HITS[0]
    stream = torch.cuda.Stream()
    for step in range(5):
        A = integer_tensor(M, K, dtype=torch.bfloat16, device="cuda")
        bias = integer_tensor(N, dtype=torch.float32, device="cuda")
        C = integer_tensor(M, N, dtype=torch.float16, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())   # A, bias, C were made there
        with torch.cuda.stream(stream if step % 2 else torch.cuda.current_stream()):
            D, F = epifuse.gemm(A, B, src, bias=bias, C=C)
        torch.cuda.synchronize()
        accum = A.double() @ B.double()
        assert torch.equal(F.double(), accum + bias.double()), step
        assert torch.equal(D.double(), torch.relu(accum + bias.double()) + C.double()), step
    assert callsite.HITS[0] - hits == 3   # the first call on each of the two streams is a full one


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_gpu_that_is_not_the_current_one():
    """Tensors on cuda:1 while cuda:0 is current: every kernel compiles, loads and launches on
    cuda:1 (first call, kept launches, kernel.run, a reduction), and the current device stays."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    A = integer_tensor(1000, 520, dtype=torch.float16, device=dev)
    B = integer_tensor(520, 744, low=-1, high=2, dtype=torch.float16, device=dev)
    bias = integer_tensor(744, dtype=torch.float32, device=dev)
    src = "def epi(accum, bias):\n    D = relu(accum + bias)\n    r = sum(D, dim=1)\n    return D, r\n"
    expected = torch.relu(A.double() @ B.double() + bias.double())
    for _ in range(3):  # the first call, then kept launches
        D, r = epifuse.gemm(A, B, src, bias=bias, out_dtype=torch.float32)
        assert D.device == dev and torch.equal(D.double(), expected)
        assert rel_error(r, expected.sum(dim=1)) < 1e-6
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def epi(accum, bias):\n    D = relu(accum + bias)\n    return D\n", bias=bias,
        D=torch.empty(1000, 744, device=dev, dtype=torch.float32)))
    for kernel in epifuse.get_kernels(args):
        if kernel.name == "reference":
            continue
        for _ in range(2):
            args.outputs["D"].fill_(float("nan"))
            kernel.run(args)
            torch.cuda.synchronize(dev)
            assert torch.equal(args.outputs["D"].double(), expected), kernel
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("dims", ["", "dim=1", "mean"])
@pytest.mark.parametrize("summand,group", [("(1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999))", 8),
                                           ("log(clamp(f, 2.0, 2.0 ** 20)) + f", 4),
                                           ("-log(clamp(f, 2.0 ** -20, 0.75))", 4)])
def test_summed_logs_large(summand, group, dims):
    """Sums of logs taken as logs of products (rules.LogSum: shifted, direct above 1 and below)
    in every kernel, the Gluon ones included, on ragged tiles, against float64, in both
    reduction modes."""
    from test_reductions import _check_summed_logs
    names = _check_summed_logs(summand, group, dims, "cuda", 520, (False, True), M=1000, N=744)
    assert any(name.startswith("gluon_") for name in names), names


def test_negation_flips_the_sign_of_zero_large():
    from test_kernels import test_negation_flips_the_sign_of_zero
    test_negation_flips_the_sign_of_zero("cuda")


def test_summed_logs_near_one_keep_their_digits_large():
    from test_reductions import test_summed_logs_near_one_keep_their_digits
    test_summed_logs_near_one_keep_their_digits("cuda")


# ---- kept launches shared by threads, streams and graphs; stand-ins; arguments that changed ------

SHARED_SRC = ("def epi(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n    m = max(D, dim=0)\n"
              "    return D, r, m\n")


@pytest.mark.parametrize("kernel", ["chosen", "triton_splitk"])
@pytest.mark.parametrize("streams", ["one stream", "two streams"])
def test_threads_and_streams_share_kept_launches(kernel, streams, monkeypatch):
    """Eight threads calling one signature at once, on one stream and on two CUDA streams (a
    site each), with reductions (an fp16 sum through a work buffer, a max through partials) and
    with split-K's kept workspace: every result exact, the kept launches used."""
    from epifuse import api
    from epifuse.runtime import callsite
    if kernel != "chosen":
        real = api.choose_kernel
        monkeypatch.setattr(api, "choose_kernel", lambda args: next(
            (k for k in api.get_kernels(args) if k.name == kernel), None) or real(args))
    import threading
    served, lock, call = [0], threading.Lock(), callsite.Site.call

    def counted(site, *args):
        with lock:
            served[0] += 1
        return call(site, *args)
    monkeypatch.setattr(callsite.Site, "call", counted)
    callsite.clear()
    from test_callsite import threaded_calls
    chosen = [None] if streams == "one stream" else [torch.cuda.Stream(), torch.cuda.Stream()]
    errors = threaded_calls("cuda", 8, 4, lambda i: chosen[i % len(chosen)], M=256, N=384, K=1024)
    assert errors == []
    assert served[0] >= 32 - 8   # at most each thread's first call a full one


def test_a_call_captured_in_a_cuda_graph_shares_nothing_with_kept_launches():
    """Calls of a kept signature before, into and after a CUDA graph capture: the captured call
    takes the full path, so its replays (interleaved with eager calls on the same stream)
    and the eager calls each compute their own inputs exactly."""
    from epifuse.runtime import callsite
    M, N, K = 256, 384, 512
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.float16, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")

    def call(A):
        return epifuse.gemm(A, B, SHARED_SRC, bias=bias, r=torch.empty(M, dtype=torch.float16, device="cuda"),
                            out_dtype=torch.float32)

    def check(A, outs):
        expected = A.double() @ B.double() + bias.double()
        assert torch.equal(outs[0].double(), expected)
        assert torch.equal(outs[1].double(), expected.sum(1).half().double())
        assert torch.equal(outs[2].double(), expected.amax(0))
    for _ in range(2):
        A = integer_tensor(M, K, dtype=torch.float16, device="cuda")
        check(A, call(A))
    static_A = integer_tensor(M, K, dtype=torch.float16, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(static_A)   # warm-up on the capture stream: a site of its own
    torch.cuda.current_stream().wait_stream(stream)
    hits = callsite.HITS[0]
    with torch.cuda.graph(graph, stream=stream):
        captured = call(static_A)
    assert callsite.HITS[0] == hits
    for _ in range(3):
        static_A.copy_(integer_tensor(M, K, dtype=torch.float16, device="cuda"))
        graph.replay()
        with torch.cuda.stream(stream):
            A = integer_tensor(M, K, dtype=torch.float16, device="cuda")
            eager = call(A)
        torch.cuda.synchronize()
        check(static_A, captured)
        check(A, eager)


@pytest.mark.parametrize("unsafe_data_ptr", [True, False], ids=["data-ptr-allowed", "data-ptr-refused"])
def test_kernels_compiled_from_fake_tensors_run_on_real_ones(unsafe_data_ptr):
    """GemmArguments of fake CUDA tensors: every kernel get_kernels offers compiles (Triton
    specializes it on the fakes' dtypes and storage offsets), and runs exactly on the real
    tensors of the same metadata, TMA kernels included."""
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    M, N, K = 512, 384, 256
    S = integer_tensor(M * N + N + 1, dtype=torch.float32, device="cuda")
    real = {"A": integer_tensor(M, K, dtype=torch.float16, device="cuda"),
            "B": integer_tensor(N, K, low=-1, high=2, dtype=torch.float16, device="cuda").t(),
            "bias": integer_tensor(N, dtype=torch.float32, device="cuda"),
            "C": S[1:1 + M * N].view(M, N), "D": torch.empty(M, N, dtype=torch.float16, device="cuda"),
            "r": torch.empty(M, device="cuda"), "m": S[1 + M * N:]}
    src = "def epi(accum, bias, C):\n    D = accum + bias + C\n    r = sum(D, dim=1)\n    m = max(D, dim=0)\n    return D, r, m\n"
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=unsafe_data_ptr):
        mode = FakeTensorMode()

    def args_of(t):
        return epifuse.GemmArguments(t["A"], t["B"], epilogue=epifuse.EpilogueArguments(
            src, bias=t["bias"], C=t["C"], D=t["D"], r=t["r"], m=t["m"]))
    planned = args_of({name: mode.from_tensor(t) for name, t in real.items()})
    real_args = args_of(real)
    assert [(repr(k), s.ok) for k, s in epifuse.kernel_statuses(planned)] == \
        [(repr(k), s.ok) for k, s in epifuse.kernel_statuses(real_args)]
    kernels = epifuse.get_kernels(planned)
    assert len(kernels) > 1
    for kernel in kernels:
        kernel.compile(planned)
    for kernel in kernels:
        for name in ("D", "r"):
            real_args.outputs[name].fill_(float("nan"))
        real["m"].fill_(float("nan"))
        kernel.run(real_args)
        torch.cuda.synchronize()
        expected = reference_outputs(real_args)
        for name, want in expected.items():
            assert torch.equal(real_args.outputs[name].double(), want.to(real_args.outputs[name].dtype).double()), \
                (kernel, name)


@pytest.mark.parametrize("kernel_index", [0, 1, -2])
def test_a_resized_tensor_stops_the_direct_launch(kernel_index):
    """After direct launches (kernel.run on the same arguments), a resize_ of an output is
    refused with nothing written, and a tensor given new memory is checked again and read
    there."""
    from epifuse.errors import ShapeError
    M, N, K = 384, 512, 256
    A = integer_tensor(M, K, dtype=torch.float16, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.float16, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    D = torch.empty(M, N, device="cuda")
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def epi(accum, bias):\n    D = accum + bias\n    return D\n", bias=bias, D=D))
    kernel = epifuse.get_kernels(args)[kernel_index]
    assert kernel.name != "reference"
    for _ in range(3):
        kernel.run(args)
    assert args._plans[kernel].fast is not None
    size = A.untyped_storage().nbytes()
    A.untyped_storage().resize_(0)
    A.untyped_storage().resize_(size)
    A.copy_(integer_tensor(M, K, dtype=torch.float16, device="cuda"))
    D.fill_(float("nan"))
    kernel.run(args)
    torch.cuda.synchronize()
    assert torch.equal(D.double(), A.double() @ B.double() + bias.double())
    guard = torch.full((M * N,), 7.0, device="cuda")
    D.resize_(M // 2, N)
    D.set_(guard.untyped_storage(), 0, (M // 2, N), (N, 1))
    with pytest.raises(ShapeError, match="has shape"):
        kernel.run(args)
    torch.cuda.synchronize()
    assert bool((guard == 7.0).all())


# Conversions bit for bit in every family (test_dtypes.py's checks, on the GPU): K long enough
# for split-K, one tile, so each family that runs it is listed by get_kernels.
STORED = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int32, torch.int8, torch.uint8]


def _families_expected():
    names = {"triton_tiled", "triton_persistent", "triton_splitk", "triton_grouped"}
    if torch.cuda.get_device_capability() == (9, 0):
        names.add("gluon_pingpong")
    return names


@pytest.mark.parametrize("out_dtype", STORED, ids=str)
def test_stores_round_and_saturate_bit_for_bit_in_every_family(out_dtype):
    from test_dtypes import check_stores
    ran = check_stores(out_dtype, "cuda", K=2048)
    assert _families_expected() <= ran, ran


@pytest.mark.parametrize("out_dtype", [torch.int8, torch.int32, torch.uint8], ids=str)
def test_integer_product_ties_round_to_even_in_every_family(out_dtype):
    """(accum + C) * 0.05 at ties: fma(x, s, 1.5 * 2**23) rounded 10.5 to 11 on an H100."""
    from test_dtypes import check_integer_product_ties
    ran = check_integer_product_ties(out_dtype, "cuda", K=2048)
    assert _families_expected() <= ran, ran


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_rounding_through_a_dtype_is_torchs_in_every_family(name):
    from test_dtypes import check_round_through
    ran = check_round_through(name, "cuda", K=2048)
    assert _families_expected() <= ran, ran


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_operands_load_every_value_exactly_in_every_family(in_dtype):
    from test_dtypes import check_loads
    ran = check_loads(in_dtype, "cuda", K=2048)
    assert _families_expected() <= ran, ran


def test_signed_zeros_keep_their_sign_large():
    from test_kernels import test_signed_zeros_keep_their_sign
    cases = [("D = X", "number"), ("D = X", "scalar"), ("D = X", "row"), ("D = accum + 1.0 / X", "number"),
             ("D = 1.0 / tanh(X)", "tile"), ("D = 1.0 / (X * -1e-40)", "ones")]
    for source, operand in cases:
        for out_dtype in (torch.float32, torch.bfloat16):
            test_signed_zeros_keep_their_sign(source, operand, out_dtype, "cuda")


@pytest.mark.parametrize("unsafe_data_ptr", [True, False], ids=["data-ptr-allowed", "data-ptr-refused"])
def test_grouped_kernels_compiled_from_fake_tensors_run_on_real_groups(unsafe_data_ptr):
    """GroupedGemmArguments of fake CUDA tensors (mixture-of-experts sizes, an empty group, one
    operand 2 bytes past a 16-byte boundary): every grouped kernel offered compiles, from the
    source the real groups get, and runs exactly on them; run on the fakes is refused."""
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    src = ("def epi(accum, alpha, bias, C):\n    F = accum * alpha + bias + C\n    D = relu(F)\n"
           "    r = sum(F, dim=1)\n    return D, F, r\n")
    N, K = 384, 256
    groups = []
    for i, M in enumerate([0, 129, 777, 64]):
        S = integer_tensor(M * N + 8, dtype=torch.float16, device="cuda")
        start = 1 if i == 2 else 8
        groups.append({"A": integer_tensor(M, K, dtype=torch.float16, device="cuda"),
                       "B": integer_tensor(N, K, low=-1, high=2, dtype=torch.float16, device="cuda").t(),
                       "bias": integer_tensor(N, dtype=torch.float32, device="cuda"),
                       "C": S[start:start + M * N].view(M, N),
                       "D": torch.empty(M, N, dtype=torch.float16, device="cuda"),
                       "F": torch.empty(M, N, device="cuda"), "r": torch.empty(M, device="cuda")})
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=unsafe_data_ptr):
        mode = FakeTensorMode()

    def grouped_of(gs):
        return epifuse.GroupedGemmArguments([epifuse.GemmArguments(g["A"], g["B"], epilogue=epifuse.EpilogueArguments(
            src, alpha=2.0, bias=g["bias"], C=g["C"], D=g["D"], F=g["F"], r=g["r"]), precision="highest") for g in gs])
    planned = grouped_of([{name: mode.from_tensor(t) for name, t in g.items()} for g in groups])
    real_args = grouped_of(groups)
    assert [(repr(k), s.ok) for k, s in epifuse.kernel_statuses(planned)] == \
        [(repr(k), s.ok) for k, s in epifuse.kernel_statuses(real_args)]
    kernels = epifuse.get_kernels(planned)
    assert kernels[0].name == "triton_grouped", epifuse.kernel_statuses(planned)
    for kernel in kernels:
        kernel.compile(planned)
    expected = [reference_outputs(p) for p in real_args]
    for kernel in kernels:
        for p in real_args:
            for dest in p.outputs.values():
                dest.fill_(float("nan"))
        kernel.run(real_args)
        torch.cuda.synchronize()
        for i, (p, ref) in enumerate(zip(real_args, expected)):
            for name, want in ref.items():
                assert torch.equal(p.outputs[name], want.to(p.outputs[name].dtype)), (kernel, i, name)
    for kernel in kernels[:-1]:
        assert kernel.plan(planned).kernel is kernel.plan(real_args).kernel, kernel
        with pytest.raises(epifuse.EpilogueError, match="fake or meta tensors, which have no memory"):
            kernel.run(planned)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_logsumexp_large_in_every_triton_kernel(dtype):
    """The log-sum-exp reduction (issue 36) at a size of many tiles each way, with values past
    exp's fp32 range, in every generated kernel that takes it (the Gluon ones refuse it)."""
    from helpers import check_reductions
    M, N, K = 1000, 5000, 256
    A = (torch.randn(M, K, device="cuda") * 8).to(dtype)
    B = torch.randn(K, N, device="cuda").to(dtype)
    src = "def epi(accum, bias):\n    x = accum + bias\n    r = logsumexp(x, dim=1)\n    c = logsumexp(x, dim=0)\n    return r, c\n"
    bias = torch.randn(N, device="cuda", dtype=dtype)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        src, bias=bias, r=torch.empty(M, device="cuda"), c=torch.empty(N, device="cuda")))
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert kernels and not any(k.gluon for k in kernels)
    for kernel in kernels:
        kernel.run(args)
        assert torch.isfinite(args.outputs["r"]).all(), kernel
        check_reductions(args, "logsumexp")


def test_row_and_col_large_in_every_triton_kernel():
    """row() and col() (issue 36) at 3000 x 5000, exact (integer-valued), and a target pick, in
    every generated kernel that takes them (the Gluon ones refuse them)."""
    M, N, K = 3000, 5000, 64
    A = integer_tensor(M, K, device="cuda", dtype=torch.float16)
    B = integer_tensor(K, N, low=-1, high=2, device="cuda", dtype=torch.float16)
    target = torch.randint(0, N, (M, 1), device="cuda")
    src = ("def epi(accum, target):\n    D = row() * 5000.0 + col()\n"
           "    t = sum(where(col() == target, accum, 0.0), dim=1)\n    return D, t\n")
    D, t = torch.empty(M, N, device="cuda"), torch.empty(M, device="cuda")
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, target=target, D=D, t=t))
    expected = (torch.arange(M, device="cuda")[:, None] * 5000 + torch.arange(N, device="cuda")[None, :]).float()   # below 2**24: exact
    picked = (A.double() @ B.double()).gather(1, target)[:, 0].float()
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert kernels and not any(k.gluon for k in kernels)
    for kernel in kernels:
        D.fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(D, expected) and torch.equal(t, picked), kernel


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_planar_complex_large_in_every_config(dtype):
    """The planar complex kernel (issue 37) at a ragged size of many tiles, in every config it
    is tried with: integer-valued planes, so accum and alpha * accum + beta * C are exact (fp32
    planes multiply in tf32, which holds small integers exactly); D stored as a complex64
    tensor through its strided planes."""
    from epifuse.epilogues import LinearCombinationPlanarComplex
    M, N, K = 1000, 1240, 1500
    Ar, Ai = (integer_tensor(M, K, dtype=dtype, device="cuda") for _ in range(2))
    Br, Bi = (integer_tensor(K, N, dtype=dtype, device="cuda") for _ in range(2))
    C = torch.complex(*(integer_tensor(M, N, dtype=torch.float32, device="cuda") for _ in range(2)))
    D = torch.empty(M, N, dtype=torch.complex64, device="cuda")
    args = LinearCombinationPlanarComplex().arguments(Ar, Ai, Br, Bi, alpha=2 - 1j, beta=0.5j, C=C, D=D)
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert len(kernels) >= 2 and all(k.name == "triton_planar" for k in kernels), epifuse.kernel_statuses(args)
    accum = torch.complex(Ar.double(), Ai.double()) @ torch.complex(Br.double(), Bi.double())
    expected = ((2 - 1j) * accum + 0.5j * C.to(torch.complex128)).to(torch.complex64)
    _each_kernel_writes(kernels, args, D, expected)


def _each_kernel_writes(kernels, args, out, expected):
    """Every kernel of `kernels`, run on `args`, writes exactly `expected` into `out`."""
    for kernel in kernels:
        out.fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), kernel


def test_planar_complex_epilogue_that_rounds_against_complex128():
    """exp, abs, division and a complex sum over N on random planes, through
    epifuse.gemm_planar_complex (its chosen kernel), within fp32's rounding."""
    M, N, K = 777, 1030, 640
    Ar, Ai = (torch.randn(M, K, device="cuda") / 16 for _ in range(2))
    Br, Bi = (torch.randn(K, N, device="cuda") / 16 for _ in range(2))
    C = torch.complex(torch.rand(M, N, device="cuda") + 1, torch.rand(M, N, device="cuda"))
    src = ("def epi(accum, C, bias):\n    P = exp(accum) / C + bias\n    m = abs(accum)\n"
           "    s = sum(conj(accum) * C, dim=1)\n    return P, m, s\n")
    bias = torch.randn(N, device="cuda")
    P, m, s = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, src, C=C, bias=bias, precision="highest",
                                          out_dtype=torch.complex64)
    accum = torch.complex(Ar.double(), Ai.double()) @ torch.complex(Br.double(), Bi.double())
    c = C.to(torch.complex128)
    def parts(z):
        return torch.view_as_real(z.to(torch.complex128))
    assert rel_error(parts(P), parts(torch.exp(accum) / c + bias.double())) < 1e-5
    assert rel_error(m.double(), accum.abs()) < 1e-5
    assert rel_error(parts(s), parts((accum.conj() * c).sum(1))) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_large_in_every_config(dtype):
    """The gated kernel (issue 36) at a ragged LLaMA-like size in every config it is tried
    with: gate * up + bias of integer-valued inputs is exact (fp32 output)."""
    M, N, K = 1000, 1500, 1024
    A = integer_tensor(M, K, dtype=dtype, device="cuda")
    W = integer_tensor(K, 2 * N, low=-1, high=2, dtype=dtype, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    src = "def g(accum, bias):\n    gate, up = accum.chunk(2, dim=-1)\n    D = gate * up + bias\n    return D\n"
    D = torch.empty(M, N, device="cuda")
    args = epifuse.GemmArguments(A, W, epilogue=epifuse.EpilogueArguments(src, bias=bias, D=D))
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert len(kernels) >= 2 and all(k.name == "triton_gated" for k in kernels), epifuse.kernel_statuses(args)
    full = A.double() @ W.double()
    expected = (full[:, :N] * full[:, N:] + bias.double()).float()
    _each_kernel_writes(kernels, args, D, expected)


def test_swiglu_through_gemm_against_float64():
    M, N, K = 2048, 2752, 1024
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(K, 2 * N, device="cuda") / K ** 0.5).to(torch.bfloat16)
    src = "def swiglu(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = silu(gate) * up\n    return D\n"
    D = epifuse.gemm(x, w, src)
    full = x.double() @ w.double()
    expected = torch.nn.functional.silu(full[:, :N]) * full[:, N:]
    assert D.shape == (M, N) and rel_error(D, expected) < 8e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_cat_through_the_gated_kernel_against_float64(dtype):
    """RoPE on a q projection (issue 36): `x1, x2 = accum.chunk(2, dim=-1)` and
    `cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)` with (M, N/2) cos and (N/2,) sin, in
    the gated kernel at a ragged size (half width 2000 + 37): the output is B's full width,
    each half within the output dtype's rounding of the float64 result."""
    M, H, K = 1000, 2037, 1024
    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(K, 2 * H, device="cuda") / K ** 0.5).to(dtype)
    cos, sin = torch.randn(M, H, device="cuda"), torch.randn(H, device="cuda")
    src = ("def rope(accum, cos, sin):\n    x1, x2 = accum.chunk(2, dim=-1)\n"
           "    D = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)\n    return D\n")
    D = torch.empty(M, 2 * H, device="cuda", dtype=dtype)
    args = epifuse.GemmArguments(x, w, epilogue=epifuse.EpilogueArguments(src, cos=cos, sin=sin, D=D))
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert kernels and all(k.name == "triton_gated" for k in kernels), epifuse.kernel_statuses(args)
    x1, x2 = (x.double() @ w.double()).chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    for kernel in kernels:
        D.fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        assert rel_error(D, expected) < 8e-3, (kernel, rel_error(D, expected))
    assert epifuse.gemm(x, w, src, cos=cos, sin=sin).shape == (M, 2 * H)


def test_linear_cross_entropy_against_torch_at_a_real_vocab():
    """epifuse.linear_cross_entropy (issue 36) at 1024 tokens x 2048 hidden x 32000 vocab, bf16,
    with ignored tokens and label smoothing: the loss and the gradients of x, weight and bias
    against torch's F.cross_entropy(F.linear(...).float()) in float64."""
    tokens, hidden, vocab = 1024, 2048, 32000
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden, device="cuda") / hidden ** 0.5).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(vocab, device="cuda").to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    target[::7] = -100
    loss = epifuse.linear_cross_entropy(x, weight, target, bias=bias, label_smoothing=0.1)
    got = torch.autograd.grad(loss, (x, weight, bias))
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    want_loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(xd, wd, bd), target,
                                                  label_smoothing=0.1)
    want = torch.autograd.grad(want_loss, (xd, wd, bd))
    assert abs(loss.item() - want_loss.item()) < 1e-3 * want_loss.item()
    for g, w in zip(got, want):
        assert rel_error(g, w) < 2e-2


@pytest.mark.parametrize("N", [64, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True], ids=["mask", "row-flag"])
def test_conditional_stores_leave_every_other_element_as_it_was(N, dtype, per_row):
    """`D = where(keep > 0.5, accum + bias, D)` (issue 36) in every kernel that takes it on the
    GPU (the Gluon ones refuse it by name): the selected elements get the new value, every other
    keeps its bits, NaNs included. Integer-valued inputs in full fp32: exact."""
    M, K = 300, 96
    A = integer_tensor(M, K, dtype=torch.float32, device="cuda")
    B = integer_tensor(K, N, dtype=torch.float32, device="cuda")
    keep = (torch.rand(M, 1 if per_row else N, device="cuda") > 0.5).float()
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    D0 = torch.randn(M, N, device="cuda").to(dtype)
    D0[::7, ::5] = float("nan")
    source = "def update(accum, D, keep, bias):\n    D = where(keep > 0.5, accum + bias, D)\n    return D\n"
    want = torch.where(keep > 0.5, (A.double() @ B.double() + bias.double()).to(dtype), D0)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    D = D0.clone()
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(source, D=D, keep=keep, bias=bias),
                                 precision="highest")
    kernels = epifuse.get_kernels(args)
    assert len(kernels) >= 2 and not any(k.name.startswith("gluon") for k in kernels)
    for kernel in kernels:
        D.copy_(D0)
        kernel.run(args)
        torch.cuda.synchronize()
        assert torch.equal(D.view(bits), want.view(bits)), kernel


@pytest.mark.parametrize("a_dtype,b_dtype", [(torch.uint8, torch.uint8), (torch.uint8, torch.int8),
                                             (torch.int8, torch.uint8)], ids=str)
def test_uint8_gemms_exact_on_the_gpu(a_dtype, b_dtype):
    """Full-range uint8 through the int8 kernels (unsigned_inputs.py), B column-major as for
    cuBLASLt: exact while every value is below 2**24 (K = 250)."""
    M, N, K = 1000, 744, 250

    def full(shape, dtype):
        low, high = (0, 256) if dtype == torch.uint8 else (-128, 128)
        return torch.randint(low, high, shape, device="cuda").to(dtype)
    A, B = full((M, K), a_dtype), full((N, K), b_dtype).t()
    C = integer_tensor(M, N, dtype=torch.float32, device="cuda")
    exact = A.double() @ B.double()
    assert torch.equal(epifuse.gemm(A, B, out_dtype=torch.int32).double(), exact)
    D = epifuse.gemm(A, B, "def e(accum, C):\n    D = accum - C\n    return D\n", C=C)
    assert torch.equal(D.double(), exact - C.double())


@pytest.mark.parametrize("N", [8, 37, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_row_reductions_in_every_supporting_config(N, dtype):
    """A reduction over N that feeds later math (issue 36: a MoE router's softmax over N
    experts, a log-softmax, a max-shifted exp, a row normalization), in one kernel whose tile
    spans N: every generated kernel that takes it (the tiled and split-K ones; the persistent
    and Gluon ones refuse it by name), against float64; and epifuse.gemm's own choice. A
    wider N (600) runs as passes, also against float64."""
    M, K = 3000, 512
    gen = torch.Generator().manual_seed(36)
    A = torch.randn(M, K, generator=gen).to("cuda", dtype)
    B = (torch.randn(K, N, generator=gen) / math.sqrt(K)).to("cuda", dtype)
    bias = torch.randn(N, generator=gen).cuda()
    src = ("def epi(accum, bias):\n    z = accum + bias\n    P = softmax(z, dim=1)\n    L = log_softmax(z, dim=1)\n"
           "    m = max(z, dim=1)\n    E = exp(z - m)\n    R = z / sum(abs(z), dim=1)\n    return P, L, E, R, m\n")
    outputs = {name: torch.empty(M, N, device="cuda", dtype=dtype) for name in "PLER"}
    precision = "highest" if dtype == torch.float32 else "default"   # fp32 products, not tf32
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, bias=bias, m=torch.empty(M, device="cuda"),
                                                                          **outputs), precision=precision)
    z = A.double() @ B.double() + bias.double()
    expected = {"P": torch.softmax(z, 1), "L": torch.log_softmax(z, 1), "E": torch.exp(z - z.amax(1, keepdim=True)),
                "R": z / z.abs().sum(1, keepdim=True), "m": z.amax(1)}
    statuses = epifuse.kernel_statuses(args)
    kernels = [k for k, status in statuses if status.ok and k.name != "reference"]
    assert {k.name for k in kernels} >= {"triton_tiled"}, statuses
    assert all(not status for k, status in statuses if k.name == "triton_persistent" or getattr(k, "gluon", False))
    assert all(k.config.block_n >= N for k in kernels)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for kernel in kernels:
        for t in args.outputs.values():
            t.fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        for name, ref in expected.items():
            assert rel_error(args.outputs[name], ref) < tolerance, (kernel, name)
    P = epifuse.gemm(A, B, "def epi(accum, bias):\n    P = softmax(accum + bias, dim=-1)\n    return P\n", bias=bias,
                     precision=precision)
    assert rel_error(P, expected["P"]) < tolerance
    wide = (torch.randn(K, 600, generator=gen) / math.sqrt(K)).to("cuda", dtype)
    P = epifuse.gemm(A, wide, "def epi(accum):\n    P = softmax(accum, dim=-1)\n    return P\n", precision=precision)
    assert rel_error(P, torch.softmax(A.double() @ wide.double(), -1)) < tolerance
