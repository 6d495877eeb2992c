"""The binder: reduction dims against accum's rank. Every reduction of the registry takes
`dim` as torch does (an int, a tuple or list of ints, None for every dimension); a dim that
names no dimension, one twice, one outside accum's, or anything but an int is an
EpilogueError with its place, through the parser, a hand-made Program and epifuse.gemm alike.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import epifuse
from epifuse.binding import bind
from epifuse.errors import EpilogueError, EpilogueSyntaxError
from epifuse.frontend import parse
from epifuse.ops import OPS

from helpers import integer_tensor

REDUCTIONS = sorted(name for name, opdef in OPS.items() if opdef.is_reduction)

# What each reduction means in torch, on float64; a reduction added later falls back to its
# registry reference.
TORCH = {
    "sum": lambda x, dim: torch.sum(x, dim=dim),
    "mean": lambda x, dim: torch.mean(x, dim=dim),
    "max": lambda x, dim: torch.amax(x, dim=dim),
    "min": lambda x, dim: torch.amin(x, dim=dim),
    "amax": lambda x, dim: torch.amax(x.abs(), dim=dim),
}


def _torch(name, x, dim):
    return TORCH[name](x, dim) if name in TORCH else OPS[name].ref(x, dim=dim)


def _source(name: str, dim: str, method: bool = False) -> str:
    call = f"accum.{name}(dim={dim})" if method else f"{name}(accum, dim={dim})"
    return f"def e(accum):\n    r = {call}\n    return r\n"


# (dim as written, rank of accum, what the error says)
BAD_DIMS = [
    ("()", 2, "names no dimension to reduce"),
    ("[]", 3, "names no dimension to reduce"),
    ("(1, 1)", 2, "reduces dim 1 twice"),
    ("(0, -2)", 2, "reduces dim -2 twice"),
    ("[2, -1, 0]", 3, "reduces dim -1 twice"),
    ("2", 2, "is out of range: accum has 2 dimensions"),
    ("(-3,)", 2, "is out of range: accum has 2 dimensions"),
    ("(0, 3)", 3, "is out of range: accum has 3 dimensions"),
    ("1.0", 2, "needs dim to be an int or a tuple of ints"),
    ("(0, True)", 2, "needs dim to be an int or a tuple of ints"),
    ("'a'", 2, "needs dim to be an int or a tuple of ints"),
]


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("dim, rank, message", BAD_DIMS)
def test_a_bad_reduction_dim_is_a_clear_error(name, dim, rank, message):
    for method in (False, True):
        source = _source(name, dim, method)
        with pytest.raises(EpilogueSyntaxError, match=message) as info:
            bind(parse(source), {}, rank)
        assert info.value.loc is not None and info.value.loc.line == 2


@pytest.mark.parametrize("name", REDUCTIONS)
def test_an_empty_dim_is_refused_through_gemm_with_a_hint(name):
    """torch reads an empty dim as every dimension (sum) or refuses it (max); NumPy reads it as
    none. epifuse refuses it, before any kernel runs: it was a crash (max, min) or an
    unreduced (M, N) result (sum, mean, amax)."""
    A, B = integer_tensor(4, 3, dtype=torch.float32), integer_tensor(3, 5, dtype=torch.float32)
    for dim in ("()", "[]"):
        with pytest.raises(EpilogueError, match=r"names no dimension to reduce") as info:
            epifuse.gemm(A, B, _source(name, dim))
        assert "dim=None" in info.value.hint
        with pytest.raises(EpilogueError, match=r"names no dimension to reduce"):
            epifuse.gemm(A.clone().requires_grad_(), B, _source(name, dim))


@pytest.mark.parametrize("name", REDUCTIONS)
def test_a_hand_made_program_with_odd_dims_binds_or_is_refused(name):
    """A Program built without the parser: a bare int dim is one dim (as torch takes it);
    anything else that is not ints is an EpilogueSyntaxError, not a TypeError from inside."""
    program = parse(_source(name, "1"))

    def with_dim(dim):
        statement = program.statements[0]
        expr = dataclasses.replace(statement.expr, params=(("dim", dim),))
        return dataclasses.replace(program, statements=(dataclasses.replace(statement, expr=expr),))

    def dims(p):
        return bind(p, {}, 2).outputs[0].node.dims

    assert dims(with_dim(1)) == dims(program) == ("N",)
    assert dims(with_dim([0, 1])) == dims(with_dim(None)) == ("M", "N")
    for dim in ((1.5,), 1.5, ("a",), (None,), True, ()):
        with pytest.raises(EpilogueSyntaxError, match=f"{name}\\(dim="):
            bind(with_dim(dim), {}, 2)


@pytest.mark.parametrize("name", REDUCTIONS)
def test_every_way_to_write_dim_reduces_as_torch_does(name):
    """dim as an int, a negative int, a list, a tuple out of order, and None, over a batched
    accum, against torch's reduction of the float64 accum."""
    A = integer_tensor(2, 4, 3, dtype=torch.float32)
    B = integer_tensor(2, 3, 5, dtype=torch.float32)
    accum = A.double() @ B.double()
    for dim, torch_dim in (("-1", -1), ("[1]", [1]), ("(2, 0)", (0, 2)), ("None", (0, 1, 2))):
        out = epifuse.gemm(A, B, _source(name, dim, method=dim == "[1]"))
        want = _torch(name, accum, torch_dim)
        assert out.numel() == want.numel(), (dim, out.shape, want.shape)
        # a log-sum-exp's fp32 exp and log err by about 1e-7 of max(|value|, 1): absolute near 0;
        # a mean folds its partials each scaled by 1 / count in fp32, so it errs by a few ulps of
        # the largest term, not of the (possibly much smaller) mean
        atol = 2e-6 if name == "logsumexp" else 1e-6 * float(accum.abs().max()) if name == "mean" else 0
        assert torch.allclose(out.double().reshape(want.shape), want, rtol=1e-6, atol=atol), (dim, out, want)


def test_the_registry_reductions_are_all_known_here():
    """A reduction added to the registry runs through the tests above with its registry
    reference; naming its torch meaning in TORCH checks that reference too."""
    assert set(REDUCTIONS) >= {"sum", "mean", "max", "min", "amax"}
    for name in REDUCTIONS:
        x = torch.randn(3, 4, dtype=torch.float64)
        assert torch.allclose(OPS[name].ref(x, dim=(1,)), _torch(name, x, (1,)))
