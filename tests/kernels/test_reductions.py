"""Reductions in epilogues: every kind x axis x destination shape, batches, ragged tiles, NaN,
accumulate, deterministic mode, and the fused-loss / statistics examples.

Sums and means are checked against float64 relative to the same fold of |x| (helpers.fold_error:
terms that cancel to near zero leave fp32's rounding as large as ever, not as small as the
result); max/min/amax exactly (the fp32 values they pick are exact in both).
"""
import math

import pytest
import torch

import epifuse
from epifuse.ops import OPS, clamp, log, sigmoid, sum
from helpers import check_reductions, fast, fold_error, integer_tensor, magnitude_outputs, reference_outputs, rel_error

M, N, K, L = 100, 72, 50, 2
KINDS = ["sum", "mean", "max", "min", "amax", "logsumexp"]

# (rank, dim source, destination shapes that must be accepted)
AXIS_CASES = [
    (2, "dim=1", [(M,), (M, 1)]),
    (2, "dim=-1", [(M,)]),
    (2, "dim=0", [(N,), (1, N)]),
    (2, "", [(1,), (1, 1), ()]),
    (2, "dim=(0, 1)", [(1,)]),
    (3, "dim=2", [(L, M), (L, M, 1)]),
    (3, "dim=1", [(L, N), (L, 1, N)]),
    (3, "dim=(1, 2)", [(L,), (L, 1, 1)]),
    (3, "", [(), (1,)]),
    (3, "dim=0", [(M, N), (1, M, N)]),
    (3, "dim=(0, 2)", [(M,), (1, M, 1)]),
]


def _gemm_inputs(rank, device, dtype=torch.float16):
    """Integer-valued A and B: accum is exact, so max/min/amax can be compared exactly."""
    shape_a, shape_b = ((L, M, K), (L, K, N)) if rank == 3 else ((M, K), (K, N))
    return (integer_tensor(*shape_a, device=device, dtype=dtype),
            integer_tensor(*shape_b, low=-1, high=2, device=device, dtype=dtype))


def _run(A, B, src, deterministic=False, accumulate=False, **tensors):
    epi = epifuse.EpilogueArguments(src, deterministic=deterministic, accumulate=accumulate, **tensors)
    args = epifuse.GemmArguments(A, B, epilogue=epi)
    kernel = epifuse.get_kernels(args)[0]
    assert kernel.name.startswith("triton_"), epifuse.kernel_statuses(args)
    kernel.run(args)
    return args


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rank,dim,shapes", fast(AXIS_CASES, keep={0, 2},
                                                 ids=[f"{r}-{d.replace(' ', '')}" for r, d, _ in AXIS_CASES]))
