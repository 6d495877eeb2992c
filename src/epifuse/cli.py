"""The `epifuse` command: demo, bench, show, kernels, verify, profile. Thin: parse arguments,
call the API, print. Every command takes an epilogue as a file (`epi.py`, `epi.py:name`), a
`module:name` (a function, a named epilogue, a FusedGemm subclass) or the source itself.
Errors print as one line (`--traceback` shows the Python traceback instead).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tokenize

import torch

from .api import get_kernels, kernel_statuses
from .binding import bind
from .demo import run_demo
from .epilogues import NamedEpilogue
from .errors import EpilogueError
from .frontend import Program, parse, parse_module, parse_source
from .fused import FusedGemm, drop_self
from .ir import Operand
from .ops import dtype_from_name
from .passes import canonical_hash, optimize
from .printing import program_source
from .tools.draw import dot_available, draw
from .tools.ncu import compiled_stats, summarize_ncu
from .tools.problems import ROLES, alignment_report, check_roles, random_arguments
from .verify import run

_DTYPES = ("float16", "bfloat16", "float32")  # what --dtype and --out-dtype take
_EPILOGUE_HELP = ("the epilogue: a file (epi.py, or epi.py:name to pick one function or FusedGemm "
                  "class), a module:name (a function, a named epilogue such as "
                  "epifuse.epilogues:LinearCombinationRelu, a FusedGemm subclass), or the source "
                  "\"def epi(accum, ...): ...\"")


class CommandError(Exception):
    """A problem with the command line that is not an EpilogueError (a missing file, ...)."""


# ---- loading an epilogue ------------------------------------------------------------------------

def load_epilogue(spec: str):
    """(Program, default roles) for a file, file:name, module:name, or source string."""
    if os.path.isfile(spec):
        return _from_file(spec, None)
    if ":" in spec and "\n" not in spec:
        head, _, tail = spec.rpartition(":")
        if os.path.isfile(head):
            return _from_file(head, tail)
        if " " not in spec and "(" not in spec and head and tail:
            return _from_module(head, tail)
    if spec.endswith(".py") and "\n" not in spec:
        raise CommandError(f"no such file: {spec}")
    return parse(spec), {}


def _from_module(module: str, attr: str):
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise CommandError(f"cannot import module {module!r}: {exc}") from None
    except (SyntaxError, RecursionError, MemoryError) as exc:  # CPython's limits on nesting included
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise CommandError(f"cannot import module {module!r}: it does not compile ({detail}); "
                           "name its file instead (FILE.py:NAME), which epifuse parses without running") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CommandError(f"module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return _from_object(obj, f"{module}:{attr}")


def _from_object(obj, label: str):
    if isinstance(obj, Program):
        return obj, {}
    if isinstance(obj, NamedEpilogue):
        return obj.program, dict(obj.roles)
    if isinstance(obj, type) and issubclass(obj, NamedEpilogue):
        try:
            return _from_object(obj(), label)
        except TypeError as exc:
            raise CommandError(f"{label} needs arguments ({exc}); build it in a Python file and "
                               "name that instead") from None
    if isinstance(obj, FusedGemm) or (isinstance(obj, type) and issubclass(obj, FusedGemm)):
        cls = obj if isinstance(obj, type) else type(obj)
        if cls.program is None:
            raise CommandError(f"{label} defines no epilogue method")
        return cls.program, dict(cls.roles)
    if isinstance(obj, str) or callable(obj):
        return parse(obj), dict(getattr(obj, "roles", {}) or {})
    raise CommandError(f"{label} is a {type(obj).__name__}, not an epilogue")


def _from_file(path: str, name: str | None):
    """Find the epilogue in a file without running it: a function taking accum, or a class with
    an `epilogue` method (a FusedGemm subclass)."""
    text = _read_source(path)
    module = parse_module(text, path)   # nesting bounded first; a located EpilogueSyntaxError
    functions = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: m for n in module.body if isinstance(n, ast.ClassDef)
               for m in n.body if isinstance(m, ast.FunctionDef) and m.name == "epilogue"}
    if name is not None:
        node = functions.get(name) or classes.get(name)
        if node is None:
            raise CommandError(f"{path} defines no function or epilogue class named {name!r} "
                               f"(it has: {', '.join([*functions, *classes]) or 'none'})")
        is_method = name not in functions
    else:
        takes_accum = [n for n in functions.values() if any(a.arg == "accum" for a in n.args.args)]
        pool = takes_accum + list(classes.values()) or list(functions.values())
        if len(pool) != 1:
            names = [n.name for n in takes_accum] + list(classes)
            raise CommandError(f"{path} defines {'no epilogue' if not pool else 'several epilogues'}"
                               + (f" ({', '.join(names)}); pick one with {path}:NAME" if names else
                                  ": write a function def epi(accum, ...)"))
        node = pool[0]
        is_method = node not in functions.values()
    lines = text.splitlines()
    segment = "\n".join(lines[node.lineno - 1:node.end_lineno]) + "\n"
    program = parse_source(segment, path, node.lineno - 1, from_string=False)
    if is_method:
        owner = next(c for c, m in classes.items() if m is node)
        if not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list):
            program = drop_self(program, owner)
        program = dataclasses.replace(program, name=owner)
    return program, {}


# ---- arguments ------------------------------------------------------------------------------------

def _role(text: str) -> tuple[str, str]:
    name, sep, role = text.partition("=")
    if not sep or not name or role not in ROLES:
        raise argparse.ArgumentTypeError(f"expected NAME=ROLE with ROLE one of {', '.join(ROLES)}, got {text!r}")
    return name, role


_INT64_MAX = 2**63 - 1   # what torch takes as a size or a seed


def _read_source(path: str) -> str:
    """The file's text as Python reads source: UTF-8, a BOM, or the encoding a coding line
    names; a clear error for bytes that do not decode (where, and which byte)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as exc:
        if "unknown encoding" in exc.msg:
            raise CommandError(f"{path}: its coding line names an encoding Python does not know") from None
        encoding = "utf-8"   # an undecodable first line: the decode below says where
    try:
        return io.TextIOWrapper(io.BytesIO(raw), encoding=encoding).read()
    except UnicodeDecodeError as exc:
        name = "UTF-8" if exc.encoding.startswith("utf") else exc.encoding
        raise CommandError(f"{path} is not {name} text: byte {exc.object[exc.start]:#04x} "
                           f"at offset {exc.start}") from None


