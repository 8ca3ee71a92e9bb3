"""``kvtier calibrate --quick`` (issue 21: under a minute; ``bench restore --quick`` is
tested in tests/engine/test_cli.py)."""

import json
import subprocess

import pytest

from .. import cli
from ..engine.conftest import on_tiny_model

pytestmark = pytest.mark.slow  # starts processes or loads the real model


def kvtier(*args: str) -> subprocess.CompletedProcess:
    done = cli.run(on_tiny_model(args))
    assert done.returncode == 0, done.stderr
    return done


def test_calibrate_quick_stores_a_profile_the_next_run_uses(tmp_path):
    done = kvtier("calibrate", "--quick", "--store", str(tmp_path))
    assert "calibrating (quick)" in done.stderr and "profile saved" in done.stdout
    assert all(link in done.stdout for link in ("L2->L1", "L3->L1", "L3->L2", "prefill"))
    out = kvtier("run", "--json", "--store", str(tmp_path), "--prompt", "hello " * 50, "--max-tokens", "2").stdout
    assert json.loads(out.splitlines()[-1])["counters"]["costmodel"]["calibrated"] is True