def test_reduction_kind_axis_destination(kind, rank, dim, shapes, device):
    A, B = _gemm_inputs(rank, device)
    C = integer_tensor(*((L, M, N) if rank == 3 else (M, N)), device=device, dtype=torch.float32)
    call = f"{kind}(x, {dim})" if dim else f"{kind}(x)"
    shift = " + 64.0" if kind in ("sum", "mean") else ""  # signed terms cancel: a wrong count would hide
    src = f"def epi(accum, C):\n    x = accum * 2.0 + C{shift}\n    r = {call}\n    return r\n"
    for shape in shapes:
        r = torch.full(shape, float("nan"), device=device)  # no user pre-fill needed
        check_reductions(_run(A, B, src, C=C, r=r), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_method_spelling_and_keepdim(kind, device):
    A, B = _gemm_inputs(2, device)
    r = torch.empty(M, 1, device=device)
    src = f"def epi(accum):\n    r = accum.{kind}(dim=1, keepdim=True)\n    return r\n"
    check_reductions(_run(A, B, src, r=r), kind)


@pytest.mark.parametrize("kind", fast(KINDS, keep={2}))
def test_deterministic_mode_is_bitwise_repeatable(kind, device):
    A, B = _gemm_inputs(2, device)
    src = f"def epi(accum):\n    r = {kind}(accum * accum, dim=0)\n    s = {kind}(accum)\n    return r, s\n"
    results = []
    for _ in range(2):
        r, s = torch.empty(N, device=device), torch.empty(1, device=device)
        args = _run(A, B, src, deterministic=True, r=r, s=s)
        check_reductions(args, kind)
        results.append((r.clone(), s.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("kind", fast(KINDS, keep={0, 4}))
def test_nan_propagates(kind, device):
    A, B = _gemm_inputs(2, device)
    C = integer_tensor(M, N, device=device, dtype=torch.float32)
    C[3, 5] = float("nan")
    src = f"def epi(accum, C):\n    r = {kind}(accum + C, dim=1)\n    c = {kind}(accum + C, dim=0)\n    return r, c\n"
    r, c = torch.empty(M, device=device), torch.empty(N, device=device)
    args = _run(A, B, src, C=C, r=r, c=c)
    assert torch.isnan(r[3]) and torch.isnan(c[5])
    assert not torch.isnan(r[torch.arange(M, device=device) != 3]).any()
    check_reductions(args, kind) if kind != "mean" else None


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
@pytest.mark.parametrize("kind", KINDS)
def test_padding_lanes_never_contribute(kind, device):
    """All-negative values: a padding zero would win max; all-positive: it would win min."""
    A, B = _gemm_inputs(2, device)
    for sign in (1.0, -1.0):  # noqa: B007
        src = (f"def epi(accum, s):\n    x = s * (abs(accum) + 1.0)\n"
               f"    r = {kind}(x, dim=1)\n    c = {kind}(x, dim=0)\n    t = {kind}(x)\n    return r, c, t\n")
        r, c, t = torch.empty(M, device=device), torch.empty(N, device=device), torch.empty(1, device=device)
        check_reductions(_run(A, B, src, s=sign, r=r, c=c, t=t), kind)


@pytest.mark.parametrize("deterministic", fast([False, True], keep={0}))
def test_amax_folds_with_an_integer_atomic_max(deterministic, device):
    """amax folds |x|'s fp32 bits with an integer atomic max (layout.reduction_mode), in either
    mode: exact, NaN where any element is NaN (a NaN with its sign bit set too), inf where an
    element is infinite; accumulating folds the destination in (its own -NaN included), into
    fp32 and fp16 destinations."""
    from epifuse.backends.triton.layout import reduction_mode
    assert reduction_mode(OPS["amax"], deterministic) == "atomic"
    A, B = _gemm_inputs(2, device)
    C = integer_tensor(M, N, device=device, dtype=torch.float32)
    negative_nan = torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32).item()
    C[3, 5], C[7, 70], C[20, 9] = negative_nan, float("-inf"), float("nan")
    src = "def epi(accum, C):\n    r = amax(accum + C, dim=1)\n    c = amax(accum + C, dim=0)\n    return r, c\n"
    r, c = torch.empty(M, device=device), torch.empty(N, device=device, dtype=torch.float16)
    args = _run(A, B, src, deterministic=deterministic, C=C, r=r, c=c)
    check_reductions(args, "amax")
    assert torch.isnan(r[3]) and torch.isnan(r[20]) and r[7] == float("inf")
    assert torch.isnan(c[5]) and torch.isnan(c[9]) and c[70] == float("inf")
    exact = "def epi(accum):\n    r = amax(accum, dim=1)\n    t = amax(accum * 0.5)\n    return r, t\n"
    r0 = integer_tensor(M, device=device, dtype=torch.float32) * 30.0  # some above every |accum|
    r0[0], r0[1] = negative_nan, -7.0
    r, t = r0.clone(), torch.full((1,), -1.0, device=device, dtype=torch.float16)
    args = _run(A, B, exact, deterministic=deterministic, accumulate=True, r=r, t=t)
    refs = reference_outputs(args)
    expected = torch.maximum(refs["r"], r0.double())  # NaN at 0, as torch.maximum
    assert torch.isnan(r[0]) and torch.equal(r[1:].double(), expected[1:].float().double())
    assert torch.equal(t.double(), refs["t"].clamp(min=-1.0).half().double())


def test_accumulate_folds_into_existing(device):
    A, B = _gemm_inputs(2, device)
    src = "def epi(accum):\n    r = sum(accum, dim=1)\n    m = max(accum, dim=0)\n    return r, m\n"
    r0, m0 = torch.randn(M, device=device), torch.randn(N, device=device) + 5.0
    r, m = r0.clone(), m0.clone()
    args = _run(A, B, src, accumulate=True, r=r, m=m)
    refs = reference_outputs(args)
    assert rel_error(r, refs["r"] + r0.double()) < 1e-5
    assert torch.equal(m.double(), torch.maximum(refs["m"], m0.double()).float().double())


def test_sum_into_half_destination_accumulates_in_fp32(device):
    A, B = _random_inputs(device)
    r = torch.empty(M, device=device, dtype=torch.float16)
    args = _run(A, B, "def epi(accum):\n    r = sum(accum + 100.0, dim=1)\n    return r\n", r=r)
    assert rel_error(r, reference_outputs(args)["r"]) < 1e-3


def test_integer_valued_sums_are_exact(device):
    A = integer_tensor(M, K, device=device)
    B = integer_tensor(K, N, low=-1, high=2, device=device)
    r, c, t = torch.empty(M, device=device), torch.empty(N, device=device), torch.empty(1, device=device)
    src = "def epi(accum):\n    r = sum(accum, dim=1)\n    c = sum(accum, dim=0)\n    t = sum(accum)\n    return r, c, t\n"
    args = _run(A, B, src, r=r, c=c, t=t)
    for name, ref in reference_outputs(args).items():
        assert torch.equal(args.outputs[name].double(), ref), name


def bce_loss(accum, bias, C):
    f = accum + bias
    loss = sum((1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))
    return loss


@pytest.mark.parametrize("bias_shape", [(N,), (M, 1)])
def test_bce_loss_without_D(bias_shape, device):
    A, B = _random_inputs(device)
    bias = torch.randn(*bias_shape, device=device)
    C = torch.randint(0, 2, (M, N), device=device).float()
    loss = epifuse.gemm(A, B, bce_loss, bias=bias, C=C)
    acc = A.double() @ B.double()
    expected = bce_loss(acc, bias.double(), C.double())
    assert loss.shape == () and rel_error(loss, expected) < 1e-5   # 0-d, as torch.sum


class _SquaredLoss(epifuse.FusedGemm):
    def epilogue(self, accum, C):
        x = accum * C
        s = sum(x * x)
        return s


@pytest.mark.parametrize("rank", [2, 3])
def test_a_reduction_over_every_dim_comes_back_0d_as_torch_sum(rank, device):
    """torch.sum(x) and torch.amax(x, dim=all) are 0-d; so are epifuse's, on every path that
    allocates them: epifuse.gemm and its kept launch, the custom ops with autograd, FusedGemm.
    Integer-valued inputs small enough that fp32 sums are exact."""
    m, n, k, batch = 24, 20, 16, 2
    shape_a, shape_b, shape_c = (((batch, m, k), (batch, k, n), (batch, m, n)) if rank == 3
                                 else ((m, k), (k, n), (m, n)))
    A = integer_tensor(*shape_a, device=device, dtype=torch.float32)
    B = integer_tensor(*shape_b, low=-1, high=2, device=device, dtype=torch.float32)
    C = integer_tensor(*shape_c, low=-1, high=2, device=device, dtype=torch.float32)
    every = tuple(range(rank))
    src = f"def loss(accum, C):\n    x = accum * C\n    s = sum(x * x)\n    t = amax(x, dim={every})\n    return s, t\n"
    x = (A.double() @ B.double()) * C.double()
    s_ref, t_ref = torch.sum(x * x), torch.amax(x.abs(), dim=every)
    assert s_ref.shape == t_ref.shape == ()
    for _ in range(2):   # the full path, then the kept launch (runtime.callsite)
        s, t = epifuse.gemm(A, B, src, C=C)
        assert s.shape == t.shape == () and s.dtype == t.dtype == torch.float32
        assert torch.equal(s.double(), s_ref) and torch.equal(t.double(), t_ref)
    # the custom ops (autograd): the forward's outputs and the gradient a 0-d loss sends back
    A_grad = A.clone().requires_grad_()
    s, t = epifuse.gemm(A_grad, B, src, C=C)
    assert s.shape == t.shape == () and s.requires_grad
    assert torch.equal(s.detach().double(), s_ref) and torch.equal(t.detach().double(), t_ref)
    s.backward()
    A64 = A.double().requires_grad_()
    torch.sum(((A64 @ B.double()) * C.double()) ** 2).backward()
    assert torch.equal(A_grad.grad.double(), A64.grad)
    loss = _SquaredLoss()(A, B, C=C)
    assert loss.shape == () and torch.equal(loss.double(), s_ref)


def test_rms_norm_statistics(device):
    def rowsumsq(accum, alpha):
        D = accum * alpha
        r = sum(D * D, dim=1)
        return D, r

    A, B = _random_inputs(device)
    D, r = epifuse.gemm(A, B, rowsumsq, alpha=0.5)
    acc = A.double() @ B.double() * 0.5
    assert rel_error(r, (acc * acc).sum(1)) < 1e-5 and rel_error(D, acc) < 1e-3


def test_cutlass_evt_mixed_dag(device):
    src = """
def evt(accum, alpha, beta, C, aux, col_bias, row_bias):
    F = alpha * accum + (beta * C + aux)
    F_max = max(F, dim=1)
    E = relu(F + 1) + col_bias + row_bias
    E_max = max(E, dim=0)
    D = E + F
    return D, F, F_max, E_max
"""
    A, B = _random_inputs(device)
    tensors = dict(alpha=1.5, beta=0.5, C=torch.randn(M, N, device=device),
                   aux=torch.randn(M, N, device=device), col_bias=torch.randn(M, 1, device=device),
                   row_bias=torch.randn(N, device=device),
                   D=torch.empty(M, N, device=device), F=torch.empty(M, N, device=device),
                   F_max=torch.empty(M, device=device), E_max=torch.empty(N, device=device))
    args = _run(A, B, src, **tensors)
    for name, ref in reference_outputs(args).items():
        assert rel_error(args.outputs[name], ref) < 1e-5, name


def test_bias_gradient_and_fp8_amax(device):
    src = """
def epi(accum, bias):
    D = gelu(accum + bias)
    db = sum(D, dim=0)
    scale = amax(D)
    return D, db, scale
"""
    A, B = _random_inputs(device)
    args = _run(A, B, src, bias=torch.randn(N, device=device), D=torch.empty(M, N, device=device),
                db=torch.empty(1, N, device=device), scale=torch.empty(1, device=device))
    refs = reference_outputs(args)
    assert rel_error(args.outputs["db"], refs["db"]) < 1e-5
    assert rel_error(args.outputs["scale"], refs["scale"]) < 1e-6


def test_shared_values_and_reuse(device):
    src = """
def epi(accum, C):
    z = accum * C
    w = z + z
    D = w * accum
    G = D - z
    s = sum(D, dim=1)
    return D, G, s
"""
    A, B = _gemm_inputs(2, device)
    tensors = dict(C=torch.randn(M, N, device=device), D=torch.empty(M, N, device=device),
                   G=torch.empty(M, N, device=device), s=torch.empty(M, device=device))
    args = _run(A, B, src, **tensors)
    nodes = args.graph.nodes()
    z = [n for n in nodes if n.op.name == "mul" and {s.op.name for s in n.src} == {"accum", "input"}]
    assert len(z) == 1                                   # accum * C computed once
    adds = [n for n in nodes if n.op.name == "add"]
    assert len(adds) == 1 and adds[0].src[0] is adds[0].src[1] is z[0]   # z + z shares z
    for name, ref in reference_outputs(args).items():
        assert rel_error(args.outputs[name], ref) < 1e-5, name


def test_reduction_destination_shape_mismatch_names_both(device):
    A, B = _gemm_inputs(2, device)
    src = "def epi(accum):\n    r = sum(accum, dim=1)\n    return r\n"
    with pytest.raises(epifuse.EpilogueError, match=r"Output r has shape \(72,\) but sum\(dim=\(1\)\)"):
        epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, r=torch.empty(N, device=device)))


