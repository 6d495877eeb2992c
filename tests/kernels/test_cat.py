"""cat of a gated epilogue's halves (issue 36): `x1, x2 = accum.chunk(2, dim=-1)` then
`D = torch.cat((a, b), dim=-1)`, an output of B's full width N, a's columns first. RoPE on a
q/k projection and a SwiGLU-and-gate join, through the gated kernel (the interpreter) and the
reference kernel, against torch.cat of the float64 halves; every refusal by name."""
import pytest
import torch
import torch.nn.functional as F

import epifuse
from epifuse.errors import EpilogueError, EpilogueSyntaxError, ShapeError, UnsupportedError
from epifuse.frontend import parse
from epifuse.printing import statement_source
from helpers import fast, integer_tensor, rel_error

ROPE = ("def rope(accum, cos, sin):\n    x1, x2 = accum.chunk(2, dim=-1)\n"
        "    D = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)\n    return D\n")
GLU_AND_GATE = ("def glu_gate(accum):\n    gate, up = torch.chunk(accum, 2, -1)\n"
                "    D = cat((silu(gate) * up, gate), -1)\n    return D\n")
# integer-valued pieces (exact in fp32), the batched join spelled dim=2, and a half-width output beside it
EXACT = ("def exact(accum, bias, C):\n    gate, up = accum.chunk(2, dim=-1)\n"
         "    D = epifuse.ops.concat((gate * up + C, up - bias), dim={dim})\n    H = gate + up\n    return D, H\n")


def halves(A, W):
    return (A.double() @ W.double()).chunk(2, dim=-1)


def rope_reference(A, W, cos, sin):
    x1, x2 = halves(A, W)
    cos, sin = cos.double(), sin.double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def run_each(args):
    """Every kernel of `args` (the gated one first, then the reference), each on outputs
    filled with NaN: {kernel name: copies of the outputs}."""
    kernels = epifuse.get_kernels(args)
    assert [k.name for k in kernels] == ["triton_gated", "reference"], epifuse.kernel_statuses(args)
    results = {}
    for kernel in kernels:
        for t in args.outputs.values():
            t.fill_(float("nan"))
        kernel.run(args)
        results[kernel.name] = {n: t.clone() for n, t in args.outputs.items()}
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotation", ["tile", "row"])
def test_rope_in_the_gated_kernel(dtype, rotation):
    """RoPE over a q projection of half width 37 (two ragged 32-column tiles per half), cos
    and sin as (M, N/2) tiles or (N/2,) rows, random values that need rounding in bf16."""
    torch.manual_seed(0)
    M, H, K = 20, 37, 24
    A = torch.randn(M, K).to(dtype)
    W = (torch.randn(K, 2 * H) / K ** 0.5).to(dtype)
    shape = (M, H) if rotation == "tile" else (H,)
    cos, sin = torch.randn(shape), torch.randn(shape)
    D = torch.empty(M, 2 * H, dtype=dtype)
    args = epifuse.GemmArguments(A, W, epilogue=epifuse.EpilogueArguments(ROPE, cos=cos, sin=sin, D=D),
                                 precision="highest")
    expected = rope_reference(A, W, cos, sin)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3   # fp32: the sums' rounding; bf16: the output's
    for name, outputs in run_each(args).items():
        assert outputs["D"].shape == (M, 2 * H) and not outputs["D"].isnan().any(), name
        assert rel_error(outputs["D"], expected) < tolerance, (name, rel_error(outputs["D"], expected))


@pytest.mark.parametrize("batched", fast([False, True], keep={0, 1}))
def test_a_join_of_integer_pieces_is_exact(batched):
    """Integer-valued: each half of D is exact in fp32, over ragged tiles each way, batched A
    and B too (the join along dim=2 there, dim=1 for 2-D), beside a half-width output H."""
    M, N, K = 45, 35, 20
    lead = (2,) if batched else ()
    A = integer_tensor(*lead, M, K, dtype=torch.float32)
    W = integer_tensor(*lead, K, 2 * N, dtype=torch.float32)
    bias = integer_tensor(N, dtype=torch.float32)
    C = integer_tensor(M, N, dtype=torch.float32)   # a tile shared across the batch
    D, H = torch.empty(*lead, M, 2 * N), torch.empty(*lead, M, N)
    src = EXACT.format(dim=len(lead) + 1)
    args = epifuse.GemmArguments(A, W, epilogue=epifuse.EpilogueArguments(src, bias=bias, C=C, D=D, H=H),
                                 precision="highest")
    gate, up = halves(A, W)
    expected = torch.cat((gate * up + C.double(), up - bias.double()), dim=-1)
    for name, outputs in run_each(args).items():
        assert torch.equal(outputs["D"].double(), expected), name
        assert torch.equal(outputs["H"].double(), gate + up), name


