"""Start-up: `import epifuse` registers the custom ops (so saved graphs naming them load) but
loads neither torch.compile's machinery, Triton, nor the API until named, `epifuse --help` does not load
the commands (docs/design/README.md, "The layers"), and every public name and submodule
resolves on first use. Each check runs in a fresh interpreter, since this one has loaded
everything already. How long start-up takes is measured, not tested here."""
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import epifuse
from epifuse import torch_ops
from helpers import fast

HEAVY = ("torch._dynamo", "torch._inductor")
ROOT = Path(__file__).resolve().parents[2]


def _loaded_after(code: str, names=HEAVY) -> list:
    """Which of `names` a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([n for n in {list(names)!r} if n in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_import_epifuse_loads_nothing_heavy():
    """Nor Triton (0.15 s) and jinja2: they load when a first kernel is chosen and rendered."""
    assert _loaded_after("import epifuse", (*HEAVY, "epifuse.api", "epifuse.nn", "epifuse.commands",
                                            "triton", "jinja2")) == []


def test_import_epifuse_registers_the_custom_ops():
    """A saved graph or exported program naming torch.ops.epifuse.gemm loads after a bare
    `import epifuse`, as torch's own ops do after `import torch`."""
    code = ("import torch, epifuse\n"
            "assert torch.ops.epifuse.gemm.default and torch.ops.epifuse.gemm_out.default")
    assert _loaded_after(code) == []


def test_a_first_call_with_autograd_loads_no_compiler():
    """torch's custom ops import torch._dynamo on their first call (1-3 s with sympy and
    torch.distributed, most of a first training step whose kernels are cached); epifuse's ops
    run as they are until dynamo is imported. Both ops, forward and backward."""
    code = ("import torch, epifuse\n"
            "A = torch.randn(8, 4, requires_grad=True); B = torch.randn(4, 6, requires_grad=True)\n"
            "epifuse.gemm(A, B, 'gelu').sum().backward()\n"
            "D = torch.empty(8, 6); epifuse.gemm(A.detach(), B.detach(), 'relu', D=D)\n"
            "assert A.grad is not None and B.grad is not None")
    assert _loaded_after(code) == []


def test_once_dynamo_is_imported_the_ops_run_through_its_disable():
    """After `import torch._dynamo` (as torch.compile does), an eager call of the op runs its
    implementation through torch._dynamo.disable, as torch's own wrapper would, and the result
    is the same; a compiled function calling it traces the op, not the implementation."""
    code = textwrap.dedent("""
        import torch, epifuse
        from epifuse import torch_ops
        A, B = torch.randn(8, 4, requires_grad=True), torch.randn(4, 6)   # through the op: autograd
        before = epifuse.gemm(A, B, 'gelu')
        assert 'torch._dynamo' not in __import__('sys').modules
        import torch._dynamo
        seen = []
        original = torch._dynamo.disable
        torch._dynamo.disable = lambda fn, *a, **k: seen.append(fn) or original(fn, *a, **k)
        after = epifuse.gemm(A, B, 'gelu')
        assert seen and torch.equal(before, after), seen
        compiled = torch.compile(lambda a, b: epifuse.gemm(a, b, 'gelu'), backend='eager', fullgraph=True)
        assert torch.equal(compiled(A, B), before)
        compiled(A, B).sum().backward()
        assert A.grad is not None
    """)
    assert "torch._dynamo" in _loaded_after(code)


def test_a_dynamo_still_being_imported_by_another_thread_is_not_called():
    """While another thread imports torch._dynamo, its module is in sys.modules without
    `disable` yet: the ops run their implementation as they are, and through disable once
    the import has finished."""
    code = textwrap.dedent("""
        import sys, types, torch, epifuse
        A, B = torch.randn(8, 4, requires_grad=True), torch.randn(4, 6)
        sys.modules['torch._dynamo'] = types.ModuleType('torch._dynamo')   # as mid-import
        during = epifuse.gemm(A, B, 'gelu')
        during.sum().backward()
        del sys.modules['torch._dynamo']
        import torch._dynamo
        seen = []
        original = torch._dynamo.disable
        torch._dynamo.disable = lambda fn, *a, **k: seen.append(fn) or original(fn, *a, **k)
        after = epifuse.gemm(A, B, 'gelu')
        assert seen and torch.equal(during, after), seen
    """)
    assert "torch._dynamo" in _loaded_after(code)


