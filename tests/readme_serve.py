"""The client snippets of the README's Serve section, each checked against a running
``kvtier serve`` (``test_readme.test_serve_snippets`` starts it): what a snippet prints
against what the README's text says it prints."""

from __future__ import annotations

import json
import re

import httpx

from .readme_blocks import README, Shell, after, block


def dashboard(shell: Shell, base: str) -> None:
    """The page the README says to open, and ``kvtier top --once`` on the same server."""
    page = httpx.get(base + "/dashboard", timeout=30)
    assert page.status_code == 200 and "<canvas" in page.text
    printed = shell.run(block(".venv/bin/kvtier top --once").commands()[0]).stdout
    for part in ("tiers", "last requests", "L3 namespaces"):
        assert part in printed, printed


def assert_model_id(base: str, model_id: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]]
    assert model_id in ids, f"/v1/models lists {ids}, the README says {model_id!r}"


def curl_chat(shell: Shell) -> dict:
    reply = json.loads(shell.run(block("curl -s localhost:8000/v1/chat/completions").commands()[0]).stdout)
    assert "error" not in reply, reply
    assert reply["choices"][0]["message"]["content"], reply
    return reply


def openai_client(shell: Shell) -> None:
    printed = shell.python(block("from openai import OpenAI").text)
    claims = re.findall(r"`((?:cached_tokens|sources)=[^`]+)`", after(block("from openai import OpenAI"), 400))
    assert len(claims) == 2, claims
    for claim in claims:
        assert claim in printed, f"{claim!r} not in {printed!r}"


def usage_shape(usage: dict) -> None:
    """The README's usage example: the keys a response has, and how its figures add up."""
    text = block('{"prompt_tokens": 1650').text
    example = json.loads(re.sub(r",\s*\.\.\.", "", text))

    def keys(obj: dict, ours: dict, path: str = "") -> None:
        for key, value in obj.items():
            assert key in ours, f"usage has no {path}{key}: {ours}"
            if isinstance(value, dict):
                keys(value, ours[key], f"{path}{key}.")

    keys(example, usage)
    for u in (example, usage):
        sources = u["prompt_tokens_details"]["sources"]
        assert sum(sources.values()) == u["prompt_tokens"]
        assert u["prompt_tokens_details"]["cached_tokens"] == sources["L1"] + sources["L2"] + sources["L3"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def streamed_usage(base: str, model_id: str) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    usage = json.loads(events[-2]).get("usage") or {}
    assert set(usage.get("prompt_tokens_details", {}).get("sources", {})) == {"L1", "L2", "L3", "recomputed"}, usage


def anthropic_client(shell: Shell) -> None:
    printed = shell.python(block("from anthropic import Anthropic").text).strip()
    claim = re.search(r"from the `anthropic` client,\s+prints `([^`]+)`", README.read_text(encoding="utf-8"))
    assert printed == claim.group(1)


def agents(shell: Shell) -> None:
    printed = shell.python(block("# one question asked twice").text).strip()
    claim = re.search(r"prints `([^`]+)`: the second request left the cache", README.read_text(encoding="utf-8"))
    assert printed == claim.group(1), printed


def metrics(shell: Shell) -> None:
    command = block("curl -s localhost:8000/metrics").text
    names = re.search(r"kvtier_\(([^)]+)\)", command).group(1).split("|")
    printed = shell.run(command).stdout
    for name in names:
        assert re.search(rf"^kvtier_{name}(\{{|\s)", printed, re.M), f"no kvtier_{name} in:\n{printed}"
