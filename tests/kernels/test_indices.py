"""row() and col() (issue 36): the global position of each element of accum, per batch, in
every Triton kernel that takes them; picking a target column; a cross-entropy with class-index
targets and an ignore index that never writes the logits."""
import pytest
import torch

import epifuse
from epifuse import epilogues
from epifuse.errors import EpilogueError, ShapeError
from epifuse.frontend import parse
from epifuse.printing import program_source
from epifuse.ops import col, row, where
from helpers import lm_head, integer_tensor

POSITIONS = "def epi(accum):\n    D = row() * 1000.0 + col()\n    E = accum + col()\n    return D, E\n"


def _triton_kernels(args):
    kernels = [k for k in epifuse.get_kernels(args) if k.name.startswith("triton_")]
    assert kernels, epifuse.kernel_statuses(args)
    return kernels


@pytest.mark.parametrize("rank", [2, 3])
def test_positions_are_global_and_count_from_zero_in_every_batch(rank, device):
    """Integer-valued: row * 1000 + col is exact in fp32 for M, N < 1000, so the check is
    equality, in every kernel, across several tiles each way (interpreter tiles are 32)."""
    M, N, K, L = 70, 90, 8, 2
    batch = (L,) if rank == 3 else ()
    A = integer_tensor(*batch, M, K, device=device, dtype=torch.float32)
    B = integer_tensor(*batch, K, N, device=device, dtype=torch.float32)
    D, E = (torch.empty(*batch, M, N, device=device) for _ in range(2))
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(POSITIONS, D=D, E=E))
    expected = (torch.arange(M, device=device)[:, None] * 1000 + torch.arange(N, device=device)[None, :]).float()
    for kernel in _triton_kernels(args):
        D.fill_(float("nan"))
        E.fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(D, expected.expand_as(D)), kernel
        assert torch.equal(E, (A.double() @ B.double() + torch.arange(N, device=device)).float()), kernel


def test_where_col_equals_target_picks_each_rows_target(device):
    M, N, K = 50, 130, 12
    A = integer_tensor(M, K, device=device, dtype=torch.float32)
    B = integer_tensor(K, N, device=device, dtype=torch.float32)
    target = torch.randint(0, N, (M, 1), device=device)
    src = "def pick(accum, target):\n    t = sum(where(col() == target, accum, 0.0), dim=1)\n    return t\n"
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, target=target,
                                                                          t=torch.empty(M, device=device)))
    expected = (A.double() @ B.double()).gather(1, target)[:, 0].float()
    for kernel in _triton_kernels(args):
        kernel.run(args)
        assert torch.equal(args.outputs["t"], expected), kernel


def test_cross_entropy_from_class_indices_with_an_ignore_index(device):
    """mean over the rows whose target is not -100 of logsumexp(z) - z[target], z = x @ W.T + b,
    from two (tokens,) outputs, never the (tokens, vocab) logits (an ignored row picks nothing;
    the mean over kept rows is taken on the (tokens,) vectors); against torch's cross_entropy
    with ignore_index=-100."""
    tokens, hidden, vocab = 64, 16, 200
    x, W, b, target = lm_head(device, tokens, hidden, vocab, seed=17)
    target[::7] = -100
    src = ("def ce(accum, bias, target):\n"
           "    z = accum + bias\n"
           "    lse = logsumexp(z, dim=1)\n"
           "    picked = sum(where(col() == target, z, 0.0), dim=1)\n"
           "    return lse, picked\n")
    lse, picked = epifuse.gemm(x, W.t(), src, bias=b, target=target[:, None])
    keep = target != -100
    loss = (lse - picked)[keep].mean()
    expected = torch.nn.functional.cross_entropy(x.double() @ W.double().t() + b.double(), target,
                                                 ignore_index=-100)
    assert torch.isclose(loss.double(), expected, rtol=1e-5)


