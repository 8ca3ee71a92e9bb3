"""``kvtier serve`` as a real process on 127.0.0.1, through the official ``openai`` and
``anthropic`` clients and plain HTTP (the small generated model: text is gibberish,
but tokens, usage and cache sources are exact)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from kvtier.engine.models.defaults import packaged_gguf

from .conftest import on_tiny_model, wait_until

pytestmark = pytest.mark.slow  # starts processes or loads the real model

PAGE = 16  # small pages: short prompts span several


class ServerProcess:
    """``kvtier serve --port 0`` in a child process; knows its URL once it is listening."""

    def __init__(self, store: Path, *flags: str, tiny: bool = True) -> None:
        args = ["serve", "--port", "0", "--store", str(store), "--page-size", str(PAGE), *flags]
        cmd = [sys.executable, "-m", "kvtier.engine.cli", *(on_tiny_model(args) if tiny else args)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        for line in self.proc.stderr:
            self.log.append(line)
            if " on http://" in line:
                self.url = line.split(" on ")[-1].strip()
                break
            assert time.monotonic() < deadline, "server did not start"
        else:
            raise AssertionError("server exited: " + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def stats(self) -> dict:
        return self.http.get("/v1/kvtier/stats").json()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("store"), "--max-running", "2", "--max-waiting", "2")
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


@pytest.fixture(scope="module")
def model(server):
    return server.openai.models.list().data[0].id


def _chat(server, model, messages, max_tokens=24, **kw):
    return server.openai.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def _sum_usage(usage) -> None:
    details = usage.prompt_tokens_details
    sources = details.model_extra["sources"] if hasattr(details, "model_extra") else details["sources"]
    assert sum(sources.values()) == usage.prompt_tokens
    assert details.cached_tokens == sources["L1"] + sources["L2"] + sources["L3"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# -- endpoints -----------------------------------------------------------------


def test_ops_endpoints(server, model):
    assert server.http.get("/health").json()["status"] == "ok"
    assert [m.id for m in server.openai.models.list().data] == [model] == ["kvtier-tiny"]  # --model as given
    _chat(server, model, [{"role": "user", "content": "warm the metrics up " * 3}], max_tokens=2)
    metrics = server.http.get("/metrics").text
    for name in (
        'kvtier_tier_capacity{tier="L1"}',
        'kvtier_link_bytes_total{link="L2->L1"}',
        'kvtier_prompt_tokens_total{source="recomputed"}',
        "kvtier_ttft_seconds_bucket",
        "kvtier_queue_seconds_count",
        'kvtier_costmodel_predictions_checked_total{part="prefill"}',
        "kvtier_server_waiting",
    ):
        assert name in metrics, name
    stats = server.stats()
    assert set(stats["tiers"]) == {"L1", "L2", "L3"} and stats["engine"]["requests"] >= 1
    assert stats["server"] == {"waiting": 0, "running": 0}
    assert server.openai.models.retrieve(model).id == model
    unknown = server.http.get("/v1/models/gpt-4o")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_chat_stream_equals_non_stream_with_usage(server, model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "page tier " * 8}]
    full = _chat(server, model, messages)
    _sum_usage(full.usage)
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    chunks = list(_chat(server, model, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    _sum_usage(chunks[-1].usage)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1  # the last is computed


def test_completions_take_text_or_token_ids(server, model, loaded):
    text = "restore the prefix from the disk tier " * 2
    ids = loaded.tokenizer.encode(text)
    by_text = server.openai.completions.create(model=model, prompt=text, max_tokens=12, temperature=0)
    by_ids = server.openai.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    _sum_usage(by_ids.usage)
    stop = by_text.choices[0].text[5:8]
    cut = server.openai.completions.create(model=model, prompt=text, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == by_text.choices[0].text.split(stop)[0]
    assert cut.choices[0].finish_reason == "stop"


def test_anthropic_messages_stream_and_usage(server, model, loaded):
    kw = dict(
        model=model,
        max_tokens=20,
        extra_body={"temperature": 0},
        system="Answer briefly.",
        messages=[{"role": "user", "content": "which tier holds the page? " * 2}],
    )
    message = server.anthropic.messages.create(**kw)
    with server.anthropic.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text and final.content[0].text == streamed
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": kw["system"]}, *kw["messages"]], add_generation_prompt=True
    )
    for usage in (message.usage, final.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == len(rendered)
        assert usage.output_tokens == 20
    assert final.usage.cache_read_input_tokens == len(rendered) - 1  # the last is computed
    assert message.stop_reason == "max_tokens"


def test_multi_turn_restores_previous_prompt_and_answer(server, model, loaded):
    """Turn N+1's prompt holds turn N's prompt and answer: all of both comes back (full
    pages and the last partial page). The first turn may share the template's start
    with earlier tests' prompts."""
    messages = [{"role": "user", "content": "a new conversation about eviction"}]
    shared = 0  # tokens of the previous turn's prompt and answer
    for turn in range(3):
        reply = _chat(server, model, messages, max_tokens=40)
        if turn:
            assert reply.usage.prompt_tokens_details.cached_tokens == shared > 3 * PAGE
        prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        answer = reply.choices[0].message.content
        shared = len(prompt) + len(loaded.tokenizer.encode(answer))  # its prompt and answer
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and turn {turn}?"}]


