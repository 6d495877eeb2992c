"""The tuning policy (EPIFUSE_TUNE: fast, full, background, 0) and the shipped tables of tuned
choices (runtime/shipped.py), on CPU: arguments of meta tensors stand for a GPU problem, fake
kernels for the candidates, a fake timer for tuning."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import epifuse
from epifuse.errors import EpilogueArgumentError
from epifuse.runtime.cache import CacheWarning
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


def test_a_full_tuning_choice_serves_fast_afterwards(gpu, monkeypatch):
    order = _s2_order()
    kernels = [Fake(order[0]), Fake("<slower in the table, faster here>")]
    args = _args(16384, 4096, 1024)
    monkeypatch.setenv("EPIFUSE_TUNE", "full")
    assert tune.choose(args, kernels) is kernels[1]
    monkeypatch.delenv("EPIFUSE_TUNE")
    assert tune.choose(args, kernels) is kernels[1] and len(gpu) == 1   # remembered, over the table


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


def test_background_tuning_works_on_copies_laid_out_as_the_callers_tensors():
    """The caller may change or free its tensors once the call returns: the worker times
    copies with the same sizes and strides, a broadcast (stride 0) operand and a transposed B
    included, so that it times the kernels as they run for the caller."""
    A, B = torch.randn(8, 4), torch.randn(6, 4).t()
    bias = torch.randn(6).expand(8, 6)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum, bias):\n    D = accum + bias\n    return D\n", bias=bias, D=torch.empty(8, 6)))
    copied = tune._copied_args(args)
    for mine, theirs in ((copied.A, A), (copied.B, B), (copied.epilogue.operands["bias"], bias)):
        assert mine.stride() == theirs.stride() and torch.equal(mine, theirs)
        assert mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()
    A.fill_(float("nan"))
    assert not copied.A.isnan().any()


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
