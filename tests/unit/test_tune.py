"""How tuning ranks its candidates (runtime/tune.rank and the history _time_all keeps), on CPU
with fake timers: a GPU that heats up while tuning runs, a first timing on a cooler GPU, and
kernels that fail to run."""
from __future__ import annotations

import pytest
import torch

import epifuse
from epifuse.runtime import tune


def _drifting_timer(costs, drift, fails=()):
    """A fake timer: each kernel's true cost plus `drift` per earlier call (a GPU heating up)."""
    calls = []

    def time_ms(kernel):
        calls.append(kernel)
        if kernel in fails:
            raise RuntimeError("out of resources")
        return costs[kernel] + drift * (len(calls) - 1)
    return time_ms, calls


def test_tuning_sees_through_a_drifting_clock():
    """The truly faster kernel wins although the first pass, timed on a cooler GPU, favours
    the one that ran first; a far slower kernel is timed once."""
    time_ms, calls = _drifting_timer({"first": 100.0, "second": 98.0, "slow": 150.0}, drift=3.0)
    ranked = tune.rank(["first", "second", "slow"], time_ms)
    assert [k for _, _, k in ranked] == ["second", "first", "slow"]
    assert calls == ["first", "second", "slow", "first", "first", "second"]
    assert ranked[0][0] == pytest.approx((101.0 + 113.0) / 2)


def test_tuning_times_contenders_again_in_the_reverse_of_their_kept_times():
    """The first kernel's kept time is the last of the first pass, so it is the first to be
    timed again: under a steady drift the truly faster first kernel (by 2 %) wins. Timed again
    in the kernels' order instead, its two times would fall later than the second's and the
    drift (3 % a timing) would hand the second kernel the win."""
    time_ms, calls = _drifting_timer({"first": 100.0, "second": 102.0}, drift=3.0)
    ranked = tune.rank(["first", "second"], time_ms)
    assert calls == ["first", "second", "first", "first", "second"]
    assert [k for _, _, k in ranked] == ["first", "second"]
    assert [t for t, _, _ in ranked] == pytest.approx([(106.0 + 109.0) / 2, (105.0 + 114.0) / 2])


def test_tuning_times_the_first_kernel_again_once_the_gpu_works():
    """The first timings of a tuning may run faster than any later one (an idle GPU's clock):
    the first kernel is timed again at the end of the pass and that time replaces its first,
    so that a lead it owes to the clock (here 15 %, more than `close`) does not exclude the
    others from the second timing."""
    costs = {"first": 100.0, "second": 95.0, "third": 130.0}
    calls = []

    def time_ms(kernel):
        calls.append(kernel)
        return costs[kernel] * (0.85 if len(calls) == 1 else 1.0)
    assert 95.0 > 85.0 * tune.CLOSE  # without the second timing, the second kernel is excluded
    ranked = tune.rank(["first", "second", "third"], time_ms)
    assert [k for _, _, k in ranked] == ["second", "first", "third"]
    assert [t for t, _, _ in ranked] == pytest.approx([95.0, 100.0, 130.0])
    assert calls == ["first", "second", "third", "first", "first", "second"]


def test_tuning_drops_a_first_kernel_that_cannot_be_timed_again():
    """Its one time ran on a cooler GPU and is not comparable with the others'."""
    calls = []

    def time_ms(kernel):
        calls.append(kernel)
        if kernel == "first" and len(calls) > 1:
            raise RuntimeError("out of resources")
        return {"first": 80.0, "second": 100.0, "third": 105.0}[kernel]
    ranked = tune.rank(["first", "second", "third"], time_ms)
    assert [k for _, _, k in ranked] == ["second", "third"]


def test_tuning_records_every_timing_in_order(monkeypatch):
    """A tuning's history keeps each timing as it ran (the first pass, the first kernel again,
    then the contenders again), so that a report can tell a drifting clock from a faster kernel."""
    times = iter([100.0, 98.0, 150.0, 97.0, 101.0, 104.0])
    monkeypatch.setattr(tune, "do_bench", lambda fn, **kw: next(times) / 1e3)
    monkeypatch.setenv("EPIFUSE_QUIET", "1")

    class Fake:
        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return f"<{self.name}>"

        def run(self, args):
            pass
    A = torch.ones(8, 8)
    args = epifuse.GemmArguments(A, A, epilogue=epifuse.EpilogueArguments(
        "def e(accum):\n    D = accum\n    return D\n", D=torch.empty(8, 8)))
    kernels = [Fake("first"), Fake("second"), Fake("slow")]
    assert tune._time_all(args, kernels) is kernels[0]
    entry = tune.HISTORY[-1]
    assert entry["calls_us"] == [["<first>", 100.0], ["<second>", 98.0], ["<slow>", 150.0],
                                 ["<first>", 97.0], ["<first>", 101.0], ["<second>", 104.0]]
    assert entry["timings_us"] == pytest.approx({"<first>": 99.0, "<second>": 101.0, "<slow>": 150.0})


