"""Grouped GEMM: several problems of different M, N, K, one shared epilogue, one launch.

On CPU the grouped Triton kernel runs through the interpreter (32-wide tiles, so the sizes
below leave ragged edges in M, N and K); integer-valued inputs make results exact, checked
against the float64 reference of each group on its own.
"""
import pytest
import torch
import torch._functorch.config as functorch_config
from helpers import integer_tensor, reference_outputs, rel_error
from torch._subclasses.fake_tensor import FakeTensorMode

import epifuse
from epifuse.errors import EpilogueArgumentError, EpilogueError, ShapeError

SIZES = [(40, 24, 16), (17, 50, 33), (64, 8, 40), (1, 33, 64)]
BIAS_RELU_AUX = ("def epi(accum, alpha, bias):\n    F = accum * alpha + bias\n"
                 "    D = relu(F)\n    return D, F\n")


# CPU tensors run through the interpreter; on a GPU machine the same tests run on CUDA.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _tensors_on_device():
    with torch.device(DEVICE):   # factory calls below without device= land there too
        yield


def ints(*shape, device=DEVICE, dtype=torch.float16):
    return integer_tensor(*shape, device=device, dtype=dtype)


def problem(M, N, K, source, device=DEVICE, dtype=torch.float16, precision="highest",
            accumulator_type=None, **tensors):
    """A, B of integer values; every output (named with a shape and dtype) poisoned with NaN."""
    A, B = ints(M, K, device=device, dtype=dtype), ints(K, N, device=device, dtype=dtype)
    epi = epifuse.EpilogueArguments(source, **tensors)
    return epifuse.GemmArguments(A, B, epilogue=epi, precision=precision, accumulator_type=accumulator_type)


def bias_relu_aux(M, N, K, device=DEVICE, dtype=torch.float16, out_dtype=torch.float16):
    return problem(M, N, K, BIAS_RELU_AUX, device, dtype, alpha=2.0,
                   bias=ints(N, device=device, dtype=torch.float32),
                   D=torch.full((M, N), float("nan"), device=device, dtype=out_dtype),
                   F=torch.full((M, N), float("nan"), device=device))


def grouped_kernel(grouped):
    kernel = epifuse.get_kernels(grouped)[0]
    assert kernel.name == "triton_grouped", epifuse.kernel_statuses(grouped)
    return kernel


