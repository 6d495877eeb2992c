"""The `epifuse` command line: its arguments, the dispatch to a command, errors as one line.
The commands themselves (demo, bench, show, kernels, verify, profile) are epifuse.commands, loaded
once the arguments parse: `epifuse --help` and a mistyped option load neither torch nor Triton.
Every command takes an epilogue as a file (`epi.py`, `epi.py:name`), a `module:name` (a function,
a named epilogue, a FusedGemm subclass) or the source itself. Errors print as one line
(`--traceback` shows the Python traceback instead).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from .errors import EpilogueError
from .tools.roles import ROLES

_DTYPES = ("float16", "bfloat16", "float32")  # what --dtype and --out-dtype take
_EPILOGUE_HELP = ("the epilogue: a file (epi.py, or epi.py:name to pick one function or FusedGemm "
                  "class), a module:name (a function, a named epilogue such as "
                  "epifuse.epilogues:LinearCombinationRelu, a FusedGemm subclass), or the source "
                  "\"def epi(accum, ...): ...\"")


# ---- arguments ------------------------------------------------------------------------------------

def _role(text: str) -> tuple[str, str]:
    name, sep, role = text.partition("=")
    if not sep or not name or role not in ROLES:
        raise argparse.ArgumentTypeError(f"expected NAME=ROLE with ROLE one of {', '.join(ROLES)}, got {text!r}")
    return name, role


_INT64_MAX = 2**63 - 1   # what torch takes as a size or a seed


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
    # the commands, and torch and the kernels with them, load only for a command to run
    from . import commands
    try:
        return commands.COMMANDS[ns.command](ns)
    except KeyboardInterrupt:
        return 130
    except (EpilogueError, commands.CommandError, OSError, subprocess.TimeoutExpired) as exc:
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
