"""`torch.compile(model, backend="epifuse")` and `epifuse.explain(fn, *example_inputs)`.

The backend is Inductor with one more pass: after AOTAutograd has split the joint graph into
forward and backward and Inductor has decomposed them (post-grad), epifuse.graph_fusion
rewrites each GEMM and the pointwise ops and reductions consuming it into one epifuse GEMM with
a generated epilogue; Inductor compiles everything else as it would. On a GPU a region is
rewritten only where its fused call measures no slower than the GEMM plus the pass it replaces
(epifuse.graph_payoff, timed while the graph compiles). `import epifuse` registers the
name "epifuse" without importing torch._dynamo (1-2 s): with torch's backend registry when
that is loaded already, else when it loads (`_register_by_name`, an import hook for that one
module); the installed package's `torch_dynamo_backends` entry point names it too.

`explain` compiles `fn` with the backend, runs it once on the example inputs (forward, and
backward where an output requires grad), and returns what the pass fused (each region's
epilogue source) and which GEMMs it left to Inductor, with why. `recorded()` gathers the same
for whatever the backend compiles while it is open, from any thread (a backward compiles in
autograd's own thread), for a caller that compiles and runs a model itself.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
from dataclasses import dataclass, field

from . import graph_fusion, graph_payoff, graph_reductions
from .graph_fusion import Fused, Report, fuse_gemms
from .graph_reductions import eliminate_reductions

_RECORDINGS: list[list] = []   # the open recorded() blocks' report lists
# On a GPU, fuse a region only where the fused call measures no slower than the GEMM plus the
# pass it replaces (epifuse.graph_payoff); False fuses every region the pass can (tests of the
# fused kernels themselves)
MEASURE_PAYOFF = True
_LOCK = threading.Lock()


def _fusion_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class EpifuseFusion(CustomGraphPass):
        def __call__(self, graph) -> None:
            report = Report(eliminated=eliminate_reductions(graph))
            on_gpu = _on_gpu(graph)
            judge = graph_payoff.slower if on_gpu and MEASURE_PAYOFF else None
            fuse_gemms(graph, report, min_elements=graph_fusion.MIN_FUSED_ELEMENTS if on_gpu else 0, judge=judge)
            with _LOCK:
                for reports in _RECORDINGS:
                    reports.append(report)

        def uuid(self):
            return get_hash_for_files((graph_fusion.__file__, graph_reductions.__file__, graph_payoff.__file__,
                                       __file__)) + \
                f"|min {graph_fusion.MIN_FUSED_ELEMENTS}|measure {MEASURE_PAYOFF}".encode()

    return EpifuseFusion()


def _on_gpu(graph) -> bool:
    """Whether the graph runs on a GPU: then GEMMs below graph_fusion.MIN_FUSED_ELEMENTS are
    left alone (the host time it weighs is a GPU launch's) and regions are timed before they
    are fused (graph_payoff); on the CPU the kernels run through Triton's interpreter, for
    tests, and every region the pass can fuse is fused."""
    for node in graph.nodes:
        value = node.meta.get("val")
        if getattr(getattr(value, "device", None), "type", None) == "cuda":
            return True
    return False


def backend(gm, example_inputs, **options):
    """The torch.compile backend: LM heads rewritten on dynamo's graph (graph_heads), then
    Inductor with epifuse's passes after its post-grad passes."""
    from torch._inductor.compile_fx import compile_fx

    from .graph_heads import fuse_heads
    heads, left = fuse_heads(gm)
    if heads or left:
        with _LOCK:
            for reports in _RECORDINGS:
                reports.append(Report(fused=[Fused(source, "linear") for source in heads], skipped=left))
    patches = {"post_grad_custom_post_pass": _fusion_pass()}
    if _RECORDINGS:   # recorded(): run the pass, not a cached result
        patches.update(fx_graph_cache=False, fx_graph_remote_cache=False)
    return compile_fx(gm, example_inputs, config_patches=patches)


@dataclass
class Explanation:
    """What the epifuse backend did with one function: `fused`, the epilogue source of each
    fused region (one per GEMM), `left`, (GEMM node, reason) for each GEMM left to Inductor,
    `eliminated`, (reduction node, rule) for each reduction replaced by the value it was
    known to have (epifuse.graph_reductions), and `notes`, (GEMM nodes, what a change to the
    model would let fuse: two gate and up weights kept as one)."""

    fused: list = field(default_factory=list)
    left: list = field(default_factory=list)
    eliminated: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"epifuse fused {len(self.fused)} GEMM(s), left {len(self.left)} to Inductor"
                 + (f", eliminated {len(self.eliminated)} reduction(s)." if self.eliminated else ".")]
        for k, source in enumerate(self.fused):
            lines.append(f"-- fused region {k}:")
            lines.append(source.rstrip())
        for name, why in self.left:
            lines.append(f"-- left {name}: {why}")
        for name, rule in self.eliminated:
            lines.append(f"-- eliminated {name}: {rule}")
        for names, note in self.notes:
            lines.append(f"-- note on {names}: {note}")
        return "\n".join(lines)


def explain(fn, *example_inputs, **example_kwargs) -> Explanation:
    """Compile `fn` (a module or function) with the epifuse backend, run it once on the example
    inputs (and backward through a sum of its floating outputs that require grad), and return
    the Explanation, which is also printed."""
    import torch
    torch._dynamo.reset()   # compile afresh, so the pass runs and is recorded
    compiled = torch.compile(fn, backend=backend)
    with recorded() as result:
        out = compiled(*example_inputs, **example_kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        loss = [o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if loss:
            torch.autograd.backward(loss)
    print(result)
    return result


@contextlib.contextmanager
def recorded():
    """Yields an Explanation that, once the block ends, holds what the epifuse backend fused
    and left in every graph it compiled meanwhile, from any thread. Within the block the pass
    runs even where Inductor's or AOTAutograd's cache holds a compiled graph (so it is
    recorded); a graph dynamo compiled before the block is not compiled again."""
    from torch._functorch import config as functorch_config
    result, reports = Explanation(), []
    with _LOCK:
        _RECORDINGS.append(reports)
    try:
        with functorch_config.patch(enable_autograd_cache=False):
            yield result
    finally:
        with _LOCK:
            _RECORDINGS[:] = [r for r in _RECORDINGS if r is not reports]   # by identity: all start empty
        for report in reports:
            result.fused.extend(f.source for f in report.fused)
            result.left.extend(report.skipped)
            result.eliminated.extend(report.eliminated)
            result.notes.extend(report.notes)


_REGISTRY = "torch._dynamo.backends.registry"


def _register(registry) -> None:
    if "epifuse" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=backend, name="epifuse")


class _RegisterWhenLoaded:
    """A meta-path finder for torch's backend registry alone: it finds the module as the path
    finder does, and registers the backend right after the module runs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(module)
        spec.loader.exec_module = exec_module   # this spec's own loader object
        return spec


def _register_by_name() -> None:
    """`torch.compile(model, backend="epifuse")` after `import epifuse`, installed or not."""
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _register(registry)
    elif not any(isinstance(f, _RegisterWhenLoaded) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLoaded())


_register_by_name()

__all__ = ["backend", "explain", "Explanation"]
