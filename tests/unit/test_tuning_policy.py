"""The tuning policy (EPIFUSE_TUNE: fast, full, background, 0) and the shipped tables of tuned
choices (runtime/shipped.py), on CPU: arguments of meta tensors stand for a GPU problem, fake
kernels for the candidates, a fake timer for tuning."""
from __future__ import annotations

import contextlib
import gc
import json
import sys
import threading
import types
import weakref
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import epifuse
from epifuse.errors import EpilogueArgumentError
from epifuse.runtime.cache import CacheWarning
from epifuse.backends import select
from epifuse.backends.triton import configs
from epifuse.backends.triton.families import COOPERATIVE, PERSISTENT, PINGPONG, SPLIT_K, TILED
from epifuse.backends.triton.kernels import TritonKernel
from epifuse.runtime import shipped, tune

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import choices  # noqa: E402

H200 = "NVIDIA H200"


class Fake:
    """A candidate kernel: what choose reads of one (its name and repr)."""

    def __init__(self, text, name="triton_persistent"):
        self.text, self.name = text, name

    def __repr__(self):
        return self.text


def _args(M, N, K, dtype=torch.float16, epilogue="def e(accum):\n    D = accum\n    return D\n"):
    A = torch.empty(M, K, dtype=dtype, device="meta")
    B = torch.empty(K, N, dtype=dtype, device="meta")
    D = torch.empty(M, N, dtype=dtype, device="meta")
    return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(epilogue, D=D))


@pytest.fixture
def gpu(monkeypatch):
    """choose sees a GPU named H200 and times with a fake timer that records what it timed."""
    timed = []

    def time_all(args, kernels, mode="full"):
        timed.append((mode, [repr(k) for k in kernels]))
        return kernels[-1]   # the fake timer's winner: the last candidate
    monkeypatch.setattr(tune, "_on_gpu", lambda args: True)
    monkeypatch.setattr(tune, "_gpu_name", lambda args: H200)
    monkeypatch.setattr(tune, "_time_all", time_all)
    monkeypatch.setattr(tune, "_MEMORY", {})
    monkeypatch.delenv("EPIFUSE_TUNE", raising=False)
    return timed


def _s2_order():
    return shipped.nearest(H200, torch.float16, 16384, 4096, 1024)["order"]


# ---- the policy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [(None, "fast"), ("", "fast"), ("fast", "fast"), ("FULL", "full"),
                                             (" background ", "background"), ("0", "0")])
