"""A profile is keyed by what changes its figures: machine, mlx version, BLAS (issue 21)."""

import os
import platform
import subprocess
import sys

import mlx.core as mx
import pytest

from kvtier.costmodel.environment import blas_id
from kvtier.costmodel.profile import profile_key

pytestmark = pytest.mark.slow  # starts processes or loads the real model

KEY = "from kvtier.costmodel.profile import profile_key; print(profile_key(bytes(8)))"


def key_in_a_process(**env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", KEY], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return done.stdout.strip()


def test_the_key_names_the_machine_the_mlx_version_and_the_blas():
    key = profile_key(bytes(8))
    for part in (platform.node(), platform.machine(), f"mlx-{mx.__version__}", blas_id()):
        assert f"/{part}/" in key, key


@pytest.mark.skipif(sys.platform != "linux", reason="mlx has one BLAS on macOS")
def test_a_profile_measured_under_another_blas_is_not_found():
    """Under mlx's reference BLAS prefill is several times slower: the profile measured
    there lives under another key, so a run with OpenBLAS finds none and recalibrates."""
    with_openblas = key_in_a_process(KVTIER_NO_OPENBLAS="0")
    if "/openblas-" not in with_openblas:
        pytest.skip("no OpenBLAS loads on this machine (see kvtier.engine.blas.openblas_hint)")
    reference = key_in_a_process(KVTIER_NO_OPENBLAS="1")
    assert "/reference/" in reference
    assert with_openblas != reference