def test_reduced_value_used_later_over_m_is_one_kernel_too_many(device):
    """A kernel runs a reduction that feeds later math only over N (a tile spans the row:
    tests/kernels/test_one_pass_reductions.py): GemmArguments refuses one over M and names what
    does run it (epifuse.gemm, in passes: tests/kernels/test_staging.py)."""
    src = "def epi(accum):\n    m = max(accum, dim=0)\n    D = accum - m\n    return D\n"
    A, B = _gemm_inputs(2, device)
    with pytest.raises(epifuse.EpilogueError, match="only over accum's last dimension") as info:
        epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, D=torch.empty(M, N, device=device)))
    assert "epifuse.gemm runs such an epilogue as passes" in str(info.value)


def test_dim_out_of_range(device):
    with pytest.raises(epifuse.EpilogueError, match="out of range"):
        epifuse.gemm(*_gemm_inputs(2, device), "def epi(accum):\n    r = sum(accum, dim=2)\n    return r\n")


def _random_inputs(device):
    return (torch.randn(M, K, device=device, dtype=torch.float16),
            torch.randn(K, N, device=device, dtype=torch.float16) / math.sqrt(K))


LOG_SUMS = [
    # (summand, the group its logs are multiplied in: 0 where each log is taken alone, and
    # whether the products are of y - 1 terms)
    ("(1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999))", 8, True),   # the BCE rewrite's -log(y)
    ("f - log(clamp(C + f * f, 1.0, 1000.0))", 8, True),
    ("log(clamp(f, 2.0, 2.0 ** 20)) + f", 4, False),
    ("log(clamp(f * f, 2.0 ** -50, 0.5))", 2, False),
    ("-log(clamp(f, 2.0 ** -20, 0.75))", 4, False),
    ("f - log(clamp(f, 0.5, 2.0))", 0, False),            # near 1 from below: a product loses digits
    ("f - log(clamp(f, 2.0 ** -100, 0.5))", 0, False),    # a product of two could underflow
    ("f - log(maximum(f, 2.0))", 0, False),               # no upper bound
    ("f - log(clamp(f, 2.0, 1e300))", 0, False),
    ("f * C - log1p(clamp(f * f, 0.0, 100.0))", 8, True),  # a log1p's argument is its excess
    ("log1p(clamp(f, -0.5, 10.0))", 0, False),            # below 0: no excess
]


