"""A prompt too long for the context is refused from its size, before the tokenizer
spends time and memory on it (the server in process, on the small generated model)."""

from __future__ import annotations

import json
import resource
import sys

import pytest
from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.serve.app import KVTierServer, ServerConfig

HUGE = "cache page tier " * ((8 << 20) - 1024 >> 4)  # 8 MiB but 1 KiB (the body limit): 8 Mi tokens


def _peak_rss() -> int:
    """The process's peak resident set, in bytes (getrusage counts KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@pytest.fixture(scope="module")
def client(loaded):
    server = KVTierServer(Engine(loaded, EngineConfig(page_size=16)), ServerConfig("kvtier-default"))
    server.start()
    with TestClient(server.app, raise_server_exceptions=False) as test_client:
        yield test_client
    server.close()


@pytest.mark.parametrize(
    "path, body, param, text",
    [
        ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}, "prompt", len(HUGE)),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1},
            "messages",
            len(HUGE),
        ),
        ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": HUGE}]}, "messages", len(HUGE)),
        (
            "/v1/messages/count_tokens",
            {"messages": [{"role": "user", "content": "q"}], "system": HUGE},
            "messages",
            len(HUGE) + 1,
        ),
    ],
)
def test_a_prompt_past_the_context_is_refused_from_its_size(client, path, body, param, text):
    content = json.dumps(body).encode()
    before = _peak_rss()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    grown = _peak_rss() - before
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"the prompt is {text} bytes of text, at least")
    # Tokenizing it would take gigabytes (the issue measured 0.65-1.6 GB); the body and
    # its parsed text are a few copies of 8 MiB. A loose bound, on the peak.
    assert grown < 200 << 20, grown


def test_a_prompt_under_the_bound_is_still_counted_exactly(client):
    """The size check only refuses what cannot fit: a prompt of 40,000 one-byte tokens,
    over the context of 32,768 but under the size bound, gets the exact count."""
    response = client.post("/v1/completions", json={"prompt": "a" * 40_000, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the prompt is 40000 tokens")