def test_the_policy_is_read_from_epifuse_tune(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("EPIFUSE_TUNE", raising=False)
    else:
        monkeypatch.setenv("EPIFUSE_TUNE", value)
    assert tune.policy() == expected


@pytest.mark.parametrize("value", ["1", "yes", "ful", "fast,full"])
def test_an_unknown_policy_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("EPIFUSE_TUNE", value)
    with pytest.raises(EpilogueArgumentError, match=r"EPIFUSE_TUNE=.* is not a tuning policy.*fast"):
        tune.policy()
    A = torch.randn(4, 8)
    with pytest.raises(EpilogueArgumentError, match="is not a tuning policy"):
        epifuse.gemm(A, A.t().contiguous(), "relu")   # on every path, a CPU one included


def test_fast_takes_the_shipped_choice_untimed(gpu):
    """At a benchmark shape of a GPU with a table, the first kernel the table ranks that is a
    candidate runs, and nothing is timed."""
    order = _s2_order()
    kernels = [Fake("<not in the table>"), Fake(order[2]), Fake(order[1])]
    assert tune.choose(_args(16384, 4096, 1024), kernels) is kernels[2]
    assert gpu == []


def test_fast_takes_the_nearest_entry_within_an_octave(gpu):
    order = _s2_order()
    kernels = [Fake("<other>"), Fake(order[0])]
    assert tune.choose(_args(12000, 4096, 1200), kernels) is kernels[1]   # 0.68 octaves from S2 in all
    assert gpu == []


def test_far_from_every_entry_fast_times_the_tables_choices_at_its_other_shapes(gpu):
    """No entry near 4096 x 4096 x 1024 (two octaves from S1 and from S2): the first choices of
    the entries, nearest first, are timed, not the untimed order's first kernels."""
    firsts = []
    for _, entry in shipped.by_distance(H200, torch.float16, 4096, 4096, 1024):
        if entry["order"][0] not in firsts:
            firsts.append(entry["order"][0])
    assert len(firsts) >= 2
    kernels = [Fake("<untimed first>"), Fake("<untimed second>"), *(Fake(name) for name in reversed(firsts))]
    tune.choose(_args(4096, 4096, 1024), kernels)
    assert gpu == [("fast", firsts[:tune.SHORT_LIST])]


def test_fast_takes_an_epilogue_pass_without_a_main_loop_untimed(gpu, monkeypatch):
    """K = 0 (the backward's elementwise pass) near no entry: the untimed order's first kernel,
    nothing timed or compiled besides it; full tuning still times every candidate."""
    kernels = [Fake(f"<k{i}>") for i in range(6)]
    args = _args(1024, 16384, 0)
    assert tune.choose(args, kernels) is kernels[0] and gpu == []
    assert tune.to_compile(args, kernels) == [kernels[0]]
    monkeypatch.setenv("EPIFUSE_TUNE", "full")
    assert tune.choose(args, kernels) is kernels[-1]
    assert gpu == [("full", [f"<k{i}>" for i in range(6)])]


def test_fast_times_a_short_list_far_from_the_table_and_remembers_it(gpu):
    """An unknown shape: the first SHORT_LIST candidates are timed once; the next call with the
    same problem takes the remembered winner, and full tuning is not answered by it."""
    kernels = [Fake(f"<k{i}>") for i in range(6)]
    args = _args(64, 50000, 300)
    assert tune.choose(args, kernels) is kernels[tune.SHORT_LIST - 1]
    assert gpu == [("fast", [f"<k{i}>" for i in range(tune.SHORT_LIST)])]
    assert tune.choose(args, kernels) is kernels[tune.SHORT_LIST - 1] and len(gpu) == 1
    with pytest.MonkeyPatch.context() as m:
        m.setenv("EPIFUSE_TUNE", "full")
        assert tune.choose(args, kernels) is kernels[-1]
    assert gpu[-1] == ("full", [f"<k{i}>" for i in range(6)])


def test_to_compile_names_the_kernels_a_call_would_compile_and_times_nothing(gpu, monkeypatch):
    """Compiling ahead (runtime/ahead.py) asks which kernels a first call would compile: the
    table's choice where fast takes it untimed, the short list where fast would time it, every
    candidate under full; nothing is timed or remembered, and the call afterwards still tunes."""
    order = _s2_order()
    near = [Fake("<not in the table>"), Fake(order[1])]
    assert tune.to_compile(_args(16384, 4096, 1024), near) == [near[1]]
    far = [Fake(f"<k{i}>") for i in range(6)]
    args = _args(64, 30000, 200)   # a shape no other test remembers a choice for (on disk too)
    assert tune.to_compile(args, far) == far[:tune.SHORT_LIST]
    monkeypatch.setenv("EPIFUSE_TUNE", "full")
    assert tune.to_compile(_args(16384, 4096, 1024), near) == near
    monkeypatch.delenv("EPIFUSE_TUNE")
    assert gpu == [] and tune._MEMORY == {}
    assert tune.choose(args, far) is far[tune.SHORT_LIST - 1] and len(gpu) == 1
    assert tune.to_compile(args, far) == [far[tune.SHORT_LIST - 1]]   # remembered now


def test_a_full_tuning_choice_serves_fast_afterwards(gpu, monkeypatch):
    order = _s2_order()
    kernels = [Fake(order[0]), Fake("<slower in the table, faster here>")]
    args = _args(16384, 4096, 1024)
    monkeypatch.setenv("EPIFUSE_TUNE", "full")
    assert tune.choose(args, kernels) is kernels[1]
    monkeypatch.delenv("EPIFUSE_TUNE")
    assert tune.choose(args, kernels) is kernels[1] and len(gpu) == 1   # remembered, over the table


_HEAVY = "def e(accum, C):\n    D = accum + C\n    E = relu(D)\n    return D, E\n"


def _heavy_args(M, N, K, dtype=torch.float16):
    """An epilogue moving 6 bytes per output element: a full-size fp16 operand, two outputs."""
    A = torch.empty(M, K, dtype=dtype, device="meta")
    B = torch.empty(K, N, dtype=dtype, device="meta")
    C, D, E = (torch.empty(M, N, dtype=dtype, device="meta") for _ in range(3))
    return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(_HEAVY, C=C, D=D, E=E))