@pytest.mark.parametrize("summand,group,shifted", LOG_SUMS)
def test_log_sum_grouping(summand, group, shifted):
    """rules.log_sum: which summed logs are taken as logs of products, and in groups of how many."""
    from epifuse.backends.triton.rules import log_sum
    from epifuse.passes import optimize
    from frontend_helpers import bound
    source = f"def epi(accum, C):\n    f = accum * 0.5\n    s = sum({summand})\n    return s\n"
    graph = optimize(bound(source, C=("M", "N")))
    logs = log_sum(graph.outputs[0].node.src[0])
    assert (logs.group if logs else 0) == group and (logs.shifted if logs else False) == shifted


@pytest.mark.parametrize("dims", fast(["", "dim=1", "mean", "rank3"], keep={1}))
@pytest.mark.parametrize("summand,group,shifted", fast([LOG_SUMS[k] for k in (0, 1, 2, 4, 5, 9)], keep={0}))
def test_summed_logs_match_float64_in_every_kernel(summand, group, shifted, dims, device):
    """Sums (scalar, per row, mean, per batch) whose logs are taken per group of columns agree
    with the float64 reference to fp32 summation's accuracy, in every kernel (ragged tiles:
    masked columns multiply by 1), also in deterministic mode."""
    _check_summed_logs(summand, group, dims, device, K, (False, True))


