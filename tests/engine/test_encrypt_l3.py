"""``--encrypt-l3`` and ``--secret-file`` as a user meets them (issue 25, item 4): an
encrypted store restores what a plain one does, a run without the secret (or with
another) recomputes and leaves the pages for the right one, and a bad secret file is one
error line."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .. import cli
from ..redis_servers import needs_redis, redis_server  # noqa: F401
from ..tiers.test_encryption import cipher
from .conftest import mlx_lm_greedy, on_tiny_model, stored_once, text_prompt
from .kind_models import restoring_wins
from .test_hybrid_models import lfm2  # noqa: F401
from .test_window_models import gemma  # noqa: F401

PROMPT = " ".join(["the system prompt of an agent with tools and a long history"] * 5)  # ~300 tokens
PAGE = 128


def run(*args) -> tuple[dict, dict]:
    done = cli.run(on_tiny_model(["run", "--json", "--max-tokens", "2", "--page-size", str(PAGE), *args]))
    assert done.returncode == 0, done.stderr
    result, last = (json.loads(line) for line in done.stdout.splitlines())
    return result, last["counters"]


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=[pytest.mark.slow, needs_redis])])
def store(request, tmp_path) -> str:
    return str(tmp_path / "store") if request.param == "lmdb" else request.getfixturevalue("redis_server").url


def test_an_encrypted_store_restores_what_a_plain_one_does(store, tmp_path, loaded):
    secret = ["--secret-file", str(tmp_path / "secret")] if "://" in store else []
    plain_store = tmp_path / "plain"
    plain = [run("--store", plain_store, "--prompt", PROMPT)[0] for _ in range(2)]
    sealed = [run("--store", store, "--encrypt-l3", *secret, "--prompt", PROMPT)[0] for _ in range(2)]
    assert [r["output_token_ids"] for r in sealed] == [r["output_token_ids"] for r in plain]
    assert [r["sources"] for r in sealed] == [r["sources"] for r in plain]
    assert sealed[1]["sources"]["L3"] > 0  # the second run restored from L3
    kept = tmp_path / "secret" if secret else Path(store) / "secret"
    assert len(kept.read_bytes()) == 32 and stat.S_IMODE(kept.stat().st_mode) == 0o600
    if not secret:  # the prompt's token ids are in the plain store's file, not in the encrypted one's
        page = np.asarray(loaded.tokenizer.encode(PROMPT)[:PAGE], "<u4").tobytes()
        assert page in (plain_store / "data.mdb").read_bytes()
        assert page not in (Path(store) / "data.mdb").read_bytes()


def test_a_run_without_the_secret_recomputes_and_leaves_the_pages(tmp_path):
    store = tmp_path / "store"
    first, _ = run("--store", store, "--encrypt-l3", "--prompt", PROMPT)
    for other in ([], ["--encrypt-l3", "--secret-file", str(tmp_path / "another")]):
        result, counters = run("--store", store, *other, "--prompt", PROMPT)
        assert result["output_token_ids"] == first["output_token_ids"]
        assert result["sources"]["L3"] == 0 and counters["tiers"]["L3"]["checksum_failures"] == 0
    again, _ = run("--store", store, "--encrypt-l3", "--prompt", PROMPT)
    assert again["sources"]["L3"] > 0 and again["output_token_ids"] == first["output_token_ids"]


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("not a directory")
    return tmp_path / "file" / "secret"


def _short(tmp_path: Path) -> Path:
    (tmp_path / "secret").write_bytes(b"short")
    return tmp_path / "secret"


def _directory(tmp_path: Path) -> Path:
    (tmp_path / "secret").mkdir()
    return tmp_path / "secret"


@pytest.mark.parametrize(
    "make,message",
    [
        (_under_a_file, "Not a directory"),
        (_short, "holds 5 bytes, not 32"),
        (_directory, "cannot read the server secret"),
    ],
)
def test_a_bad_secret_file_is_one_error_line(tmp_path, make, message):
    args = ["run", "--store", tmp_path / "store", "--encrypt-l3", "--secret-file", make(tmp_path), "--prompt", "hi"]
    done = cli.run(on_tiny_model(args))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("kvtier: error: ") and message in line, line


@pytest.mark.parametrize("kind", ["gemma", "lfm2"])
def test_window_and_hybrid_models_restore_encrypted_pages(request, tmp_path, kind):
    """A window model's pages are decrypted whole (no segment read), a hybrid model's
    snapshots too: the output is mlx-lm's, every reusable page from L3."""
    loaded = request.getfixturevalue(kind)
    page = 16
    prompt = text_prompt(loaded, 150, seed=3)  # 9 full pages before the last token

    def engine() -> Engine:
        store = StoreConfig(l1_bytes=1 << 26, l2_bytes=1 << 26, store_dir=tmp_path, cipher=cipher())
        return restoring_wins(Engine(loaded, EngineConfig(page_size=page, store=store, snapshot_spacing=2)))

    stored_once(engine(), prompt)
    restarted = engine()
    (restored,) = restarted.generate([prompt], SamplingParams(max_tokens=8))
    failures = restarted.stats().store.tiers["L3"].checksum_failures
    restarted.close()
    assert restored.output == mlx_lm_greedy(loaded, prompt, 8) and failures == 0
    assert restored.sources()["L3"] == 9 * page
