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
from pathlib import Path


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
    """Which BLAS this process's mlx uses, for verbose output and benchmarks."""
    if sys.platform == "darwin":
        return "Accelerate"
    maps = Path("/proc/self/maps")
    text = maps.read_text() if maps.exists() else ""
    for line in text.splitlines():
        if "libopenblas" in line:
            return f"OpenBLAS ({line.split()[-1]})"
    return "mlx bundled reference BLAS (install libopenblas0-pthread for ~10x faster prefill)"