def test_epilogue_bytes_counts_full_size_operands_and_outputs_not_a_bias_row():
    assert tune.epilogue_bytes(_heavy_args(256, 128, 64)) == 6.0
    assert tune.epilogue_bytes(_args(256, 128, 64)) == 2.0
    A, B = torch.empty(256, 64, device="meta"), torch.empty(64, 128, device="meta")
    bias, D = torch.empty(128, device="meta"), torch.empty(256, 128, dtype=torch.bfloat16, device="meta")
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum, bias):\n    D = accum + bias\n    return D\n", bias=bias, D=D))
    assert tune.epilogue_bytes(args) == pytest.approx(2 + 4 / 256)


def _kind(text):
    return tuple(text.strip("<>").split()[:2])


def test_distinct_tiles_takes_one_kernel_of_each_family_and_tile_in_the_most_pieces():
    order = [Fake(text) for text in _s2_order()]
    picked = [repr(k) for k in tune.distinct_tiles(order, 4)]
    kinds = [_kind(text) for text in picked]
    assert len(set(kinds)) == 4
    firsts = list(dict.fromkeys(_kind(repr(k)) for k in order))
    assert kinds == firsts[:4]   # kinds in the order of their first kernel
    for text in picked:   # of its kind, the most pieces, then the best ranked
        same = [repr(k) for k in order if _kind(repr(k)) == _kind(text)]
        most = max(tune._epilogue_pieces(t) for t in same)
        assert text == next(t for t in same if tune._epilogue_pieces(t) == most)


def test_distinct_tiles_prefers_the_epilogue_in_more_pieces_of_one_tile():
    order = [Fake(t) for t in ("<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages, epilogue in 2>",
                               "<triton_persistent 128x128x64 group 8, 8 warps, 4 stages, flat>",
                               "<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages>",
                               "<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages, epilogue in 4>",
                               "<triton_persistent 128x128x64 group 8, 4 warps, 4 stages>")]
    assert tune.distinct_tiles(order, 4) == [order[3], order[1]]
    assert tune.distinct_tiles(order, 1) == [order[3]]


def test_distinct_tiles_finds_more_pieces_among_kernels_the_ranking_left_out():
    """A shipped ranking names the configs it was measured over; a split added since is a
    candidate all the same, and a heavy epilogue takes it."""
    ranked = [Fake("<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages, epilogue in 2>"),
              Fake("<triton_persistent 128x128x64 group 8, 8 warps, 4 stages, flat>")]
    four = Fake("<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages, epilogue in 4>")
    other = Fake("<gluon_pingpong 128x128x64 group 8, 4 warps, 4 stages, epilogue in 2>")
    assert tune.distinct_tiles(ranked, 4, [*ranked, four, other]) == [four, ranked[1]]


