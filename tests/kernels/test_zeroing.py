"""In-kernel zeroing of atomic reductions (templates/macros.j2): the tiled and Gluon kernels zero
small fp32 sums, means and amax themselves and order the zeros before every program's atomics
through (arrivals, done) words that the plan keeps per CUDA stream and per graph capture
(plan.ZeroingWords); the other destinations start from a launch before the kernel."""
import pytest
import torch

import epifuse
from helpers import check_reductions, fast, integer_tensor, reference_outputs, rel_error, run_python

M, N, K = 100, 72, 50


# atomic reductions the tiled and Gluon kernels zero themselves
ZEROED = ("def epi(accum, C):\n    x = accum * 2.0 + C + 64.0\n    s = sum(x)\n    r = sum(x, dim=1)\n"
          "    m = mean(x, dim=0)\n    a = amax(x, dim=0)\n    return s, r, m, a\n")


def _zeroed_problem(device, rows=M, cols=N, depth=K, dtype=torch.float16):
    A = integer_tensor(rows, depth, device=device, dtype=dtype)
    B = integer_tensor(depth, cols, low=-1, high=2, device=device, dtype=dtype)
    C = integer_tensor(rows, cols, device=device, dtype=torch.float32)
    outs = dict(s=torch.empty((), device=device), r=torch.empty(rows, device=device),
                m=torch.empty(cols, device=device), a=torch.empty(cols, device=device))
    return A, B, C, outs


def _count_launches_of_zeroing(args, kernel, launches, words=None):
    """The (arrivals, done) words `words` (the plan's own pair, which the stream that made the
    plan launches with, when None) after `launches` launches of `kernel` on `args` with them."""
    plan = args._plans[kernel]
    sync = plan.sync.first if words is None else words
    assert plan.meta["ANY_ZERO"] and sync.dtype == torch.int64
    assert plan.owned[-1] is plan.sync.first is plan.values[plan.sync.index]
    arrivals = plan.values[plan.sync.index + 1]
    assert sync.tolist() == [launches * arrivals, launches]


@pytest.mark.slow   # one of the longest: the README's run leaves it to -m slow (CI runs it)
def test_small_atomic_reductions_are_zeroed_by_the_kernel(device, monkeypatch):
    """fp32 contiguous sums, means and amax start from the first program's zeros, not from a
    launch before the kernel: destinations full of NaN come out right launch after launch, and
    the plan's words count the programs' arrivals and the launches."""
    from epifuse.backends.triton import plan as plans
    prepared = []
    monkeypatch.setattr(plans, "prepare_reduction", lambda y, *rest: prepared.append(y.name))
    A, B, C, outs = _zeroed_problem(device)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(ZEROED, C=C, **outs))
    kernel = next(k for k in epifuse.get_kernels(args) if k.name == "triton_tiled")
    for launch in (1, 2, 3):
        for t in outs.values():
            t.fill_(float("nan"))
        kernel.run(args)
        check_reductions(args, "sum")
        _count_launches_of_zeroing(args, kernel, launch)
    assert prepared == []
    assert args._plans[kernel].simple  # nothing runs around the launch


@pytest.mark.parametrize("case", fast(["accumulate", "bf16", "strided", "over the limit"], keep={0, 3}))
def test_reductions_the_kernel_does_not_zero_start_from_a_launch(case, device, monkeypatch):
    """An accumulated, non-fp32, non-contiguous or large destination is zeroed (or copied) by a
    launch before the kernel, as before; the others of the same launch still by the kernel."""
    from epifuse.backends.triton import plan as plans
    prepared = []
    real = plans.prepare_reduction
    monkeypatch.setattr(plans, "prepare_reduction", lambda y, *rest: (prepared.append(y.name), real(y, *rest)))
    A, B, C, outs = _zeroed_problem(device)
    accumulate = case == "accumulate"
    if case == "bf16":
        outs["r"] = torch.empty(M, device=device, dtype=torch.bfloat16)
    elif case == "strided":
        outs["r"] = torch.empty(M, 2, device=device)[:, 0]
    elif case == "over the limit":
        monkeypatch.setattr(plans, "ZERO_LIMIT", M - 1)
    for t in outs.values():
        t.copy_(integer_tensor(*t.shape, low=0, device=device, dtype=torch.float32)) if accumulate else t.fill_(float("nan"))
    before = {name: t.double().clone() for name, t in outs.items()}
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(ZEROED, C=C, accumulate=accumulate, **outs))
    kernel = next(k for k in epifuse.get_kernels(args) if k.name == "triton_tiled")
    kernel.run(args)
    for name, ref in reference_outputs(args).items():
        if accumulate:
            ref = torch.maximum(ref, before[name]) if name == "a" else ref + before[name]
        tolerance = 1e-2 if outs[name].dtype == torch.bfloat16 else 1e-5
        assert rel_error(outs[name], ref) < tolerance, name
    expected = ["s", "r", "m", "a"] if accumulate else ["r"]  # M > N: only r is over the limit
    assert prepared == expected
    assert args._plans[kernel].meta["ANY_ZERO"] == (not accumulate)


