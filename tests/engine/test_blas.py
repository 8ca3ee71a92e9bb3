"""Which BLAS mlx uses, as benchmarks and `-v` report it."""

import ctypes.util
import os
import subprocess
import sys

import pytest

from kvtier.engine.blas import blas_in_use

ASK = "import numpy, kvtier, mlx.core; from kvtier.engine.blas import blas_in_use; print(blas_in_use())"


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is preloaded on Linux only")
def test_numpys_own_openblas_is_not_taken_for_mlxs():
    """numpy is loaded with its bundled OpenBLAS, but mlx keeps its reference BLAS."""
    env = {**os.environ, "KVTIER_NO_OPENBLAS": "1"}
    done = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.startswith("mlx bundled reference BLAS"), done.stdout


def system_openblas() -> bool:
    """Whether kvtier's import preloaded the system OpenBLAS (as ``preload_openblas`` finds it)."""
    if sys.platform != "linux" or os.environ.get("KVTIER_NO_OPENBLAS") == "1":
        return False
    try:
        ctypes.CDLL("libopenblas.so.0")
        return True
    except OSError:
        return ctypes.util.find_library("openblas") is not None


@pytest.mark.skipif(not system_openblas(), reason="the system OpenBLAS is not installed (or not on Linux)")
def test_the_preloaded_system_openblas_is_reported():
    assert blas_in_use().startswith("OpenBLAS ")
