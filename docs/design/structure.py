"""Draw the package's structure from its imports, and check the rules it lives by.

    python docs/design/structure.py            # rewrite docs/design/structure.md
    python docs/design/structure.py --check    # exit 1 if the drawing is stale or a rule broken

Every module of src/epifuse has a layer (LAYERS below, bottom first). A module may import
modules of its own layer or below, never above; the imports form no circle; and an import
inside a function is kept for an optional or slow dependency only, each listed in LOCAL with
why. A module that loads names on first use (a module __getattr__) is listed in LAZY, and its
table of those names agrees with its `if TYPE_CHECKING:` imports, which the drawing shows.
Nothing is run: the imports are read from the source (ast).
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
    ("the language: parsing and the IR", ["nesting", "program", "frontend", "ir"]),
    ("graphs: binding, passes, printing, the reference, autodiff, tensor geometry (and stand-ins: "
     "metadata without memory), staging in passes, complex epilogues over real parts, uint8 GEMMs as int8 ones",
     ["binding", "rewrite", "passes.", "printing", "reference", "autodiff", "stand_in", "shapes", "staging",
      "complex_parts", "unsigned_inputs"]),
    ("what a call is made of: arguments and their checks (single and grouped), the outputs epifuse "
     "allocates, activations", ["arguments", "grouped_arguments", "allocation", "activations"]),
    ("verification against the float64 reference", ["verify"]),
    ("the on-disk caches, and compiles in processes of their own", ["runtime", "runtime.cache", "runtime.triton_identity",
                            "runtime.compile_child", "runtime.compile_processes",
                            "runtime.compiled"]),
    ("kernels: the contract, the reference kernels, the Triton backend",
     ["backends", "backends.base", "backends.reference", "backends.triton."]),
    ("choosing a kernel: candidates, order, tuning, kernels compiled ahead in worker threads",
     ["backends.select", "runtime.ahead", "runtime.shipped", "runtime.tune"]),
    ("PyTorch integration and kept launches: the epilogue table (ids and keys), what the custom ops plan, "
     "their backward and its kernels compiled ahead, their sharding rules on DTensors, the custom ops; "
     "a staged epilogue's later passes compiled ahead",
     ["epilogue_table", "op_planning", "op_backward", "backward_ahead", "sharding", "torch_ops", "runtime.callsite",
      "staged_ahead"]),
    ("the facade: gemm, and planar complex GEMMs", ["api", "planar"]),
    ("built on the facade: nn.FusedLinear (and its shards under tensor parallelism), the fused linear "
     "cross-entropy, class-based and named epilogues, the demo",
     ["sharded", "losses", "loss_ops", "nn", "fused", "epilogues", "demo"]),
    ("the torch.compile backend: the LM-head rewrite, reduction elimination and the GEMM fusion pass on FX graphs, the backend and explain",
     ["graph_heads", "graph_reductions", "graph_fusion", "graph_payoff", "backend"]),
    ("tools: trace, draw, problems, profiler output, the ops reference", ["tools."]),
    ("entry points", ["debug", "cli", "commands", "__main__", "__init__"]),
]

# Function-local imports of the package's own modules, with why.
LOCAL: dict[tuple[str, str], str] = {
    ("cli", "commands"): "the commands load once the arguments parse: `epifuse --help` and a "
                         "mistyped option load neither torch nor Triton",
    ("backend", "graph_heads"): "the LM-head rewrite (and the linear cross-entropy it calls, with epifuse.api) "
                                "loads when a graph is compiled: `import epifuse` does not load them",
}

# Modules that load names on first use through a module __getattr__ (PEP 562) and importlib,
# which the import statements do not show: module -> (the tuple of submodules, the dict of
# module -> names) it loads. Its `if TYPE_CHECKING:` block imports exactly these, for type
# checkers and for the drawing; --check fails when the two differ, or when another module
# defines a module __getattr__.
LAZY: dict[str, tuple[str, str]] = {
    "__init__": ("_SUBMODULES", "_NAMES"),   # the API, nn, debug... load when first named
}


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


def lazy_problems(module: str, path: Path) -> list[str]:
    """A module __getattr__ only in a LAZY module, whose table names what its TYPE_CHECKING
    block imports: (module, name) pairs, a submodule as (itself, itself)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    getattr_defined = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    if module not in LAZY:
        return [f"{module} defines a module __getattr__ (names loaded on first use), which LAZY "
                "does not list"] if getattr_defined else []
    submodules_name, names_name = LAZY[module]
    values = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    if not getattr_defined or submodules_name not in values or names_name not in values:
        return [f"{module} is in LAZY but has no module __getattr__, {submodules_name} or {names_name}"]
    table = {(m, m) for m in ast.literal_eval(values[submodules_name])}
    table |= {(m, name) for m, names in ast.literal_eval(values[names_name]).items() for name in names}
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.level == 1:
                    imported |= {(statement.module or alias.name, alias.name) for alias in statement.names}
    if table != imported:
        differ = sorted(table ^ imported)
        return [f"{module}'s names loaded on first use and its TYPE_CHECKING imports differ: {differ}"]
    return []


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
    problems += [problem for module, path in found.items() for problem in lazy_problems(module, path)]
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
    if LAZY:
        lines += ["", "Loaded on first use (a module `__getattr__`; the imports above are its `if TYPE_CHECKING:` "
                  "block, which names the same):", ""]
        lines += [f"- `{m}`" for m in sorted(LAZY)]
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