def run_exact(grouped):
    """Run the grouped Triton kernel; every output of every group equals its reference."""
    refs = [reference_outputs(p) for p in grouped]
    grouped_kernel(grouped).run(grouped)
    for i, (p, ref) in enumerate(zip(grouped, refs)):
        for name, expected in ref.items():
            out = p.outputs[name]
            assert torch.equal(out, expected.to(out.dtype)), (i, name, (out.double() - expected).abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bias_relu_two_outputs_ragged_groups(dtype):
    grouped = epifuse.GroupedGemmArguments([bias_relu_aux(M, N, K, dtype=dtype) for M, N, K in SIZES])
    run_exact(grouped)


def test_fp16_accumulator_groups():
    groups = [problem(M, N, K, BIAS_RELU_AUX, accumulator_type=torch.float16, alpha=2.0,
                      bias=ints(N, dtype=torch.float32), D=torch.full((M, N), float("nan"), dtype=torch.float16),
                      F=torch.full((M, N), float("nan"))) for M, N, K in SIZES]
    grouped = epifuse.GroupedGemmArguments(groups)
    assert grouped.accumulator_type == torch.float16
    run_exact(grouped)


def test_statuses_and_reference_fallback_agree():
    grouped = epifuse.GroupedGemmArguments([bias_relu_aux(M, N, K) for M, N, K in SIZES[:3]])
    statuses = epifuse.kernel_statuses(grouped)
    names = [k.name for k, _ in statuses]   # one Triton config in the interpreter, several on CUDA
    assert set(names[:-1]) == {"triton_grouped"} and names[-1] == "reference_grouped"
    assert all(s.ok for _, s in statuses)
    assert "3 groups in one launch" in statuses[0][1].reason
    reference = epifuse.get_kernels(grouped)[-1]
    reference.run(grouped)
    first = [{n: t.clone() for n, t in p.outputs.items()} for p in grouped]
    grouped_kernel(grouped).run(grouped)
    for p, outs in zip(grouped, first):
        for name, t in outs.items():
            assert torch.equal(p.outputs[name], t), name


def test_verify_and_compile():
    grouped = epifuse.GroupedGemmArguments([bias_relu_aux(M, N, K) for M, N, K in SIZES[:2]])
    kernel = grouped_kernel(grouped)
    kernel.compile(grouped)
    report = kernel.run(grouped, verify=True)
    assert report.ok and [c.name for c in report.checks] == ["group 0: D", "group 0: F",
                                                             "group 1: D", "group 1: F"]
    assert epifuse.get_kernels(grouped)[-1].run(grouped, verify=True).ok


def test_rerun_reads_new_data_in_place():
    grouped = epifuse.GroupedGemmArguments([bias_relu_aux(M, N, K) for M, N, K in SIZES[:3]])
    run_exact(grouped)
    for p in grouped:
        p.A.copy_(ints(*p.A.shape))
        p.operands["bias"].copy_(ints(p.N, dtype=torch.float32))
    run_exact(grouped)


def test_empty_groups_and_k_zero():
    """Groups with M = 0 or N = 0 have no tiles; K = 0 gives accum = 0 and the epilogue runs."""
    sizes = [(0, 24, 16), (40, 24, 16), (12, 0, 8), (20, 30, 0), (33, 17, 20)]
    grouped = epifuse.GroupedGemmArguments([bias_relu_aux(M, N, K) for M, N, K in sizes])
    run_exact(grouped)
    assert torch.equal(grouped[3].outputs["F"], grouped[3].operands["bias"].expand(20, 30))


def test_many_small_groups_find_their_rows():
    """Eleven groups (four bisection steps), empty ones among them, one or two tiles each."""
    sizes = [(8, 8, 8), (0, 8, 8), (40, 5, 8), (3, 3, 3), (0, 9, 4), (9, 40, 8), (1, 1, 1),
             (33, 2, 8), (8, 8, 0), (2, 64, 8), (5, 7, 9)]
    run_exact(epifuse.GroupedGemmArguments([bias_relu_aux(M, N, K) for M, N, K in sizes]))


def test_compute_capability_is_checked_for_every_group():
    grouped = epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), bias_relu_aux(9, 9, 9)])
    status = {k.name: s for k, s in epifuse.kernel_statuses(grouped, cc=75)}["triton_grouped"]
    assert not status.ok and "compute capability 75 is below 8.0" in status.reason
    assert [k.name for k in epifuse.get_kernels(grouped, cc=75)] == ["reference_grouped"]


def test_all_groups_empty_still_writes_reductions():
    """No tiles, no launch; a sum over no rows is 0 and a mean over them NaN, as in torch."""
    src = "def epi(accum):\n    s = sum(accum, dim=0)\n    m = mean(accum, dim=0)\n    return s, m\n"
    problems = [problem(0, N, 8, src, s=torch.full((N,), 5.0), m=torch.full((N,), 5.0)) for N in (8, 40)]
    grouped = epifuse.GroupedGemmArguments(problems)
    grouped_kernel(grouped).run(grouped)
    for p in grouped:
        assert torch.equal(p.outputs["s"], torch.zeros(p.N)) and p.outputs["m"].isnan().all()


def test_column_row_tile_and_per_group_tensor_scalars():
    src = ("def epi(accum, scale, bias, C, gamma):\n"
           "    D = accum * scale + bias - C * gamma\n    return D\n")
    problems = []
    for M, N, K in [*SIZES, (0, 20, 8)]:   # with M = 1 the (1, 1) scale is a scalar; M = 0: empty
        problems.append(problem(M, N, K, src, scale=ints(M, 1, dtype=torch.float32),
                                bias=ints(1, N, dtype=torch.float32), C=ints(M, N),
                                gamma=torch.tensor([float(len(problems) - 1)]),
                                D=torch.full((M, N), float("nan"))))
    grouped = epifuse.GroupedGemmArguments(problems)
    assert [r.axes for r in grouped.roles] == [("M",), ("N",), ("M", "N"), ()]
    run_exact(grouped)


