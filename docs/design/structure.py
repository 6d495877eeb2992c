"""Draw the package's structure from its imports, and check the rules it lives by.

    python docs/design/structure.py            # rewrite docs/design/structure.md
    python docs/design/structure.py --check    # exit 1 if the drawing is stale or a rule broken

Every module of src/epifuse has a layer (LAYERS below, bottom first). A module may import
modules of its own layer or below, never above; the imports form no circle; and an import
inside a function is kept for an optional or slow dependency only, each listed in LOCAL with
why. Nothing is run: the imports are read from the source (ast).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "epifuse"
OUTPUT = Path(__file__).resolve().parent / "structure.md"

# Bottom first: what each layer is for, and its modules (a trailing "." takes a whole folder).
LAYERS = [
    ("foundation: errors, the ops registry, dtype names", ["errors", "version", "ops."]),
    ("the language: parsing and the IR", ["frontend", "ir"]),
    ("graphs: binding, passes, printing, the reference, autodiff, tensor geometry",
     ["binding", "rewrite", "passes.", "printing", "reference", "autodiff", "shapes"]),
    ("what a call is made of: arguments and their checks, activations", ["arguments", "activations"]),
    ("verification against the float64 reference", ["verify"]),
    ("the on-disk caches", ["runtime", "runtime.cache", "runtime.compiled"]),
    ("kernels: the contract, the reference kernels, the Triton backend",
     ["backends", "backends.base", "backends.reference", "backends.triton."]),
    ("choosing a kernel: candidates, order, tuning", ["backends.select", "runtime.tune"]),
    ("PyTorch integration and kept launches", ["torch_ops", "runtime.callsite"]),
    ("the facade", ["api"]),
    ("built on the facade: nn.FusedLinear, class-based and named epilogues, the demo",
     ["nn", "fused", "epilogues", "demo"]),
    ("tools: trace, draw, problems, profiler output, the ops reference", ["tools."]),
    ("entry points", ["debug", "cli", "__main__", "__init__"]),
]

# Function-local imports of the package's own modules, with why (none today).
LOCAL: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        found[name.removesuffix(".__init__") if name != "__init__" else "__init__"] = path
    return found


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".") and module.startswith(member) or module + "." == member):
                return index
    raise SystemExit(f"structure.py: {module} has no layer; add it to LAYERS")


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import of the package's own modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # the package a relative import starts from: "" for epifuse/__init__.py itself
    package = "" if module == "__init__" else module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def walk(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and (child.level or (child.module or "").startswith("epifuse")):
                base = package if child.level else ""
                for _ in range(max(child.level - 1, 0)):
                    base = base.rpartition(".")[0]
                stem = child.module or ""
                if not child.level:
                    stem = stem.removeprefix("epifuse").lstrip(".")
                full = ".".join(p for p in (base, stem) if p)
                for alias in child.names:
                    target = resolve(f"{full}.{alias.name}" if full else alias.name) or resolve(full)
                    if target and target != module:
                        found.append((target, local))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("epifuse."):
                        target = resolve(alias.name.removeprefix("epifuse."))
                        if target and target != module:
                            found.append((target, local))
            walk(child, inner)
    walk(tree, False)
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def survey():
    found = modules()
    known = set(found)
    edges: dict[str, set[str]] = {m: set() for m in found}
    upward, local = [], []
    for module, path in found.items():
        for target, inside in imports(module, path, known):
            edges[module].add(target)
            if inside:
                local.append((module, target))
            if layer_of(target) > layer_of(module):
                upward.append((module, target))
    return found, edges, upward, local


def render() -> tuple[str, list[str]]:
    found, edges, upward, local = survey()
    problems = []
    loops = circles(edges)
    problems += [f"import circle: {' -> '.join(group)}" for group in loops]
    problems += [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}), a layer above it" for a, b in upward]
    problems += [f"{a} imports {b} inside a function, which LOCAL does not list" for a, b in local
                 if (a, b) not in LOCAL]
    lines = ["# The package's structure", "",
             "<!-- Written by `python docs/design/structure.py` from the imports of src/epifuse; do not edit.",
             "     `--check` (run by the tests) fails when this page is stale or a rule below is broken. -->", "",
             "Layers, bottom first. A module imports only modules of its own layer or below; the imports",
             "form no circle; a function-local import of the package's own modules is listed with why.", "",
             f"**{len(found)} modules, {sum(len(v) for v in edges.values())} imports, {len(loops)} circles, "
             f"{len(upward)} imports up a layer, {len(local)} function-local imports.**", "",
             "```mermaid", "flowchart BT"]
    for index, (title, _) in enumerate(LAYERS):
        lines.append(f'    L{index}["{index}. {title}"]')
    layer_edges = sorted({(layer_of(a), layer_of(b)) for a, targets in edges.items() for b in targets
                          if layer_of(a) != layer_of(b)})
    lines += [f"    L{a} --> L{b}" for a, b in layer_edges]
    lines += ["```", "", "| layer | module | lines | imports (of the package) |", "|---|---|---|---|"]
    for index, (title, _) in enumerate(LAYERS):
        members = sorted(m for m in found if layer_of(m) == index)
        for m in members:
            count = sum(1 for _ in found[m].open(encoding="utf-8"))
            lines.append(f"| {index} | `{m}` | {count} | {', '.join(f'`{t}`' for t in sorted(edges[m])) or '—'} |")
    if local:
        lines += ["", "Function-local imports:", ""]
        lines += [f"- `{a}` imports `{b}`: {LOCAL.get((a, b), 'NOT LISTED')}" for a, b in local]
    return "\n".join(lines) + "\n", problems


def main(argv) -> int:
    text, problems = render()
    if "--check" in argv:
        stale = not OUTPUT.exists() or OUTPUT.read_text(encoding="utf-8") != text
        for problem in problems + (["docs/design/structure.md is stale: run python docs/design/structure.py"]
                                   if stale else []):
            print(problem, file=sys.stderr)
        return 1 if problems or stale else 0
    OUTPUT.write_text(text, encoding="utf-8")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
