"""Give mlx an OpenBLAS on Linux: the system's when installed, else the cmeel-openblas wheel's.

``mlx[cpu]`` wheels on Linux link a reference BLAS; OpenBLAS makes prefill several
times faster with the same results. Loading it with ``RTLD_GLOBAL`` before
``mlx.core`` is imported puts its ``cblas_*`` symbols first in the global lookup
scope, so mlx binds to them. The system library (Debian's ``libopenblas0-pthread``,
found by the dynamic loader) comes first: it is built for the distribution. Else the
``cmeel-openblas`` wheel, a Linux dependency of kvtier, ships one with unprefixed
symbols (numpy's and scipy's copies are prefixed, ``scipy_cblas_*``, and mlx cannot
use them); it needs the GNU Fortran runtime ``libgfortran.so.5``, which no wheel ships
under that name, so on a system without it the wheel's library does not load. It is
never required: without one, or with ``KVTIER_NO_OPENBLAS=1``, mlx keeps its own BLAS,
and ``openblas_hint`` says how to get one.

A library built for one CPU family only (the wheel's is built for ``SKYLAKEX``, without
OpenBLAS's runtime dispatch) loads anywhere but dies of SIGILL at its first AVX-512
instruction on a CPU without it (AMD Zen before 4, most desktop Intel), taking the
process with it; such a library is passed over (``runs_here``) before it is loaded
globally.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

SYSTEM_LIBRARY = "libopenblas.so.0"
WHEEL = "cmeel-openblas"
_WHEEL_LIBRARY = "cmeel.prefix/lib/libopenblas.so.0"
_failures: list[str] = []  # why each candidate did not load, for the hint
AVX512_CORES = ("SKYLAKEX", "COOPERLAKE", "SAPPHIRERAPIDS")  # OpenBLAS targets whose kernels use AVX-512


def wheel_library() -> Path | None:
    """The cmeel-openblas wheel's ``libopenblas.so.0``, if that wheel is installed."""
    try:
        # str(): typeshed's locate_file gives a SimplePath, not an os.PathLike (it is a Path)
        path = Path(str(metadata.distribution(WHEEL).locate_file(_WHEEL_LIBRARY)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def candidates() -> Iterator[str]:
    """The OpenBLAS libraries to try, best first: the system's, then the wheel's (looked
    up only when asked for: reading package metadata costs more than loading a library)."""
    yield SYSTEM_LIBRARY
    if wheel := wheel_library():
        yield str(wheel)


def preload_openblas() -> bool:
    """Load the first OpenBLAS of ``candidates`` globally; must run before ``import mlx.core``."""
    if sys.platform != "linux" or os.environ.get("KVTIER_NO_OPENBLAS") == "1":
        return False
    _failures.clear()
    if "mlx.core" in sys.modules:
        _failures.append("mlx.core was imported before kvtier, which loads OpenBLAS first")
        return False
    for name in candidates():
        try:
            if (reason := runs_here(name)) is not None:
                _failures.append(reason)
                continue
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            log.info("loaded %s for mlx", name)
            return True
        except OSError as err:
            _failures.append(str(err))
    log.info("no OpenBLAS for mlx: %s", "; ".join(_failures))
    return False


def runs_here(name: str) -> str | None:
    """Why the OpenBLAS ``name`` cannot run on this CPU (built for an AVX-512 core alone,
    on a CPU whose flags lack ``avx512f``), else None. Loads it locally (its symbols stay
    out of the global scope) to read its build configuration; OSError when it does not
    load."""
    get_config = getattr(ctypes.CDLL(name), "openblas_get_config", None)
    if get_config is None:
        return None
    get_config.restype = ctypes.c_char_p
    config = (get_config() or b"").decode(errors="replace").split()
    if "DYNAMIC_ARCH" in config or not set(config) & set(AVX512_CORES) or "avx512f" in cpu_flags():
        return None
    core = next(c for c in config if c in AVX512_CORES)
    return f"{name} is built for {core} only and this CPU has no AVX-512"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def openblas_hint() -> str | None:
    """One line on how to give mlx an OpenBLAS, or None where there is nothing to say
    (one is in use, not Linux, or ``KVTIER_NO_OPENBLAS=1`` asked for mlx's own)."""
    from kvtier.costmodel.environment import openblas

    if sys.platform != "linux" or os.environ.get("KVTIER_NO_OPENBLAS") == "1" or openblas() is not None:
        return None
    slow = "mlx uses its reference BLAS (prefill several times slower than with OpenBLAS)"
    if wheel_library() is None:
        return f"{slow}: `pip install {WHEEL}` (or `apt-get install libopenblas0-pthread`) gives it one"
    if any("libgfortran" in failure for failure in _failures):
        return (
            f"{slow}: the {WHEEL} wheel's OpenBLAS needs the GNU Fortran runtime libgfortran.so.5 "
            "(`apt-get install libgfortran5`, or `apt-get install libopenblas0-pthread` instead)"
        )
    return f"{slow}: {WHEEL}'s library did not load ({'; '.join(_failures)})"


def blas_in_use() -> str:
    """Which BLAS this process's mlx uses, for verbose output and benchmarks."""
    from kvtier.costmodel.environment import openblas

    if sys.platform == "darwin":
        return "Accelerate"
    lib = openblas()
    if lib is not None:
        return f"OpenBLAS {lib['version']} ({lib['filepath']}, {lib['num_threads']} threads)"
    return "mlx bundled reference BLAS"
