"""Through ``kvtier serve`` (issue 25, item 1): a record swapped in from another prefix
is not served after a restart (the answer is the recomputed one, its tokens labelled
``recomputed``). ``--encrypt-l3`` is the same engine flag as ``run``'s
(tests/engine/test_encrypt_l3.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import Profile
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.page import page_keys

from ..tiers.test_bound_records import records
from .test_server import PAGE, ServerProcess

pytestmark = pytest.mark.slow  # starts servers

SHARED = "tier page restore " * 10  # 180 characters: the byte tokenizer's tokens
A, B = "a" * PAGE + SHARED, "b" * PAGE + SHARED


def seeded(store: Path, loaded) -> Path:
    """A store whose profile makes restoring win (prefill about 2 ms a token), so that
    the plan restores every stored page and the test sees every L3 read."""
    profile = Profile.defaults()
    profile.compute = ComputeModel([0.02, 0.002, 3e-6])
    profile.calibrated = True
    with DiskTier(store) as tier:
        tier.tables.put_meta(loaded.profile_key(loaded.geometry(PAGE)), profile.to_dict())
    return store


def complete(server: ServerProcess, prompt: str) -> tuple[str, dict]:
    body = {"model": "kvtier-tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    reply = server.http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["sources"]


def served(store: Path, *flags: str, prompts: tuple[str, ...] = (A,)) -> list[tuple[str, dict]]:
    server = ServerProcess(store, *flags)
    try:
        return [complete(server, p) for p in prompts]
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_a_swapped_record_is_recomputed_after_a_restart(tmp_path, loaded):
    store = seeded(tmp_path / "store", loaded)
    (first, _), _ = served(store, prompts=(A, B))
    namespace = loaded.namespace(loaded.geometry(PAGE))
    keys_a, keys_b = (page_keys(namespace, loaded.tokenizer.encode(p)) for p in (A, B))
    with records(store) as stored:
        stored[keys_a[1]] = stored[keys_b[1]]  # the same tokens, another prefix
    server = ServerProcess(store)
    text, sources = complete(server, A)
    failures = httpx.get(server.url + "/v1/kvtier/stats").json()["tiers"]["L3"]["checksum_failures"]
    assert server.stop() == 0
    assert text == first and failures == 1
    assert sources["L3"] == PAGE and sources["recomputed"] == len(loaded.tokenizer.encode(A)) - PAGE
