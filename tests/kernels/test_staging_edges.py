"""Staged epilogues at their edges (epifuse.staging, api.gemm's passes): the caller's tensors
for returned statistics, keywords checked as a one-pass call checks them, aliases of a
reduction, statements no output reads, and a reduction of a reduction's value."""
import pytest
import torch

import epifuse
from epifuse import staging
from epifuse.errors import EpilogueArgumentError, EpilogueError
from epifuse.frontend import parse

RETURNED_AND_FED = "def e(accum):\n    m = max(accum, dim=1)\n    P = exp(accum - m)\n    return P, m\n"


def _inputs(device, M=40, K=16, N=44):
    return torch.randn(M, K, device=device), torch.randn(K, N, device=device)


def test_a_returned_statistic_is_written_into_the_callers_tensor(device):
    A, B = _inputs(device)
    m, P = torch.full((40, 1), float("nan"), device=device), torch.full((40, 44), float("nan"), device=device)
    got_P, got_m = epifuse.gemm(A, B, RETURNED_AND_FED, m=m, P=P)
    assert got_m is m and got_P is P
    z = A.double() @ B.double()
    assert torch.allclose(m.double()[:, 0], z.amax(dim=1), atol=1e-5)
    assert torch.allclose(P.double(), torch.exp(z - z.amax(dim=1, keepdim=True)), atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"Cc": 1.0}, "Unexpected keyword argument 'Cc'"),
    ({"Q": "output"}, "Unexpected keyword argument 'Q'"),
])
def test_keywords_are_checked_before_any_pass_runs(kwargs, message, device):
    A, B = _inputs(device)
    kwargs = {k: (torch.empty(40, 44, device=device) if v == "output" else v) for k, v in kwargs.items()}
    with pytest.raises(EpilogueArgumentError, match=message):
        epifuse.gemm(A, B, RETURNED_AND_FED, **kwargs)


def test_an_alias_of_a_reduction_is_a_reduction_output_not_a_statistic(device):
    """`D = m` copies a reduction: returned alone it is one kernel's (M,) output; read by later
    math through the alias, it is a statistic, and comes back from the pass computing it."""
    A, B = _inputs(device)
    z = A.double() @ B.double()
    alone = "def e(accum):\n    m = max(accum, dim=1)\n    D = m\n    return D\n"
    assert not staging.needs_passes(parse(alone))
    D = epifuse.gemm(A, B, alone)
    assert D.shape == (40,) and torch.allclose(D.double(), z.amax(dim=1), atol=1e-5)
    through = "def e(accum):\n    m = max(accum, dim=1)\n    D = m\n    P = exp(accum - D)\n    return P, D\n"
    P, D = epifuse.gemm(A, B, through)
    assert D.shape == (40,) and torch.allclose(D.double(), z.amax(dim=1), atol=1e-5)
    assert torch.allclose(P.double(), torch.exp(z - z.amax(dim=1, keepdim=True)), atol=1e-5)


def test_statements_no_output_reads_add_no_pass(device):
    """Dead statements that read a statistic neither fail nor cost a GEMM."""
    src = ("def e(accum):\n    m = max(accum, dim=1)\n    s = sum(exp(accum - m), dim=1)\n"
           "    t = accum / s\n    return m\n")
    assert len(staging.passes(parse(src))) == 1
    A, B = _inputs(device)
    m = epifuse.gemm(A, B, src)
    assert torch.allclose(m.double(), (A.double() @ B.double()).amax(dim=1), atol=1e-5)


@pytest.mark.parametrize("line", [
    "D = sum(max(accum, dim=1))",
    "D = max(sum(accum, dim=0), dim=0)",
    "m = mean(accum, dim=1)\n    D = sum(m * 2.0)",
])
def test_a_reduction_of_a_statistic_alone_is_refused_by_name(line, device):
    """An epilogue broadcasts a reduction's input to accum's shape: folding a statistic alone
    would fold its broadcast copies (N times torch's value), so it is refused."""
    A, B = _inputs(device)
    with pytest.raises(EpilogueError, match="varies along accum only through another reduction's result"):
        epifuse.gemm(A, B, f"def e(accum):\n    {line}\n    return D\n")
