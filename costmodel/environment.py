"""What a cost profile's figures depend on besides the model: the machine, mlx's version
and the BLAS mlx calls. OpenBLAS makes mlx[cpu]'s prefill several times faster than its
reference BLAS, and an mlx release can change its kernels, so a profile measured under
other ones predicts the wrong times: profiles are stored under ``environment_id()``
(``plan.profile_key``) and one measured elsewhere is never used.
"""

from __future__ import annotations

import platform
import sys
from functools import cache


def openblas() -> dict | None:
    """threadpoolctl's record of the OpenBLAS that mlx binds to, if one is loaded: an
    unprefixed ``libopenblas`` (the system's or the cmeel-openblas wheel's, preloaded
    by ``kvtier.engine.blas``). numpy's and scipy's own copies export prefixed symbols
    (``scipy_cblas_*``) that mlx never binds to, so they do not count."""
    from threadpoolctl import threadpool_info

    return next(
        (lib for lib in threadpool_info() if lib["internal_api"] == "openblas" and lib["prefix"] == "libopenblas"), None
    )


def blas_id() -> str:
    """A short name of the BLAS mlx uses: ``accelerate``, ``openblas-0.3.21`` or ``reference``."""
    if sys.platform == "darwin":
        return "accelerate"
    lib = openblas()
    return f"openblas-{lib['version']}" if lib else "reference"


@cache
def environment_id() -> str:
    """``node/arch/mlx-VERSION/BLAS``; fixed for a process (the BLAS is bound when mlx loads)."""
    import mlx.core as mx

    version = mx.__version__  # type: ignore[attr-defined]  # set at runtime, absent from mlx's stubs
    return f"{platform.node()}/{platform.machine()}/mlx-{version}/{blas_id()}"
