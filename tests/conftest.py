import os
import tempfile

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)


def pytest_configure(config):
    # One private kvtier home for the whole run: the default model is written once
    # and shared with CLI subprocesses; the user's cache is never touched.
    os.environ.setdefault("KVTIER_HOME", tempfile.mkdtemp(prefix="kvtier-test-"))
