"""Conditional stores (issue 36): `D = where(cond, value, D)` with D both an operand and the
output of that name updates D in place where the condition holds; the generated kernels store
under the condition and never read D, the reference kernel reads and rewrites it; every other
element keeps its bits. Through the interpreted kernels and the reference, against torch."""
import pytest
import torch

import epifuse
from epifuse.errors import EpilogueError, EpilogueSyntaxError, UnsupportedError
from epifuse.frontend import parse
from epifuse.printing import program_source
from helpers import fast, integer_tensor

UPDATE = "def update(accum, D, keep, bias):\n    D = where(keep > 0.5, accum + bias, D)\n    return D\n"
KEEP_OLD = "def update(accum, D, keep, bias):\n    D = where(keep > 0.5, D, accum + bias)\n    return D\n"


def _problem(batched: bool, per_row: bool, dtype, N: int = 70):
    """Ragged against the interpreter's tiles of 32; N = 64 gives 16-byte row strides, where
    the persistent (TMA) kernel runs too, N = 70 only the pointer kernels."""
    lead = (2,) if batched else ()
    M, K = 45, 40
    A = integer_tensor(*lead, M, K, dtype=torch.float32)
    B = integer_tensor(*lead, K, N, dtype=torch.float32)
    keep = (torch.rand(*lead, M, 1 if per_row else N) > 0.5).float()
    bias = integer_tensor(N, dtype=torch.float32)
    D = torch.randn(*lead, M, N).to(dtype)   # values a rewrite could not give back unchanged
    D[..., ::7, ::5] = float("nan")          # nor these
    return A, B, keep, bias, D


@pytest.mark.parametrize("source, new_where_true", [(UPDATE, True), (KEEP_OLD, False)], ids=["where-new", "where-old"])
@pytest.mark.parametrize("per_row", [False, True], ids=["mask", "row-flag"])
@pytest.mark.parametrize("batched", fast([False, True], keep={0}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [70, 64])
def test_only_the_selected_elements_change_in_every_kernel(source, new_where_true, per_row, batched, dtype, N):
    A, B, keep, bias, D0 = _problem(batched, per_row, dtype, N)
    selected = (keep > 0.5) if new_where_true else ~(keep > 0.5)
    new = (A.double() @ B.double() + bias.double()).to(dtype)
    want = torch.where(selected.expand_as(D0), new, D0)
    D = D0.clone()
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(source, D=D, keep=keep, bias=bias),
                                 precision="highest")
    kernels = epifuse.get_kernels(args)
    assert [k.name for k in kernels][-1] == "reference" and len(kernels) >= 2
    assert N == 70 or "triton_persistent" in [k.name for k in kernels]
    for kernel in kernels:
        D.copy_(D0)
        kernel.run(args)
        assert torch.equal(D.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), kernel


def test_the_generated_kernel_stores_under_the_condition_and_never_loads_the_operand():
    A, B, keep, bias, D = _problem(False, False, torch.float32)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(UPDATE, D=D, keep=keep, bias=bias))
    kernel = epifuse.get_kernels(args)[0]
    assert kernel.name != "reference"
    lines = kernel.source(args).splitlines()
    loads = [line for line in lines if "tl.load(x" in line]
    stores = [line for line in lines if "tl.store(y0_ptr" in line]
    # operands in order: D is x0, keep x1, bias x2
    assert not any("x0_ptr" in line for line in loads) and any("x1_ptr" in line for line in loads)
    assert stores and all("mask=mask & (" in line for line in stores)


def test_epifuse_gemm_updates_in_place_and_returns_the_operand():
    A, B, keep, bias, D0 = _problem(False, True, torch.float32)
    D = D0.clone()
    out = epifuse.gemm(A, B, UPDATE, D=D, keep=keep, bias=bias, precision="highest")
    assert out is D
    want = torch.where(keep > 0.5, A.double() @ B.double() + bias.double(), D0.double()).float()
    assert torch.equal(D.view(torch.int32), want.view(torch.int32))


def test_another_output_reading_the_updated_value_gets_it_whole():
    """E reads the updated D: the kernel computes where() itself (reading D), both outputs right."""
    source = ("def update(accum, D, keep):\n    D = where(keep > 0.5, accum, D)\n    E = D * 2.0\n"
              "    return D, E\n")
    A, B, keep, _, D0 = _problem(False, False, torch.float32)
    D0 = torch.nan_to_num(D0)
    D = D0.clone()
    _, E = epifuse.gemm(A, B, source, D=D, keep=keep, precision="highest")
    want = torch.where(keep > 0.5, A @ B, D0)
    assert torch.equal(D, want) and torch.equal(E, want * 2.0)


def test_the_update_prints_and_parses_back():
    program = parse(UPDATE)
    assert program.updates == ("D",)
    again = parse(program_source(program))
    assert again.updates == ("D",) and again.operands == program.operands


@pytest.mark.parametrize("source, error, message", [
    ("def e(accum, D):\n    D = where(accum > 0.0, accum, D)\n    return accum\n", EpilogueSyntaxError,
     "updates operand D in place, but the epilogue does not return D"),
    ("def e(accum, D):\n    D = where(accum > 0.0, accum, D)\n    D = where(accum > 1.0, accum, D)\n    return D\n",
     EpilogueSyntaxError, "cannot be defined twice"),
    ("def e(accum, D):\n    D = D + accum\n    return D\n", EpilogueSyntaxError,
     "an operand updated in place is written `D = where\\(cond, value, D\\)`"),
    ("def e(accum, D):\n    D = where(accum > 0.0, D, D)\n    return D\n", EpilogueSyntaxError, "cannot be defined twice"),
    ("def e(accum):\n    accum = where(accum > 0.0, 1.0, accum)\n    return accum\n", EpilogueError, "accum"),
])
def test_what_is_not_an_in_place_update_is_refused(source, error, message):
    with pytest.raises(error, match=message):
        parse(source)


