"""Use the system OpenBLAS for mlx on Linux when it is installed.

``mlx[cpu]`` wheels on Linux link a reference BLAS; OpenBLAS makes prefill about
10x faster with the same results. Loading it with ``RTLD_GLOBAL`` before
``mlx.core`` is imported puts its ``cblas_*`` symbols first in the global lookup
scope, so mlx binds to them. It is never required: without the library, or with
``KVTIER_NO_OPENBLAS=1``, mlx keeps its own BLAS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


def preload_openblas() -> bool:
    """Load OpenBLAS globally if possible; must run before ``import mlx.core``."""
    if sys.platform != "linux" or os.environ.get("KVTIER_NO_OPENBLAS") == "1":
        return False
    if "mlx.core" in sys.modules:
        return False
    for name in ("libopenblas.so.0", ctypes.util.find_library("openblas")):
        if not name:
            continue
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


def blas_in_use() -> str:
    """Which BLAS this process's mlx uses, for verbose output and benchmarks. threadpoolctl
    lists the BLAS libraries loaded; the one mlx binds to on Linux is the system
    ``libopenblas`` preloaded above (numpy's and scipy's own OpenBLAS copies export
    prefixed symbols that mlx never binds to, so they do not count)."""
    if sys.platform == "darwin":
        return "Accelerate"
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib["internal_api"] == "openblas" and lib["prefix"] == "libopenblas":
            return f"OpenBLAS {lib['version']} ({lib['filepath']}, {lib['num_threads']} threads)"
    return "mlx bundled reference BLAS (install libopenblas0-pthread for ~10x faster prefill)"