@pytest.mark.parametrize("dims", ["", "dim=1"])
@pytest.mark.parametrize("summand,group,shifted", fast([LOG_SUMS[k] for k in (0, 1, 3)], keep=set()))
def test_summed_logs_in_the_persistent_and_split_k_kernels(summand, group, shifted, dims, device):
    """As above with a K the persistent and split-K kernels take in the interpreter too."""
    names = _check_summed_logs(summand, group, dims, device, 160, (False,))
    assert {"triton_persistent", "triton_splitk"} <= names, names


def _check_summed_logs(summand, group, dims, device, K, modes, M=M, N=N) -> set:
    """Run `summand` summed as `dims` says through every kernel but the reference in each
    reduction mode of `modes`, against float64; the names of the kernels run."""
    rank = 3 if dims == "rank3" else 2
    call = {"": "sum({})", "dim=1": "sum({}, dim=1)", "mean": "mean({})", "rank3": "sum({}, dim=(1, 2))"}[dims]
    source = (f"def epi(accum, C):\n    f = accum * 0.5\n    s = {call.format(summand)}\n    return s\n")
    shape = (L, M, N) if rank == 3 else (M, N)
    # integer-valued: accum is exact, so the logs' arguments are the reference's (a GEMM's rounding
    # near accum = 0 would move log(f * f) far more than the grouping does)
    A = integer_tensor(*((L, M, K) if rank == 3 else (M, K)), device=device)
    B = integer_tensor(*((L, K, N) if rank == 3 else (K, N)), low=-1, high=2, device=device)
    C = torch.randint(0, 2, shape, device=device).float()
    out_shape = {"": (1,), "dim=1": (M,), "mean": (1,), "rank3": (L,)}[dims]
    names = set()
    for deterministic in modes:
        epi = epifuse.EpilogueArguments(source, deterministic=deterministic, C=C,
                                        s=torch.empty(out_shape, device=device))
        args = epifuse.GemmArguments(A, B, epilogue=epi)
        ref, magnitude = reference_outputs(args)["s"], magnitude_outputs(args)["s"]
        kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
        assert kernels, epifuse.kernel_statuses(args)
        for kernel in kernels:
            if group:
                assert f"EPI_N // {group})" in kernel.source(args, "cuda").replace("]", ")"), kernel
            args.outputs["s"].fill_(float("nan"))
            kernel.run(args)
            error = fold_error(args.outputs["s"], ref, magnitude)  # terms may cancel: 19933 did
            assert error < 1e-5, (kernel, deterministic, error)
            names.add(kernel.name)
    return names


