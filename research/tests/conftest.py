"""Test set-up of the research probes' tests, as tests/conftest.py sets up the library's: the
source tree (src/ and the repository root, for `epifuse`, `bench` and `research`) on sys.path,
Triton's interpreter where there is no GPU, and a kernel cache directory of this session's own
(the SASS probe's offline compiles generate kernel modules)."""
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
for path in (ROOT / "src", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

os.environ.setdefault("EPIFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="epifuse-test-cache-"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
