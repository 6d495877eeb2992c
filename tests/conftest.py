"""Test set-up: CPU runs go through Triton's interpreter; `-m gpu` runs on CUDA.

TRITON_INTERPRET is set before any generated kernel is imported, and every test session
uses its own kernel cache directory. The folders mirror the package (unit/), run kernels
through the interpreter (kernels/), need a GPU (gpu/), or fuzz (fuzz/); the helpers they share
live here, on the import path of every test.
"""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the GPU tests run checks written for the interpreter in tests/kernels (`from test_reductions
# import ...`), also when tests/gpu runs alone, before pytest has put tests/kernels on the path
sys.path.insert(1, str(Path(__file__).resolve().parent / "kernels"))

os.environ.setdefault("EPIFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="epifuse-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    if HAS_CUDA:
        from gpu_order import longest_first
        items[:] = longest_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A GPU run's tests (longest first) go one at a time to the next free worker
    (tests/gpu_order.py says why); any other run is xdist's own."""
    if not HAS_CUDA or config.getoption("dist", "no") != "load":
        return None
    from gpu_order import scheduler_class
    return scheduler_class()(config, log)


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs every run; a failure's report prints its seed, and
    EPIFUSE_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("EPIFUSE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("seed", f"replay with EPIFUSE_TEST_SEED={seed}"))


@pytest.fixture(autouse=True)
def _epilogue_keys_read_back():
    """Every epilogue a test registers for the torch ops reads back from its key as the same
    program (what a process that loads a torch.compile cache does), checks of names included."""
    import sys
    before = len(sys.modules["epifuse.epilogue_table"]._TABLE) if "epifuse.epilogue_table" in sys.modules else 0
    yield
    table = sys.modules.get("epifuse.epilogue_table")
    if table is not None:
        for entry in table._TABLE[before:]:
            assert table.read_key(entry.key) == (entry.user, entry.saves_accum), entry.key[:80]
