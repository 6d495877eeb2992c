"""The canonical hash (renaming keeps the key, roles change it) and the graph passes, one at a
time on graphs built with `epifuse.binding.bind`, then end to end through the interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import epifuse
from epifuse import EpilogueArguments, GemmArguments
from epifuse.ir import accum, const, op
from epifuse.passes import canonical_hash, optimize
from epifuse.passes.algebra import simplify_algebra
from epifuse.passes.dce import eliminate_dead_code
from epifuse.passes.fold import fold_constants
from epifuse.reference import evaluate

from frontend_helpers import M, N, accum_of, body, bound, cpu_ab, ops_in, output_node
from helpers import integer_tensor


@pytest.fixture
def AB():
    return cpu_ab()


# ---- canonical hash -----------------------------------------------------------------------------

HASHED = "def epi(accum, alpha, C):\n    F = accum * alpha\n    G = F + C\n    D = relu(G)\n    return D\n"
HASHED_RENAMED = ("def other(accum, scale, bias):\n    t = accum * scale\n    u = t + bias\n"
                  "    out = torch.relu(u)\n    return out\n")


def hashed_function(accum, s, c):
    tmp = accum * s
    tmp2 = tmp + c
    result = F.relu(tmp2)
    return result


def key_of(source, A, B, **tensors):
    return GemmArguments(A, B, epilogue=EpilogueArguments(source, **tensors)).key


def test_renaming_locals_and_operands_keeps_the_key(AB):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    k1 = key_of(HASHED, A, B, alpha=2.0, C=C, D=torch.empty(M, N))
    k2 = key_of(HASHED_RENAMED, A, B, scale=5.0, bias=C.clone(), out=torch.empty(M, N))
    k3 = key_of(hashed_function, A, B, s=1.5, c=C.clone(), result=torch.empty(M, N))
    assert k1 == k2 == k3
    assert isinstance(k1, str) and k1


@pytest.mark.parametrize("other", [
    HASHED.replace("F + C", "F - C"),
    HASHED.replace("relu", "sigmoid"),
    HASHED.replace("accum * alpha", "accum * 2.0"),
    "def epi(accum, alpha, C):\n    F = accum * alpha\n    G = F + C\n    D = relu(G)\n    return D, F\n",
], ids=["sub", "sigmoid", "literal", "extra-output"])
def test_a_different_epilogue_has_a_different_key(AB, other):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    extra = {"F": torch.empty(M, N)} if "return D, F" in other else {}
    base = key_of(HASHED, A, B, alpha=2.0, C=C, D=torch.empty(M, N))
    kwargs = dict(C=C, D=torch.empty(M, N), **extra)
    if "alpha" in other.split("\n")[0]:
        kwargs["alpha"] = 2.0
    assert key_of(other, A, B, **kwargs) != base


def test_operand_roles_are_part_of_the_key(AB):
    A, B = AB
    tile = key_of(HASHED, A, B, alpha=2.0, C=torch.zeros(M, N), D=torch.empty(M, N))
    row = key_of(HASHED, A, B, alpha=2.0, C=torch.zeros(N), D=torch.empty(M, N))
    column = key_of(HASHED, A, B, alpha=2.0, C=torch.zeros(M, 1), D=torch.empty(M, N))
    scalar = key_of(HASHED, A, B, alpha=2.0, C=3.0, D=torch.empty(M, N))
    assert len({tile, row, column, scalar}) == 4


def test_operand_values_are_not_part_of_the_key(AB):
    A, B = AB
    k1 = key_of(HASHED, A, B, alpha=2.0, C=torch.zeros(M, N), D=torch.empty(M, N))
    k2 = key_of(HASHED, A, B, alpha=-7.0, C=torch.ones(M, N), D=torch.empty(M, N))
    assert k1 == k2


def test_renamed_epilogues_sharing_a_key_both_run_correctly(AB):
    """Two epilogues with one key share a kernel; each run must still bind its own names."""
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    acc = accum_of(A, B)
    D1 = epifuse.gemm(A, B, HASHED, alpha=2.0, C=C)
    D2 = epifuse.gemm(A, B, HASHED_RENAMED, scale=3.0, bias=C)
    D3 = epifuse.gemm(A, B, hashed_function, s=-1.0, c=C)
    assert torch.equal(D1.double(), torch.relu(acc * 2.0 + C.double()))
    assert torch.equal(D2.double(), torch.relu(acc * 3.0 + C.double()))
    assert torch.equal(D3.double(), torch.relu(-acc + C.double()))


def test_epilogues_differing_only_in_which_operand_is_used_run_correctly(AB):
    """After DCE both graphs read one scalar operand, so they hash alike; the values must not mix."""
    A, B = AB
    uses_alpha = "def epi(accum, alpha, beta):\n    D = accum * alpha\n    return D\n"
    uses_beta = "def epi(accum, alpha, beta):\n    D = accum * beta\n    return D\n"
    D1 = epifuse.gemm(A, B, uses_alpha, alpha=2.0, beta=3.0)
    D2 = epifuse.gemm(A, B, uses_beta, alpha=2.0, beta=3.0)
    assert torch.equal(D1.double(), accum_of(A, B) * 2.0)
    assert torch.equal(D2.double(), accum_of(A, B) * 3.0)


def test_canonical_hash_ignores_names_directly():
    g1 = optimize(bound(HASHED, C=("M", "N")), check=True)
    g2 = optimize(bound(HASHED_RENAMED, bias=("M", "N")), check=True)
    assert canonical_hash(g1) == canonical_hash(g2)
    g3 = optimize(bound(HASHED, C=("N",)))
    assert canonical_hash(g1) != canonical_hash(g3)
    assert canonical_hash(optimize(g1)) == canonical_hash(g1)  # the pipeline is idempotent


# ---- passes, one at a time ----------------------------------------------------------------------

def test_nodes_are_interned():
    a = accum()
    assert accum() is a
    assert op("mul", a, const(2.0)) is op("mul", a, const(2.0))
    assert op("mul", a, const(2.0)) is not op("mul", a, const(3.0))
    assert const(0.0) is not const(-0.0)  # the sign of zero is part of a literal
    assert op("leaky_relu", a, negative_slope=0.2) is op("leaky_relu", a, negative_slope=0.2)


def test_constant_folding():
    graph = bound(body("accum * (2.0 * 3.0)"))
    assert [n.arg for n in graph.nodes() if n.op.name == "const"] == [2.0, 3.0]
    folded = fold_constants(graph)
    consts = [n for n in folded.nodes() if n.op.name == "const"]
    assert len(consts) == 1 and consts[0].arg == 6.0
    assert ops_in(folded).count("mul") == 1
    assert output_node(folded) is op("mul", accum(), const(6.0))


def test_constant_folding_of_nested_literals_and_functions():
    folded = fold_constants(bound(body("accum + exp(0.0) * -(2.0 ** 3.0) / 4.0")))
    consts = [n.arg for n in folded.nodes() if n.op.name == "const"]
    assert consts == [-2.0]
    assert ops_in(folded).count("add") == 1


def test_constant_folding_leaves_values_alone():
    graph = bound(body("accum * alpha * 2.0", "accum, alpha"))
    assert ops_in(fold_constants(graph)) == ops_in(graph)


def test_folded_graph_end_to_end(AB):
    A, B = AB
    D = epifuse.gemm(A, B, body("accum * (2.0 * 3.0) + (1.0 - 4.0)"))
    assert torch.equal(D.double(), accum_of(A, B) * 6.0 - 3.0)


@pytest.mark.parametrize("text", ["accum * 1.0", "1.0 * accum", "accum + -0.0", "-0.0 + accum",
                                  "accum - 0.0", "accum / 1.0", "accum ** 1.0", "--accum",
                                  "accum * (3.0 - 2.0)", "(accum - 0.0) * 1.0"])
def test_identity_elements_are_removed(text):
    graph = optimize(bound(body(text)), check=True)
    assert output_node(graph) is accum()
    assert ops_in(graph) == ["accum"]


@pytest.mark.parametrize("text, kept", [("0.0 - accum", "sub"), ("1.0 / accum", "div"),
                                        ("accum + 0.0", "add"),  # -0.0 + 0.0 is +0.0: not an identity
                                        ("accum * 2.0", "mul"), ("accum + 1.0", "add"),
                                        ("(accum > 0.0) * 1.0", "mul")])
def test_non_identities_are_kept(text, kept):
    graph = optimize(bound(body(text)))
    assert output_node(graph).op.name == kept


def test_identity_with_an_operand_is_removed():
    graph = simplify_algebra(bound(body("(accum * alpha) * 1.0 - 0.0", "accum, alpha")))
    node = output_node(graph)
    assert node.op.name == "mul" and node.src[0] is accum() and node.src[1].op.name == "input"
    assert ops_in(graph).count("mul") == 1 and "sub" not in ops_in(graph)


def test_common_subexpressions_are_one_node():
    source = ("def epi(accum, alpha):\n    z = accum * alpha\n    w = accum * alpha\n"
              "    D = z + w\n    return D\n")
    graph = bound(source)
    assert ops_in(graph).count("mul") == 1
    node = output_node(graph)
    assert node.op.name == "add" and node.src[0] is node.src[1]
    assert len(graph.nodes()) == 4  # accum, alpha, mul, add


def test_z_plus_z_shares_its_source():
    graph = bound("def epi(accum, alpha):\n    z = accum * alpha\n    D = z + z\n    return D\n")
    node = output_node(graph)
    assert node.src[0] is node.src[1]
    assert graph.users()[id(node.src[0])] == 2


def test_common_subexpressions_across_outputs():
    source = ("def epi(accum, C):\n    D = relu(accum + C)\n    F = sigmoid(accum + C)\n"
              "    return D, F\n")
    graph = bound(source, C=("N",))
    d, f = output_node(graph, "D"), output_node(graph, "F")
    assert d.src[0] is f.src[0]
    assert ops_in(graph).count("add") == 1


def test_cse_end_to_end(AB):
    A, B = AB
    source = ("def epi(accum, alpha):\n    z = accum * alpha\n    w = accum * alpha\n"
              "    D = z + w\n    return D\n")
    D = epifuse.gemm(A, B, source, alpha=3.0)
    assert torch.equal(D.double(), accum_of(A, B) * 6.0)


def test_dead_operand_is_dropped():
    source = "def epi(accum, alpha, beta, C):\n    unused = C * beta\n    D = accum * alpha\n    return D\n"
    graph = bound(source, C=("M", "N"))
    assert [o.name for o in graph.operands] == ["alpha", "beta", "C"]
    pruned = eliminate_dead_code(graph)
    assert [o.name for o in pruned.operands] == ["alpha"]
    assert all(n.op.name != "input" or n.arg.name == "alpha" for n in pruned.nodes())
    assert "unused" not in {pruned.name_of(n) for n in pruned.nodes()}


def test_dead_operand_through_the_api(AB):
    A, B = AB
    source = "def epi(accum, alpha, C):\n    D = accum * alpha\n    return D\n"
    C = torch.full((M, N), float("nan"))
    args = GemmArguments(A, B, epilogue=EpilogueArguments(source, alpha=2.0, C=C, D=torch.empty(M, N)))
    assert [o.name for o in args.graph.operands] == ["alpha"]
    D = epifuse.gemm(A, B, source, alpha=2.0, C=C)
    assert torch.equal(D.double(), accum_of(A, B) * 2.0)


def test_log_sigmoid_rewrite():
    graph = bound(body("log(sigmoid(accum))"))
    rewritten = simplify_algebra(graph)
    names = ops_in(rewritten)
    assert "log" not in names and "sigmoid" not in names
    assert "softplus" in names
    x = torch.tensor([[-200.0, -30.0, -1.0, 0.0, 1.0, 30.0, 200.0]], dtype=torch.float64)
    naive = evaluate(graph, x, {}, torch.float32)["D"].double()
    stable = evaluate(rewritten, x, {}, torch.float32)["D"].double()
    assert torch.isinf(naive[0, 0])  # sigmoid(-200) underflows in fp32
    assert torch.isfinite(stable).all()
    assert torch.allclose(stable, F.logsigmoid(x), rtol=1e-6, atol=1e-6)


def test_log_sigmoid_end_to_end(AB):
    A, B = AB
    D = epifuse.gemm(A, B, body("log(sigmoid(accum * 100.0))"))
    expected = F.logsigmoid(accum_of(A, B) * 100.0)
    assert torch.isfinite(D).all()
    assert torch.allclose(D.double(), expected, rtol=1e-5, atol=1e-5)


def test_log_of_a_clamped_sigmoid_loses_the_division():
    """The BCE idiom log(clamp(sigmoid(f), lo, hi)): no sigmoid, no division; -log1p(e) with
    e = exp(-f) kept in [1/hi - 1, 1/lo - 1] by a clamp of exp's argument; the same values,
    extremes, NaN and Inf included."""
    graph = bound(body("log(clamp(sigmoid(accum), 0.001, 0.999))"))
    rewritten = simplify_algebra(graph)
    assert "sigmoid" not in ops_in(rewritten) and "div" not in ops_in(rewritten)
    log1p = output_node(rewritten).src[0]
    assert output_node(rewritten).op.name == "neg" and log1p.op.name == "log1p" and log1p.src[0].op.name == "exp"
    clamp = log1p.src[0].src[0]
    assert clamp.op.name == "clamp" and clamp.src[0].op.name == "neg"
    assert clamp.params == pytest.approx({"min": math.log(1 / 0.999 - 1), "max": math.log(999.0)})
    x = torch.cat([torch.randn(1, 2000, dtype=torch.float64) * 12,
                   torch.tensor([[-math.inf, -200.0, -6.9068, -6.9067, 0.0, 6.9067, 6.9068, 200.0,
                                  math.inf, math.nan]], dtype=torch.float64)], dim=1)
    _assert_as_accurate(graph, rewritten, x)


def _assert_as_accurate(graph, rewritten, x):
    """The rewritten graph in fp32 is as close to the float64 truth as the original in fp32, and
    equal to it in float64; NaN where it is NaN, zeros that both give signed alike."""
    truth = evaluate(graph, x, {}, torch.float64)["D"]
    assert torch.allclose(evaluate(rewritten, x, {}, torch.float64)["D"], truth, rtol=1e-14, atol=1e-15,
                          equal_nan=True)
    before = evaluate(graph, x, {}, torch.float32)["D"].double()
    after = evaluate(rewritten, x, {}, torch.float32)["D"].double()
    assert torch.equal(before.isnan(), after.isnan())
    finite = before.isfinite()
    assert torch.equal(before[~finite & ~before.isnan()], after[~finite & ~before.isnan()])
    zeros = (before == 0) & (after == 0)  # where torch's sigmoid rounds to 1, log1p keeps -exp(-x)
    assert torch.equal(torch.signbit(before[zeros]), torch.signbit(after[zeros]))
    error_before = ((before - truth).abs() / (truth.abs() + 1))[finite]
    error_after = ((after - truth).abs() / (truth.abs() + 1))[finite]
    assert error_after.max() <= error_before.max() * 1.5 + 1e-7


@pytest.mark.parametrize("text,applies", [
    ("log(clamp(sigmoid(accum), 1e-7, 1.0))", True),
    ("log(clamp(sigmoid(accum), min=1e-7))", True),
    ("log(clamp(sigmoid(accum), max=0.5))", False),      # no lower clamp: 1 + exp(-x) overflows first
    ("log(clamp(sigmoid(accum), 0.0, 0.9))", False),     # log(0) stays reachable
    ("log(clamp(sigmoid(accum), 0.9, 0.1))", False),     # min > max: torch gives max everywhere
    ("log(clamp(sigmoid(accum), 1.0, 2.0))", False),     # lo at 1: log(1/lo - 1) is no number
    ("log(clamp(sigmoid(accum), 1e-40, 0.5))", False),   # lo subnormal: exp(log(1/lo - 1)) overflows
    ("log(clamp(accum, 0.001, 0.999))", False),
])
def test_log_of_a_clamped_sigmoid_applies_only_where_exact(text, applies):
    graph = bound(body(text))
    rewritten = simplify_algebra(graph)
    assert ("sigmoid" not in ops_in(rewritten)) == applies or "sigmoid" not in ops_in(graph)
    x = torch.cat([torch.randn(1, 300, dtype=torch.float64) * 40,
                   torch.tensor([[-math.inf, -120.0, -100.0, 0.0, 100.0, math.inf, math.nan]],
                                dtype=torch.float64)], dim=1)
    _assert_as_accurate(graph, rewritten, x)


def test_log_of_a_clamped_sigmoid_has_finite_gradients():
    """Where the clamp holds, the gradient is 0, also where exp(-x) would overflow in fp32."""
    A = torch.tensor([[-100.0, -50.0, -7.0, -1.0, 0.5, 7.0, 100.0]]).t().contiguous().requires_grad_()
    B = torch.ones(1, 3, requires_grad=True)
    epifuse.gemm(A, B, body("log(clamp(sigmoid(accum), 0.001, 0.999))")).sum().backward()
    A64 = A.detach().double().requires_grad_()
    torch.log(torch.clamp(torch.sigmoid(A64 @ B.detach().double()), 0.001, 0.999)).sum().backward()
    assert torch.allclose(A.grad.double(), A64.grad, rtol=1e-6, atol=0)


def test_log_of_a_clamped_sigmoid_end_to_end(AB):
    """Through the kernel (its log of a clamped value is the special-case-free polynomial)."""
    A, B = AB
    D = epifuse.gemm(A, B, body("log(clamp(sigmoid(accum * 0.5), 0.001, 0.999))"))
    expected = torch.log(torch.clamp(torch.sigmoid(accum_of(A, B) * 0.5), 0.001, 0.999))
    assert torch.allclose(D.double(), expected, rtol=1e-6, atol=2e-7)  # fp32 rounds 1 + exp(-x)


@pytest.mark.parametrize("text", ["accum * sigmoid(accum)", "sigmoid(accum) * accum",
                                  "accum * torch.sigmoid(accum)", "accum * accum.sigmoid()"])
def test_x_times_sigmoid_x_becomes_silu(text):
    graph = simplify_algebra(bound(body(text)))
    assert output_node(graph) is op("silu", accum())
    assert ops_in(graph) == ["accum", "silu"]


def test_silu_needs_the_same_x():
    graph = simplify_algebra(bound(body("accum * sigmoid(accum * 2.0)")))
    assert output_node(graph).op.name == "mul"


def test_silu_rewrite_end_to_end(AB):
    A, B = AB
    D = epifuse.gemm(A, B, body("(accum * 0.25) * sigmoid(accum * 0.25)"))
    assert torch.allclose(D.double(), F.silu(accum_of(A, B) * 0.25), rtol=1e-5, atol=1e-5)


def test_each_pass_keeps_outputs_and_names():
    source = "def epi(accum, alpha):\n    F = accum * (2.0 * 3.0)\n    D = F * 1.0\n    return D, F\n"
    graph = bound(source)
    for run_pass in (fold_constants, simplify_algebra, eliminate_dead_code, optimize):
        out = run_pass(graph)
        assert [o.name for o in out.outputs] == ["D", "F"]
    final = optimize(graph)
    assert output_node(final, "D") is output_node(final, "F")
    assert [o.name for o in final.operands] == []


def test_passes_do_not_change_results():
    source = ("def epi(accum, C):\n    a = accum * (1.0 * 1.0) + 0.0\n    b = log(sigmoid(a))\n"
              "    c = a * sigmoid(a)\n    D = b + c + C * (2.0 - 1.0)\n    return D\n")
    graph = bound(source, C=("N",))
    x = torch.randn(M, N, dtype=torch.float64) * 4
    C = torch.randn(N, dtype=torch.float64)
    before = evaluate(graph, x, {"C": C}, torch.float64)["D"]
    after = evaluate(optimize(graph, check=True), x, {"C": C}, torch.float64)["D"]
    assert torch.allclose(before, after, rtol=1e-12, atol=1e-12)
    assert math.isclose(float(before.sum()), float(after.sum()), rel_tol=1e-12)
