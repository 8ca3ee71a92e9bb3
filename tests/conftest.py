import os
import shutil
import tempfile

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)

_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def pytest_configure(config):
    # One private kvtier home for the whole run, even when the user exported one: the
    # default model is written once and shared with CLI subprocesses; the user's cache
    # is never touched, and the home is removed at the end. Under pytest-xdist the
    # controller makes it and its workers inherit it (they start after this hook).
    if not _WORKER:
        os.environ["KVTIER_HOME"] = tempfile.mkdtemp(prefix="kvtier-test-")
    os.environ["KVTIER_NO_AUTO_CALIBRATE"] = "1"  # tests that want it unset it
    # Under pytest-xdist every core runs a worker: one BLAS thread each (and each child
    # it starts), so that workers do not take each other's cores. OpenBLAS reads this
    # when a process loads it, after this hook in the workers.
    if not _WORKER and (getattr(config.option, "numprocesses", None) or 0) > 1:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_unconfigure(config):
    if not _WORKER:
        shutil.rmtree(os.environ["KVTIER_HOME"], ignore_errors=True)
