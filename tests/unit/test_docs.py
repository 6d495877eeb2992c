"""The docs cannot drift: docs/ops.md is the generator's output, every Python block of the
hand-written pages is an excerpt of a script in examples/, and every script runs (on a CPU, at
a small size, through Triton's interpreter so the generated kernels themselves run)."""
import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import epifuse
from epifuse.tools import docs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PAGES = [ROOT / "docs" / "tutorial.md", ROOT / "docs" / "kernels.md"]


def test_ops_reference_is_generated_from_the_registry():
    committed = (ROOT / "docs" / "ops.md").read_text()
    assert committed == docs.render_ops_reference(), \
        "docs/ops.md is out of date: run `PYTHONPATH=src python -m epifuse.tools.docs -o docs/ops.md`"


def test_ops_reference_lists_every_op_and_named_epilogue():
    from epifuse import epilogues
    from epifuse.ops import OPS
    text = docs.render_ops_reference()
    for name in OPS:
        assert f"| `{name}` |" in text, name
    for name in epilogues.NAMED:
        assert f"### `{name}`" in text, name


def test_docs_check_command(tmp_path, capsys):
    assert docs.main(["--check", str(ROOT / "docs" / "ops.md")]) == 0
    stale = tmp_path / "ops.md"
    stale.write_text("# old\n")
    assert docs.main(["--check", str(stale)]) == 1
    assert "is out of date; run: python -m epifuse.tools.docs -o" in capsys.readouterr().err
    assert docs.main(["-o", str(stale)]) == 0 and stale.read_text() == docs.render_ops_reference()


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_are_excerpts_of_examples(page):
    sources = {p.name: p.read_text() for p in EXAMPLES}
    blocks = _python_blocks(page)
    assert blocks
    for block in blocks:
        block = textwrap.dedent(block).strip("\n")
        assert any(block in text for text in sources.values()), f"not in any example:\n{block}"


def test_every_example_is_in_the_tutorial():
    tutorial = (ROOT / "docs" / "tutorial.md").read_text()
    for path in EXAMPLES:
        assert f"examples/{path.name}" in tutorial, path.name
    for linked in re.findall(r"examples/([\w.]+\.py)", tutorial):
        assert (ROOT / "examples" / linked).exists(), linked


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    import torch
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), EPIFUSE_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_INTERPRET="1", EPIFUSE_TUNE="0")
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET")   # on the GPU machine, the compiled kernels
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    # each says which kernel ran, here a generated one (the interpreter's, or the GPU's)
    ran = re.findall(r"^.*: (fused (?:Triton|Gluon) kernel|reference kernel) .*$", result.stdout, flags=re.M)
    assert ran and set(ran) <= {"fused Triton kernel", "fused Gluon kernel"}, result.stdout[-2000:]


KERNEL_LINES = {
    True: r"fused Triton kernel triton_\w+ \d+x\d+x\d+ .*\(Triton's interpreter\)",
    False: re.escape("reference kernel (torch matmul, then the epilogue in torch ops; not fused), since "
                     "CPU tensors run Triton kernels only under its interpreter: set TRITON_INTERPRET=1 "
                     "(slow; for testing)"),
}


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["TRITON_INTERPRET=1", "no-TRITON_INTERPRET"])
def test_example_says_which_kernel_ran(tmp_path, interpret):
    """On a CPU, 01_custom_epilogue.py runs the fused kernel through Triton's interpreter with
    TRITON_INTERPRET=1 and the unfused reference kernel without it, and says which (with how to
    get the fused one), rather than only "matches torch" either way."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), EPIFUSE_CACHE_DIR=str(tmp_path / "cache"),
               EPIFUSE_TUNE="0", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "01_custom_epilogue.py")], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if "matches torch" in line]
    assert [line.split(":")[0] for line in lines] == ["kernels[0] matches torch", "epifuse.gemm matches torch"]
    for line in lines:
        assert re.fullmatch(r"[^:]+ matches torch: " + KERNEL_LINES[interpret], line), line


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(epifuse.__path__, "epifuse."):
        if info.name.endswith("__main__"):
            continue
        if any(test.examples for test in doctest.DocTestFinder().find(importlib.import_module(info.name))):
            names.append(info.name)
    return names


@pytest.mark.parametrize("module", _modules_with_examples())
def test_docstring_examples_run(module):
    """The `>>>` examples in the package's docstrings are run and their output compared."""
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed, result
