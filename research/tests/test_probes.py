"""The research probes' offline parts (research/): reading ncu's CSV, the power and byte-energy
models, the toolchain and SASS probes' offline compiles, the L2 probe's driver structures. No GPU.
"""


def test_ncu_probe_table_reads_the_raw_csv():
    """One line per profiled launch, in launch order, with its label; a metric ncu did not
    collect reads '-'."""
    from research import ncu_probe
    text = ('==PROF== Connected\nNCU_PROBE_LABELS ["a", "b"]\n'
            '"ID","Kernel Name","gpu__time_duration.sum","lts__t_bytes.sum"\n'
            '"","","nsecond","byte"\n'
            '"0","sm90_xmma_gemm_tilesize128x256x64_cluster2x1x1","195,500","1,200,000,000"\n'
            '"1","epifuse_kernel","201,250","1,700,000,000"\n')
    lines = ncu_probe.table(text, ["cublas A@B", "identity <k>"]).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:1] == ["195.5"] and "cublas A@B / sm90_xmma_gemm_tilesize128x256x64" in lines[1]
    assert "1200.0" in lines[1] and "1700.0" in lines[2] and "identity <k> / epifuse_kernel" in lines[2]
    assert lines[2].split()[1] == "-"             # no SM clock column in this CSV
    assert ncu_probe.table("no csv here", []) == "no kernels in the ncu output"


def test_ncu_probe_gives_the_share_of_reads_the_l2_request_coalescer_merged():
    from research import ncu_probe
    text = ('"ID","Kernel Name","lrc__xbar2gpc_sectors_op_read.sum","lrc__lts2lrc_sectors_op_read.sum"\n'
            '"","","sector","sector"\n'
            '"0","epifuse_kernel","50,000,000","20,000,000"\n'
            '"1","cutlass_kernel","50,000,000","50,000,000"\n'
            '"2","nothing_read","0","0"\n')
    lines = ncu_probe.table(text, ["coop", "cluster", "none"]).splitlines()
    coalesced = [h for h, _, _ in ncu_probe.COLUMNS].index("coal%")
    assert [line.split()[coalesced] for line in lines[1:]] == ["60.0", "0.0", "-"]


def test_ncu_probe_lists_each_launchs_largest_stall_reasons():
    from research import ncu_probe
    stalled = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    reasons = ["barrier", "long_scoreboard", "math_pipe_throttle", "wait", "sleeping", "selected"]
    header = '"ID","Kernel Name",' + ",".join(f'"{stalled.format(r)}"' for r in reasons)
    text = (header + "\n" + '"",""' + ',"ratio"' * 6 + "\n"
            '"0","nvjet_sm90","0.10","2.50","0.75","1,250.5","n/a","1"\n'
            '"1","epifuse_kernel","0","0","0","0","0","1"\n')
    lines = ncu_probe.table(text, ["cublas A@B", "identity"]).splitlines()
    assert lines[-2] == "  cublas A@B: wait 1250.50, long_scoreboard 2.50, math_pipe_throttle 0.75, barrier 0.10"
    assert lines[-1] == "  identity: -"


def test_power_probe_counts_the_dram_bytes_beyond_cublas():
    """The power probe's model charges each workload for the (M, N) operands it reads and the
    outputs it writes beyond cuBLAS's D: relu_aux reads C and writes F too, a loss reads the
    labels instead of writing D, a bias row costs nothing."""
    import torch

    from bench.workloads import WORKLOADS
    from research.power_probe import extra_dram_bytes, extra_dram_split
    M, N, K = 64, 48, 16
    tile = M * N * 2
    expected = {"identity": 0, "bias_gelu": 0, "lincomb": tile, "relu_aux": 2 * tile, "bce_loss": 4,
                "rowsumsq": 4 * M}
    for name, extra in expected.items():
        w = WORKLOADS[name]
        gen = torch.Generator()
        gen.manual_seed(0)
        s = w.build(M, N, K, torch.float16, "cpu", gen)
        assert extra_dram_bytes(w, s, M, N) == extra, name
    gen = torch.Generator()
    gen.manual_seed(0)
    s = WORKLOADS["relu_aux"].build(M, N, K, torch.float16, "cpu", gen)
    assert extra_dram_split(WORKLOADS["relu_aux"], s, M, N) == (tile, tile)
    s = WORKLOADS["bce_loss"].build(M, N, K, torch.float16, "cpu", gen)
    assert extra_dram_split(WORKLOADS["bce_loss"], s, M, N) == (tile, 4 - tile)