def test_row_operand_that_is_a_scalar_in_one_group():
    src = "def epi(accum, bias):\n    D = accum + bias\n    return D\n"
    problems = [problem(24, N, 16, src, bias=ints(N, dtype=torch.float32),
                        D=torch.full((24, N), float("nan"))) for N in (40, 1, 9)]
    grouped = epifuse.GroupedGemmArguments(problems)
    assert grouped.roles[0].axes == ("N",)
    run_exact(grouped)


LAYOUTS = {
    "row_major": lambda t: t,
    "column_major": lambda t: t.t().contiguous().t(),
    "sliced": lambda t: torch.cat([t, t], dim=1)[:, : t.shape[1]],
}


def test_column_major_and_transposed_operands_mixed_across_groups():
    src = "def epi(accum, C):\n    D = accum - C\n    return D\n"
    problems = []
    for (M, N, K), layout in zip(SIZES, ["row_major", "column_major", "sliced", "column_major"]):
        to = LAYOUTS[layout]
        A = to(ints(M, K))
        B = ints(N, K).t() if layout != "sliced" else to(ints(K, N))   # B (K, N) as a transposed view
        epi = epifuse.EpilogueArguments(src, C=to(ints(M, N, dtype=torch.float32)),
                                        D=to(torch.full((M, N), float("nan"))))
        problems.append(epifuse.GemmArguments(A, B, epilogue=epi))
    run_exact(epifuse.GroupedGemmArguments(problems))


def test_int8_inputs():
    src = "def epi(accum, scale):\n    D = accum * scale\n    return D\n"
    problems = [problem(M, N, K, src, dtype=torch.int8, scale=ints(N, dtype=torch.float32),
                        D=torch.full((M, N), float("nan"))) for M, N, K in SIZES[:3]]
    run_exact(epifuse.GroupedGemmArguments(problems))


def test_random_fp16_relative_error():
    src = "def epi(accum, bias):\n    D = gelu(accum + bias)\n    return D\n"
    problems = []
    for M, N, K in SIZES:
        A, B = torch.randn(M, K).half(), (torch.randn(K, N) / K ** 0.5).half()
        epi = epifuse.EpilogueArguments(src, bias=torch.randn(N), D=torch.empty(M, N))
        problems.append(epifuse.GemmArguments(A, B, epilogue=epi))
    grouped = epifuse.GroupedGemmArguments(problems)
    grouped_kernel(grouped).run(grouped)
    for p in grouped:
        assert rel_error(p.outputs["D"], reference_outputs(p)["D"]) < 1e-5


@pytest.mark.parametrize("deterministic", [False, True])
def test_reductions(deterministic):
    src = ("def epi(accum, bias):\n    D = accum + bias\n    s = sum(D, dim=1)\n"
           "    m = mean(D, dim=0)\n    x = amax(D, dim=1)\n    y = max(D, dim=1)\n    return D, s, m, x, y\n")
    problems = []
    for M, N, K in SIZES:
        epi = epifuse.EpilogueArguments(
            src, deterministic=deterministic, bias=ints(N, dtype=torch.float32),
            D=torch.full((M, N), float("nan")), s=torch.full((M,), float("nan")),
            m=torch.full((N,), float("nan"), dtype=torch.float16), x=torch.full((M, 1), float("nan")),
            y=torch.full((M,), float("nan"), dtype=torch.float16))
        problems.append(epifuse.GemmArguments(ints(M, K), ints(K, N), epilogue=epi))
    grouped = epifuse.GroupedGemmArguments(problems)
    refs = [reference_outputs(p) for p in grouped]
    grouped_kernel(grouped).run(grouped)
    for p, ref in zip(grouped, refs):
        for name in ("D", "s", "x"):
            assert torch.equal(p.outputs[name], ref[name].float()), name
        assert torch.equal(p.outputs["y"], ref["y"].half()), "y"
        assert rel_error(p.outputs["m"], ref["m"]) < 1e-3


