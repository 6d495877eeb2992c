"""Pictures of an epilogue's DAG: graphviz DOT source, drawn by `dot` where it is installed.

    epifuse.debug.draw(args.graph, "epilogue.svg")
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ..errors import EpilogueArgumentError
from ..ir import ACCUM, AXES, CONST, INPUT, Graph

_COLORS = {"accum": "#cfe2f3", "input": "#d9ead3", "const": "#eeeeee", "reduce": "#f4cccc",
           "op": "#ffffff", "output": "#fce5cd"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_source(graph: Graph, title: str = "epilogue") -> str:
    """The Graph as graphviz DOT: leaves at the top, outputs at the bottom."""
    if not isinstance(graph, Graph):
        raise EpilogueArgumentError(f"Drawing takes a Graph (such as GemmArguments.graph), not {type(graph).__name__}.")
    lines = [f"digraph {_quote(title)} {{", "  rankdir=TB;",
             f"  label={_quote(title)}; labelloc=t; fontname=Helvetica;",
             "  node [fontname=Helvetica, fontsize=11, style=filled];"]
    ids: dict[int, str] = {}
    for k, node in enumerate(graph.nodes()):
        ids[id(node)] = f"n{k}"
        axes = "".join(a for a in AXES if a in node.axes) or "scalar"
        if node.op is ACCUM:
            label, shape, color = "accum", "box", _COLORS["accum"]
        elif node.op is INPUT:
            label, shape, color = f"{node.arg.name}\n{node.arg.kind} [{axes}]", "box", _COLORS["input"]
        elif node.op is CONST:
            label, shape, color = repr(node.arg), "plaintext", _COLORS["const"]
        else:
            params = ", ".join(f"{k2}={v!r}" for k2, v in node.params.items())
            user = graph.name_of(node)
            label = node.op.name + (f"({params})" if params else "") + (f"\n{user}" if user else "")
            shape, color = "ellipse", _COLORS["reduce" if node.op.is_reduction else "op"]
        lines.append(f"  n{k} [label={_quote(label)}, shape={shape}, fillcolor={_quote(color)}];")
        for s in node.src:
            lines.append(f"  {ids[id(s)]} -> n{k};")
    for o in graph.outputs:
        lines.append(f"  out_{o.name} [label={_quote(o.name)}, shape=box, style=\"filled,bold\", "
                     f"fillcolor={_quote(_COLORS['output'])}];")
        lines.append(f"  {ids[id(o.node)]} -> out_{o.name};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_available() -> str | None:
    """The path of graphviz's `dot`, or None."""
    return shutil.which("dot")


def draw(graph: Graph, path: str | Path, title: str = "epilogue") -> Path:
    """Write the Graph to `path`: .dot (the DOT source, no graphviz needed), .svg or .png
    (graphviz's `dot` must be on PATH, else RuntimeError saying so)."""
    path = Path(path)
    source = dot_source(graph, title)
    fmt = path.suffix.lower().lstrip(".")
    if fmt in ("dot", "gv"):
        path.write_text(source)
        return path
    if fmt not in ("svg", "png", "pdf"):
        raise EpilogueArgumentError(f"Cannot draw to {path.name}: use a .svg, .png, .pdf or .dot file.")
    dot = dot_available()
    if dot is None:
        raise RuntimeError("graphviz's `dot` is not on PATH; install graphviz, or write the DOT "
                           "source with a .dot file name")
    result = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=source.encode(),
                            capture_output=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"dot failed: {result.stderr.decode(errors='replace').strip()[:200]}")
    return path
