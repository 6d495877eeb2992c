"""Generate docs/ops.md, the op reference, from the ops registry (so it cannot fall out of date).

    python -m epifuse.tools.docs                   # print it
    python -m epifuse.tools.docs -o docs/ops.md    # write it
    python -m epifuse.tools.docs --check docs/ops.md   # exit 1 if the file differs from the registry

Everything here is read from the registry (`epifuse.ops.OPS`), the frontend's operator table,
the Triton backend's rule table and the named epilogues; nothing is written by hand but prose.
"""
from __future__ import annotations

import argparse
import ast
import sys

from .. import epilogues as E
from ..activations import CUTLASS_NAMES
from ..backends.triton.rules import missing_rules
from ..frontend import _BINOPS, _CMPOPS
from ..ops import OPS

_GROUPS = (
    ("elementwise", "Elementwise math and activations"),
    ("compare", "Comparisons (a boolean result)"),
    ("logical", "Logic on conditions"),
    ("cast", "Rounding through a narrower type"),
    ("reduce", "Reductions"),
    ("index", "Indices (where each element of accum is)"),
    ("composite", "Composites (the parser writes them as other ops)"),
    ("complex", "Parts of complex values (planar complex GEMMs' epilogues only)"),
    ("join", "Joins (a gated epilogue's two half-width tiles into one output of full width)"),
)
_SYMBOLS = {ast.Add: "a + b", ast.Sub: "a - b", ast.Mult: "a * b", ast.Div: "a / b",
            ast.Pow: "a ** b", ast.BitAnd: "a & b", ast.BitOr: "a | b", ast.Lt: "a < b",
            ast.LtE: "a <= b", ast.Gt: "a > b", ast.GtE: "a >= b", ast.Eq: "a == b",
            ast.NotEq: "a != b"}

HEADER = """# Op reference

<!-- Generated from the ops registry by `python -m epifuse.tools.docs -o docs/ops.md`; do not edit.
     tests/unit/test_docs.py fails when this file and the registry disagree. -->

Every op epifuse knows. Inside an epilogue an op is parsed, never called, and may be spelled
`op(x)`, `torch.op(x)`, `F.op(x)`, `torch.nn.functional.op(x)`, `epifuse.ops.op(x)` or
`x.op()`, by its name or any name in the *also* column. Called on torch tensors,
`epifuse.ops.op` runs the op's torch reference, so an epilogue function is its own eager
version. Epilogue math runs in fp32, or in float64 when A, B or a tensor operand is float64
(`compute_dtype=` may change it); NaN and Inf follow torch.

Columns: *arguments* are the tensor inputs, then compile-time parameters (literals) with their
defaults; *cost* is per element: plain flops + special-function ops (exp, log, ...); *Triton*
says whether the Triton kernels lower the op (and why not); *grad* whether autograd has a
derivative rule for it (comparisons and logic pass no gradient: their results are boolean).
"""


def _first_paragraph(doc: str) -> str:
    return _cell(" ".join(doc.strip().split("\n\n")[0].split()))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _operators() -> list[str]:
    rows = [(_SYMBOLS[k], v) for k, v in {**_BINOPS, **_CMPOPS}.items() if k in _SYMBOLS]
    rows += [("-x", "neg"), ("~x", "logical_not"), ("max(a, b), min(a, b)", "maximum, minimum"),
             ("x.to(torch.float16), x.half(), x.bfloat16(), x.float()", "to")]
    lines = ["## Operators", "", "| you write | op |", "|---|---|"]
    lines += [f"| `{_cell(s)}` | {', '.join(f'`{n}`' for n in op.split(', '))} |" for s, op in rows]
    lines += ["", "Comparisons chain (`a < b < c` is `(a < b) & (b < c)`); `clamp` with tensor "
              "bounds becomes `maximum`/`minimum`. `&`, `|` and `~` take conditions (comparisons, logic, "
              "or names bound to them), as torch's do on bool tensors; on numbers torch's are bitwise, "
              "which an epilogue refuses: `logical_and`, `logical_or` and `logical_not` treat nonzero "
              "as true.", ""]
    return lines


def _triton_status(name: str) -> str:
    if OPS[name].is_reduction:
        return "yes (reduction stage)"
    if OPS[name].kind == "composite":
        return "as the ops it is written as"
    if OPS[name].kind == "complex":
        return "as real and imaginary parts (complex_parts)"
    if OPS[name].kind == "join":
        return "yes (the gated kernel's store)"
    missing = {op.name: reason for op, reason in missing_rules().items()}
    return "yes" if name not in missing else f"no: {missing[name]}"