def test_sum_reduction_accumulates_into_what_is_there():
    src = "def epi(accum):\n    s = sum(accum, dim=1)\n    return s\n"
    starts = [ints(M, dtype=torch.float32) for M, _, _ in SIZES[:3]]
    problems = [epifuse.GemmArguments(ints(M, K), ints(K, N), epilogue=epifuse.EpilogueArguments(
                    src, accumulate=True, s=start.clone())) for (M, N, K), start in zip(SIZES[:3], starts)]
    grouped = epifuse.GroupedGemmArguments(problems)
    grouped_kernel(grouped).run(grouped)
    for p, start in zip(grouped, starts):
        assert torch.equal(p.outputs["s"], start + (p.A.double() @ p.B.double()).sum(dim=1).float())


# ---- planning from stand-ins: fake and meta tensors ----------------------------------------------

STAND_IN_SRC = ("def epi(accum, alpha, bias, C):\n    F = accum * alpha + bias + C\n    D = relu(F)\n"
                "    r = sum(F, dim=1)\n    return D, F, r\n")


def _stand_in_groups() -> list[dict]:
    """Real tensors of every role per group: B transposed, and C and r views at offsets into one
    storage, C 2 bytes past a 16-byte boundary in one group (which the kernel's source is
    specialized on); an empty group among them."""
    groups = []
    for i, (M, N, K) in enumerate([(40, 24, 16), (0, 8, 40), (17, 50, 33), (1, 33, 64)]):
        S = torch.full((M * N + M + 9,), float("nan"), dtype=torch.float16)
        start = 1 if i == 2 else 8
        groups.append(dict(A=ints(M, K), B=ints(N, K).t(), bias=ints(N, dtype=torch.float32),
                           C=S[start:start + M * N].view(M, N).copy_(ints(M, N)),
                           D=torch.full((M, N), float("nan"), dtype=torch.float16),
                           F=torch.full((M, N), float("nan")), r=S[-M:] if M else S[:0]))
    return groups


def _grouped_of(groups: list[dict]) -> epifuse.GroupedGemmArguments:
    return epifuse.GroupedGemmArguments([
        epifuse.GemmArguments(g["A"], g["B"], precision="highest", epilogue=epifuse.EpilogueArguments(
            STAND_IN_SRC, alpha=2.0, bias=g["bias"], C=g["C"], D=g["D"], F=g["F"], r=g["r"]))
        for g in groups])


def _stand_in_maker(kind: str):
    if kind == "meta":
        return lambda t: t.to("meta")
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=kind == "fake-data-ptr-allowed"):
        mode = FakeTensorMode()
    return mode.from_tensor


@pytest.mark.parametrize("kind", ["fake", "fake-data-ptr-allowed", "meta"])
def test_kernels_are_planned_from_stand_ins_and_run_on_real_groups(kind):
    """GroupedGemmArguments, kernel_statuses, get_kernels and compile take fake tensors (whose
    addresses read 0, or raise) and meta tensors, as for one GEMM; the kernels offered for fake
    tensors are those offered for the real ones, compiled from the same source (specialized on
    the real tensors' alignment), and each runs exactly on real groups of the same metadata.
    Meta tensors name no device Triton runs on: they get the reference kernel, as one GEMM does."""
    real = _stand_in_groups()
    make = _stand_in_maker(kind)
    planned = _grouped_of([{name: make(t) for name, t in g.items()} for g in real])
    real_args = _grouped_of(real)
    statuses = epifuse.kernel_statuses(planned)
    kernels = epifuse.get_kernels(planned)
    if kind == "meta":
        assert "tensors on meta are not supported" in statuses[0][1].reason
        assert [k.name for k in kernels] == ["reference_grouped"]
    else:
        assert [(repr(k), s) for k, s in statuses] == [(repr(k), s) for k, s in epifuse.kernel_statuses(real_args)]
        assert kernels[0].name == "triton_grouped"
    for kernel in kernels:
        kernel.compile(planned)
    expected = [reference_outputs(p) for p in real_args]
    for kernel in kernels:
        for p in real_args:
            for dest in p.outputs.values():
                dest.fill_(float("nan"))
        kernel.run(real_args)
        for i, (p, ref) in enumerate(zip(real_args, expected)):
            for name, want in ref.items():
                assert torch.equal(p.outputs[name], want.to(p.outputs[name].dtype)), (kernel, i, name)
    for kernel in kernels[:-1]:
        assert kernel.plan(planned).kernel is kernel.plan(real_args).kernel, kernel
        with pytest.raises(ShapeError, match="fake or meta tensors, which have no memory"):
            kernel.run(planned)


