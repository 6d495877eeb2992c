"""The `epifuse` command: show, kernels, verify, profile, --help, and one-line errors.

Commands run in-process through `epifuse.cli.main` (fast); graphviz's `dot` and Nsight
Compute's `ncu` are replaced by small fake executables on PATH where a test needs them.
"""
import importlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from epifuse import cli, commands, debug
from epifuse.tools import harness
from helpers import fast

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
EPI_FILE = '''\
import torch
import epifuse
from epifuse.ops import relu


def helper(x):
    return x


def relu_aux_store(accum, alpha, C):
    F = (accum * alpha) + (C * 2.0)
    D = relu(F)
    return D, F


class BiasRelu(epifuse.FusedGemm):
    def epilogue(self, accum, bias):
        D = relu(accum + bias)
        return D
'''


@pytest.fixture
def epi_file(tmp_path):
    path = tmp_path / "epi.py"
    path.write_text(EPI_FILE)
    return str(path)


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """PATH with only a folder we control (no dot, no ncu)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


def _executable(folder, name, body):
    path = folder / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- --help -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, phrase", [
    ("show", "draw it with graphviz"), ("kernels", "alignment of every tensor"),
    ("verify", "float64"), ("profile", "ncu --clock-control none"), ("demo", "CUTLASS"),
    ("bench", "benchmark suite"),
])
def test_help_for_each_command(capsys, command, phrase):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert out.startswith(f"usage: epifuse {command}") and phrase in " ".join(out.split())


@pytest.mark.parametrize("argv", [["bench", "--quick"], ["--traceback", "bench", "--quick", "--out", "x"],
                                  ["bench", "--shapes", "S2", "--workloads", "identity,bench"], ["bench"]])
def test_bench_passes_every_word_after_it_to_the_harness(monkeypatch, argv):
    """`epifuse bench --quick` (the README's command): options right after `bench` reach
    bench/run.py, which argparse's REMAINDER alone refused."""
    import bench.run
    seen = []
    monkeypatch.setattr(bench.run, "main", lambda rest: seen.append(rest) or 0)
    assert cli.main(argv) == 0
    assert seen == [argv[argv.index("bench") + 1:]]


def _console_script(folder):
    """A launcher like the `epifuse` script pip writes: run as a file from a folder outside the
    checkout, so (unlike `python -m epifuse`) the current directory is not on sys.path."""
    script = folder / "bin" / "epifuse"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("import sys\nfrom epifuse.cli import main\nsys.exit(main())\n")
    return script


def _installed_copy(folder):
    """epifuse as a wheel installs it: the package alone in a site folder, no bench/ beside it."""
    site = folder / "site"
    shutil.copytree(ROOT / "src" / "epifuse", site / "epifuse", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _cpu_env(tmp_path, pythonpath, interpret=False):
    env = dict(os.environ, PYTHONPATH=str(pythonpath), EPIFUSE_CACHE_DIR=str(tmp_path / "cache"),
               EPIFUSE_TUNE="0", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


@pytest.mark.parametrize("where, install", fast([(".", "editable"), (".", "wheel"), ("examples", "editable"),
                                                  ("examples", "wheel")], keep={0},
                                                 ids=[".-editable", ".-wheel", "examples-editable", "examples-wheel"]))
def test_bench_runs_from_a_checkout(tmp_path, install, where):
    """`epifuse bench` from the checkout's root (or a folder in it), as the README says, finds
    bench/ whether epifuse is imported from the checkout's src/ or installed elsewhere; the dry
    run is what runs on a CPU."""
    site = ROOT / "src" if install == "editable" else _installed_copy(tmp_path)
    result = subprocess.run([sys.executable, str(_console_script(tmp_path)), "bench", "--dry-run"],
                            cwd=ROOT / where, env=_cpu_env(tmp_path, site), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    from bench.workloads import WORKLOADS
    assert f"dry run ok: {len(WORKLOADS)} workloads ({', '.join(WORKLOADS)})" in result.stdout


def test_bench_outside_a_checkout_says_what_to_do(tmp_path):
    """An installed epifuse run outside any checkout: one line saying where bench/ is and what
    to run."""
    result = subprocess.run([sys.executable, str(_console_script(tmp_path)), "bench", "--quick"],
                            cwd=tmp_path, env=_cpu_env(tmp_path, _installed_copy(tmp_path)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("epifuse bench: the benchmark harness (bench/) comes with epifuse's source")
    assert f"neither {tmp_path.resolve()} nor a folder above it is a checkout" in result.stderr
    assert "clone the repository and run `epifuse bench ...` (or `python -m bench ...`) from its root" \
        in result.stderr


@pytest.mark.parametrize("interpret", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["TRITON_INTERPRET=1", "no-TRITON_INTERPRET"])
def test_demo_says_which_kernel_ran(tmp_path, interpret):
    """On a CPU the demo runs the generated kernels through Triton's interpreter (it sets
    TRITON_INTERPRET=1 itself) and says so for every example, not only "matches torch"."""
    result = subprocess.run([sys.executable, "-m", "epifuse", "demo"], cwd=tmp_path,
                            env=_cpu_env(tmp_path, ROOT / "src", interpret), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    ran = [line.strip() for line in lines if "run by the" in line]
    assert len(ran) == 4 == sum(line.lstrip().startswith("ok ") for line in lines), result.stdout
    for line in ran:
        assert line.startswith("run by the fused Triton kernel triton_"), line
        assert line.endswith("(Triton's interpreter)"), line


def test_harness_is_found_from_the_checkout_or_the_package(tmp_path, monkeypatch):
    assert harness.find_checkout(ROOT) == ROOT
    assert harness.find_checkout(ROOT / "src" / "epifuse" / "tools") == ROOT
    assert harness.find_checkout(tmp_path) == ROOT        # the checkout epifuse is imported from
    monkeypatch.setattr(harness, "PACKAGE_CHECKOUT", None)  # as in an installed wheel
    assert harness.find_checkout(tmp_path) is None
    assert harness.find_checkout(ROOT / "examples") == ROOT
    other = tmp_path / "other_checkout"   # another clone: the harness must time this epifuse's code
    (other / "bench").mkdir(parents=True)
    (other / "bench" / "run.py").write_text("")
    (other / "src" / "epifuse").mkdir(parents=True)
    (other / "src" / "epifuse" / "__init__.py").write_text("")
    assert harness.is_checkout(other)
    monkeypatch.setattr(harness, "PACKAGE_CHECKOUT", ROOT)
    assert harness.find_checkout(other) == ROOT
    monkeypatch.setattr(harness, "PACKAGE_CHECKOUT", None)
    assert harness.find_checkout(other) == other   # an installed epifuse: the clone's harness
    with pytest.raises(harness.HarnessNotFound, match="clone the repository") as info:
        harness.bench_main(tmp_path)
    assert isinstance(info.value, OSError)   # the CLI's one-line errors
    assert harness.bench_main(ROOT) is importlib.import_module("bench.run").main


def test_top_level_help_lists_commands_but_not_the_internal_one(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "show", "kernels", "verify", "profile", "bench"):
        assert f"    {command}" in out
    assert "_profile-target" not in out


def test_module_entry_point_runs():
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    result = subprocess.run([sys.executable, "-m", "epifuse", "show", "--help"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0 and "usage: epifuse show" in result.stdout


# ---- errors are one line ----------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["show", "def e(accum):\n    D = gleu(accum)\n    return D"],
     "epifuse show: Unsupported operation 'gleu' (<epilogue string>:2:9). Did you mean: 'gelu'"),
    (["show", "missing_file.py"], "epifuse show: no such file: missing_file.py"),
    (["show", "no_such_module:epi"], "epifuse show: cannot import module 'no_such_module'"),
    (["show", "epifuse.demo:nothing_here"], "epifuse show: module 'epifuse.demo' has no attribute 'nothing_here'"),
    (["show", "epifuse.epilogues:Generic"], "epifuse show: epifuse.epilogues:Generic needs arguments"),
    (["kernels", "def e(accum, b):\n    D = accum + b\n    return D", "--role", "c=row"],
     "epifuse kernels: --role names 'c', which is not an operand of e."),
])
def test_errors_are_one_line(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith(message), err


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["kernels", "epi.py", "--shape", "1", "2"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err == ("epifuse kernels: error: argument --shape: expected 3 arguments "
                   "(see epifuse kernels --help)\n")


@pytest.mark.parametrize("argv, message", [
    (["kernels", "epi.py", "--shape", "-1", "16", "16"], "argument --shape: expected an integer from 0 to 9223372036854775807, got '-1'"),
    (["verify", "epi.py", "--batch", "-2"], "argument --batch: expected an integer from 0 to 9223372036854775807, got '-2'"),
    (["verify", "epi.py", "--kernel", "-99"], "argument --kernel: expected an integer of 0 or more, got '-99'"),
    (["kernels", "epi.py", "--shape", "1", "1", str(2**64)],
     f"argument --shape: expected an integer from 0 to 9223372036854775807, got '{2**64}'"),
    (["kernels", "epi.py", "--cc", "0"], "argument --cc: expected an integer of 1 or more, got '0'"),
    (["verify", "epi.py", "--seed", "99999999999999999999"],
     "argument --seed: expected an integer from 0 to 9223372036854775807, got '99999999999999999999'"),
])
def test_numbers_out_of_range_are_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err == f"epifuse {argv[0]}: error: {message} (see epifuse {argv[0]} --help)\n"


def test_a_problem_too_large_to_allocate_is_a_one_line_error(capsys, epi_file):
    rc, out, err = _run(capsys, "kernels", epi_file + ":BiasRelu", "--shape", "10000000", "10000000", "1")
    assert rc == 2
    assert err.startswith("epifuse kernels: cannot allocate the tensors of a 10000000x10000000x1 problem: ")
    assert err.count("\n") == 1 and "allocate" in err.split("problem: ")[1]
    rc, out, err = _run(capsys, "kernels", epi_file + ":BiasRelu", "--shape", str(2**62), str(2**62), "1")
    assert rc == 2 and err.count("\n") == 1 and "cannot allocate the tensors of a" in err


def test_files_are_read_as_python_reads_source(capsys, tmp_path):
    """A BOM, or a coding line naming latin-1, as Python reads them: the text decodes, and a
    syntax error's column counts characters on a line with non-ASCII ones (it was 3 short when
    CPython re-read the latin-1 line from disk to find it)."""
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbfdef epi(accum):\n    D = accum * 2.0\n    return D\n")
    rc, out, err = _run(capsys, "show", str(bom))
    assert rc == 0 and "mul" in out, err
    for name, encoded in (("latin.py", "latin-1"), ("utf8.py", "utf-8")):
        path = tmp_path / name
        path.write_bytes((f"# -*- coding: {encoded} -*-\ndef epi(accum):\n"
                          '    s = "\u00e9\u00e9\u00e9"; D = accum +* 2\n    return D\n').encode(encoded))
        rc, out, err = _run(capsys, "show", str(path))
        assert rc == 2 and err.endswith(f"invalid syntax ({path}:3:27)\n"), err
    unknown = tmp_path / "unknown.py"
    unknown.write_bytes(b"# -*- coding: foo -*-\ndef epi(accum):\n    D = accum\n    return D\n")
    rc, out, err = _run(capsys, "show", str(unknown))
    assert rc == 2 and err == f"epifuse show: {unknown}: its coding line names an encoding Python does not know\n"
    first_line = tmp_path / "first.py"
    first_line.write_bytes(b"# caf\xe9\ndef epi(accum):\n    D = accum\n    return D\n")
    rc, out, err = _run(capsys, "show", str(first_line))
    assert rc == 2 and err == f"epifuse show: {first_line} is not UTF-8 text: byte 0xe9 at offset 5\n"


def test_a_file_that_is_not_utf8_is_a_one_line_error(capsys, tmp_path):
    path = tmp_path / "latin1.py"
    path.write_bytes(b"def epi(accum):\n    D = accum  # \xe9\n    return D\n")
    rc, out, err = _run(capsys, "show", str(path))
    assert rc == 2 and err == f"epifuse show: {path} is not UTF-8 text: byte 0xe9 at offset 33\n"


def test_traceback_flag_raises(capsys):
    with pytest.raises(Exception, match="Unsupported operation 'gleu'"):
        cli.main(["--traceback", "show", "def e(accum):\n    D = gleu(accum)\n    return D"])


# ---- loading epilogues -------------------------------------------------------------------------------

def test_load_from_files_modules_and_strings(epi_file):
    program, _ = commands.load_epilogue(epi_file + ":relu_aux_store")
    assert program.name == "relu_aux_store" and program.operands == ("alpha", "C")
    assert program.filename == epi_file and program.statements[0].loc.line == 11
    program, _ = commands.load_epilogue(epi_file + ":BiasRelu")
    assert program.name == "BiasRelu" and program.operands == ("bias",)
    program, roles = commands.load_epilogue("epifuse.epilogues:LinearCombinationSilu")
    assert program.name == "linear_combination_silu" and roles["alpha"] == "number"
    program, _ = commands.load_epilogue("epifuse.demo:relu_aux_store")
    assert program.outputs[0][0] == "D"
    program, _ = commands.load_epilogue("def e(accum):\n    D = accum\n    return D\n")
    assert program.name == "e"


def test_file_with_several_epilogues_asks_which(capsys, epi_file):
    rc, out, err = _run(capsys, "show", epi_file)
    assert rc == 2 and "defines several epilogues (relu_aux_store, BiasRelu); pick one with" in err


def test_file_errors_point_into_the_file(capsys, tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import torch\n\n\ndef epi(accum):\n    D = accum\n    D = D * 2.0\n    return D\n")
    rc, out, err = _run(capsys, "show", str(path))
    assert rc == 2 and f"Variable 'D' cannot be defined twice. ({path}:6:5)" in err


# ---- show ---------------------------------------------------------------------------------------------

def test_show_prints_the_dag_without_graphviz(capsys, epi_file, bare_path):
    rc, out, err = _run(capsys, "show", epi_file + ":relu_aux_store", "--role", "alpha=number")
    assert rc == 0, err
    assert out.startswith("# relu_aux_store: operands alpha: number, C: tile; hash ")
    assert "%6(F) = add(%2, %5)  : float[LMN]" in out and "return D <- %7(D)" in out
    assert "# no picture: graphviz's `dot` is not on PATH" in out


def test_show_draws_with_dot(capsys, epi_file, bare_path, tmp_path, monkeypatch):
    _executable(bare_path, "dot", """\
        import sys
        out = sys.argv[sys.argv.index("-o") + 1]
        open(out, "w").write("<svg>" + sys.stdin.read() + "</svg>")
    """)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "show", "epifuse.epilogues:LinearCombinationRelu", "--source")
    assert rc == 0, err
    picture = tmp_path / "linear_combination_relu.svg"
    assert f"picture: {picture}" in out and out.startswith("def linear_combination_relu(")
    assert picture.read_text().startswith('<svg>digraph "linear_combination_relu"')
    rc, out, err = _run(capsys, "show", epi_file + ":BiasRelu", "-o", "dag.png", "--batched")
    assert rc == 0 and (tmp_path / "dag.png").exists() and "float[LMN]" in out


def test_show_writes_dot_and_refuses_svg_without_graphviz(capsys, epi_file, bare_path, tmp_path):
    rc, out, err = _run(capsys, "show", epi_file + ":BiasRelu", "-o", str(tmp_path / "g.dot"),
                        "--role", "bias=row")
    assert rc == 0 and (tmp_path / "g.dot").read_text().startswith('digraph "BiasRelu"')
    assert "bias\\ntensor [N]" in (tmp_path / "g.dot").read_text()
    rc, out, err = _run(capsys, "show", epi_file + ":BiasRelu", "-o", str(tmp_path / "g.svg"))
    assert rc == 2 and "graphviz's `dot` is not on PATH" in err and err.count("\n") == 1


# ---- kernels ---------------------------------------------------------------------------------------------

def test_kernels_lists_statuses_and_alignment(capsys, epi_file):
    rc, out, err = _run(capsys, "kernels", epi_file + ":relu_aux_store", "--shape", "64", "48", "33",
                        "--role", "alpha=number")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"# relu_aux_store: 64x48x33 float16 on {DEVICE}"
    assert any(line.startswith("yes  <reference>") for line in lines)
    assert "bad  A: (64, 33) float16, strides (33, 1)" in out   # a 66-byte row stride
    assert "ok   B: (33, 48) float16" in out


def test_kernels_batched_column_major(capsys, epi_file):
    rc, out, err = _run(capsys, "kernels", epi_file + ":BiasRelu", "--shape", "32", "32", "32",
                        "--batch", "2", "--layout-b", "col", "--role", "bias=row", "--cc", "90")
    assert rc == 0, err
    assert "32x32x32 x L=2" in out and "B: (2, 32, 32) float16, strides (1024, 1, 32)" in out


# ---- verify ------------------------------------------------------------------------------------------------

def test_verify_every_kernel(capsys, epi_file):
    rc, out, err = _run(capsys, "verify", epi_file + ":relu_aux_store", "--role", "alpha=number",
                        "--shape", "40", "24", "16", "--all", "--dtype", "float32")
    assert rc == 0, err
    assert out.startswith(f"# verify relu_aux_store: 40x24x16 float32 on {DEVICE}, seed 0")
    assert out.count("matches the float64 reference") >= 3 and "DIFFERS" not in out
    assert "ok   D: largest error" in out and "ok   F: largest error" in out


def test_verify_reports_a_mismatch(capsys, epi_file, monkeypatch):
    from epifuse.backends.reference import ReferenceKernel
    original = ReferenceKernel.run

    def wrong(self, args):
        original(self, args)
        args.outputs["F"][2, 3] = 100.0

    monkeypatch.setattr(ReferenceKernel, "run", wrong)
    rc, out, err = _run(capsys, "verify", epi_file + ":relu_aux_store", "--shape", "16", "16", "16", "--all")
    assert rc == 1
    assert "<reference>: DIFFERS from the float64 reference" in out and "FAIL F: largest error" in out
    assert "at (2, 3)" in out


def test_verify_kernel_index_past_the_last_is_an_error(capsys, epi_file):
    rc, out, err = _run(capsys, "verify", epi_file + ":BiasRelu", "--shape", "16", "16", "16", "--kernel", "99")
    assert rc == 2 and err.count("\n") == 1
    assert "epifuse verify: --kernel 99 is out of range: " in err and "`epifuse kernels` lists them" in err


# ---- profile --------------------------------------------------------------------------------------------------

def test_profile_says_when_ncu_is_missing(capsys, epi_file, bare_path):
    rc, out, err = _run(capsys, "profile", epi_file + ":BiasRelu")
    assert rc == 3 and err.count("\n") == 1
    assert "Nsight Compute (`ncu`) is not on PATH, so profiling is unavailable here" in err


NCU_CSV = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python","127.0.0.1","epifuse_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","50,331,648"
"0","4242","python","127.0.0.1","epifuse_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","33,554,432"
"0","4242","python","127.0.0.1","epifuse_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","%","41.5"
"0","4242","python","127.0.0.1","epifuse_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","200,000"
"0","4242","python","127.0.0.1","epifuse_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","168"
"0","4242","python","127.0.0.1","epifuse_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","78.25"
'''
INFO = dict(kernel="<triton_persistent 128x256x64>", name="epi", L=1, M=4096, N=4096, K=4096,
            dtype="float16", device="NVIDIA H100", registers=168, spills=0)


def test_ncu_csv_summary():
    metrics = debug.parse_ncu_csv(NCU_CSV)
    assert metrics["gpu__time_duration.sum"] == ("nsecond", 200000.0)
    text = debug.summarize_ncu(NCU_CSV, INFO)
    assert text.splitlines() == [
        "profile of <triton_persistent 128x256x64> for epi, 4096x4096x4096 float16, on NVIDIA H100 "
        "(ncu --clock-control none)",
        "  time                200.0 us",
        "  registers             168 per thread, 0 spilled (Triton's count)",
        "  DRAM                 50.3 MB read, 33.6 MB written, 419.4 GB/s achieved",
        "  throughput     SM 78.2 % of peak, memory 41.5 % of peak",
        "  FLOP/s              687.2 TFLOP/s (2*L*M*N*K / time)",
    ]
    with pytest.raises(RuntimeError, match="ncu wrote no metrics"):
        debug.summarize_ncu("==PROF== nothing\n", INFO)


def test_profile_runs_ncu_and_summarizes(capsys, epi_file, bare_path, monkeypatch):
    """The whole command with a fake ncu that checks its arguments and answers with metrics."""
    (bare_path / "metrics.csv").write_text(NCU_CSV)
    _executable(bare_path, "ncu", f"""\
        import json, shutil, sys
        argv = sys.argv[1:]
        assert argv[:2] == ["--clock-control", "none"], argv
        assert "--kernel-name" in argv and "_profile-target" in argv, argv
        shutil.copy({str(bare_path / 'metrics.csv')!r}, argv[argv.index("--log-file") + 1])
        print("EPIFUSE_PROFILE_TARGET " + json.dumps({INFO!r}))
    """)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, out, err = _run(capsys, "profile", epi_file + ":BiasRelu", "--role", "bias=row")
    assert rc == 0, err
    assert out.startswith("profile of <triton_persistent 128x256x64> for epi") and "687.2 TFLOP/s" in out


def test_profile_reports_ncu_failure(capsys, epi_file, bare_path, monkeypatch):
    _executable(bare_path, "ncu", """\
        import sys
        print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters")
        sys.exit(1)
    """)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, out, err = _run(capsys, "profile", epi_file + ":BiasRelu")
    assert rc == 2 and err.count("\n") == 1
    assert "ncu failed (exit 1): ==ERROR== ERR_NVGPUCTRPERM" in err and "admin rights" in err


@pytest.mark.parametrize("role, message", [
    ("bais=row", "epifuse show: --role names 'bais', which is not an operand of epi. Did you mean: 'bias'?\n"),
    ("alpha=batch", "epifuse show: a batch role (L, 1, 1) needs a batched accum: add --batched\n"),
])
def test_show_checks_roles_as_kernels_and_verify_do(capsys, tmp_path, role, message):
    path = tmp_path / "epi.py"
    path.write_text("def epi(accum, bias, alpha):\n    D = accum * alpha + bias\n    return D\n")
    rc, out, err = _run(capsys, "show", str(path), "--text", "--role", role)
    assert rc == 2 and err == message


def test_a_role_needs_a_name(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["show", "epi.py", "--role", "=row"])
    assert info.value.code == 2 and "expected NAME=ROLE" in capsys.readouterr().err


# ---- deeply nested files --------------------------------------------------------------------------

DEEP_FILES = {   # a helper beside the epilogue nests too deeply for CPython's parser
    "unary-minus": "def helper(x):\n    return " + "-" * 10000 + "x\n",
    "lambdas": "helper = " + "lambda: " * 3000 + "0\n",
    "attributes": "helper = x" + ".a" * 10000 + "\n",
    "calls": "helper = f" + "()" * 10000 + "\n",
    "parentheses": "helper = " + "(" * 180 + "0" + ")" * 180 + "\n",
    "f-string": 'helper = f"{' + "not " * 5000 + 'x}"\n',
}
_EPILOGUE = "\n\ndef epi(accum):\n    D = accum * 2.0\n    return D\n"


def test_show_on_a_deeply_nested_file_is_a_one_line_error_in_a_new_process(tmp_path):
    """`epifuse show` on a file CPython's parser cannot nest that deep printed
    "MemoryError: MemoryError"; it names the nesting limit and the place."""
    path = tmp_path / "deep.py"
    path.write_text(DEEP_FILES["unary-minus"] + _EPILOGUE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-m", "epifuse", "show", str(path), "--text"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and "MemoryError" not in result.stderr, result.stderr
    assert result.stderr.startswith("epifuse show: The statement nests too deeply")
    assert "nesting limit" in result.stderr and f"({path}:2:" in result.stderr


_CLI_SMALL_STACK = """
import contextlib, io, sys, threading
from epifuse import cli
paths = {paths!r}
results = []

def work():
    for case_id, path in paths.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main(["show", path, "--text"])
        if rc != 2 or "nesting limit" not in err.getvalue():
            results.append((case_id, rc, err.getvalue()[:300]))

threading.stack_size(128 * 1024)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(results)
sys.exit(1 if results else 0)
"""


@pytest.mark.slow   # a subprocess (about 2 s); the one-line-error twin stays in the README's run
def test_show_on_deeply_nested_files_in_a_small_stack(tmp_path):
    from helpers import run_python
    paths = {}
    for case_id, text in DEEP_FILES.items():
        paths[case_id] = str(tmp_path / f"{case_id.replace('-', '_')}.py")
        with open(paths[case_id], "w") as f:
            f.write(text + _EPILOGUE)
    result = run_python(_CLI_SMALL_STACK.format(paths=paths), timeout=300)
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])


def test_a_module_that_does_not_compile_is_a_command_error(tmp_path, monkeypatch):
    (tmp_path / "deep_epilogue_module.py").write_text(DEEP_FILES["unary-minus"] + _EPILOGUE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(commands.CommandError, match="cannot import module 'deep_epilogue_module': it does not compile"):
        commands.load_epilogue("deep_epilogue_module:epi")


def test_ordinary_code_beside_the_epilogue_still_loads(capsys, tmp_path):
    path = tmp_path / "ordinary.py"
    path.write_text("TABLE = [" + ", ".join(str(-i) for i in range(3000)) + "]\n"
                    "def report(x):\n    return f\"{x!r:>10} and {x + 1} {{literal}} {len(TABLE)}\"\n" + _EPILOGUE)
    rc, out, err = _run(capsys, "show", str(path), "--text")
    assert rc == 0 and "mul" in out, err


def test_show_takes_an_activation_name_as_gemm_does(capsys):
    rc, out, err = _run(capsys, "show", "gelu", "--text")
    assert rc == 0 and "gelu(" in out and "return D" in out, err
    rc, out, err = _run(capsys, "show", "gleu", "--text")
    assert rc == 2 and "Unknown activation 'gleu'" in err and "Did you mean: 'gelu'?" in err


def test_show_takes_a_module_attribute_holding_an_activation_name(capsys, tmp_path, monkeypatch):
    (tmp_path / "activation_name_module.py").write_text('ACT = "gelu"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = _run(capsys, "show", "activation_name_module:ACT", "--text")
    assert rc == 0 and "gelu(" in out, err