def test_a_heavy_epilogue_of_the_compile_backend_times_a_spread_of_the_table_and_remembers(gpu):
    """time_heavy and 6 bytes per output: the first kernel of each family and tile of the
    table's ranking are timed (fast), and the winner serves the next call with or without
    time_heavy; a light epilogue, or a heavy one without time_heavy, takes the table's first."""
    kernels = [Fake(text) for text in _s2_order()]
    picked = tune.distinct_tiles(kernels, tune.HEAVY_SHORT_LIST, kernels)
    smallest = tune.smallest_ping_pong(kernels)
    if tune._kind(smallest) not in {tune._kind(k) for k in picked}:
        picked.append(smallest)
    spread = [repr(k) for k in picked]
    assert tune.choose(_heavy_args(16384, 4096, 1024), kernels) is kernels[0] and gpu == []
    assert tune.choose(_args(16384, 4096, 1024), kernels, time_heavy=True) is kernels[0] and gpu == []
    winner = tune.choose(_heavy_args(16384, 4096, 1024), kernels, time_heavy=True)
    assert gpu == [("fast", spread)] and repr(winner) == spread[-1]
    assert tune.choose(_heavy_args(16384, 4096, 1024), kernels) is winner and len(gpu) == 1


@pytest.mark.parametrize("policy", ["fast", "full"])
def test_nothing_is_timed_while_a_cuda_graph_is_captured(gpu, monkeypatch, policy):
    """Timing synchronizes, which fails a capture: during one, the table's first choice (or the
    untimed order's first) serves, under every policy, heavy epilogues of the backend included."""
    monkeypatch.setenv("EPIFUSE_TUNE", policy)
    monkeypatch.setattr(tune, "capturing", lambda device: True)
    kernels = [Fake(text) for text in _s2_order()]
    assert tune.choose(_heavy_args(16384, 4096, 1024), kernels, time_heavy=True) is kernels[0]
    far = [Fake(f"<k{i}>") for i in range(5)]
    assert tune.choose(_args(64, 50000, 300), far) is far[0]
    assert gpu == []


def test_zero_takes_the_untimed_order(gpu, monkeypatch):
    monkeypatch.setenv("EPIFUSE_TUNE", "0")
    kernels = [Fake("<first>"), Fake(_s2_order()[0])]
    assert tune.choose(_args(16384, 4096, 1024), kernels) is kernels[0] and gpu == []


def test_background_serves_the_fast_choice_and_queues_full_tuning(gpu, monkeypatch):
    queued = []
    monkeypatch.setattr(tune, "tune_in_background", lambda args, kernels, key: queued.append(len(kernels)))
    monkeypatch.setenv("EPIFUSE_TUNE", "background")
    order = _s2_order()
    kernels = [Fake("<first>"), Fake(order[0]), Fake("<third>")]
    assert tune.choose(_args(16384, 4096, 1024), kernels) is kernels[1]
    kernels_far = [Fake("<a>"), Fake("<b>")]
    assert tune.choose(_args(64, 50000, 300), kernels_far) is kernels_far[0]   # no entry: the untimed first
    assert queued == [3, 2] and gpu == []


# ---- background tuning's worker (CUDA's stream calls stubbed: CPU tensors stand for a GPU's) ------

class _NoEvent:
    def record(self):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def worker(gpu, monkeypatch):
    """The background policy with a queue, a worker and listeners of the test's own; choices are
    remembered in memory only. Whatever is still queued at the end is dropped and the worker
    waited for."""
    monkeypatch.setenv("EPIFUSE_TUNE", "background")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(tune, "_store", lambda key, choice: None)
    monkeypatch.setattr(tune, "_PENDING", {})
    monkeypatch.setattr(tune, "_FAILED", set(), raising=False)
    monkeypatch.setattr(tune, "_WORKER", [])
    monkeypatch.setattr(tune, "LISTENERS", [])
    yield gpu
    with tune._LOCK:
        tune._PENDING.clear()
    assert tune.wait_for_background(10)


def _cpu_args(M, N, K, dtype=torch.float32):
    """A problem of real (random) CPU tensors: a transposed B and a broadcast bias."""
    A = torch.randn(M, K, dtype=dtype)
    B = torch.randn(N, K, dtype=dtype).t()
    bias = torch.randn(N, dtype=dtype).expand(M, N)
    return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum, bias, s):\n    D = accum * s + bias\n    return D\n", bias=bias, s=0.5,
        D=torch.empty(M, N, dtype=dtype)))