# ---- what GroupedGemmArguments refuses ---------------------------------------------------------

def test_refuses_an_empty_list_and_other_things():
    with pytest.raises(EpilogueArgumentError, match="at least one problem"):
        epifuse.GroupedGemmArguments([])
    with pytest.raises(EpilogueArgumentError, match="list of GemmArguments"):
        epifuse.GroupedGemmArguments(bias_relu_aux(8, 8, 8))
    with pytest.raises(EpilogueArgumentError, match="Group 1 is a dict"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), {}])


def test_refuses_different_epilogues():
    other = problem(8, 8, 8, "def epi(accum, alpha, bias):\n    F = accum * alpha - bias\n"
                             "    D = relu(F)\n    return D, F\n",
                    alpha=2.0, bias=ints(8, dtype=torch.float32),
                    D=torch.empty(8, 8, dtype=torch.float16), F=torch.empty(8, 8))
    with pytest.raises(EpilogueArgumentError, match=r"Group 1's epilogue computes `F = accum \* alpha - bias` where group 0's computes `F = accum \* alpha \+ bias`"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), other])
    renamed = problem(8, 8, 8, "def epi(accum, beta, bias):\n    F = accum * beta + bias\n"
                               "    D = relu(F)\n    return D, F\n",
                      beta=2.0, bias=ints(8, dtype=torch.float32),
                      D=torch.empty(8, 8, dtype=torch.float16), F=torch.empty(8, 8))
    with pytest.raises(EpilogueArgumentError, match=r"Group 2's epilogue takes the operands \(beta, bias\) but group 0's takes \(alpha, bias\)"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), bias_relu_aux(9, 9, 9), renamed])


def test_refuses_different_numbers_and_number_versus_tensor():
    differs = problem(8, 8, 8, BIAS_RELU_AUX, alpha=3.0, bias=ints(8, dtype=torch.float32),
                      D=torch.empty(8, 8, dtype=torch.float16), F=torch.empty(8, 8))
    with pytest.raises(EpilogueArgumentError, match=r"Group 1: operand alpha = 3.0 but group 0 has alpha = 2.0"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), differs])
    tensor = problem(8, 8, 8, BIAS_RELU_AUX, alpha=torch.tensor(2.0), bias=ints(8, dtype=torch.float32),
                     D=torch.empty(8, 8, dtype=torch.float16), F=torch.empty(8, 8))
    with pytest.raises(EpilogueArgumentError, match="Group 1: operand alpha is a tensor but group 0's is a Python number"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), tensor])


def test_refuses_different_dtypes():
    with pytest.raises(ShapeError, match="Group 1: A is torch.float32 but group 0's A is torch.float16"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), bias_relu_aux(8, 8, 8, dtype=torch.float32)])
    with pytest.raises(ShapeError, match="Group 1: output D is torch.float32 but group 0's is torch.float16"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), bias_relu_aux(8, 8, 8, out_dtype=torch.float32)])
    half_bias = problem(8, 8, 8, BIAS_RELU_AUX, alpha=2.0, bias=ints(8),
                        D=torch.empty(8, 8, dtype=torch.float16), F=torch.empty(8, 8))
    with pytest.raises(ShapeError, match="Group 1: operand bias is torch.float16"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), half_bias])


