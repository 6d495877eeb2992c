"""Errors for the wrong objects and options in the API's hands (beside the epilogue source's
errors, which test_errors.py holds): arguments objects, kernels, dtypes, yes/no options and
the debug helpers each name what they were given."""
from __future__ import annotations

import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, GemmArguments
from test_errors import AB, ALPHA, K, M, N, out, raises, src


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
