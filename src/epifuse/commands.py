"""What each `epifuse` command does: demo, bench, show, kernels, verify, profile. Thin: load the
epilogue, call the API, print. `epifuse.cli` parses the command line and loads this module only
then (the commands need torch and the kernels; `--help` needs neither).

An epilogue comes as a file (`epi.py`, `epi.py:name`), a `module:name` (a function, a named
epilogue, a FusedGemm subclass) or the source itself.
"""
from __future__ import annotations

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

from . import staging
from .api import get_kernels, kernel_statuses
from .backends.triton import configs
from .arguments import epilogue_program
from .binding import bind
from .demo import run_demo
from .epilogues import NamedEpilogue
from .frontend import parse_module, parse_source
from .program import Program
from .fused import FusedGemm, drop_self
from .ir import Operand, fed_reductions
from .ops import dtype_from_name
from .passes import canonical_hash, optimize
from .printing import program_source
from .tools.draw import dot_available, draw
from .tools.harness import run_bench
from .tools.ncu import compiled_stats, summarize_ncu
from .tools.problems import alignment_report, check_roles, random_arguments
from .verify import run


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
    return epilogue_program(spec), {}   # source, or an activation's name as epifuse.gemm takes it


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
        return epilogue_program(obj), dict(getattr(obj, "roles", {}) or {})
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
    shown = ", ".join(f"{n}: {roles.get(n, 'tile')}" for n in program.operands) or "none"
    if ns.source:
        print(program_source(program), end="")
    if staging.needs_passes(program) and not staging.over_rows(program, rank):
        steps = staging.passes(program)
        print(f"# {program.name}: operands {shown}; a reduction over other dims than N feeds later math: "
              f"epifuse.gemm runs it as {len(steps)} passes (epifuse.staging), each a kernel:")
        for step in steps:
            print(program_source(step.program), end="")
        return 0
    graph = optimize(bind(program, operands, rank, in_tile=True))
    print(f"# {program.name}: operands {shown}; hash {canonical_hash(graph)}")
    fed = fed_reductions(graph)
    if fed:
        folded = ", ".join(sorted({f"{node.op.name}()" for node in fed}))
        print(f"# {folded} over N feeds later math: one kernel where a tile spans N (N <= {configs.WIDEST_N}), "
              f"else {len(staging.passes(program))} passes (epifuse.staging); `epifuse kernels` says which")
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
    return run_bench(ns.rest)   # bench/ is in a source checkout, found by tools/harness.py


COMMANDS = {"demo": _cmd_demo, "show": _cmd_show, "kernels": _cmd_kernels, "verify": _cmd_verify,
            "profile": _cmd_profile, "_profile-target": _cmd_profile_target, "bench": _cmd_bench}