def test_without_model_flags_the_id_is_the_one_the_readme_sends(tmp_path):
    """The README's snippets send ``kvtier-default``: a server started without --model or
    --served-model-name answers it (openai client and raw HTTP), and a body without
    ``model``; another id is a 404 that names the served one."""
    srv = ServerProcess(tmp_path / "store", tiny=False)
    try:
        assert [m.id for m in srv.openai.models.list().data] == ["kvtier-default"]
        hello = [{"role": "user", "content": "Hello"}]
        reply = srv.openai.chat.completions.create(model="kvtier-default", max_tokens=4, messages=hello)
        assert reply.model == "kvtier-default" and reply.usage.completion_tokens > 0
        raw = srv.http.post(
            "/v1/chat/completions", json={"model": "kvtier-default", "messages": hello, "max_tokens": 4}
        )
        assert raw.status_code == 200 and raw.json()["model"] == "kvtier-default"
        assert srv.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        if packaged_gguf() is not None:  # the real model: a completion's text is what it generated, space and all
            paris = dict(model="kvtier-default", prompt="The capital of France is", max_tokens=2, temperature=0)
            assert srv.openai.completions.create(**paris).choices[0].text == " Paris."
            streamed = [c.choices[0].text for c in srv.openai.completions.create(**paris, stream=True) if c.choices]
            assert "".join(streamed) == " Paris." and " Paris" in streamed
        other = srv.http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "Hello", "max_tokens": 2})
        assert other.status_code == 404 and "'kvtier-default'" in other.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, "".join(srv.log)


def test_served_model_name_is_the_id(tmp_path):
    srv = ServerProcess(tmp_path / "store", "--served-model-name", "team/model-a")
    try:
        assert [m.id for m in srv.openai.models.list().data] == ["team/model-a"]
        reply = srv.openai.completions.create(model="team/model-a", prompt="x", max_tokens=2)
        assert reply.model == "team/model-a"
        assert srv.http.post("/v1/completions", json={"model": "kvtier-tiny", "prompt": "x"}).status_code == 404
    finally:
        assert srv.stop() == 0, "".join(srv.log)


# -- sampling settings, logprobs, whole characters ------------------------------------------

# Byte tokens 0xC3 0xA9 are "é": biased far above the rest, with a presence penalty that
# makes the two alternate, the tiny model writes "ééé..."; 5 tokens end inside the third.
ACCENTS = {"logit_bias": {"195": 100, "169": 99}, "presence_penalty": 1.5}