def test_refuses_different_options():
    first = bias_relu_aux(8, 8, 8)
    other = bias_relu_aux(8, 8, 8)
    other.precision = "default"
    first.precision = "highest"
    with pytest.raises(EpilogueArgumentError, match="Group 1 has precision='default' but group 0 has 'highest'"):
        epifuse.GroupedGemmArguments([first, other])


def test_refuses_different_devices():
    meta = bias_relu_aux(8, 8, 8, device="meta")
    with pytest.raises(ShapeError, match=r"Group 1 is on meta but group 0 is on (cpu|cuda)"):
        epifuse.GroupedGemmArguments([bias_relu_aux(8, 8, 8), meta])


def test_refuses_batched_problems():
    epi = epifuse.EpilogueArguments("def epi(accum):\n    D = accum\n    return D\n", D=torch.empty(2, 8, 8))
    batched = epifuse.GemmArguments(ints(2, 8, 8), ints(2, 8, 8), epilogue=epi)
    with pytest.raises(ShapeError, match=r"Group 1 is batched: .*grouped GEMM problems are 2-D"):
        epifuse.GroupedGemmArguments([problem(8, 8, 8, "def epi(accum):\n    D = accum\n    return D\n",
                                              D=torch.empty(8, 8)), batched])


def test_refuses_outputs_shared_between_groups():
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"
    D = torch.empty(8, 8)
    first = problem(8, 8, 8, src, C=torch.ones(8, 8), D=D)
    reads_it = problem(8, 8, 8, src, C=D, D=torch.empty(8, 8))
    with pytest.raises(ShapeError, match="Group 0's D and group 1's C share memory"):
        epifuse.GroupedGemmArguments([first, reads_it])
    writes_it = problem(8, 8, 8, src, C=torch.ones(8, 8), D=D)
    with pytest.raises(ShapeError, match="share memory"):
        epifuse.GroupedGemmArguments([first, writes_it])
    # an in-place update within one group (D = C) and inputs shared by groups are fine
    in_place = torch.ones(8, 8)
    shared_b = ints(8, 8)
    ok = [epifuse.GemmArguments(ints(8, 8), shared_b, epilogue=epifuse.EpilogueArguments(src, C=in_place, D=in_place)),
          epifuse.GemmArguments(ints(8, 8), shared_b, epilogue=epifuse.EpilogueArguments(
              src, C=torch.ones(8, 8), D=torch.empty(8, 8)))]
    run_exact(epifuse.GroupedGemmArguments(ok))


def test_errors_are_epilogue_errors():
    assert issubclass(EpilogueArgumentError, EpilogueError) and issubclass(ShapeError, EpilogueError)