def test_the_ops_wrappers_are_what_the_first_call_hook_expects():
    """torch_ops._dynamo_disabled_once_imported relies on how torch.library.custom_op wraps an
    implementation (its `_backend_fns`, the wrapped function's `__dynamo_disable`): if a torch
    builds them otherwise, this fails, and the hook (which then changes nothing) needs a look."""
    for op in (torch_ops._gemm, torch_ops._gemm_out):
        wrapped = [getattr(w, "__wrapped__", None) for w in op._backend_fns.values()]
        assert wrapped and all(callable(getattr(fn, "__dynamo_disable", None)) for fn in wrapped)


def test_every_submodule_is_an_attribute_once_named():
    code = ("import epifuse\n"
            "assert epifuse.activations.ACTIVATIONS and epifuse.frontend.parse and epifuse.verify\n"
            "assert epifuse.runtime and epifuse.tools and epifuse.backends\n"
            "assert {'activations', 'frontend', 'nn', 'ops', 'torch_ops'} <= set(dir(epifuse))\n"
            "assert not {'annotations', 'importlib'} & set(dir(epifuse))")
    assert _loaded_after(code) == []


@pytest.mark.parametrize("argv", fast([["--help"], ["show", "--help"], ["verify", "--help"], ["bench", "--help"],
                                       ["show"], ["nonsense"]], keep={0, 5}))
def test_help_and_argument_errors_do_not_load_the_commands(argv):
    """The parser answers --help and a mistyped command line before the commands load."""
    code = ("import contextlib, io\nfrom epifuse import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    try:\n        cli.main({argv!r})\n    except SystemExit:\n        pass")
    assert _loaded_after(code, (*HEAVY, "epifuse.commands", "epifuse.api")) == []


def test_the_public_names_load_on_first_use():
    code = ("import epifuse\nfrom epifuse import api, fused\n"
            "assert epifuse.gemm is api.gemm and epifuse.FusedGemm is fused.FusedGemm\n"
            "assert all(getattr(epifuse, name) is not None for name in epifuse.__all__)\n"
            "assert set(epifuse.__all__) <= set(dir(epifuse))\n"
            "assert epifuse.nn.FusedLinear and epifuse.torch_ops.gemm and epifuse.debug.trace\n"
            "assert epifuse.epilogues.LinearCombinationRelu and epifuse.ops.relu\n"
            "namespace = {}\nexec('from epifuse import *', namespace)\n"
            "assert set(epifuse.__all__) <= set(namespace)")
    # the API and the custom ops load; torch.compile's machinery waits for torch.compile
    assert _loaded_after(code, ("torch._dynamo", "torch._inductor")) == []


def test_a_name_that_is_not_there_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'epifuse' has no attribute 'gemmm'"):
        epifuse.gemmm  # noqa: B018
    assert not hasattr(epifuse, "_not_a_name")


def test_describe_is_marked_as_assume_constant_result_marks():
    """torch_ops marks _describe for torch.compile without importing torch._dynamo: by what
    torch.compiler.assume_constant_result does to a function, which this checks is still all
    it does."""
    def probe():
        return 0
    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and vars(probe), "assume_constant_result no longer marks the function itself"
    assert vars(probe).items() <= vars(torch_ops._describe).items()
    # (the compile tests of test_torch_ops.py fail with fullgraph=True when the mark is lost:
    # dynamo then traces the parser)



def _structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "docs" / "design" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAZY_INIT = """
    from typing import TYPE_CHECKING
    if TYPE_CHECKING:
        from . import nn
        from .api import gemm{extra}
    _SUBMODULES = ("nn",)
    _NAMES = {{"api": ("gemm",)}}
    def __getattr__(name):
        pass
"""


@pytest.mark.parametrize("module, extra, problem", [
    ("__init__", "", None),
    ("__init__", ", get_kernels", "TYPE_CHECKING imports differ: [('api', 'get_kernels')]"),
    ("api", "", "api defines a module __getattr__ (names loaded on first use), which LAZY does not list"),
])
def test_structure_holds_lazy_names_to_their_type_checking_imports(tmp_path, module, extra, problem):
    """The structure check's allowance for names loaded on first use is narrow: only a module in
    LAZY, and only names its TYPE_CHECKING block imports (which the drawing shows)."""
    path = tmp_path / "module.py"
    path.write_text(textwrap.dedent(LAZY_INIT.format(extra=extra)))
    problems = _structure().lazy_problems(module, path)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]