def _grad(d) -> str:
    if d.makes_bool:
        return "none (boolean)"
    if d.kind == "index":
        return "none (a position)"
    if d.kind == "composite":
        return "through its ops"
    if d.kind == "complex":
        return "none (no autograd in complex epilogues)"
    if d.kind == "join":
        return "no (autograd refuses it)"
    return "yes" if d.vjp else "no"


def _op_table(kind: str) -> list[str]:
    lines = ["| op | also | arguments | meaning | cost | Triton | grad |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(n for n, d in OPS.items() if d.kind == kind):
        d = OPS[name]
        args = [f"({d.input_names})" if d.sequence else d.input_names] if d.input_names else []
        args += [f"{p}={v!r}" for p, v in d.params]
        cost = f"{d.cost.flops}" + (f" + {d.cost.special} special" if d.cost.special else "")
        arguments = f"`{_cell(', '.join(args))}`" if args else "(none)"
        lines.append(f"| `{name}` | {', '.join(f'`{a}`' for a in d.aliases) or ''} | "
                     f"{arguments} | {_cell(d.doc)} | {cost} | "
                     f"{_cell(_triton_status(name))} | {_grad(d)} |")
    return lines


def _named_epilogues() -> list[str]:
    lines = ["## Named epilogues (`epifuse.epilogues`)", "",
             "Built from templates over the op names above; each is its own source (a `str`), "
             "usable wherever an epilogue function is. Shown with their defaults:", ""]
    examples = {"LinearCombinationClamp": dict(min=0.0, max=6.0)}
    for name, cls in E.NAMED.items():
        if cls is E.Generic:
            continue
        epi = cls(**examples.get(name, {}))
        lines += [f"### `{name}`", "", _first_paragraph(cls.__doc__), "", "```python",
                  f"# {epi!r}", str(epi).rstrip(), "```", ""]
    lines += ["### `Generic`", "", _first_paragraph(E.Generic.__doc__), "",
              "Activations (`epifuse.epilogues.<name>()`, or any unary op name) for "
              "`LinearCombination(activation=...)`, `BiasElementwise` and `Generic`:", "",
              "| activation | becomes |", "|---|---|"]
    for name, make in CUTLASS_NAMES.items():
        shown = "Clamp(min=0.0, max=1.0)" if name == "Clamp" else f"{name}()"
        act = make(min=0.0, max=1.0) if name == "Clamp" else make()
        lines.append(f"| `{shown}` | `{_cell(act.statements('F', 'D')[0])}` |")
    lines += ["", "Scale types (`ScaleType`): "
              + "; ".join(f"`{m.name}`: `{E._LINEAR[m][1]}`" for m in E.ScaleType
                          if m in E._LINEAR) + ".", ""]
    return lines


def render_ops_reference() -> str:
    """The text of docs/ops.md."""
    lines = HEADER.splitlines() + [""] + _operators()
    for kind, title in _GROUPS:
        lines += [f"## {title}", ""] + _op_table(kind) + [""]
    takes_complex = sorted(n for n, d in OPS.items() if d.complex is not None and d.kind != "complex")
    lines += ["In a planar complex GEMM's epilogue (`epifuse.gemm_planar_complex`), these ops take complex "
              "values (each as torch's, with a real value's zero imaginary part left out of the arithmetic): "
              + ", ".join(f"`{n}`" for n in takes_complex) + ". Any other op refuses a complex input "
              "by name.", ""]
    lines += _named_epilogues()
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epifuse.tools.docs",
                                     description="Generate the op reference (docs/ops.md) from the registry.")
    parser.add_argument("-o", "--output", help="write it here instead of printing it")
    parser.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated text")
    ns = parser.parse_args(argv)
    text = render_ops_reference()
    if ns.check:
        try:
            with open(ns.check) as f:
                current = f.read()
        except OSError as exc:
            print(f"python -m epifuse.tools.docs: cannot read {ns.check}: {exc}", file=sys.stderr)
            return 1
        if current != text:
            print(f"{ns.check} is out of date; run: python -m epifuse.tools.docs -o {ns.check}", file=sys.stderr)
            return 1
        return 0
    if ns.output:
        with open(ns.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
