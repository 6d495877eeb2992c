"""Which Triton is installed: its version, and the identity of its compiler library (path,
size, mtime), which changes whenever Triton is installed anew.

Standard library only, and Triton imported on first use (not loaded with epifuse): a compile
process (compile_child.py, run by file path) loads this file too, so that the parent and its
children name one installation alike. The compiled index, tuning's key and the Gluon check
read the version here.
"""
from __future__ import annotations

import functools
import os
import sysconfig


def triton_version() -> str:
    """The installed Triton's version."""
    import triton
    return triton.__version__


@functools.lru_cache(maxsize=None)
def installation() -> str:
    """Triton's version and the path, size and mtime of its compiler library. Edits to Triton's
    Python files alone (an editable install) do not change it."""
    import triton
    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    lib = os.path.join(os.path.dirname(triton.__file__), "_C", f"libtriton.{ext}")
    st = os.stat(lib)
    return f"triton {triton_version()} {lib} {st.st_size} {st.st_mtime_ns}"