def _blocked_timer(monkeypatch, record=None):
    """A fake timer that waits for the returned event before it picks the last candidate,
    calling `record(args)` first where given."""
    release = threading.Event()

    def time_all(args, kernels, mode="full"):
        release.wait(10)
        if record is not None:
            record(args)
        return kernels[-1]
    monkeypatch.setattr(tune, "_time_all", time_all)
    return release


def _tensors_reachable(root, limit=200_000) -> list:
    """The tensors reachable from `root` through containers and objects' attributes (not
    through functions, classes or modules, which reach everything)."""
    found, seen, todo = [], set(), [root]
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.CodeType, types.FrameType)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def test_a_failed_background_tuning_is_not_queued_again_nor_drops_kept_choices(worker, monkeypatch):
    """A tuning that raises in the worker (out of memory, say) is remembered: the calls after it
    keep fast's choice without tuning again, and the kept choices and launches stay (the
    listeners are not called, the generation does not move)."""
    tuned, dropped = [], []

    def failing(args, kernels, mode="full"):
        tuned.append(mode)
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(tune, "_time_all", failing)
    tune.LISTENERS.append(lambda: dropped.append(True))
    before = getattr(tune, "generation", lambda: None)()
    args = _cpu_args(64, 48, 32)
    kernels = [Fake("<k0>"), Fake("<k1>"), Fake("<k2>")]
    for _ in range(4):
        assert tune.choose(args, kernels) is kernels[0]
        assert tune.wait_for_background(5)
    assert tuned == ["background"] and dropped == []
    assert tune.generation() == before


def test_a_background_winner_moves_the_generation_before_the_listeners_run(worker, monkeypatch):
    """The counterpart: a tuning that works is remembered, moves the generation and calls the
    listeners (which see the generation moved)."""
    seen = []
    tune.LISTENERS.append(lambda: seen.append(tune.generation()))
    before = tune.generation()
    args = _cpu_args(64, 48, 32)
    kernels = [Fake("<k0>"), Fake("<k1>")]
    assert tune.choose(args, kernels) is kernels[0]
    assert tune.wait_for_background(5)
    assert seen == [before + 1] and tune.generation() == before + 1
    assert tune.choose(args, kernels) is kernels[1]   # the fake timer's winner serves now


def test_the_background_queue_holds_no_tensors(worker, monkeypatch):
    """While the worker times one problem, the others queued hold a description of each (its
    layouts, numbers and options), not copies of their tensors: a step with many GEMM shapes
    does not hold a copy of all of their inputs at once."""
    release = _blocked_timer(monkeypatch)
    kernels = [Fake("<k0>"), Fake("<k1>")]
    for i in range(4):   # distinct shape buckets: four problems
        tune.choose(_cpu_args(64, 16 << i, 32), kernels)
    with tune._LOCK:
        queued = list(tune._PENDING.values())
    try:
        assert len(queued) == 4
        assert _tensors_reachable(queued) == []
    finally:
        release.set()
    assert tune.wait_for_background(10)


