import os
import shutil
import tempfile

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)

_HOME = tempfile.mkdtemp(prefix="kvtier-test-")


def pytest_configure(config):
    # One private kvtier home for the whole run, even when the user exported one: the
    # default model is written once and shared with CLI subprocesses; the user's cache
    # is never touched, and the home is removed at the end.
    os.environ["KVTIER_HOME"] = _HOME
    os.environ["KVTIER_NO_AUTO_CALIBRATE"] = "1"  # tests that want it unset it


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)