def test_tuning_drops_kernels_that_fail():
    time_ms, calls = _drifting_timer({"a": 10.0, "b": 5.0, "c": 10.5}, drift=0.0, fails=("b",))
    ranked = tune.rank(["a", "b", "c"], time_ms)
    assert [k for _, _, k in ranked] == ["a", "c"]
    assert tune.rank(["b"], time_ms) == []


class _TiledFake:
    def __init__(self, name, block_m, block_n):
        self.name = name
        self.config = type("Config", (), {"block_m": block_m, "block_n": block_n})()

    def __repr__(self):
        return f"<{self.name}>"

    def config_for(self, args):  # the config a kernel runs, after any fallback
        return self.config

    def run(self, args):
        pass


def _identity_args():
    A = torch.ones(8, 8)
    return epifuse.GemmArguments(A, A, epilogue=epifuse.EpilogueArguments(
        "def e(accum):\n    D = accum\n    return D\n", D=torch.empty(8, 8)))


@pytest.mark.parametrize("coop_us, sms, chosen", [
    (102.0, None, "coop"),      # 2 % slower in tuning, a quarter fewer operand bytes: it wins
    (102.9, None, "coop"),      # just inside 3 %
    (104.0, None, "pingpong"),  # 4 % slower: the faster one stays
    (102.0, 132, "pingpong"),   # its one 8x8 tile would leave SMs idle: time alone decides
])
def test_within_three_percent_the_kernel_reading_fewer_operand_bytes_wins(monkeypatch, coop_us, sms, chosen):
    # the first pass, the first kernel again, then both again (the first kernel first)
    times = iter([100.0, coop_us, 100.0, 100.0, coop_us])
    monkeypatch.setattr(tune, "do_bench", lambda fn, **kw: next(times) / 1e3)
    monkeypatch.setattr(tune, "_sms", lambda args: sms)
    monkeypatch.setenv("EPIFUSE_QUIET", "1")
    kernels = [_TiledFake("pingpong", 128, 128), _TiledFake("coop", 128, 256)]
    assert repr(tune._time_all(_identity_args(), kernels)) == f"<{chosen}>"
    entry = tune.HISTORY[-1]
    assert entry["choice"] == f"<{chosen}>" and entry["fastest"] == "<pingpong>"
    assert entry["timings_us"] == pytest.approx({"<pingpong>": 100.0, "<coop>": coop_us})


def test_the_lighter_kernel_is_preferred_only_among_near_ties():
    pingpong, coop, small = _TiledFake("pp", 128, 128), _TiledFake("coop", 128, 256), _TiledFake("s", 64, 128)
    args = _identity_args()

    def weigh(kernel):
        return tune.operand_bytes_per_output(kernel, args, None)
    timings = [(1.00, 0, pingpong), (1.01, 2, small), (1.02, 1, coop)]
    assert [k for _, _, k in tune.lighter_first(timings, weigh)] == [coop, pingpong, small]
    assert [k for _, _, k in tune.lighter_first(timings, weigh, within=1.005)] == [pingpong, small, coop]
    twin = _TiledFake("twin", 256, 128)  # as light as coop and slower: the faster of the two wins
    assert tune.lighter_first([(1.00, 0, pingpong), (1.01, 1, coop), (1.02, 2, twin)], weigh)[0][2] is coop
    assert tune.lighter_first([(1.00, 0, pingpong), (1.01, 1, twin), (1.02, 2, coop)], weigh)[0][2] is twin
    coop.gluon = True  # as light as twin, and a Gluon kernel: it wins the tie
    assert tune.lighter_first([(1.00, 0, pingpong), (1.01, 1, twin), (1.02, 2, coop)], weigh)[0][2] is coop
    assert tune.lighter_first([(1.00, 0, pingpong), (1.01, 1, twin), (1.04, 2, coop)], weigh)[0][2] is twin
    pingpong.gluon = True  # being Gluon does not outweigh the lighter tiles
    assert tune.lighter_first([(1.00, 0, pingpong), (1.01, 1, twin)], weigh)[0][2] is twin
    untiled = [(1.00, 0, "untiled"), (1.01, 1, pingpong)]  # no config: its bytes are unknown
    assert [k for _, _, k in tune.lighter_first(untiled, weigh)] == ["untiled", pingpong]
    assert [k for _, _, k in tune.lighter_first(untiled[::-1], weigh)] == [pingpong, "untiled"]
    assert tune.lighter_first([], weigh) == []