def test_swiglu_and_gate_through_gemm_allocate_full_width():
    """epifuse.gemm allocates a join's output at B's full width in A's dtype, batched too;
    cat((silu(gate) * up, gate), -1) against float64."""
    torch.manual_seed(1)
    A, W = torch.randn(2, 12, 16), torch.randn(16, 2 * 37)
    D = epifuse.gemm(A, W, GLU_AND_GATE, precision="highest")
    assert D.shape == (2, 12, 74) and D.dtype == torch.float32
    gate, up = halves(A, W)
    assert rel_error(D, torch.cat((F.silu(gate) * up, gate), dim=-1)) < 1e-6


def test_a_caller_given_output_of_any_strides():
    """A column-major output of shape (M, N) is written at its strides; one of the half width,
    or of any other shape, is refused before anything runs."""
    torch.manual_seed(2)
    M, H, K = 12, 37, 8
    A, W = torch.randn(M, K), torch.randn(K, 2 * H)
    cos, sin = torch.randn(H), torch.randn(H)
    D = torch.full((2 * H, M), float("nan")).t()
    epifuse.gemm(A, W, ROPE, cos=cos, sin=sin, D=D, precision="highest")
    assert rel_error(D, rope_reference(A, W, cos, sin)) < 1e-6
    for shape in ((M, H), (M, 2 * H + 1), (1, M, 2 * H)):
        with pytest.raises(ShapeError) as info:
            epifuse.gemm(A, W, ROPE, cos=cos, sin=sin, D=torch.empty(shape))
        assert str(info.value).startswith(
            f"Output D is cat((a, b), dim=-1) of two tiles of the gated half width {H}, so its shape is "
            f"({M}, {2 * H}) (the width of B's {2 * H} columns), but the tensor passed has shape {shape}.")


def test_the_epilogue_is_its_own_reference():
    """The same function on torch tensors (torch.chunk, epifuse.ops.cat) gives what the kernel does."""
    from epifuse.ops import cat, silu

    def glu_gate(accum):
        gate, up = accum.chunk(2, dim=-1)
        D = cat((silu(gate) * up, gate), dim=-1)
        return D

    A, W = integer_tensor(6, 8, dtype=torch.float32), integer_tensor(8, 10, dtype=torch.float32)
    assert torch.allclose(epifuse.gemm(A, W, glu_gate, precision="highest"), glu_gate(A @ W))
    with pytest.raises(TypeError, match=r"cat\(\) takes its 2 tensors as one tuple"):
        cat(A, A)


def test_a_join_after_a_statistics_pass():
    """A softmax of one half joined to the other: passes of the same gated GEMM (staging)."""
    torch.manual_seed(3)
    A, W = torch.randn(10, 12), torch.randn(12, 2 * 20)
    src = ("def g(accum):\n    x1, x2 = accum.chunk(2, dim=-1)\n    D = cat((softmax(x1, dim=-1), x2), dim=-1)\n"
           "    return D\n")
    D = epifuse.gemm(A, W, src, precision="highest")
    x1, x2 = halves(A, W)
    assert rel_error(D, torch.cat((torch.softmax(x1, -1), x2), -1)) < 1e-6


def test_cat_is_printed_as_it_is_written():
    program = parse(ROPE)
    statement = program.statements[-1]
    assert statement.expr.value == "cat" and statement.expr.params == (("dim", (-1,)),)
    assert statement_source(statement.target, statement.expr) == \
        "D = cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)"


def _gated(body: str, params: str = "") -> str:
    return f"def e(accum{params}):\n    x1, x2 = accum.chunk(2, dim=-1)\n{body}"