def test_summed_logs_near_one_keep_their_digits(device):
    """A BCE loss whose predictions all saturate (every y at the clamp, 1/0.999 rounded to fp32,
    which alone puts each log 6e-7 off): a direct product of eight such values adds 2.6e-6 of
    rounding near 1, the shifted one a few ulp."""
    A = integer_tensor(M, K, low=1, high=4, device=device)
    B = integer_tensor(K, N, low=1, high=4, device=device)
    C = torch.ones(M, N, device=device)
    for kernel_args in [epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            bce_loss, bias=torch.randn(N, device=device), C=C, loss=torch.empty(1, device=device)))]:
        ref = reference_outputs(kernel_args)["loss"]
        for kernel in (k for k in epifuse.get_kernels(kernel_args) if k.name != "reference"):
            kernel.run(kernel_args)
            assert rel_error(kernel_args.outputs["loss"], ref) < 1.5e-6, (kernel, rel_error(kernel_args.outputs["loss"], ref))


@pytest.mark.parametrize("rows,cols", fast([(64, 64), (64, 40), (40, 64), (40, 40)], keep={3}))
def test_whole_and_ragged_tiles(rows, cols):
    """Where every tile is whole along an axis, the launch says so (EVEN_M / EVEN_N) and the
    epilogue's mask there is a constant the compiler drops; row sums, column maxima and a
    BCE loss agree with float64 either way, in the tiled, persistent and split-K kernels
    (a K they all take; the interpreter's tiles are 32 wide)."""
    ran = _check_whole_and_ragged(rows, cols, "cpu", 128, 32)
    assert {"triton_tiled", "triton_persistent", "triton_splitk"} <= ran, ran


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(128, 128), (128, 72), (100, 128), (100, 72), (512, 384), (512, 376)])
def test_whole_and_ragged_tiles_on_the_gpu(rows, cols):
    """As above with the GPU's kernels, the Gluon ones included."""
    ran = _check_whole_and_ragged(rows, cols, "cuda", 256, 128)
    assert {"triton_persistent", "gluon_pingpong", "gluon_cooperative"} <= ran, ran