def test_a_kernel_is_weighed_by_the_tiles_it_runs_after_a_fallback():
    """A 128x256 config that fell back to 128x128 tiles (out of shared memory) reads what a
    128x128 kernel reads, and is not preferred for the tiles it no longer runs."""
    coop = _TiledFake("coop", 128, 256)
    args = _identity_args()
    assert tune.operand_bytes_per_output(coop, args, None) == pytest.approx(1 / 128 + 1 / 256)
    coop.config_for = lambda args: type("Config", (), {"block_m": 128, "block_n": 128})()
    assert tune.operand_bytes_per_output(coop, args, None) == pytest.approx(2 / 128)
    assert tune.operand_bytes_per_output(coop, args, 1) == pytest.approx(2 / 128)  # 1 tile, 1 SM
    assert tune.operand_bytes_per_output(coop, args, 2) == float("inf")  # 1 tile, 2 SMs


def test_only_the_gluon_kernels_are_marked_gluon():
    """Triton's own warp-specialized configs included: the tie-break's evidence compares the
    Gluon kernels with those too."""
    from epifuse.backends.triton import configs
    from epifuse.backends.triton.families import COOPERATIVE, PERSISTENT, PINGPONG, TILED
    from epifuse.backends.triton.kernels import TritonKernel
    assert TritonKernel(COOPERATIVE, configs.COOPERATIVE[0]).gluon
    assert TritonKernel(PINGPONG, configs.PINGPONG[0]).gluon
    ws = [c for c in configs.PERSISTENT if c.warp_specialize]
    assert ws and not any(TritonKernel(PERSISTENT, c).gluon for c in ws)
    assert not TritonKernel(PERSISTENT, configs.INTERPRETER).gluon
    assert not TritonKernel(TILED, configs.INTERPRETER).gluon


def test_real_kernels_are_weighed_by_their_tiles(monkeypatch):
    """1/BLOCK_M + 1/BLOCK_N of the tiles a kernel runs: its config's, or the smaller config it
    fell back to after running out of resources for these arguments."""
    from epifuse.backends.triton import configs, kernels
    from epifuse.backends.triton.families import COOPERATIVE, PERSISTENT, PINGPONG
    args = _identity_args()
    coop = kernels.TritonKernel(COOPERATIVE, configs.COOPERATIVE[0])
    ping = kernels.TritonKernel(PINGPONG, configs.PINGPONG[0])
    assert tune.operand_bytes_per_output(coop, args, None) == 1 / 128 + 1 / 256
    assert tune.operand_bytes_per_output(ping, args, None) == 1 / 128 + 1 / 128
    small = kernels.TritonKernel(PERSISTENT, configs.INTERPRETER)
    assert tune.operand_bytes_per_output(small, args, None) == 1 / 32 + 1 / 32
    monkeypatch.setitem(kernels._FALLBACK, (coop.family.name, args.key, coop.config), configs.SMALL_GRID[0])
    assert tune.operand_bytes_per_output(coop, args, None) == 1 / 64 + 1 / 128


def test_a_new_ranking_rule_is_a_new_tuning_key():
    assert f"ranking {tune.RANKING}" in tune.tuning_key(_identity_args())


def test_only_a_kernel_whose_own_tiles_fill_the_sms_is_promoted():
    """512x512: 16 tiles of 128x128 fill 12 SMs, 8 of 128x256 do not, so the ping-pong stays
    first although the cooperative kernel is within 3 % and lighter; with 8 SMs both fill them."""
    A, B = torch.ones(512, 8), torch.ones(8, 512)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum):\n    D = accum\n    return D\n", D=torch.empty(512, 512)))
    pingpong, coop = _TiledFake("pp", 128, 128), _TiledFake("coop", 128, 256)
    timings = [(1.00, 0, pingpong), (1.02, 1, coop)]
    for sms, first in ((12, pingpong), (8, coop)):
        ranked = tune.lighter_first(timings, lambda k: tune.operand_bytes_per_output(k, args, sms))
        assert ranked[0][2] is first


def test_split_k_is_never_promoted_for_its_tiles():
    split = _TiledFake("split", 128, 256)
    split.config.split_k = 2
    assert tune.operand_bytes_per_output(split, _identity_args(), None) == float("inf")