def test_logit_bias_and_penalties_steer_and_text_ends_on_whole_characters(server, model):
    kw = dict(model=model, prompt="the cache", max_tokens=5, temperature=0)
    plain = server.openai.completions.create(**kw)
    steered = server.openai.completions.create(**kw, extra_body=ACCENTS)
    assert steered.choices[0].text == "éé" != plain.choices[0].text
    assert steered.usage.completion_tokens == 5 and steered.choices[0].finish_reason == "length"
    pieces = [
        c.choices[0].text for c in server.openai.completions.create(**kw, extra_body=ACCENTS, stream=True) if c.choices
    ]
    assert "".join(pieces) == "éé" and not any("\ufffd" in p for p in pieces)
    messages = [{"role": "user", "content": "the cache"}]
    chat = _chat(server, model, messages, max_tokens=5, extra_body=ACCENTS)
    assert chat.choices[0].message.content == "éé"
    streamed = [
        c.choices[0].delta.content or ""
        for c in _chat(server, model, messages, max_tokens=5, stream=True, extra_body=ACCENTS)
        if c.choices
    ]
    assert "".join(streamed) == "éé" and not any("\ufffd" in p for p in streamed)
    unbiased = _chat(server, model, messages, max_tokens=5, extra_body={"logit_bias": {"195": 100}})
    assert unbiased.choices[0].message.content == ""  # five lone lead bytes: nothing whole to show