def test_byte_energy_fits_only_the_levels_whose_streams_took_equal_time():
    """The price is the slope through the levels whose DRAM and L2 streams matched in time; a
    level run unpaced (DRAM 2.4 times as long) stays out, and fewer than two matched levels is
    an error, not a price."""
    import pytest

    from research.byte_energy import price_fit

    def level(ratio, bytes_per_ms, watts):
        return {"time_ratio": {"read": ratio}, "bytes_per_ms": {"read": bytes_per_ms}, "dram_w": {"read": watts}}
    levels = [level(2.4, 3.9e9, 520.0), level(1.01, 0.9e9, 100.0), level(1.0, 0.5e9, 60.0), level(0.99, 0.3e9, 40.0)]
    fit = price_fit(levels, "read")
    assert fit["levels"] == 3 and fit["mj_per_byte"] == pytest.approx(1e-7) and fit["constant_w"] == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="fewer than two levels of matched read"):
        price_fit(levels[:2], "read")


def test_byte_energy_charges_the_slope_of_dram_power():
    """A byte's price is the slope of the DRAM stream's extra power against its bandwidth; a
    case is charged its extra bytes at that price against cuBLAS's energy (less the idle power
    over its time, or whole), and the smaller charge is kept."""
    from research.byte_energy import case_charge, dram_part_mj_per_byte, marginal_fit
    from research.power_probe import charged_ratio, dynamic_mj
    slope, intercept = marginal_fit([(1.0, 40.0), (2.0, 70.0), (3.0, 100.0)])
    assert abs(slope - 30.0) < 1e-12 and abs(intercept - 10.0) < 1e-12
    dram = {"mj_per_call": 400.0, "sustained_ms": 0.8}     # 500 W
    l2 = {"mj_per_call": 150.0, "sustained_ms": 0.4}       # 375 W
    assert dynamic_mj(dram, 100.0) == 320.0
    assert dram_part_mj_per_byte(dram, l2, 100.0, 1000) == (320.0 - 110.0) / 1000
    cublas = {"mj_per_call": 140.0, "sustained_ms": 0.2}   # 700 W
    assert charged_ratio(100, 50, 0.2, 0.4, cublas, 200.0) == 1 + (20 + 20) / 100
    energy = {"idle_w": 100.0, "dram_mj_per_byte": {"read": 0.2, "write": 0.4}}
    case = {"read_bytes": 100, "written_bytes": 50, "cublas": cublas}
    charges = case_charge(case, energy)
    assert charges["idle"] == 1 + 40 / 120 and charges["whole"] == 1 + 40 / 140
    assert charges["charged"] == charges["whole"]
    fewer = case_charge({**case, "written_bytes": -150}, energy)   # a case that writes less than D
    assert fewer["charged"] == fewer["whole"] == 1 + (20 - 60) / 140


def test_toolchain_probe_compiles_a_cluster_and_finds_its_tile_load():
    """Offline (no GPU): the probe's kernel really is compiled as a 2-CTA cluster (a compile
    that dropped the cluster would load the tile the same way), and its TMA load is read from
    that PTX, so the multicast answer rests on a real cluster compile."""
    from research import toolchain_probe
    result = toolchain_probe.probe()
    assert result["cluster_of_two"]
    assert ".reqnctapercluster" not in toolchain_probe.cluster_ptx(num_ctas=1)
    assert len(result["cluster_load_ptx"]) == 1 and "cp.async.bulk.tensor.2d" in result["cluster_load_ptx"][0]
    # where the copy takes a cache policy or a multicast flag (Triton 3.9), the probe passes it
    # and the PTX carries it; where it takes neither (3.6), the PTX carries neither
    assert result["cache_hint_in_ptx"] == result["gluon_tma_load_cache_hint"]
    assert result["multicast"] == result["gluon_tma_load_multicast_arg"]
    assert toolchain_probe.tma_loads("x\n  cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                     ".multicast::cluster [r1], [r2, {r3, r4}], [r5], h6;\n"
                                     "  cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [r7, {r3, r4}], [r1];") \
        == ["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
            "[r1], [r2, {r3, r4}], [r5], h6;"]