def test_background_tuning_times_fresh_tensors_laid_out_as_the_callers(worker, monkeypatch):
    """The worker times each problem on tensors of its own, made when it reaches the problem,
    with the caller's sizes, strides (a transposed B, a broadcast operand, an overlapping view)
    and dtypes and random values; numbers as they are. They are freed before the next problem's
    are made, and drawing them leaves the caller's random stream where it was."""
    timed, earlier = [], []

    def record(args):
        gc.collect()
        timed.append({"alive before": [ref() is not None for ref in earlier], "program": args.epilogue.program,
                      "numbers": {n: v for n, v in args.operands.items() if not isinstance(v, torch.Tensor)},
                      "tensors": {n: (t.clone(), t.stride(), t.untyped_storage().data_ptr())
                                  for n, t in _named_tensors(args).items()}})
        earlier.extend(weakref.ref(t) for t in _named_tensors(args).values())
    release = _blocked_timer(monkeypatch, record)
    kernels = [Fake("<k0>"), Fake("<k1>")]
    first = _cpu_args(16, 8, 8, torch.float16)
    A, C = torch.randn(8, 8), torch.randn(24).as_strided((8, 6), (2, 1))   # rows overlap
    B = torch.randn(6, 8).t()
    second = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum, C):\n    D = accum + C\n    return D\n", C=C, D=torch.empty(8, 6)))
    tune.choose(first, kernels)
    tune.choose(second, kernels)
    rng = torch.random.get_rng_state()
    release.set()
    assert tune.wait_for_background(10)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert [record["alive before"] for record in timed] == [[], [False] * 4]   # A, B, D and bias
    gc.collect()
    assert all(ref() is None for ref in earlier)
    for callers, record in zip((first, second), timed):
        assert record["program"] is callers.epilogue.program
        theirs = _named_tensors(callers)
        assert record["tensors"].keys() == theirs.keys()
        for name, (values, stride, address) in record["tensors"].items():
            caller = theirs[name]
            assert (values.shape, stride, values.dtype) == (caller.shape, caller.stride(), caller.dtype)
            assert address != caller.untyped_storage().data_ptr()
            assert values.isfinite().all() and values.float().std() > 0.1 and not torch.equal(values, caller)
    assert timed[0]["numbers"] == {"s": 0.5} and timed[0]["tensors"]["bias"][1] == (0, 1)
    assert timed[1]["tensors"]["C"][1] == (2, 1)