def _int_in(low: int, high: int | None = None):
    """An argparse type: an integer from `low` to `high` (no upper bound without one)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f"of {low} or more" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value
    return parse


def _problem_options(p: argparse.ArgumentParser, shape_default=None, shape_help="") -> None:
    p.add_argument("epilogue", help=_EPILOGUE_HELP)
    p.add_argument("--shape", type=_int_in(0, _INT64_MAX), nargs=3, metavar=("M", "N", "K"), default=shape_default,
                   help=shape_help or "problem size (default: %(default)s)")
    p.add_argument("--batch", type=_int_in(0, _INT64_MAX), metavar="L", help="a batched GEMM of L problems")
    p.add_argument("--dtype", choices=_DTYPES, default="float16", help="A and B dtype (default: float16)")
    p.add_argument("--out-dtype", choices=_DTYPES, help="dtype of tile outputs (default: the input dtype)")
    p.add_argument("--role", type=_role, action="append", default=[], metavar="NAME=ROLE",
                   help="an operand's role: number, scalar (one-element tensor), row (N,), col (M, 1), "
                        "tile (default), batch (L, 1, 1); repeat for several")


def _arguments(ns, program, roles, fill=True, device=None):
    M, N, K = ns.shape
    try:
        return random_arguments(program, M, N, K, L=ns.batch, dtype=dtype_from_name(ns.dtype),
                                roles={**roles, **dict(ns.role)}, device=device,
                                out_dtype=dtype_from_name(ns.out_dtype) if ns.out_dtype else None,
                                seed=getattr(ns, "seed", 0), fill=fill,
                                layout_a=getattr(ns, "layout_a", "row"), layout_b=getattr(ns, "layout_b", "row"))
    except RuntimeError as exc:   # torch.OutOfMemoryError, the CPU allocator's, a size that overflows
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        if "allocate" not in reason and "overflow" not in reason.lower():
            raise
        batch = f" x L={ns.batch}" if ns.batch is not None else ""
        raise CommandError(f"cannot allocate the tensors of a {M}x{N}x{K}{batch} problem: {reason}") from None


def _pick(kernels: list, index: int):
    """The `--kernel index`-th of the supported `kernels`."""
    if index >= len(kernels):
        count = f"{len(kernels)} kernel supports" if len(kernels) == 1 else f"{len(kernels)} kernels support"
        raise CommandError(f"--kernel {index} is out of range: {count} this problem, numbered from 0 "
                           "(`epifuse kernels` lists them)")
    return kernels[index]


def _describe(ns, args) -> str:
    batch = f" x L={args.L}" if args.rank == 3 else ""
    return f"{args.M}x{args.N}x{args.K}{batch} {ns.dtype} on {args.A.device.type}"


# ---- commands -------------------------------------------------------------------------------------

def _cmd_demo(ns) -> int:
    return 0 if run_demo() else 1


def _cmd_show(ns) -> int:
    program, roles = load_epilogue(ns.epilogue)
    roles = {**roles, **dict(ns.role)}
    check_roles(program, roles)
    rank = 3 if ns.batched else 2
    if not ns.batched and "batch" in roles.values():
        raise CommandError("a batch role (L, 1, 1) needs a batched accum: add --batched")
    axes = {"number": (), "scalar": (), "row": ("N",), "col": ("M",), "tile": ("L", "M", "N")[3 - rank:],
            "batch": ("L",)}
    operands = {}
    for name in program.operands:
        role = roles.get(name, "tile")
        operands[name] = Operand(name, "number" if role == "number" else "tensor", axes[role])
    graph = optimize(bind(program, operands, rank))
    shown = ", ".join(f"{n}: {roles.get(n, 'tile')}" for n in program.operands) or "none"
    if ns.source:
        print(program_source(program), end="")
    print(f"# {program.name}: operands {shown}; hash {canonical_hash(graph)}")
    print(graph)
    if ns.text:
        return 0
    path = ns.output or (f"{program.name}.svg" if dot_available() else None)
    if path is None:
        print("# no picture: graphviz's `dot` is not on PATH (install graphviz for SVG/PNG; "
              "-o FILE.dot writes the DOT source)")
        return 0
    try:
        written = draw(graph, path, program.name)
    except RuntimeError as exc:
        raise CommandError(f"cannot draw {path}: {exc}") from None
    print(f"picture: {os.path.abspath(written)}")
    return 0


def _cmd_kernels(ns) -> int:
    program, roles = load_epilogue(ns.epilogue)
    args = _arguments(ns, program, roles, fill=False)
    print(f"# {program.name}: {_describe(ns, args)}")
    for kernel, status in kernel_statuses(args, cc=ns.cc):
        print(f"{'yes' if status.ok else 'no ':3s}  {kernel!r:55s} {status.reason}")
    print("# alignment (TMA needs 16-byte aligned bases and leading strides):")
    for name, ok, text in alignment_report(args):
        print(f"{'ok ' if ok else 'bad'}  {name}: {text}")
    return 0


def _cmd_verify(ns) -> int:
    if ns.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    program, roles = load_epilogue(ns.epilogue)
    if ns.shape is None:
        ns.shape = (512, 512, 256) if torch.cuda.is_available() else (64, 64, 32)
    args = _arguments(ns, program, roles)
    statuses = kernel_statuses(args)
    supported = [k for k, s in statuses if s.ok]
    chosen = supported if ns.all else [_pick(supported, ns.kernel)] if supported else []
    print(f"# verify {program.name}: {_describe(ns, args)}, seed {ns.seed}, against the float64 reference")
    if not any(k.name != "reference" for k in supported) and args.A.device.type == "cpu":
        print("# only the reference kernel runs on CPU tensors; --interpret runs the Triton kernels "
              "through Triton's interpreter")
    ok = True
    for kernel in chosen:
        for dest in args.outputs.values():   # anything the kernel fails to write shows up
            dest.fill_(float("nan") if dest.dtype.is_floating_point else -1)
        report = run(kernel, args, verify=True, rtol=ns.rtol, raise_on_mismatch=False)
        print(report)
        ok &= report.ok
    return 0 if ok else 1


_NCU_METRICS = ("gpu__time_duration.sum", "launch__registers_per_thread", "dram__bytes_read.sum",
                "dram__bytes_write.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed")
_TARGET_MARK = "EPIFUSE_PROFILE_TARGET "


def _cmd_profile(ns) -> int:
    ncu = ns.ncu or shutil.which("ncu")
    if ncu is None:
        print("epifuse profile: Nsight Compute (`ncu`) is not on PATH, so profiling is unavailable "
              "here; install Nsight Compute (it comes with the CUDA toolkit) or pass --ncu PATH",
              file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("epifuse profile: profiling needs a CUDA GPU, and none is visible "
              "(torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    load_epilogue(ns.epilogue)   # report epilogue errors here, not from inside ncu
    with tempfile.TemporaryDirectory(prefix="epifuse-profile-") as tmp:
        log = os.path.join(tmp, "ncu.csv")
        target = [sys.executable, "-m", "epifuse.cli", "_profile-target", ns.epilogue,
                  "--shape", *map(str, ns.shape), "--dtype", ns.dtype, "--kernel", str(ns.kernel)]
        target += ["--batch", str(ns.batch)] if ns.batch else []
        target += ["--out-dtype", ns.out_dtype] if ns.out_dtype else []
        for name, role in ns.role:
            target += ["--role", f"{name}={role}"]
        command = [ncu, "--clock-control", "none", "--target-processes", "all",
                   "--kernel-name", "regex:epifuse_kernel", "--launch-skip", "1", "--launch-count", "1",
                   "--csv", "--page", "details", "--print-units", "base",
                   "--metrics", ",".join(_NCU_METRICS), "--log-file", log, *target]
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=ns.timeout)
        ncu_text = ""
        if os.path.exists(log):
            with open(log) as f:
                ncu_text = f.read()
    info = next((json.loads(line[len(_TARGET_MARK):]) for line in result.stdout.splitlines()
                 if line.startswith(_TARGET_MARK)), None)
    if result.returncode != 0 or info is None:
        errors = [ln for ln in (ncu_text + result.stderr + result.stdout).splitlines()
                  if "ERROR" in ln or "Error" in ln]
        detail = errors[-1].strip() if errors else (result.stderr.strip().splitlines() or ["no output"])[-1]
        hint = (" (the GPU's performance counters need admin rights: run as root or allow "
                "non-admin profiling)") if "ERR_NVGPUCTRPERM" in ncu_text + result.stderr + result.stdout else ""
        raise CommandError(f"ncu failed (exit {result.returncode}): {detail}{hint}")
    print(summarize_ncu(ncu_text, info))
    return 0


def _cmd_profile_target(ns) -> int:
    """Inside ncu: build the arguments, run the kernel twice (the first compiles), report."""
    program, roles = load_epilogue(ns.epilogue)
    args = _arguments(ns, program, roles, device="cuda")
    kernels = get_kernels(args)
    kernel = _pick(kernels, ns.kernel)
    kernel.run(args)
    torch.cuda.synchronize()
    kernel.run(args)
    torch.cuda.synchronize()
    info = dict(kernel=repr(kernel), name=program.name, L=args.L, M=args.M, N=args.N, K=args.K,
                dtype=ns.dtype, device=torch.cuda.get_device_name(), **compiled_stats(kernel, args))
    print(_TARGET_MARK + json.dumps(info), flush=True)
    return 0


def _cmd_bench(ns) -> int:
    try:  # the harness is in a source checkout, not in the installed package
        from bench.run import main as bench_main
    except ImportError:
        raise CommandError("the benchmark harness lives in the source tree's bench/ folder; "
                           "run this from a checkout (PYTHONPATH=src:. epifuse bench)") from None
    return bench_main(ns.rest)


# ---- the parser -----------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not usage plus a message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="epifuse", formatter_class=fmt,
                     description="Fuse Python epilogues into GEMM kernels.",
                     epilog="Run `epifuse COMMAND --help` for each command's options and examples.")
    parser.add_argument("--traceback", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    sub.add_parser("demo", formatter_class=fmt,
                   help="run CUTLASS's epilogue-notebook examples and check them against torch",
                   description="Run the examples of CUTLASS's epilogue notebook, check each against "
                               "torch, and time them on a GPU (on a CPU they run through Triton's "
                               "interpreter at a small size).")

    show = sub.add_parser("show", formatter_class=fmt, help="print the optimized DAG of an epilogue and draw it",
                          description="Print the optimized DAG of an epilogue (one line per node, with "
                                      "your names) and draw it with graphviz: to NAME.svg by default when "
                                      "`dot` is installed, or to -o FILE (.svg, .png, .pdf, or .dot for "
                                      "the DOT source, which needs no graphviz).",
                          epilog="examples:\n"
                                 "  epifuse show epi.py\n"
                                 "  epifuse show epi.py:relu_aux_store --role alpha=number -o dag.png\n"
                                 "  epifuse show epifuse.epilogues:LinearCombinationRelu --source\n"
                                 "  epifuse show $'def e(accum, b):\\n    D = relu(accum + b)\\n    return D' --role b=row   # bash's $'...'")
    show.add_argument("epilogue", help=_EPILOGUE_HELP)
    show.add_argument("--role", type=_role, action="append", default=[], metavar="NAME=ROLE",
                      help="an operand's role: number, scalar, row, col, tile (default), batch")
    show.add_argument("--batched", action="store_true", help="show the batched (L, M, N) form")
    show.add_argument("-o", "--output", metavar="FILE", help="where to draw (.svg, .png, .pdf, .dot)")
    show.add_argument("--text", action="store_true", help="print only, draw nothing")
    show.add_argument("--source", action="store_true", help="also print the epilogue's source")

    kernels = sub.add_parser("kernels", formatter_class=fmt,
                             help="which kernels support an epilogue, why not, and alignment problems",
                             description="List every kernel class and config for an epilogue and a "
                                         "problem, whether it supports it and why (or why not), then "
                                         "the alignment of every tensor (what TMA kernels need).",
                             epilog="examples:\n"
                                    "  epifuse kernels epi.py --shape 4096 4096 4096\n"
                                    "  epifuse kernels epi.py --shape 1000 1000 1001 --layout-b col --cc 90")
    _problem_options(kernels, (1024, 1024, 1024))
    kernels.add_argument("--layout-a", choices=("row", "col"), default="row",
                         help="A row-major (K contiguous, default) or column-major")
    kernels.add_argument("--layout-b", choices=("row", "col"), default="row",
                         help="B row-major (N contiguous, default) or column-major (K contiguous)")
    kernels.add_argument("--cc", type=_int_in(1), help="compute capability to check against, e.g. 80 or 90")

    verify = sub.add_parser("verify", formatter_class=fmt,
                            help="run an epilogue on random inputs and compare with the float64 reference",
                            description="Run the epilogue's best kernel (or every supported kernel) on "
                                        "random inputs and compare each output with the reference "
                                        "interpreter in float64; print the largest error, where it is, "
                                        "and the tolerance. Exit status 1 on a mismatch.",
                            epilog="examples:\n"
                                   "  epifuse verify epi.py\n"
                                   "  epifuse verify epi.py --all --shape 256 192 64 --role bias=row\n"
                                   "  epifuse verify epifuse.epilogues:LinearCombinationSilu --interpret")
    _problem_options(verify, None, "problem size (default: 512 512 256 on a GPU, 64 64 32 on a CPU)")
    verify.add_argument("--all", action="store_true", help="verify every supported kernel, not just the best")
    verify.add_argument("--kernel", type=_int_in(0), default=0, metavar="I", help="verify the I-th supported kernel")
    verify.add_argument("--seed", type=_int_in(0, _INT64_MAX), default=0, help="random seed (default: 0)")
    verify.add_argument("--rtol", type=float, help="relative tolerance (default: by output dtype)")
    verify.add_argument("--interpret", action="store_true",
                        help="on a CPU, run the Triton kernels through Triton's interpreter")

    profile = sub.add_parser("profile", formatter_class=fmt,
                             help="profile one kernel under Nsight Compute and summarize it",
                             description="Run the epilogue's best kernel (or the I-th) once under "
                                         "Nsight Compute (ncu --clock-control none) and summarize time, "
                                         "registers, spills, achieved DRAM bandwidth and FLOP/s. Needs "
                                         "`ncu` on PATH and a CUDA GPU; says so when either is missing.",
                             epilog="examples:\n"
                                    "  epifuse profile epi.py --shape 4096 4096 4096\n"
                                    "  epifuse profile epifuse.epilogues:LinearCombinationGELU --role alpha=number")
    _problem_options(profile, (4096, 4096, 4096))
    profile.add_argument("--kernel", type=_int_in(0), default=0, metavar="I", help="profile the I-th supported kernel")
    profile.add_argument("--ncu", metavar="PATH", help="the ncu executable (default: ncu on PATH)")
    profile.add_argument("--timeout", type=int, default=600, help="seconds to wait for ncu (default: 600)")

    target = sub.add_parser("_profile-target", help=argparse.SUPPRESS)
    _problem_options(target, (4096, 4096, 4096))
    target.add_argument("--kernel", type=_int_in(0), default=0)

    bench = sub.add_parser("bench", formatter_class=fmt, help="run the benchmark suite (GPU)",
                           description="Run the benchmark suite (from a source checkout, GPU); the "
                                       "options after `bench` go to the harness (bench/run.py), "
                                       "e.g. `epifuse bench --quick`; `python -m bench --help` "
                                       "lists them.")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    sub._choices_actions = [a for a in sub._choices_actions if a.dest != "_profile-target"]
    return parser


_COMMANDS = {"demo": _cmd_demo, "show": _cmd_show, "kernels": _cmd_kernels, "verify": _cmd_verify,
             "profile": _cmd_profile, "_profile-target": _cmd_profile_target, "bench": _cmd_bench}


def one_line(exc: BaseException) -> str:
    """An error as one line: the message, the epilogue's file:line:column, the hint."""
    if isinstance(exc, EpilogueError):
        text = exc.message
        if exc.loc is not None:
            text += f" ({exc.loc.filename}:{exc.loc.line}:{exc.loc.col + 1})"
        if exc.hint:
            text += f". {exc.hint}" if not text.endswith((".", "?", "!")) else f" {exc.hint}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def _parse(parser: argparse.ArgumentParser, argv: list) -> argparse.Namespace:
    """The arguments; after `bench`, everything but a lone --help is the harness's, options
    first included (argparse's REMAINDER does not take an option as its first word)."""
    command = next((i for i, word in enumerate(argv) if not word.startswith("-")), None)
    if command is None or argv[command] != "bench" or argv[command + 1:] in (["-h"], ["--help"]):
        return parser.parse_args(argv)
    ns = parser.parse_args(argv[:command + 1])
    ns.rest = argv[command + 1:]
    return ns


def main(argv=None) -> int:
    parser = build_parser()
    ns = _parse(parser, sys.argv[1:] if argv is None else list(argv))
    try:
        return _COMMANDS[ns.command](ns)
    except KeyboardInterrupt:
        return 130
    except (EpilogueError, CommandError, OSError, subprocess.TimeoutExpired) as exc:
        if ns.traceback:
            raise
        print(f"epifuse {ns.command}: {one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug in epifuse or a library: still one line, with the way to more
        if ns.traceback or os.environ.get("EPIFUSE_DEBUG"):
            raise
        print(f"epifuse {ns.command}: {type(exc).__name__}: {one_line(exc)} "
              "(run `epifuse --traceback ...` for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