@pytest.mark.parametrize("src, message", [
    ("def e(accum, C):\n    D = torch.cat((accum, C), dim=-1)\n    return D\n",
     "cat joins two half-width tiles of a gated epilogue, and this epilogue does not chunk accum."),
    (_gated("    D = cat((x1, x2), dim=-1)\n    E = D * 2.0\n    return E\n"),
     "'D' is the cat of two half-width tiles, N wide: it can only be returned, not used in further math."),
    (_gated("    D = cat((x1, x2), dim=-1) * 2.0\n    return D\n"),
     "cat(...) must be the whole value of an output (`D = cat((a, b), dim=-1)`): the joined tile is N wide, "
     "and no math is done at that width."),
    (_gated("    D = cat((cat((x1, x2), dim=-1), x2), dim=-1)\n    return D\n"), "must be the whole value of an output"),
    (_gated("    D = cat((x1, x2, x1), dim=-1)\n    return D\n"),
     "cat() takes one tuple of two tiles, the pieces written side by side: cat((a, b), dim=-1)."),
    (_gated("    D = cat(x1, x2)\n    return D\n"), "cat() takes one tuple of two tiles"),
    (_gated("    D = cat((x1, x2))\n    return D\n"),
     "cat() without dim joins along dim 0 (torch's default), the rows; the halves of accum's columns join "
     "along the last dim."),
    (_gated("    D = cat((x1, x2), dim=(-1,))\n    return D\n"), "cat() needs dim to be an int literal."),
    (_gated("    D = cat((x1, x2), dim=-1, out=x1)\n    return D\n"), "cat() got an unexpected keyword argument 'out'."),
    (_gated("    D = x1.cat((x2,), dim=-1)\n    return D\n"), "cat() is not a method of a tensor."),
])
def test_what_cat_refuses_when_parsed(src, message):
    with pytest.raises(EpilogueSyntaxError) as info:
        parse(src)
    assert message in str(info.value)
    assert "line" in str(info.value)   # placed at the offending source


@pytest.mark.parametrize("src, batched, error, message", [
    (_gated("    D = cat((x1, x2), dim=0)\n    return D\n"), False, EpilogueSyntaxError,
     "cat(dim=0) does not join along the columns: accum has 2 dimensions (M, N), and only the last, dim=-1 "
     "(or 1), joins the two halves of accum's columns."),
    (_gated("    D = cat((x1, x2), dim=1)\n    return D\n"), True, EpilogueSyntaxError,
     "cat(dim=1) does not join along the columns: accum has 3 dimensions (L, M, N)"),
    (_gated("    D = cat((x1, bias), dim=-1)\n    return D\n", ", bias"), False, EpilogueError,
     "cat((a, b), dim=-1) joins two tiles of the gated epilogue's half width, each varying along M and N; "
     "its second piece varies along N."),
    (_gated("    D = cat((2.0 + 0.0 * s, x1), dim=-1)\n    return D\n", ", s"), False, EpilogueError,
     "its first piece varies along nothing (a scalar)."),
])
def test_what_cat_refuses_when_bound(src, batched, error, message):
    lead = (2,) if batched else ()
    A, W = torch.ones(*lead, 4, 3), torch.ones(3, 8)
    tensors = {"bias": torch.ones(4)} if "bias" in src else {"s": 2.0} if ", s" in src else {}
    with pytest.raises(error) as info:
        epifuse.gemm(A, W, src, **tensors)
    assert message in str(info.value)


def test_autograd_refuses_cat_by_name():
    A = torch.randn(8, 4, requires_grad=True)
    W = torch.randn(4, 10)
    with pytest.raises(UnsupportedError, match=r"Autograd through epifuse does not take cat of the gated "
                                               r"halves yet \(D = cat\(\(a, b\), dim=-1\)\), and A requires grad"):
        epifuse.gemm(A, W, GLU_AND_GATE.replace("cat((silu(gate) * up, gate), -1)", "cat((gate, up), dim=-1)"))
    with torch.no_grad():
        assert epifuse.gemm(A, W, GLU_AND_GATE).shape == (8, 10)


def test_repeated_calls_keep_their_launch_and_allocate_full_width():
    """A repeated call takes its kept launch (runtime.callsite), which allocates each call's
    output at the full width and splits each call's own B into its halves."""
    from epifuse.runtime import callsite
    for step in range(3):
        A, W = integer_tensor(9, 8, dtype=torch.float32), integer_tensor(8, 2 * 21, dtype=torch.float32)
        cos, sin = integer_tensor(9, 21, dtype=torch.float32), integer_tensor(21, dtype=torch.float32)
        hits = callsite.HITS[0]
        D = epifuse.gemm(A, W, ROPE, cos=cos, sin=sin, precision="highest")
        assert callsite.HITS[0] - hits == (0 if step == 0 else 1), step
        assert torch.equal(D.double(), rope_reference(A, W, cos, sin)), step
