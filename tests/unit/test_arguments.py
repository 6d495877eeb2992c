"""Errors of the arguments (epifuse.arguments and the API's entry points), beside the epilogue
source's errors, which test_errors.py holds: shapes that do not fit, tensors that overlap,
wrong objects and options (arguments objects, kernels, dtypes, yes/no options, the debug
helpers), each naming what it was given, and none leaving an output touched."""
from __future__ import annotations

import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, GemmArguments
from epifuse import EpilogueError
from epifuse.ir import fed_reductions
from test_errors import AB, ALPHA, BIAS, K, M, N, gemm_args, out, outputs_for, raises, src


def test_an_epilogue_function_must_be_wrapped_in_epilogue_arguments():
    A, B = AB()
    with raises("GemmArguments' epilogue must be an EpilogueArguments, not function."):
        GemmArguments(A, B, epilogue=lambda accum: accum)


@pytest.mark.parametrize("value", [None, "args", 3])
def test_kernels_are_chosen_for_gemm_arguments_only(value):
    with raises("Kernels are chosen for a GemmArguments"):
        epifuse.kernel_statuses(value)
    with raises("Kernels are chosen for a GemmArguments"):
        epifuse.get_kernels(EpilogueArguments(ALPHA, alpha=1.0, D=out()) if value is None else value)


@pytest.mark.parametrize("cc", ["90", 9.0, 0, -1, True])
def test_cc_is_a_positive_int(cc):
    A, B = AB()
    args = GemmArguments(A, B, epilogue=EpilogueArguments(ALPHA, alpha=1.0, D=out()))
    with raises("cc must be a compute capability as an int such as 90"):
        epifuse.get_kernels(args, cc=cc)


@pytest.mark.parametrize("value", [None, "args", 3])
def test_a_kernel_runs_and_compiles_on_gemm_arguments_only(value):
    args, grouped = _plain_and_grouped()
    for kernels, expected in ((epifuse.get_kernels(args), "GemmArguments"),
                              (epifuse.get_kernels(grouped), "GroupedGemmArguments")):
        for kernel in kernels:
            for call in (kernel.run, kernel.compile, lambda v: kernel.run(v, verify=True)):
                with raises(f"runs on {expected}, not on {type(value).__name__}"):
                    call(value)


def test_plain_and_grouped_kernels_refuse_each_others_arguments():
    args, grouped = _plain_and_grouped()
    for kernel in epifuse.get_kernels(args):
        with raises("runs on GemmArguments, not on GroupedGemmArguments"):
            kernel.run(grouped)
    for kernel in epifuse.get_kernels(grouped):
        with raises("runs on GroupedGemmArguments, not on GemmArguments"):
            kernel.run(args)


def _plain_and_grouped():
    A, B = AB()
    args = GemmArguments(A, B, epilogue=EpilogueArguments(ALPHA, alpha=1.0, D=out()))
    return args, epifuse.GroupedGemmArguments([args])


@pytest.mark.parametrize("out_dtype", ["float16", 5, (torch.float16,)])
@pytest.mark.parametrize("grad", [False, True])
def test_out_dtype_must_be_a_dtype(out_dtype, grad):
    A, B = AB()
    with raises("out_dtype must be a torch.dtype such as torch.float16"):
        epifuse.gemm(A.requires_grad_(grad), B, ALPHA, alpha=1.0, out_dtype=out_dtype)


@pytest.mark.parametrize("dtype", [getattr(torch, n) for n in ("int4", "float4_e2m1fn_x2", "bits8") if hasattr(torch, n)])
@pytest.mark.parametrize("grad", [False, True])
def test_outputs_of_packed_or_bit_dtypes_are_refused(dtype, grad):
    A, B = AB()
    with raises(f"Output D has dtype {dtype}, which torch cannot convert a float32 value to elementwise"):
        epifuse.gemm(A.requires_grad_(grad), B, ALPHA, alpha=1.0, out_dtype=dtype)