def test_the_custom_ops_refuse_an_in_place_update():
    """Inputs that require grad go through the custom ops, which return new tensors: refused."""
    A, B, keep, bias, D = _problem(False, False, torch.float32)
    A.requires_grad_()
    with pytest.raises(UnsupportedError, match="updates D in place where a condition holds"):
        epifuse.gemm(A, B, UPDATE, D=D, keep=keep, bias=bias)


def test_an_update_needs_the_operand_as_a_full_tensor():
    """D given as a number cannot be written: the output must be a tensor."""
    A, B, keep, bias, _ = _problem(False, False, torch.float32)
    with pytest.raises(epifuse.errors.EpilogueArgumentError, match="Output D must be a torch.Tensor"):
        epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(UPDATE, D=1.0, keep=keep, bias=bias))


def test_the_gluon_kernels_refuse_a_conditional_store_by_name():
    """Its masked store has not run in a Gluon kernel on a GPU: the offline check (no GPU
    needed) says so, and the Triton kernels take it."""
    from epifuse.backends.triton import configs
    from epifuse.backends.triton.families import gluon_problem_check
    A, B = torch.randn(128, 64).to(torch.bfloat16), torch.randn(64, 128).to(torch.bfloat16)
    D, keep, bias = torch.randn(128, 128).to(torch.bfloat16), torch.ones(128, 128), torch.zeros(128)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(UPDATE, D=D, keep=keep, bias=bias))
    status = gluon_problem_check("pingpong", args, configs.INTERPRETER, 90)
    assert status is not None and not status.ok and "conditional stores (D = where(...))" in status.reason


def test_the_split_k_kernel_stores_once_under_the_condition():
    """K = 128: the split-K kernel takes it too (its last program of a tile runs the epilogue)."""
    M, K, N = 45, 128, 64
    A, B = integer_tensor(M, K, dtype=torch.float32), integer_tensor(K, N, dtype=torch.float32)
    keep, bias = (torch.rand(M, N) > 0.5).float(), integer_tensor(N, dtype=torch.float32)
    D0 = torch.randn(M, N)
    D0[::7, ::5] = float("nan")
    want = torch.where(keep > 0.5, (A.double() @ B.double() + bias.double()).float(), D0)
    D = D0.clone()
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(UPDATE, D=D, keep=keep, bias=bias),
                                 precision="highest")
    (split,) = [k for k in epifuse.get_kernels(args) if k.name == "triton_splitk"]
    split.run(args)
    assert torch.equal(D.view(torch.int32), want.view(torch.int32))


def test_an_update_and_the_same_where_under_a_new_name_get_different_kernels():
    """`D = where(...)` and `E = where(...)` (E a new output, D only read) have the same graph
    but for the output's name; the first stores under the condition, the second everywhere.
    Their kernels must not be shared: E is written whole after D's kernel ran in the process."""
    A, B, keep, _, D0 = _problem(False, False, torch.float32)
    D0 = torch.nan_to_num(D0)
    update = "def update(accum, D, keep):\n    D = where(keep > 0.5, accum, D)\n    return D\n"
    fresh = "def fresh(accum, D, keep):\n    E = where(keep > 0.5, accum, D)\n    return E\n"
    want = torch.where(keep > 0.5, (A.double() @ B.double()).float(), D0)
    D = D0.clone()
    epifuse.gemm(A, B, update, D=D, keep=keep, precision="highest")
    assert torch.equal(D, want)
    D = D0.clone()
    E = torch.full_like(D0, 999.0)
    epifuse.gemm(A, B, fresh, D=D, keep=keep, E=E, precision="highest")
    assert torch.equal(E, want) and torch.equal(D, D0)


def test_tuning_builds_its_scratch_and_background_problems_of_an_update():
    """The tuner's copies of a call (fresh outputs; the background worker's rebuilt problem)
    take D once, as operand and output."""
    from epifuse.runtime import tune
    A, B, keep, bias, D = _problem(False, False, torch.float32)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(UPDATE, D=D, keep=keep, bias=bias))
    scratch = tune._scratch_args(args)
    assert scratch.epilogue.operands["D"] is scratch.epilogue.outputs["D"] and scratch.outputs["D"] is not D
    rebuilt = tune._materialized(tune._described(args))
    assert rebuilt.epilogue.operands["D"] is rebuilt.epilogue.outputs["D"]


def test_a_planar_complex_gemm_refuses_a_conditional_store_by_name():
    Ar, Ai = torch.randn(8, 4), torch.randn(8, 4)
    Br, Bi = torch.randn(4, 6), torch.randn(4, 6)
    source = "def e(accum, D, keep):\n    D = where(keep > 0.5, abs(accum), D)\n    return D\n"
    with pytest.raises(UnsupportedError, match="planar complex GEMM does not take conditional stores"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, source, D=torch.zeros(8, 6), keep=torch.ones(8, 6))