def test_gradients_flow_past_the_positions(device):
    gen = torch.Generator(device="cpu").manual_seed(19)
    A = torch.randn(5, 4, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    B = torch.randn(4, 6, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    src = "def epi(accum):\n    D = tanh(accum) * col() + row()\n    return D\n"
    assert torch.autograd.gradcheck(lambda a, b: epifuse.gemm(a, b, src), (A, B))


def test_on_torch_tensors_they_take_accum_for_its_shape():
    assert torch.equal(col(torch.zeros(2, 3)), torch.tensor([[0.0, 1.0, 2.0]]))
    assert torch.equal(row(torch.zeros(2, 4, 3)), torch.tensor([[[0.0], [1.0], [2.0], [3.0]]]))
    with pytest.raises(TypeError, match=r"call it as col\(accum\)"):
        col()


@pytest.mark.parametrize("index", [row, col])
def test_on_fewer_than_two_dimensions_they_say_so(index):
    for shape in [(5,), ()]:
        with pytest.raises(ShapeError, match=rf"{index.name}\(accum\) needs accum of 2 or 3 dimensions"):
            index(torch.randn(shape))


def with_accum(accum, bias):
    D = accum * row(accum) - col(accum) + bias
    E = where(col(accum) == row(accum), accum, 0.0)
    return D, E


@pytest.mark.parametrize("rank", [2, 3])
def test_row_and_col_of_accum_spell_the_same_in_an_epilogue_and_on_tensors(rank, device):
    """row(accum) / col(accum): the parser reads the argument as the accumulator's shape (the
    same op as row() / col()), so an epilogue with them is its own eager reference."""
    batch = (2,) if rank == 3 else ()
    A = torch.randn(*batch, 40, 12, device=device)
    B = torch.randn(*batch, 12, 36, device=device)
    bias = torch.randn(36, device=device)
    D, E = epifuse.gemm(A, B, with_accum, bias=bias)
    eager_D, eager_E = with_accum(A.double() @ B.double(), bias.double())
    assert eager_D.dtype == torch.float64
    assert torch.allclose(D.double(), eager_D, rtol=1e-5, atol=1e-4)
    assert torch.allclose(E.double(), eager_E, rtol=1e-5, atol=1e-5)
    spellings = ["row(accum) - col(accum=accum)", "row() - col()"]
    sources = [program_source(parse(f"def e(accum):\n    D = accum * {s}\n    return D\n")) for s in spellings]
    assert sources[0] == sources[1]


@pytest.mark.parametrize("call, message", [
    ("col(bias)", r"col\(\) takes no argument but the accumulator: 'bias' is not accum"),
    ("row(accum * 2.0)", r"row\(\) takes no argument but the accumulator"),
    ("col(accum, accum)", r"col\(\) takes at most 1 argument \(accum\), got 2"),
    ("accum.row()", r"row\(\) is not a method of a tensor"),
    ("row(x=accum)", r"row\(\) got an unexpected keyword argument 'x'"),
])
def test_an_index_takes_nothing_but_accum(call, message):
    with pytest.raises(EpilogueError, match=message) as info:
        parse(f"def e(accum, bias):\n    D = accum + {call}\n    return D\n")
    assert info.value.loc.line == 2 and "(accum)" in (info.value.hint or "")


def test_row_of_accum_in_an_activation_is_refused():
    """An activation sees only its own argument, so row(accum) there is refused as any read of
    accum is; row() runs."""
    with pytest.raises(EpilogueError, match="Variable 'accum' is not defined"):
        epilogues.Generic("def act(x):\n    y = x + row(accum)\n    return y\n")
    epi = epilogues.Generic("def act(x):\n    y = x + row()\n    return y\n")
    A, B, C = torch.randn(8, 4), torch.randn(4, 6), torch.randn(8, 6)
    expected = A.double() @ B.double() + C.double() + torch.arange(8).double()[:, None]
    assert torch.allclose(epi(A, B, C=C).double(), expected, atol=1e-5)