@pytest.mark.parametrize("value", ["False", "no", 2, None, torch.tensor([True, False])])
def test_yes_no_options_take_booleans(value):
    """bool("False") is True: a string would have turned accumulate on."""
    from epifuse.nn import FusedLinear
    for name, make in (("accumulate", lambda v: EpilogueArguments(ALPHA, accumulate=v, alpha=1.0, D=out())),
                       ("deterministic", lambda v: EpilogueArguments(ALPHA, deterministic=v, alpha=1.0, D=out())),
                       ("store_preactivation", lambda v: epifuse.epilogues.BiasElementwise("relu", store_preactivation=v)),
                       ("recompute", lambda v: FusedLinear(4, 3, recompute=v))):
        with raises(f"{name} must be True or False, not {value!r}"):
            make(value)
    EpilogueArguments(ALPHA, accumulate=1, deterministic=False, alpha=1.0, D=out())


def test_debug_helpers_name_bad_arguments():
    from epifuse import debug
    src_ = src("D = relu(accum * alpha)", "return D", params="accum, alpha")
    args = debug.random_arguments(src_, 8, 8, 4, dtype=torch.float32)
    for kwargs, phrase in ((dict(tile=(0,)), "tile must be two ints of 0 or more"),
                           (dict(tile=None), "tile must be two ints of 0 or more"),
                           (dict(tile_shape=(0, 4)), "tile_shape must be two ints of 1 or more"),
                           (dict(dtype=torch.int32), "trace's dtype must be a floating torch.dtype")):
        with raises(phrase):
            debug.trace(args, **kwargs)
    with raises("trace takes a GemmArguments, not EpilogueArguments"):
        debug.trace(args.epilogue)
    with raises("layout_a must be 'row' or 'col', not 'diagonal'"):
        debug.random_arguments(src_, 4, 5, 3, layout_a="diagonal")
    with raises("out_dtype must be a torch.dtype such as torch.float16, not 'float16'"):
        debug.random_arguments(src_, 4, 5, 3, out_dtype="float16")
    assert debug.trace(args, tile=(0, 0)) is not None


def test_verify_needs_values_and_arguments():
    meta = dict(device="meta")
    args = GemmArguments(torch.empty(M, K, **meta), torch.empty(K, N, **meta),
                         epilogue=EpilogueArguments(ALPHA, alpha=1.0, D=torch.empty(M, N, **meta)))
    kernel = epifuse.get_kernels(args)[-1]
    kernel.run(args)
    with raises("verify=True compares values, and tensors on the meta device have none."):
        kernel.run(args, verify=True)
    with raises("runs on GemmArguments, not on NoneType"):
        kernel.run(None, verify=True)


# ---- errors of the arguments and shapes ----------------------------------------------------------

def test_k_mismatch():
    with pytest.raises(EpilogueError, match=r"do not multiply: A has K=8 columns but B has 7 rows"):
        gemm_args(ALPHA, torch.randn(16, 8), torch.randn(7, 16), alpha=1.0, D=out())
    with pytest.raises(EpilogueError, match=r"do not multiply"):
        epifuse.gemm(torch.randn(16, 8), torch.randn(7, 16))


def test_devices_must_match_meta_device():
    # CUDA is not needed to check the device rule: the meta device is another device.
    A, B = AB()
    with raises("Operand bias is on meta but A and B are on cpu."):
        gemm_args(BIAS, A, B, bias=torch.zeros(N, device="meta"), D=out())
    with raises("A is on cpu but B is on meta"):
        gemm_args(BIAS, A, torch.empty(K, N, device="meta"), bias=1.0, D=out())
    with raises("Output D is on meta but A and B are on cpu."):
        gemm_args(BIAS, A, B, bias=1.0, D=torch.empty(M, N, device="meta"))


def test_batch_mismatch():
    with pytest.raises(EpilogueError, match="batch sizes must match"):
        gemm_args(ALPHA, torch.randn(2, M, K), torch.randn(3, K, N), alpha=1.0, D=torch.empty(3, M, N))


def test_elementwise_output_shape_must_match_accum():
    with raises("Output D has shape (16, 15) but accum is (16, 16)"):
        gemm_args(ALPHA, alpha=1.0, D=torch.empty(M, 15))