def _check_whole_and_ragged(rows, cols, device, depth, tile) -> set:
    """Run every kernel but the reference on a (rows, depth) x (depth, cols) GEMM, whose
    kernels' tiles divide `tile`; the names of the kernels run."""
    src = ("def epi(accum, C):\n    f = accum * 0.25\n    r = sum(f * f, dim=1)\n    c = max(f, dim=0)\n"
           "    loss = sum((1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999)))\n    return r, c, loss\n")
    A = integer_tensor(rows, depth, device=device)
    B = integer_tensor(depth, cols, low=-1, high=2, device=device)
    C = torch.randint(0, 2, (rows, cols), device=device).half()
    outs = dict(r=torch.empty(rows, device=device), c=torch.empty(cols, device=device),
                loss=torch.empty((), device=device))
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, C=C, **outs))
    refs = reference_outputs(args)
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    whole, ran = set(), set()
    for kernel in kernels:
        meta = kernel.plan(args).meta
        assert meta["EVEN_M"] == (rows % meta["BLOCK_M"] == 0), kernel
        assert meta["EVEN_N"] == (cols % meta["BLOCK_N"] == 0), kernel
        whole.update(axis for axis in ("M", "N") if meta[f"EVEN_{axis}"])
        for out in args.outputs.values():
            out.fill_(float("nan"))
        kernel.run(args)
        for name, ref in refs.items():
            assert rel_error(args.outputs[name], ref) < 1e-5, (kernel, name, rel_error(args.outputs[name], ref))
        ran.add(kernel.name)
    assert ("M" in whole) == (rows % tile == 0) and ("N" in whole) == (cols % tile == 0), whole
    return ran


def test_grouped_whole_and_ragged_groups(device):
    """The grouped kernel's EVEN_M / EVEN_N hold only where every group's tiles are whole: one
    ragged group among whole ones keeps the masks, and every group's sums are right."""
    src = "def epi(accum):\n    f = accum * 0.5\n    r = sum(f * f, dim=1)\n    t = sum(f)\n    return r, t\n"
    for sizes in ([(64, 64, 32), (128, 64, 32)], [(64, 64, 32), (40, 40, 32)]):
        problems = [epifuse.GemmArguments(
            integer_tensor(M, K, device=device), integer_tensor(K, N, low=-1, high=2, device=device),
            epilogue=epifuse.EpilogueArguments(src, r=torch.empty(M, device=device),
                                               t=torch.empty((), device=device)))
            for M, N, K in sizes]
        grouped = epifuse.GroupedGemmArguments(problems)
        kernel = epifuse.get_kernels(grouped)[0]
        assert kernel.name == "triton_grouped", epifuse.kernel_statuses(grouped)
        meta = kernel.plan(grouped).meta
        assert meta["EVEN_M"] == all(M % meta["BLOCK_M"] == 0 for M, _, _ in sizes), meta
        assert meta["EVEN_N"] == all(N % meta["BLOCK_N"] == 0 for _, N, _ in sizes), meta
        if device == "cpu":  # the interpreter's 32-wide tiles: the first set is whole
            assert meta["EVEN_M"] == meta["EVEN_N"] == (sizes[1][0] != 40), meta
        kernel.run(grouped)
        for p in grouped:
            for name, ref in reference_outputs(p).items():
                assert rel_error(p.outputs[name], ref) < 1e-6, (sizes, name)


def test_clamp_with_its_min_above_its_max_in_a_sum_of_logs(device):
    """clamp(1 + exp(x), 1.5, 1.0) is 1.0 everywhere (torch takes the max): its logs sum to 0,
    and the logs of products' clamp in the exp's log domain does not apply (log(0))."""
    A, B = _gemm_inputs(2, device)
    src = "def epi(accum):\n    loss = sum(log(clamp(1 + exp(accum * 0.1), 1.5, 1.0)))\n    return loss\n"
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        src, loss=torch.full((), float("nan"), device=device)))
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert kernels, epifuse.kernel_statuses(args)
    for kernel in kernels:
        args.outputs["loss"].fill_(float("nan"))
        kernel.run(args)
        assert args.outputs["loss"].item() == 0.0, kernel