def _gluon_and_tiled_kernels(args):
    from epifuse.backends.triton import configs
    from epifuse.backends.triton.families import COOPERATIVE, PINGPONG, TILED
    from epifuse.backends.triton.kernels import TritonKernel
    kernels = [TritonKernel(TILED, configs.TILED[2]),
               *(TritonKernel(PINGPONG, c) for c in (*configs.SMALL_GRID, *configs.PINGPONG[1:2])),
               *(TritonKernel(COOPERATIVE, c) for c in configs.COOPERATIVE[:1])]
    for kernel in kernels:
        assert kernel.supports(args), (kernel, kernel.supports(args))
    return kernels


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,depth", [(128, 8192, 96), (1000, 744, 96), (64, 128, 96), (65536, 64, 16)])
def test_in_kernel_zeroing_on_the_gpu(rows, cols, depth):
    """Every kernel that zeroes its reductions, with consumers that take no tile (a small grid),
    several tiles per consumer, a single tile, and the largest row sum it zeroes under tiles
    that take no time (K = 16: without the wait for the zeros, the ping-pong kernels lose
    sums): NaN-filled destinations, three launches, then three replays of a captured CUDA
    graph, each against the float64 reference."""
    A, B, C, outs = _zeroed_problem("cuda", rows, cols, depth)  # rows of A 16-byte aligned for TMA
    for kernel in _gluon_and_tiled_kernels(epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            ZEROED, C=C, **outs))):
        args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(ZEROED, C=C, **outs))
        for launch in (1, 2, 3):
            for t in outs.values():
                t.fill_(float("nan"))
            kernel.run(args)
            torch.cuda.synchronize()
            check_reductions(args, "sum")
            _count_launches_of_zeroing(args, kernel, launch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the capture takes a pair of its own
            kernel.run(args)
        captured = args._plans[kernel].sync.captured
        assert len(captured) == 1
        for replay in (1, 2, 3):
            for t in outs.values():
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_reductions(args, "sum")
            _count_launches_of_zeroing(args, kernel, 3)
            _count_launches_of_zeroing(args, kernel, replay, words=captured[0])


def test_each_stream_takes_its_own_zeroing_words():
    """A plan's (arrivals, done) words go by what launches it: the stream that made the plan
    keeps the plan's own pair, each other stream gets a new zeroed pair (zeroed on that stream),
    each graph capture a pair of its own that nothing else takes (zeroed with the plan for the
    first few, so a capture adds no zeroing to the graph); the plan's values never change."""
    from epifuse.backends.triton.plan import ZeroingWords
    words = ZeroingWords(1, torch.device("cpu"))
    assert words.home is None  # no streams on the CPU
    words.home = 100
    values = ["x", words.first, 7]
    assert words.values_for(values, 100, False) is values
    assert words.values_for(values, 100, False) is values
    second = words.values_for(values, 200, False)
    assert second is not values and values[1] is words.first and second[0] == "x" and second[2] == 7
    assert second[1] is not words.first and second[1].tolist() == [0, 0]
    assert all(second[1] is not spare for spare in words.spares)
    assert words.values_for(second, 200, False) is second
    assert words.values_for(second, 100, False)[1] is words.first
    spares = list(words.spares)
    taken = [words.values_for(values, stream, True)[1] for stream in (100, 200, 100, 300, 100)]
    assert [id(t) for t in taken[:4]] == [id(t) for t in reversed(spares)] and len({id(t) for t in taken}) == 5
    assert all(t.tolist() == [0, 0] for t in taken) and words.spares == []
    assert [id(t) for t in words.captured] == [id(t) for t in taken]
    assert all(t is not words.first and t is not second[1] for t in taken)
    assert words.values_for(values, 300, False)[1] is not taken[3]  # a capture's pair is its own
    assert words.values_for(values, 100, False) is values


def test_a_plan_made_during_a_capture_keeps_no_zeros_for_later(monkeypatch):
    """Zeros queued while a graph is captured happen only where that graph replays: a plan
    made then has no home stream and no spares, so every stream and every later capture gets a
    pair zeroed where it is used."""
    from epifuse.backends.triton import device, plan
    monkeypatch.setattr(device, "capturing", lambda device: True)
    words = plan.ZeroingWords(0, torch.device("cpu"))
    assert words.home is None and words.spares == []
    values = [words.first]
    pairs = [words.values_for(values, 100, True)[0], words.values_for(values, 100, True)[0],
             words.values_for(values, 100, False)[0]]
    assert len({id(p) for p in (*pairs, words.first)}) == 4
    assert all(p.tolist() == [0, 0] for p in pairs)


_TWO_STREAMS_SCRIPT = """
import torch, epifuse
from helpers import check_reductions
from test_zeroing import ZEROED, _gluon_and_tiled_kernels, _zeroed_problem
A, B, C, outs = _zeroed_problem("cuda", 4096, 2048, 2048)
make = lambda: epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(ZEROED, C=C, **outs))
streams = [torch.cuda.Stream(), torch.cuda.Stream()]
big = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
for kernel in _gluon_and_tiled_kernels(make()):
    args = make()
    for s in streams:  # leave freed blocks full of garbage where the streams' pairs may land
        with torch.cuda.stream(s):
            garbage = torch.full((64,), 12345, device="cuda", dtype=torch.int64)
        del garbage
    for _ in range(20):  # the plan's own zeros queue behind a busy default stream
        big @ big
    kernel.compile(args)
    for launch in range({launches}):
        with torch.cuda.stream(streams[launch % 2]):
            kernel.run(args)
    torch.cuda.synchronize()
    plan = args._plans[kernel]
    arrivals = plan.values[plan.sync.index + 1]
    for s in streams:
        words = plan.sync.by_stream[s.cuda_stream]
        assert words.tolist() == [{launches} // 2 * arrivals, {launches} // 2], (kernel, words)
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    for graph in graphs:  # both captured on torch.cuda.graph's one capture stream
        with torch.cuda.graph(graph):
            kernel.run(args)
    for replay in range({launches}):
        with torch.cuda.stream(streams[replay % 2]):
            graphs[replay % 2].replay()
    torch.cuda.synchronize()
    assert [w.tolist() for w in plan.sync.captured] == [[{launches} // 2 * arrivals, {launches} // 2]] * 2
    for t in outs.values():
        t.fill_(float("nan"))
    kernel.run(args)
    torch.cuda.synchronize()
    check_reductions(args, "sum")
    print("ok", kernel, flush=True)
"""


_CAPTURED_PLAN_SCRIPT = """
import torch, epifuse
from helpers import check_reductions
from test_zeroing import ZEROED, _zeroed_problem
A, B, C, _ = _zeroed_problem("cuda", 1024, 1024, 256)
outs = {name: torch.empty(shape, device="cuda") for name, shape in (("s", ()), ("r", (1024,)), ("m", (1024,)), ("a", (1024,)))}
side = torch.cuda.Stream()
with torch.cuda.stream(side):  # tuning and compiles, outside any capture
    epifuse.gemm(A, B, ZEROED, C=C, **outs)
torch.cuda.synchronize()
graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
for graph in graphs:  # the first capture makes the plan (a new stream: a new call site)
    with torch.cuda.graph(graph):
        epifuse.gemm(A, B, ZEROED, C=C, **outs)
for graph in (graphs[1], graphs[0], graphs[1], graphs[0]):
    for t in outs.values():
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_reductions(epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(ZEROED, C=C, **outs)), "sum")
print("replays ok")
"""


@pytest.mark.gpu
def test_graphs_of_a_plan_made_during_a_capture():
    """Two graphs of one epifuse.gemm call whose plan was made during the first capture (its
    zeros exist only in that graph), the second replayed first: every replay is right and
    finishes. In a subprocess with a timeout, as above."""
    result = run_python(_CAPTURED_PLAN_SCRIPT, timeout=240)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert "replays ok" in result.stdout, result.stdout


@pytest.mark.gpu
def test_overlapping_launches_on_two_streams_finish():
    """One GemmArguments launched again and again on two streams at once (their launches
    overlap), its plan made while the default stream is busy, then two CUDA graphs of it
    replayed at once on the two streams: every launch finishes, since each stream and each
    capture counts its launches in words of its own, zeroed before they are used; the words
    count their launches, and a launch after them is right. In a subprocess with a timeout,
    so that programs waiting forever fail this test rather than hang the run."""
    result = run_python(_TWO_STREAMS_SCRIPT.format(launches=40), timeout=240)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert result.stdout.count("ok <") == 4, result.stdout  # tiled, two ping-pongs, cooperative


@pytest.mark.gpu
def test_kept_launches_zero_their_reductions(monkeypatch):
    """Repeated epifuse.gemm calls with NaN-filled reduction outputs: the kept launch runs
    nothing but the kernel (its reductions zeroed there), and every call is right."""
    from epifuse.runtime import callsite
    monkeypatch.setenv("EPIFUSE_TUNE", "0")  # the untimed order: the small-grid ping-pong first
    A, B, C, _ = _zeroed_problem("cuda", 128, 1024, depth=96)
    hits = callsite.HITS[0]
    for call in range(4):
        outs = {name: torch.full(shape, float("nan"), device="cuda")
                for name, shape in (("s", ()), ("r", (128,)), ("m", (1024,)), ("a", (1024,)))}
        epifuse.gemm(A, B, ZEROED, C=C, **outs)
        args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(ZEROED, C=C, **outs))
        check_reductions(args, "sum")
    assert callsite.HITS[0] - hits == 3
    site = callsite.sites()[-1]
    assert site.before is None and site.after is None