@pytest.mark.parametrize("value, phrase", [
    (True, "Operand alpha must be a number or a torch.Tensor, but got bool."),
    ("2.0", "Operand alpha must be a number or a torch.Tensor, but got str."),
    (None, "Operand alpha must be a number or a torch.Tensor, but got NoneType."),
    (torch.zeros(16, 16, dtype=torch.bool), "Operand alpha has dtype torch.bool"),
    (torch.zeros(16, 16, dtype=torch.complex64), "Operand alpha has dtype torch.complex64"),
])
def test_operand_types(value, phrase):
    with raises(phrase):
        EpilogueArguments(ALPHA, alpha=value, D=out())


def test_output_must_be_a_tensor():
    with raises("Output D must be a torch.Tensor, but got float."):
        EpilogueArguments(ALPHA, alpha=1.0, D=3.0)


def test_out_and_D_must_agree():
    A, B = AB()
    epi = EpilogueArguments(ALPHA, alpha=1.0, D=out())
    with raises("`out` and the epilogue's output D are different tensors."):
        GemmArguments(A, B, out=out(), epilogue=epi)


RED_ROWS = src("r = sum(accum, dim=1)", "return r")


@pytest.mark.parametrize("value", ["not a tensor", 3.0, [[0.0] * N] * M])
@pytest.mark.parametrize("source", [RED_ROWS, ALPHA, None], ids=["without-D", "with-D", "no-epilogue"])
def test_out_must_be_a_tensor_whatever_the_epilogue_returns(value, source):
    A, B = AB()
    epi = None if source is None else EpilogueArguments(
        source, **({"r": torch.empty(M)} if source is RED_ROWS else {"alpha": 1.0, "D": out()}))
    with raises(f"`out` must be a torch.Tensor, but got {type(value).__name__}."):
        GemmArguments(A, B, out=value, epilogue=epi)


def test_out_needs_an_epilogue_that_returns_D():
    """`out` is the epilogue's D: with an epilogue that returns none, nothing would write it."""
    A, B = AB()
    epi = EpilogueArguments(RED_ROWS, r=torch.empty(M))
    with raises("`out` is the epilogue's output D, but this epilogue returns r and no D"):
        GemmArguments(A, B, out=out(), epilogue=epi)
    assert GemmArguments(A, B, out=None, epilogue=epi).reductions == {"r": "sum"}


def test_arguments_tell_a_tensor_changed_since_they_were_checked():
    """current() is the cheap test (sizes, strides, addresses); check_current() names a resize,
    and checks a tensor in new memory again and takes it."""
    A, B = AB()
    D = out()
    args = gemm_args(BIAS, A, B, bias=torch.randn(N), D=D)
    assert args.current() and args.check_current() is False
    size = A.untyped_storage().nbytes()
    A.untyped_storage().resize_(0)
    assert not args.current()
    with raises("A's storage holds 0 bytes"):
        args.check_current()
    A.untyped_storage().resize_(size)   # new memory (at the old address, maybe)
    args.check_current()
    assert args.current()
    D.resize_(M - 1, N)
    with raises(f"Output D has shape ({M - 1}, {N}) and strides ({N}, 1) now, but ({M}, {N})"):
        args.check_current()


def test_an_operand_cannot_be_returned():
    with raises("Output 'C' is also an input of the epilogue."):
        gemm_args(src("D = accum", "return C", params="accum, C"), C=out())


# ---- reductions ---------------------------------------------------------------------------------

RED_SUM_DIM1 = src("r = sum(accum, dim=1)", "return r")


@pytest.mark.parametrize("source, shape, expected", [
    (RED_SUM_DIM1, (12,), "expected (16,) or (16, 1)"),
    (RED_SUM_DIM1, (16, 12), "expected (16,) or (16, 1)"),
    (RED_SUM_DIM1, (1, 16), "expected (16,) or (16, 1)"),
    (src("r = accum.max(dim=0)", "return r"), (16,), "expected (12,) or (1, 12)"),
    (src("r = mean(accum, dim=(0, 1))", "return r"), (16,), "gives one value: pass a one-element tensor"),
])
def test_reduction_destination_shape_must_match_dim(source, shape, expected):
    A, B = torch.randn(16, 8), torch.randn(8, 12)  # M != N
    with pytest.raises(EpilogueError) as info:
        gemm_args(source, A, B, r=torch.empty(shape))
    message = str(info.value)
    assert "Output r has shape" in message and expected in message