def _named_tensors(args) -> dict:
    return {"A": args.A, "B": args.B, **args.outputs,
            **{n: v for n, v in args.operands.items() if isinstance(v, torch.Tensor)}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.int8, torch.uint8, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("shape, stride", [((16, 12), (12, 1)), ((16, 12), (1, 16)), ((16, 12), (0, 1)),
                                           ((16, 12), (2, 1))], ids=["rows", "columns", "broadcast", "overlapping"])
def test_fresh_tensors_have_the_layout_and_random_values_of_their_dtype(dtype, shape, stride):
    layout = tune._Layout(shape, stride, dtype, torch.device("cpu"))
    fresh = tune._fresh_tensor(layout, torch.Generator().manual_seed(1))
    assert (tuple(fresh.shape), fresh.stride(), fresh.dtype) == (shape, stride, dtype)
    values = fresh.as_strided((tune._span(layout),), (1,))   # every element of the span drawn
    if dtype == torch.bool:
        assert values.any() and not values.all()
    elif dtype.is_floating_point:
        wide = values.double()
        assert wide.isfinite().all() and 0.5 < wide.std() < 2 and (wide < 0).any() and (wide > 0).any()
    else:
        wide = values.long()
        assert wide.abs().max() <= 4 and len(wide.unique()) > 2
        assert (wide < 0).any() == (dtype != torch.uint8)


class _Unreadable:
    """An epilogue whose tensors cannot be read (a stand-in for anything that raises while a
    problem is being queued)."""

    def __getattr__(self, name):
        raise ValueError("unreadable")


def test_an_error_while_queueing_leaves_nothing_claimed(worker, monkeypatch):
    """Whatever raises while a problem is queued, the problem is not left claimed: a later call
    queues it, and the worker finishes."""
    timed = []
    release = _blocked_timer(monkeypatch, lambda args: timed.append(args.M))
    kernels = [Fake("<k0>"), Fake("<k1>")]
    tune.choose(_cpu_args(16, 8, 8), kernels)   # the worker is busy with this one
    args = _cpu_args(300, 8, 8)
    epilogue, args.epilogue = args.epilogue, _Unreadable()
    with pytest.raises(ValueError, match="unreadable"):
        tune.choose(args, kernels)
    args.epilogue = epilogue
    assert tune.choose(args, kernels) is kernels[0]
    release.set()
    assert tune.wait_for_background(5)
    assert timed == [16, 300] and tune.choose(args, kernels) is kernels[1]


def test_a_choice_made_while_a_background_winner_lands_is_not_kept(worker, monkeypatch):
    """choose_kernel chooses outside its lock: where the worker remembers a winner (and the
    listeners drop the kept choices) meanwhile, the choice made before it is not kept, or it
    would serve that signature from then on instead of the winner."""
    monkeypatch.setattr(select, "_CHOSEN", OrderedDict())
    tune.LISTENERS.append(select._forget_choices)
    fast = Fake("<fast>")
    kernels = [fast, Fake("<tuned>")]
    monkeypatch.setattr(select, "get_kernels", lambda args: kernels)
    other = _cpu_args(64, 48, 32)

    def choose_as_the_worker_lands(args, candidates, time_heavy=False):
        tune.tune_in_background(other, candidates, "another problem")
        assert tune.wait_for_background(5)   # remembered, listeners called
        return fast
    monkeypatch.setattr(tune, "choose", choose_as_the_worker_lands)
    args = _cpu_args(16, 8, 8)
    assert select.choose_kernel(args) is fast
    assert args.signature not in select._CHOSEN
    monkeypatch.setattr(tune, "choose", lambda args, candidates, time_heavy=False: fast)   # nothing lands: kept
    assert select.choose_kernel(args) is fast and args.signature in select._CHOSEN


def test_the_docs_say_not_to_capture_a_cuda_graph_while_background_tuning_runs():
    """The worker synchronizes and allocates, which fails a CUDA graph capture in another
    thread: tune's docstring and the README's background bullet say to wait for it first."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    bullet = readme[readme.index("- `background`:"):]
    bullet = bullet[:bullet.index("\n- ")]
    for text in (tune.__doc__, bullet):
        words = " ".join(text.split())
        assert "CUDA graph" in words and "wait_for_background()" in words


def test_the_policy_is_part_of_a_calls_signature(monkeypatch):
    """A kept launch chosen under one policy does not serve another."""
    A = torch.randn(8, 8)
    monkeypatch.setenv("EPIFUSE_TUNE", "0")
    D = torch.empty(8, 8)
    zero = epifuse.GemmArguments(A, A, epilogue=epifuse.EpilogueArguments("relu", D=D)).signature
    monkeypatch.setenv("EPIFUSE_TUNE", "full")
    assert epifuse.GemmArguments(A, A, epilogue=epifuse.EpilogueArguments("relu", D=D)).signature != zero


# ---- the shipped tables -------------------------------------------------------------------------

def test_file_names_and_input_classes():
    assert shipped.gpu_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3.json"
    assert shipped.input_class(torch.bfloat16) == shipped.input_class(torch.float16) == "16-bit float"
    assert shipped.input_class(torch.float8_e4m3fn) == "fp8" and shipped.input_class(torch.int8) == "int8"
    assert shipped.input_class(torch.float32) is None


def test_no_entry_for_an_unknown_gpu_a_far_shape_or_another_input_type():
    assert shipped.nearest("NVIDIA A100-SXM4-80GB", torch.float16, 4096, 4096, 4096) is None
    assert shipped.nearest(H200, torch.float16, 4096, 4096, 40000) is None      # K 4.9 octaves away
    assert shipped.nearest(H200, torch.float32, 4096, 4096, 4096) is None
    assert shipped.nearest(H200, torch.bfloat16, 4096, 4096, 4096)["M"] == 4096


def _all_kernel_names() -> set:
    families = (PERSISTENT, PINGPONG, COOPERATIVE, TILED, SPLIT_K)
    lists = [v for v in vars(configs).values() if isinstance(v, (list, tuple))]
    names = set()
    for family in families:
        for group in lists:
            for config in group:
                if hasattr(config, "block_m"):
                    names.add(repr(TritonKernel(family, config)))
    return names


@pytest.mark.parametrize("path", sorted(shipped.TABLES.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_table_loads_and_names_kernels_that_exist(path):
    """A table naming a config that was renamed or removed would pass silently over to timing:
    each shipped table's first choices must still be kernels epifuse builds."""
    data = json.loads(path.read_text())
    assert shipped.gpu_file_name(data["gpu"]) == path.name
    table = shipped.table(data["gpu"])
    assert table is not None and table["entries"]
    names = _all_kernel_names()
    for entry in table["entries"]:
        assert entry["order"][0] in names, (entry["input"], entry["M"], entry["N"], entry["K"])


def test_a_damaged_table_is_passed_over_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(shipped, "TABLES", tmp_path)
    shipped.table.cache_clear()
    try:
        (tmp_path / "NVIDIA-H200.json").write_text('{"gpu": "NVIDIA H200", "entries": [{"input": 3}]}')
        with pytest.warns(CacheWarning, match="not a table"):
            assert shipped.table(H200) is None
        assert shipped.nearest(H200, torch.float16, 4096, 4096, 4096) is None
    finally:
        shipped.table.cache_clear()


# ---- how bench.choices ranks ---------------------------------------------------------------------

def _record(choice, **us):
    return {"choice": choice, "policy": "full", "timings_us": us}


def test_the_table_ranks_by_mean_time_relative_to_each_workloads_choice():
    ranked = choices.rank([_record("a", a=100.0, b=110.0, c=150.0), _record("b", a=104.0, b=100.0, c=160.0)])
    assert [name for name, _, _ in ranked] == ["a", "b", "c"] or [name for name, _, _ in ranked] == ["b", "a", "c"]
    assert ranked[-1][0] == "c" and ranked[0][1] == 2


def test_within_three_percent_the_kernel_chosen_most_often_comes_first():
    records = [_record("a", a=100.0, b=99.0), _record("a", a=100.0, b=98.5), _record("b", a=101.0, b=100.0)]
    assert choices.rank(records)[0][0] == "a"   # b scores 0.99 but was chosen once, a twice


def test_a_kernel_timed_for_fewer_workloads_comes_after():
    ranked = choices.rank([_record("a", a=100.0, z=50.0), _record("a", a=100.0)])
    assert [name for name, _, _ in ranked] == ["a", "z"]


def test_rows_not_tuned_in_full_are_left_out_of_a_table():
    row = {"M": 64, "N": 64, "K": 64, "dtype": "fp16"}
    full = {"env": {"gpu": "G"}, "_source": "x.json",
            "rows": [{**row, "epifuse_tuning": _record("a", a=1.0)},
                     {**row, "epifuse_tuning": {**_record("b", b=1.0), "policy": "fast"}}]}
    table = choices.table([full])
    assert table["gpu"] == "G" and [e["order"] for e in table["entries"]] == [["a"]]


def test_the_smallest_ping_pong_is_the_first_kernel_of_the_smallest_ping_pong_tile():
    kernels = [Fake("<gluon_pingpong 128x128x64 group 8, 4 warps, 4 stages, epilogue in 2>"),
               Fake("<triton_tiled 64x64x64 group 8, 4 warps, 4 stages>"),
               Fake("<gluon_pingpong 64x128x64 group 8, 4 warps, 8 stages>"),
               Fake("<gluon_pingpong 64x128x64 group 8, 4 warps, 6 stages, epilogue in 2>")]
    assert tune.smallest_ping_pong(kernels) is kernels[2]
    assert tune.smallest_ping_pong(kernels[1:2]) is None


def test_a_heavy_epilogue_also_times_the_smallest_ping_pong(gpu):
    """The 64-row ping-pong, offered last on a full grid and named by no ranking, joins the
    four of distinct_tiles for a heavy epilogue of the backend; a light one never times it."""
    order = [Fake(text) for text in _s2_order()]
    small = Fake("<gluon_pingpong 64x128x64 group 8, 4 warps, 8 stages>")
    kernels = [*order, small]
    winner = tune.choose(_heavy_args(16384, 4096, 1024), kernels, time_heavy=True)
    timed = gpu[0][1]
    assert repr(small) in timed and len(timed) == tune.HEAVY_SHORT_LIST + 1 and repr(winner) in timed
    assert tune.choose(_args(16384, 4096, 1024), kernels, time_heavy=True) is order[0] and len(gpu) == 1
