import os
import shutil
import tempfile

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)

_OWN_HOME: list[str] = []


def pytest_configure(config):
    # One private kvtier home for the whole run: the models are written once and
    # shared with CLI subprocesses; the user's cache is never touched.
    if "KVTIER_HOME" not in os.environ:
        os.environ["KVTIER_HOME"] = tempfile.mkdtemp(prefix="kvtier-test-")
        _OWN_HOME.append(os.environ["KVTIER_HOME"])


def pytest_unconfigure(config):
    # The imported SmolLM2 alone is over 500 MB: leave nothing behind.
    for home in _OWN_HOME:
        shutil.rmtree(home, ignore_errors=True)