def test_reduction_destination_shapes_that_fit():
    A, B = torch.randn(16, 8), torch.randn(8, 12)
    assert gemm_args(RED_SUM_DIM1, A, B, r=torch.empty(16)).reductions == {"r": "sum"}
    assert gemm_args(RED_SUM_DIM1, A, B, r=torch.empty(16, 1)).reductions == {"r": "sum"}


@pytest.mark.parametrize("lines", [
    ["r = sum(accum, dim=0)", "D = accum + r", "return D, r"],
    ["r = sum(accum, dim=0)", "D = accum * 2.0", "s = r * 2.0", "return D, s"],
    ["r = accum.max(dim=0)", "D = relu(r)", "return D"],
    ["D = accum - mean(accum, dim=0, keepdim=True)", "return D"],
    ["D = accum / amax(accum)", "return D"],
])
def test_a_reduction_result_over_other_dims_than_n_cannot_be_used(lines):
    source = src(*lines)
    with raises("one kernel runs a reduction that feeds later math only over accum's last dimension") as info:
        gemm_args(source, **outputs_for(source))
    assert info.value.loc is not None


@pytest.mark.parametrize("lines, outputs", [
    (["r = sum(accum, dim=1)", "D = accum + r", "return D, r"], {"r": (M,)}),
    (["D = accum - mean(accum, dim=-1, keepdim=True)", "return D"], {}),
])
def test_a_reduction_result_over_n_binds_for_one_kernel(lines, outputs):
    """One kernel runs it where a tile spans N (tests/kernels/test_one_pass_reductions.py)."""
    source = src(*lines)
    args = gemm_args(source, **{**outputs_for(source), **{n: torch.empty(s) for n, s in outputs.items()}})
    assert [node.op.name for node in fed_reductions(args.graph)] in (["sum"], ["mean"])


def test_reduction_dim_out_of_range():
    with raises("sum(dim=2) is out of range: accum has 2 dimensions"):
        gemm_args(src("r = sum(accum, dim=2)", "return r"), r=torch.empty(M))
    with raises("sum() reduces dim -1 twice."):
        gemm_args(src("r = sum(accum, dim=(1, -1))", "return r"), r=torch.empty(M))


# ---- aliasing -----------------------------------------------------------------------------------