def test_sass_probe_counts_a_sigmoids_special_functions():
    """Offline (no GPU): in the cooperative kernel each of 256 threads holds 128 of a 128x256
    tile's elements, and a sigmoid adds one exp2 and one reciprocal on the SFU for each."""
    import torch

    from research import sass_probe
    A, B = torch.randn(256, 128, dtype=torch.float16), torch.randn(128, 512, dtype=torch.float16)
    operands = {"bias": torch.randn(512, dtype=torch.float16)}
    delta = sass_probe.added(sass_probe.KERNELS["coop"], "sigmoid", A, B, operands)
    assert delta["MUFU.EX2"] == 128 and delta["MUFU.RCP"] == 128, delta
    assert sass_probe.opcode_counts("        /*0010*/  @!P0 MUFU.EX2 R4, R4 ;\n"
                                    "        /*0020*/  FFMA R1, R2, R3, R4 ;") == {"MUFU.EX2": 1, "FFMA": 1}


def test_l2_probe_lays_out_the_access_policy_window_as_the_driver_reads_it():
    """CUaccessPolicyWindow: base_ptr, num_bytes, hitRatio, hitProp, missProp (32 bytes with its
    padding), inside the 64-byte CUstreamAttrValue union."""
    import ctypes

    from research.l2_probe import _AttrValue, _Window
    assert [getattr(_Window, f).offset for f in ("base_ptr", "num_bytes", "hitRatio", "hitProp", "missProp")] \
        == [0, 8, 16, 20, 24]
    assert ctypes.sizeof(_Window) == 32 and _AttrValue.accessPolicyWindow.offset == 0


def test_l2_probe_says_its_policies_are_gone():
    """The kernels lost their L2 cache-policy hints: `--policies` exits with a message that
    names the notebook's entry, instead of failing on a missing name."""
    import pytest

    from research import l2_probe
    with pytest.raises(SystemExit) as exit_info:
        l2_probe.main(["--policies", "identity:S2"])
    assert "NOTEBOOK.md, 2026-11-26 17:53" in str(exit_info.value)


def test_cold_timeline_samples_the_callers_stack_and_the_other_threads():
    """Inclusive seconds per function: a function the caller spends its time in is counted for
    the caller, one a thread of its own runs for 'others'."""
    import threading
    import time

    from research.cold_timeline import Sampler

    def busy_in_thread(stop):
        while not stop.is_set():
            time.sleep(0.001)

    def busy_in_caller():
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
    stop = threading.Event()
    with Sampler() as sampler:
        # named as the sampler keeps only these frames: stand-ins for epifuse's threads
        worker = threading.Thread(target=busy_in_thread, args=(stop,), name="epifuse-compile-0")
        worker.start()
        busy_in_caller()
        stop.set()
        worker.join()
    table = sampler.table(top=50)
    assert table["caller"]["samples"] > 10
    assert table["others"]["samples"] > 10
    assert any(label.endswith("threading.py:run") for label, _ in table["others"]["top"])


def test_ab_table_lists_each_file_of_a_run(tmp_path, capsys):
    import json

    from research import ab_table
    (tmp_path / "cold_gemm_after_1.txt").write_text("cold bias_gelu S2: 2.50 s (inclusive seconds)\n")
    (tmp_path / "probe_after_1.json").write_text(json.dumps(dict.fromkeys(ab_table.PROBE_KEYS, 1.5)))
    (tmp_path / "overhead_before_1.json").write_text(json.dumps({
        "epifuse_gemm_us": 20.0, "torch_addmm_us": 15.0, "gemm_over_addmm_us": 5.0, "epifuse_gemm_new_output_us": 25.0,
        "torch_addmm_relu_us": 17.0, "new_output_over_addmm_relu_us": 8.0, "kernel": "<k>"}))
    (tmp_path / "overhead_broken_2.json").write_text("{")
    ab_table.main(str(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cold_gemm_after_1") and lines[0].endswith("2.50 s (inclusive seconds)")
    assert lines[2].startswith("after_1") and lines[2].split()[1:] == ["1.50"] * 6
    assert "over  5.00" in lines[3] and "| <k>" in lines[3]
    assert "unreadable" in lines[4]
