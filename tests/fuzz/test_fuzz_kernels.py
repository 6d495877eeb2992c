"""Property-based fuzzing: random epilogues through every generated kernel, against float64.

Hypothesis writes random epilogue source strings (tests/fuzz_strategies.py: every op of the
registry in every spelling, operands of every role, dtype and layout, ragged shapes, tile and
reduction outputs); each example runs through every kernel `get_kernels` offers except the
reference one, and every output is compared with the float64 reference (tests/fuzz_harness.py
says how closely). Inputs are dyadic (multiples of 1/4, small), so accum and every linear
combination of accum and operands is exact in fp32 and fp64 alike.

Budget: 250 examples in CI (about 50 s on two CPU cores, plus 1000 cheap bind-only examples);
EPIFUSE_FUZZ_EXAMPLES sets it. On a GPU each example compiles new kernels (about a second
each), so the long run is parallel: `python tests/gpu_fuzz.py` starts one pytest process per
core, each with its own EPIFUSE_FUZZ_SEED and share of the examples, and sums their reports.
Shrinking is off unless EPIFUSE_FUZZ_SHRINK=1 (it re-runs kernels for minutes). Every failure
found became a named regression test in tests/test_fuzz_regressions.py.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, note, settings

from fuzz_harness import EXAMPLES, FUZZ_SETTINGS, HAS_CUDA, FuzzTally, build, describe, seeded
from fuzz_strategies import Example, Operand, examples


@pytest.fixture
def fuzz_tally(request):
    """Counts the examples a fuzz test runs (Hypothesis calls the test once per example, the
    fixture is set up once per test) and writes the report at the end, passed or failed."""
    tally = FuzzTally(request.node.name)
    yield tally
    tally.write()


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs test_fuzz_gpu instead")
@seeded
@FUZZ_SETTINGS
@given(ex=examples())
def test_fuzz_against_float64_reference(ex, fuzz_tally):
    fuzz_tally.run(ex, "cpu")


@pytest.mark.gpu
@seeded
@FUZZ_SETTINGS
@given(ex=examples())
def test_fuzz_gpu(ex, fuzz_tally):
    fuzz_tally.run(ex, "cuda")



# Source-level properties: cheap (no kernel runs), so more examples.

@pytest.mark.slow
@settings(max_examples=4 * EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(ex=examples())
def test_fuzzed_sources_bind_and_hash_stably(ex):
    """Every generated source parses and binds; binding twice gives the same graph and key, and
    renaming operands and temporaries does not change the canonical hash."""
    note(describe(ex))
    args, _ = build(ex, "cpu")
    again, _ = build(ex, "cpu")
    assert again.key == args.key
    renamed = ex.source
    for i, o in enumerate(ex.operands):
        renamed = _rename(renamed, o.name, f"zz_operand_{i}")
    if renamed != ex.source:
        other = Example(**{**ex.__dict__, "source": renamed,
                           "operands": [Operand(**{**o.__dict__, "name": f"zz_operand_{i}"})
                                        for i, o in enumerate(ex.operands)]})
        assert build(other, "cpu")[0].key == args.key


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(ex=examples())
def test_fuzzed_problems_plan_alike_from_fake_tensors(ex):
    """Every generated problem planned from fake tensors of its tensors (views sharing their
    storage as the real ones do; reading a data pointer refused): GemmArguments takes them,
    every kernel's status is the one the real tensors get, and each kernel offered compiles."""
    import torch
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    import epifuse
    note(describe(ex))
    args, _ = build(ex, "cpu")
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode()

    def fake(value):
        return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
    epi = epifuse.EpilogueArguments(args.epilogue.program, accumulate=args.accumulate,
                                    deterministic=args.deterministic, compute_dtype=args.compute_dtype,
                                    **{n: fake(v) for n, v in {**args.operands, **args.outputs}.items()})
    planned = epifuse.GemmArguments(fake(args.A), fake(args.B), epilogue=epi, precision=args.precision)
    assert planned.key == args.key
    statuses = epifuse.kernel_statuses(planned)
    assert [(repr(k), s) for k, s in statuses] == [(repr(k), s) for k, s in epifuse.kernel_statuses(args)]
    for kernel, status in statuses:
        if status.ok:
            kernel.compile(planned)


def _rename(source: str, old: str, new: str) -> str:
    import io
    import tokenize
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    out = []
    for i, t in enumerate(tokens):
        keyword = i + 1 < len(tokens) and tokens[i + 1].string == "="   # f(beta=2.0)
        attribute = i > 0 and tokens[i - 1].string == "."             # x.beta()
        rename = t.type == tokenize.NAME and t.string == old and not keyword and not attribute
        out.append((t.type, new if rename else t.string))
    return tokenize.untokenize(out)