def test_an_output_overlapping_A_is_rejected():
    A, B = torch.randn(M, K), torch.randn(K, N)
    with raises("Output D overlaps the GEMM input A."):
        gemm_args(ALPHA, A, B, alpha=1.0, D=A)
    with raises("Output D overlaps the GEMM input A."):
        big = torch.randn(2 * M, K)
        gemm_args(ALPHA, big[:M], B, alpha=1.0, D=big[M // 2: M // 2 + M])
    with raises("Output D overlaps the GEMM input B."):
        gemm_args(ALPHA, A, B, alpha=1.0, D=B)


def test_an_output_beside_A_in_one_storage_is_fine():
    storage = torch.randn(2 * M, K)
    A, D = storage[:M], storage[M:]
    args = gemm_args(ALPHA, A, torch.randn(K, N), alpha=1.0, D=D)
    assert args.outputs["D"] is D


def test_overlapping_outputs_are_rejected():
    source = src("D = accum", "F = accum * 2.0", "return D, F")
    D = out()
    with raises("Outputs D and F overlap in memory."):
        gemm_args(source, D=D, F=D)


def test_an_output_partly_overlapping_an_operand_is_rejected():
    storage = torch.randn(M + 1, N)
    with raises("Output D partly overlaps operand C."):
        gemm_args(src("D = accum + C", "return D", params="accum, C"), C=storage[:M], D=storage[1:])


def test_errors_leave_outputs_untouched():
    D = torch.full((M, N), 7.0)
    with pytest.raises(EpilogueError):
        gemm_args(BIAS, bias=torch.zeros(3), D=D)
    with pytest.raises(EpilogueError):
        epifuse.gemm(*AB(), BIAS, bias=torch.zeros(3), D=D)
    assert torch.equal(D, torch.full((M, N), 7.0))


# ---- groups that differ from group 0 ------------------------------------------------------------

GROUP_SRC = "def epi(accum, alpha, bias):\n    F = accum * alpha + bias\n    D = relu(F)\n    return D, F\n"


def _group(dtype=torch.float16, b_dtype=None, source=GROUP_SRC, alpha=2.0, bias=None, D_dtype=torch.float16,
           device="cpu", options=None, gemm_options=None, tensors=None):
    """One 2-D GEMM of a grouped problem: integer-valued A, B and bias; `tensors` replaces the
    epilogue's keywords (operands and outputs) for an epilogue of other names."""
    A = torch.randint(-3, 4, (M, K)).to(dtype).to(device)
    B = torch.randint(-3, 4, (K, N)).to(b_dtype or dtype).to(device)
    bias = torch.randint(-3, 4, (N,)).float().to(device) if bias is None else bias
    tensors = tensors or dict(alpha=alpha, bias=bias, D=torch.empty(M, N, dtype=D_dtype, device=device),
                              F=torch.empty(M, N, device=device))
    return GemmArguments(A, B, epilogue=EpilogueArguments(source, **(options or {}), **tensors), **(gemm_options or {}))


GROUP_DIFFERENCES = {
    "device": (lambda: _group(device="meta"), "Group 2 is on meta but group 0 is on cpu"),
    "A-dtype": (lambda: _group(dtype=torch.float32, b_dtype=torch.float16),
                "Group 2: A is torch.float32 but group 0's A is torch.float16"),
    "B-dtype": (lambda: _group(b_dtype=torch.float32), "Group 2: B is torch.float32 but group 0's B is torch.float16"),
    "accumulator-type": (lambda: _group(gemm_options={"accumulator_type": torch.float16}),
                         "Group 2 has accumulator_type=torch.float16 but group 0 has torch.float32"),
    "precision": (lambda: _group(gemm_options={"precision": "highest"}),
                  "Group 2 has precision='highest' but group 0 has 'default'"),
    "accumulate": (lambda: _group(options={"accumulate": True}), "Group 2 has accumulate=True but group 0 has False"),
    "deterministic": (lambda: _group(options={"deterministic": True}),
                      "Group 2 has deterministic=True but group 0 has False"),
    "compute-dtype-given": (lambda: _group(options={"compute_dtype": torch.float64}),
                            ("Group 2 computes in torch.float64 (compute_dtype=torch.float64 is given) but group 0 in "
                             "torch.float32 (the default: none of A, B and its tensor operands is float64)")),
    "compute-dtype-from-a-float64-operand": (
        lambda: _group(bias=torch.randint(-3, 4, (N,)).double()),
        ("Group 2 computes in torch.float64 (the default, as its operand bias is torch.float64) but group 0 in "
         "torch.float32 (the default: none of A, B and its tensor operands is float64)")),
    "operand-dtype": (lambda: _group(bias=torch.randint(-3, 4, (N,)).half()),
                      "Group 2: operand bias is torch.float16 but group 0's is torch.float32"),
    "output-dtype": (lambda: _group(D_dtype=torch.float32), "Group 2: output D is torch.float32 but group 0's is torch.float16"),
    "operand-names": (lambda: _group(source=GROUP_SRC.replace("alpha", "beta"), tensors=dict(
                          beta=2.0, bias=torch.randint(-3, 4, (N,)).float(), D=torch.empty(M, N, dtype=torch.float16),
                          F=torch.empty(M, N))),
                      "Group 2's epilogue takes the operands (beta, bias) but group 0's takes (alpha, bias)"),
    "output-names": (lambda: _group(source=GROUP_SRC.replace("F", "G"), tensors=dict(
                         alpha=2.0, bias=torch.randint(-3, 4, (N,)).float(), D=torch.empty(M, N, dtype=torch.float16),
                         G=torch.empty(M, N))),
                     "Group 2's epilogue returns (D, G) but group 0's returns (D, F)"),
    "epilogue-computation": (lambda: _group(source=GROUP_SRC.replace("+ bias", "- bias")),
                             ("Group 2's epilogue computes `F = accum * alpha - bias` where group 0's computes "
                              "`F = accum * alpha + bias`")),
    "epilogue-extra-statement": (lambda: _group(source=GROUP_SRC.replace("D = relu(F)", "G = F * 2.0\n    D = relu(G)")),
                                 "Group 2's epilogue computes `G = F * 2.0` where group 0's computes `D = relu(F)`"),
    "epilogue-output-order": (lambda: _group(source=GROUP_SRC.replace("return D, F", "return F, D")),
                              "Group 2's epilogue returns (F, D) but group 0's returns (D, F)"),
    "operand-kind": (lambda: _group(alpha=torch.tensor(2.0)),
                     "Group 2: operand alpha is a tensor but group 0's is a Python number"),
    "number-value": (lambda: _group(alpha=3.0), "Group 2: operand alpha = 3.0 but group 0 has alpha = 2.0"),
}


@pytest.mark.parametrize("difference", GROUP_DIFFERENCES)
def test_a_group_that_differs_from_group_0_is_named_with_both_values(difference):
    """Each attribute one launch shares, differing in group 2 only: the error names that
    attribute, and group 2's and group 0's values of it."""
    build, phrase = GROUP_DIFFERENCES[difference]
    with raises(phrase):
        epifuse.GroupedGemmArguments([_group(), _group(), build()])


@pytest.mark.parametrize("difference", ["operand-roles", "layouts"])
def test_groups_may_differ_in_roles_and_layouts(difference):
    """What the groups' table holds per group (strides, so an operand's broadcast and each
    tensor's layout) may differ from group 0's."""
    other = _group(bias=torch.randint(-3, 4, (M, N)).float()) if difference == "operand-roles" else \
        _group(bias=torch.randint(-3, 4, (2 * N,)).float()[::2])
    assert len(epifuse.GroupedGemmArguments([_group(), other])) == 2


# ---- scalar reductions are 0-d ----------------------------------------------------------------

@pytest.mark.parametrize("batched", [False, True])
def test_a_reduction_over_every_dim_is_allocated_0d_as_torch_sum(batched):
    """output_specs and allocate_outputs give a reduction over every dim torch's 0-d shape (it was
    (1,)); a reduction over some dims keeps the others, as torch does; the reference kernel
    writes the 0-d destination; the custom ops' meta impl gives the same shapes."""
    from epifuse.allocation import allocate_outputs
    from epifuse.backends.reference import ReferenceKernel
    from epifuse.frontend import parse
    L = 3
    A = torch.randint(-3, 4, ((L, 12, 8) if batched else (12, 8))).float()
    B = torch.randint(-1, 2, ((L, 8, 10) if batched else (8, 10))).float()
    every = (0, 1, 2) if batched else (0, 1)
    source = ("def loss(accum):\n    s = sum(accum * accum)\n"
              f"    t = amax(accum, dim={every})\n    r = mean(accum, dim={every[-2:]})\n    return s, t, r\n")
    program = parse(source)
    accum = A.double() @ B.double()
    refs = {"s": torch.sum(accum * accum), "t": torch.amax(accum.abs(), dim=every),
            "r": torch.mean(accum, dim=every[-2:])}
    tensors = allocate_outputs(program, A, B, {})
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {n: tuple(r.shape) for n, r in refs.items()}
    assert tensors["s"].shape == () and tensors["r"].shape == ((L,) if batched else ())
    args = GemmArguments(A, B, epilogue=EpilogueArguments(program, **tensors))
    ReferenceKernel().run(args)
    for name, ref in refs.items():
        assert torch.allclose(tensors[name].double(), ref, rtol=1e-6), name
    planned = epifuse.torch_ops.gemm(A.to("meta"), B.to("meta"), source)
    assert [tuple(t.shape) for t in planned] == [tuple(r.shape) for r in refs.values()]


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_scalar_reduction_still_takes_any_one_element_destination(shape):
    A, B = torch.randint(-3, 4, (12, 8)).float(), torch.randint(-1, 2, (8, 10)).float()
    s = torch.full(shape, float("nan"))
    args = gemm_args("def loss(accum):\n    s = sum(accum)\n    return s\n", A, B, s=s)
    epifuse.backends.reference.ReferenceKernel().run(args)
    assert s.shape == shape and s.double().item() == (A.double() @ B.double()).sum().item()


# ---- reprs ----------------------------------------------------------------------------------------

_REPR_SOURCE = ("def relu_aux(accum, alpha, C, bias):\n    F = accum * alpha + C + bias\n    D = relu(F)\n"
                "    r = sum(F, dim=1)\n    s = amax(F)\n    return D, F, r, s\n")


def _repr_tensors(m, device="cpu", dtype=torch.float16):
    """Tensors whose values (1234.5) a repr must not show."""
    def full(*shape, dtype=torch.float32):
        return torch.full(shape, 1234.5, device=device, dtype=dtype)
    return dict(alpha=3.0, C=full(m, N), bias=full(N), D=full(m, N, dtype=dtype), F=full(m, N),
                r=full(m), s=full())


def test_arguments_reprs_say_what_the_call_is_without_tensor_values():
    A, B = torch.randn(24, K, dtype=torch.float16), torch.randn(K, N, dtype=torch.float16)
    epi = EpilogueArguments(_REPR_SOURCE, deterministic=True, **_repr_tensors(24))
    text = repr(epi)
    assert text.startswith("EpilogueArguments(relu_aux(accum, alpha, C, bias) -> D, F, r, s;"), text
    assert "alpha=3.0" in text and f"C=float32[24, {N}]" in text and "s=float32[]" in text
    assert "deterministic=True" in text and "1234" not in text and "tensor(" not in text
    args = GemmArguments(A, B, epilogue=epi)
    text = repr(args)
    for part in (f"GemmArguments(M=24, N={N}, K={K}, A=float16[24, {K}], B=float16[{K}, {N}]",
                 "epilogue=relu_aux(alpha: number 3.0", f"C: tile float32[24, {N}]", f"bias: row float32[{N}]",
                 f"D: tile float16[24, {N}]", "r: sum over dim=1 float32[24]", "s: amax over all dims float32[]",
                 "accumulator=float32", "compute=float32", "precision='default'", "deterministic=True"):
        assert part in text, (part, text)
    assert "1234" not in text and "tensor(" not in text and "L=" not in text and "stand-ins" not in text
    A2 = torch.randn(16, K, dtype=torch.float16)
    other = GemmArguments(A2, B, epilogue=EpilogueArguments(_REPR_SOURCE, deterministic=True, **_repr_tensors(16)))
    text = repr(epifuse.GroupedGemmArguments([args, other]))
    assert text.startswith(f"GroupedGemmArguments(2 groups [24x{N}x{K}, 16x{N}x{K}] (M x N x K), A=float16"), text
    assert "epilogue=relu_aux(alpha: number, C: tile, bias: row)" in text and "r: sum over dim=1 float32" in text
    assert "1234" not in text


def test_arguments_reprs_tell_batches_and_stand_ins():
    from torch._subclasses.fake_tensor import FakeTensorMode
    A, B = torch.empty(2, 24, K, device="meta"), torch.empty(2, K, N, device="meta")
    text = repr(GemmArguments(A, B, out=torch.empty(2, 24, N, device="meta"), precision="highest"))
    assert text.startswith(f"GemmArguments(L=2, M=24, N={N}, K={K}, A=float32[2, 24, {K}] meta"), text
    assert "epilogue=identity() -> D: tile" in text and "precision='highest'" in text and "stand-ins" in text
    with FakeTensorMode():
        A, B, D = torch.empty(24, K), torch.empty(K, N), torch.empty(24, N)
        text = repr(GemmArguments(A, B, out=D))
    assert f"A=float32[24, {K}] fake" in text and "stand-ins" in text