def test_logprobs_stream_and_not_in_openai_shapes(server, model):
    """Greedy: each chosen token is the best of its top_logprobs, with the same value;
    the streamed chunks carry the same entries as the whole response, one per token."""
    messages = [{"role": "user", "content": "log the probabilities"}]
    full = _chat(server, model, messages, max_tokens=8, logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(_chat(server, model, messages, max_tokens=8, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert _chat(server, model, messages, max_tokens=2).choices[0].logprobs is None

    text = server.openai.completions.create(model=model, prompt="log", max_tokens=6, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == text.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    assert all(max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    stream = server.openai.completions.create(
        model=model, prompt="log", max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    streamed = [
        lp for c in stream if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == logprobs.token_logprobs


def test_unsupported_settings_through_the_clients(server, model):
    messages = [{"role": "user", "content": "x"}]
    for kw, param in (
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(n=2), "n"),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}],
                    }
                ]
            ),
            "messages.0.content",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            server.openai.chat.completions.create(**{"model": model, "messages": messages, **kw})
        assert caught.value.body["param"] == param and "not supported" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="echo"):
        server.openai.completions.create(model=model, prompt="x", echo=True)
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        server.anthropic.messages.create(
            model=model,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        )


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{oops", 400, None),
        ("/v1/completions", b'{"prompt": 3}', 400, "prompt"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": [999999]}', 400, "prompt"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "x"}]}', 400, "messages.0.role"),
        ("/v1/chat/completions", b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        ("/v1/messages", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "max_tokens"),
    ],
)
def test_bad_requests_answer_an_error_object(server, path, body, status, param):
    response = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "Traceback" not in response.text


def test_prompt_past_the_context_and_oversized_bodies(server, model):
    too_long = server.http.post("/v1/completions", json={"prompt": "x" * 33000, "max_tokens": 1})
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
    huge = server.http.post("/v1/completions", content=b" " * (9 << 20), headers={"content-type": "application/json"})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    assert server.http.get("/v1/nothing").status_code == 404
    assert server.http.get("/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        server.openai.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        server.anthropic.messages.create(model=model, max_tokens=-1, messages=[{"role": "user", "content": "x"}])


# -- concurrency -------------------------------------------------------------------


def _stream_in_background(
    server, model, max_tokens: int, prompt: str = "stream me " * 3, hang_up: threading.Event | None = None
) -> tuple[threading.Thread, list]:
    """A streaming completion read line by line in a thread (status first, then the lines);
    past 100 tokens the client hangs up after a few lines, once ``hang_up`` is set if given."""
    chunks: list = []

    def read() -> None:
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            timeout=120,
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
        ) as response:
            chunks.append(response.status_code)
            for line in filter(None, response.iter_lines()):
                chunks.append(line)
                if len(chunks) > 4 and max_tokens > 100 and (hang_up is None or hang_up.is_set()):
                    return  # hang up mid-stream

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, chunks


def test_full_queue_answers_429_and_hung_up_streams_are_cancelled(server, model):
    """Two running (--max-running 2), two waiting (--max-waiting 2): the fifth is refused.
    Every client hangs up after a few chunks: the engine cancels all four long requests."""
    before = server.stats()["engine"]
    hang_up = threading.Event()  # the clients keep reading until the queue has been seen full
    streams = []  # distinct prompts: identical ones would wait behind one another (single flight)
    for group, state in (((0, 1), {"waiting": 0, "running": 2}), ((2, 3), {"waiting": 2, "running": 2})):
        streams += [_stream_in_background(server, model, 5000, f"stream number {i} " * 3, hang_up) for i in group]
        wait_until(lambda state=state: server.stats()["server"] == state, str(state))
    refused = server.http.post("/v1/completions", json={"model": model, "prompt": "one more", "max_tokens": 1})
    hang_up.set()
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert int(refused.headers["retry-after"]) > 0
    for thread, _ in streams:
        thread.join(timeout=120)
    wait_until(lambda: server.stats()["engine"]["cancelled"] - before["cancelled"] == 4, "four cancellations")
    after = server.stats()
    assert after["server"] == {"waiting": 0, "running": 0}
    assert after["engine"]["requests"] == before["requests"]  # none ran to its end
    assert all(chunks[0] == 200 for _, chunks in streams)


# -- shutdown, restart, a shared store ---------------------------------------------------


def test_sigterm_drains_flushes_to_l3_for_a_second_server_and_a_restart(tmp_path):
    store = tmp_path / "shared"
    first, second = ServerProcess(store), ServerProcess(store)
    prompt = "the disk tier keeps pages across restarts " * 3
    try:
        model = first.openai.models.list().data[0].id
        cold = first.openai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        pages = (cold.usage.prompt_tokens - 1) // PAGE
        thread, chunks = _stream_in_background(first, model, max_tokens=30)
        wait_until(lambda: len(chunks) > 3, "the stream to start")
        assert first.stop() == 0, "".join(first.log)  # SIGTERM: the stream in flight is finished first
        thread.join(timeout=60)
        assert chunks[-1] == "data: [DONE]" and chunks[0] == 200
        warm = second.openai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert warm.usage.prompt_tokens_details.model_extra["sources"]["L3"] == pages * PAGE
        assert warm.choices[0].text == cold.choices[0].text
    finally:
        second.stop()
    restarted = ServerProcess(store)
    try:
        again = restarted.openai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.model_extra["sources"]["L3"] == pages * PAGE
    finally:
        assert restarted.stop(signal.SIGINT) == 0


def test_clients_that_vanish_never_kill_the_server(server, model):
    """Clients that close before reading their answer, or reset the connection while it
    streams, leave the server serving: a write to a dead socket is an error there, never
    a SIGPIPE that ends the process."""
    import socket
    import struct

    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "vanish", "max_tokens": 40, "stream": True}).encode()
    for i in range(20):
        sock = socket.create_connection((host, int(port)))
        if i % 2:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        else:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            sock.recv(1)  # the stream has begun
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        sock.close()
    time.sleep(1)
    assert server.proc.poll() is None, server.proc.returncode
    assert server.http.get("/health").status_code == 200
    # The race above is narrow; what makes the server safe is that it ignores SIGPIPE
    # (the CLI restores the default for `kvtier ... | head`): read the process's mask.
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGPIPE - 1))


@pytest.mark.parametrize("port", ["99999", "busy"])
def test_a_port_that_cannot_be_used_is_one_line_and_exit_2(port):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1]) if port == "busy" else port
        done = subprocess.run(
            [sys.executable, "-m", "kvtier.engine.cli", "serve", "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert port in done.stderr