def test_unsupported_dtype_falls_back_to_the_reference_loop_with_a_reason():
    src = "def epi(accum):\n    D = accum\n    return D\n"
    problems = [problem(M, N, K, src, dtype=torch.float64, D=torch.empty(M, N, dtype=torch.float64))
                for M, N, K in SIZES[:2]]
    grouped = epifuse.GroupedGemmArguments(problems)
    statuses = {k.name: s for k, s in epifuse.kernel_statuses(grouped)}
    assert not statuses["triton_grouped"].ok
    assert "group 0: input dtype torch.float64" in statuses["triton_grouped"].reason
    kernels = epifuse.get_kernels(grouped)
    assert [k.name for k in kernels] == ["reference_grouped"]
    kernels[0].run(grouped)
    for p in grouped:
        assert torch.equal(p.outputs["D"], p.A @ p.B)


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixture_of_experts_sizes_on_gpu(device, dtype):
    """Experts with uneven token counts (one empty, one with a single token) at realistic sizes."""
    tokens = [0, 1, 77, 300, 1024, 513, 2048, 129]
    N, K = 1536, 1024
    src = ("def epi(accum, bias, scale):\n    F = accum * scale + bias\n"
           "    D = gelu(F)\n    s = sum(D, dim=1)\n    return D, F, s\n")
    problems = []
    for M in tokens:
        A = integer_tensor(M, K, device=device, dtype=dtype)
        B = integer_tensor(K, N, low=-1, high=2, device=device, dtype=dtype)
        epi = epifuse.EpilogueArguments(
            src, bias=integer_tensor(N, device=device, dtype=torch.float32),
            scale=integer_tensor(M, 1, low=1, high=3, device=device, dtype=torch.float32),
            D=torch.full((M, N), float("nan"), device=device, dtype=dtype),
            F=torch.full((M, N), float("nan"), device=device), s=torch.empty(M, device=device))
        problems.append(epifuse.GemmArguments(A, B, epilogue=epi))
    grouped = epifuse.GroupedGemmArguments(problems)
    kernel = grouped_kernel(grouped)
    refs = [reference_outputs(p) for p in grouped]
    kernel.run(grouped)
    kernel.run(grouped)   # the second run takes the direct launch
    torch.cuda.synchronize()
    for p, ref in zip(grouped, refs):
        assert torch.equal(p.outputs["F"], ref["F"].float())
        assert rel_error(p.outputs["D"], ref["D"]) < 1e-2
        assert rel_error(p.outputs["s"], ref["s"]) < 1e-5


# ---- groups whose memory moved since the arguments were built ------------------------------------

def _two_groups():
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"
    ts = [{n: integer_tensor(8, 8, dtype=torch.float32, device=DEVICE) for n in "ABC"} for _ in range(2)]
    for t in ts:
        t["D"] = torch.full((8, 8), 7.0, device=DEVICE)
    grouped = epifuse.GroupedGemmArguments([epifuse.GemmArguments(t["A"], t["B"], epilogue=epifuse.EpilogueArguments(
        src, C=t["C"], D=t["D"])) for t in ts])
    return grouped, ts


def _expected(t):
    return t["A"].double() @ t["B"].double() + t["C"].double()


def test_a_refused_run_is_refused_again():
    """Group 0's output set_ onto group 1's operand: refused, and refused again the next time
    (the refused check must not record the new addresses as checked)."""
    grouped, ts = _two_groups()
    kernel = grouped_kernel(grouped)
    kernel.run(grouped)
    ts[0]["D"].set_(ts[1]["C"])
    for _ in range(2):
        with pytest.raises(ShapeError, match="share memory"):
            kernel.run(grouped)


def test_memory_moved_under_one_kernel_is_replanned_by_the_other():
    """A group's output moved to new memory and the reference kernel ran first: the grouped
    Triton kernel still writes the new memory (its plan of old addresses is dropped)."""
    grouped, ts = _two_groups()
    kernels = epifuse.get_kernels(grouped)
    triton, reference = kernels[0], kernels[-1]
    assert triton.name == "triton_grouped" and reference.name == "reference_grouped"
    triton.run(grouped)
    ts[0]["D"].set_(torch.full((8, 8), 7.0, device=DEVICE))
    reference.run(grouped)
    ts[0]["D"].fill_(7.0)
    triton.run(grouped)
    for t in ts:
        assert torch.equal(t["D"].double(), _expected(t))


def test_groups_whose_number_differs_only_in_its_sign_are_refused():
    """s = 0.0 in one group and -0.0 in another: 1 / s tells them apart, and a number is passed
    once for the launch."""
    src = "def epi(accum, s):\n    D = accum + 1.0 / s\n    return D\n"
    problems = [epifuse.GemmArguments(integer_tensor(8, 8, dtype=torch.float32), integer_tensor(8, 8, dtype=torch.float32),
                                      epilogue=epifuse.EpilogueArguments(src, s=s, D=torch.empty(8, 8)))
                for s in (0.0, -0.0)]
    with pytest.raises(EpilogueArgumentError, match="s = -0.0 but group 0 has s = 0.0"):
        epifuse.GroupedGemmArguments(problems)
