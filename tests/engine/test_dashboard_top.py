"""``kvtier top`` as a process against a real server (in a thread of the test, on a free
127.0.0.1 port): it shows the server's figures, and Ctrl-C ends it cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from .dashboard_server import served  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # starts a server and processes

ENV = {**os.environ, "COLUMNS": "200", "LINES": "80"}


def _top(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.engine.cli", "top", *args]


def test_top_once_shows_the_servers_figures(served):
    stats = served.http.get("/v1/kvtier/stats").json()
    out = subprocess.run(_top("--once", served.url), capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split("│")[1].strip(): line for line in out.stdout.splitlines() if line.count("│") > 3}
    for name, tier in stats["tiers"].items():
        cells = [c.strip() for c in rows[name].split("│")]
        assert cells[4:7] == [str(tier["pages"]), str(tier["hit_pages"]), str(tier["evictions"])], name
    engine = stats["engine"]
    assert re.search(rf"served, prompt tokens\s+{engine['requests']}, {engine['prompt_tokens']}\b", out.stdout)


def test_ctrl_c_ends_top_cleanly(served):
    proc = subprocess.Popen(
        _top(served.url, "--interval", "0.2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    try:
        for line in proc.stdout:  # the first frame is drawn: the view is live
            if "L3 namespaces" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == ""  # no traceback, no error line
    finally:
        proc.kill()
