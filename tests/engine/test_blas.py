"""Which BLAS mlx uses, as benchmarks and `-v` report it."""

import ctypes.util
import os
import pty
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts processes or loads the real model

ASK = "import numpy, kvtier, mlx.core; from kvtier.engine.blas import blas_in_use; print(blas_in_use())"


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is preloaded on Linux only")
def test_numpys_own_openblas_is_not_taken_for_mlxs():
    """numpy is loaded with its bundled OpenBLAS, but mlx keeps its reference BLAS."""
    env = {**os.environ, "KVTIER_NO_OPENBLAS": "1"}
    done = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.startswith("mlx bundled reference BLAS"), done.stdout


def system_openblas() -> bool:
    """Whether a system OpenBLAS is installed (as ``preload_openblas`` finds it)."""
    if sys.platform != "linux":
        return False
    try:
        ctypes.CDLL("libopenblas.so.0")
        return True
    except OSError:
        return ctypes.util.find_library("openblas") is not None


@pytest.mark.skipif(not system_openblas(), reason="the system OpenBLAS is not installed (or not on Linux)")
def test_the_preloaded_system_openblas_is_reported():
    """In a process of its own: it holds whatever the suite runs under (KVTIER_NO_OPENBLAS=1 too)."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_NO_OPENBLAS"}
    done = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.startswith("OpenBLAS "), done.stdout


# mx.matmul of two float32 matrices calls cblas_sgemm: the BLAS whose sgemm gives the
# same bits is the one mlx bound to (another BLAS sums in another order).
SAME_BITS = """
import ctypes, sys
import numpy as np
import kvtier  # KVTIER_NO_OPENBLAS=1: preloads nothing; the library named below is loaded instead
import mlx.core as mx
lib = ctypes.CDLL(sys.argv[1])
rng = np.random.default_rng(0)
a, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((64, 512), (512, 64)))
theirs = np.empty((64, 64), np.float32)
P, one, zero = ctypes.c_void_p, ctypes.c_float(1.0), ctypes.c_float(0.0)
lib.cblas_sgemm(101, 111, 111, 64, 64, 512, one, P(a.ctypes.data), 512, P(b.ctypes.data), 64, zero,
                P(theirs.ctypes.data), 64)  # row-major, no transposes
print(np.array_equal(np.array(mx.matmul(mx.array(a), mx.array(b))), theirs))
"""
PRELOADED = "import ctypes, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); " + SAME_BITS


def same_bits(preload: bool) -> str:
    from kvtier.engine.blas import wheel_library

    env = {**os.environ, "KVTIER_NO_OPENBLAS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PRELOADED if preload else SAME_BITS, str(wheel_library())],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS wheel is a Linux dependency")
def test_the_openblas_wheel_is_installed_and_tried_after_the_system_library():
    from kvtier.engine.blas import SYSTEM_LIBRARY, candidates, wheel_library

    wheel = wheel_library()
    assert wheel is not None and wheel.is_file() and wheel.name == "libopenblas.so.0"
    assert list(candidates()) == [SYSTEM_LIBRARY, str(wheel)]


def gfortran() -> bool:
    """Whether the GNU Fortran runtime the wheel's library needs is installed."""
    try:
        ctypes.CDLL("libgfortran.so.5")
        return True
    except OSError:
        return False


def wheel_runs_here() -> bool:
    from kvtier.engine.blas import runs_here, wheel_library

    return (wheel := wheel_library()) is not None and runs_here(str(wheel)) is None


@pytest.mark.skipif(
    sys.platform != "linux" or not gfortran() or not wheel_runs_here(),
    reason="the OpenBLAS wheel is a Linux dependency; its library needs libgfortran.so.5 and, "
    "built for AVX-512 CPUs only, a CPU with AVX-512",
)
def test_mlx_binds_to_the_wheels_openblas_when_it_is_loaded_first():
    """Loaded globally before mlx, the wheel's cblas_sgemm is the one mlx calls; without
    that, mlx's own BLAS gives other bits (the check can fail)."""
    assert same_bits(preload=True) == "True"
    assert same_bits(preload=False) == "False"


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is preloaded on Linux only")
def test_without_openblas_one_line_on_stderr_says_how_to_get_it(tmp_path):
    """No -v: the CLI's one line, on a terminal (a script's stderr gets it only with -v, so
    tests and pipelines that read stderr see what they did before). mlx imported before
    kvtier is one way to end up without OpenBLAS on any machine."""
    script = (
        "import sys, mlx.core; from kvtier.engine.cli import main; "
        "sys.exit(main(['run', '--no-offload', '--model', 'kvtier-tiny', '--max-tokens', '1', '--prompt', 'hi']))"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_NO_OPENBLAS"}
    for terminal in (True, False):
        main_end, child_end = pty.openpty() if terminal else os.pipe()
        done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=child_end, env=env)
        os.close(child_end)
        stderr = _read_all(main_end)
        assert done.returncode == 0, stderr
        lines = [line for line in stderr.splitlines() if "BLAS" in line]
        if not terminal:
            assert lines == [], stderr
            continue
        assert len(lines) == 1, stderr
        assert lines[0].startswith("kvtier: mlx uses its reference BLAS") and "mlx.core was imported before" in lines[0]


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # a pty whose other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is preloaded on Linux only")
def test_no_line_when_mlx_keeps_its_own_blas_on_request():
    env = {**os.environ, "KVTIER_NO_OPENBLAS": "1"}
    ask = "from kvtier.engine.blas import openblas_hint; import mlx.core; print(openblas_hint())"
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "None"


WHEEL_ONLY = """
import os
from kvtier.engine import blas  # KVTIER_NO_OPENBLAS=1: the import preloads nothing
os.environ["KVTIER_NO_OPENBLAS"] = "0"
blas.candidates = lambda: iter([str(blas.wheel_library())])  # as on a system without its own OpenBLAS
blas.preload_openblas()
import mlx.core as mx
mx.eval(mx.matmul(mx.ones((64, 64)), mx.ones((64, 64))))
"""


@pytest.mark.skipif(
    sys.platform != "linux" or not gfortran(), reason="the OpenBLAS wheel's library loads on Linux only"
)
def test_the_wheels_openblas_never_kills_the_first_matmul():
    """The wheel's library is built for one CPU family (AVX-512): on a CPU without it, it
    loads, then dies of SIGILL at mlx's first matmul unless it is passed over."""
    env = {**os.environ, "KVTIER_NO_OPENBLAS": "1"}
    done = subprocess.run([sys.executable, "-c", WHEEL_ONLY], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
