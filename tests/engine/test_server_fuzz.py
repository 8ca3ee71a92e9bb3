"""Random JSON bodies against the server app (in process): every answer is 200 or an
error object with a 4xx status, the server keeps serving, and greedy output for a
fixed prompt is the same before and after (nothing in the store was harmed)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

ERROR_KEYS = {"message", "type", "param", "code"}

text = st.text(st.characters(codec="utf-8"), max_size=30)
json_values_base = st.none() | st.booleans() | st.integers(-3, 300) | st.floats(-2, 3, allow_nan=False) | text
tokens = st.lists(st.integers(0, 255), min_size=1, max_size=20)
# Valid bodies (max_tokens small, so that they run quickly) ...
sampling = {
    "model": st.just("kvtier-default"),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "seed": st.integers(0, 2**64 - 1),
    "stream": st.booleans(),
}
openai = {
    **sampling,
    "max_tokens": st.integers(1, 3),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "n": st.just(1),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100), max_size=3),
    "user": text,
}
completion = {**openai, "logprobs": st.integers(0, 5), "echo": st.just(False), "best_of": st.just(1)}
chat = {
    **openai,
    "max_completion_tokens": st.integers(1, 3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "response_format": st.just({"type": "text"}),
}
# Fields that are refused whatever else the body holds: each one's 400 names it.
refused = {
    "echo": st.just(True),
    "best_of": st.integers(2, 5),
    "n": st.integers(2, 4),
    "response_format": st.just({"type": "json_object"}),
    "frobnicate": json_values_base,
    "image": st.just([{"type": "image_url", "image_url": {"url": "data:,"}}]),
}
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
    }
)
valid = {
    "/v1/completions": st.fixed_dictionaries({"prompt": text.filter(bool) | tokens}, optional=completion),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3)}, optional=chat
    ).map(  # top_logprobs needs logprobs
        lambda b: {**b, "logprobs": True} if "top_logprobs" in b else b
    ),
    "/v1/messages": st.fixed_dictionaries(
        {
            "max_tokens": st.integers(1, 3),
            "messages": st.lists(message.map(lambda m: {**m, "role": "user"}), min_size=1, max_size=2),
        },
        optional={**sampling, "system": text, "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2)},
    ),
}
# ... and any JSON in any field, whole bodies of any JSON, and bytes that are not JSON.
json_values = st.recursive(
    json_values_base,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = sorted({*completion, *chat, "prompt", "messages", "system", "stop_sequences"})


# Shapes that reached mlx, a tokenizer or the interpreter's recursion limit unchecked
# (each answered 500 once): always a 400 with the endpoint's error object.
surrogate = st.characters(categories=["Cs"])  # lone UTF-16 halves: json.dumps escapes them
unpaired = st.tuples(text, surrogate, text).map("".join)
hostile_fields = {
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**64),
    "logit_bias": st.sampled_from(["²", "٣", "1.5", "-1", " 1"]).map(lambda key: {key: 1}),
    "stop": st.lists(st.just("x"), min_size=65, max_size=80) | st.just("y" * 1001),
    "stop_sequences": st.just(["z"] * 65),
    "top_k": st.integers(max_value=0),
    "diagnostics": json_values.filter(lambda v: not isinstance(v, str) and v is not None).map(
        lambda v: {"previous_message_id": v}
    ),
}


def _with_surrogate(path: str, body: dict, value: str) -> dict:
    """A lone surrogate in the body's text: the prompt, a message, the system prompt."""
    if path == "/v1/completions":
        return {**body, "prompt": value}
    if path == "/v1/chat/completions":
        return {**body, "messages": [{"role": "user", "content": value}]}
    return {**body, "system": value}


def hostile(path: str):
    fields = sorted({"seed", "logit_bias", "stop"} if path != "/v1/messages" else {"stop_sequences", "top_k", "seed"})
    if path == "/v1/messages":
        fields.append("diagnostics")
    field = st.sampled_from(fields).flatmap(lambda name: st.tuples(st.just(name), hostile_fields[name]))
    one_field = st.tuples(valid[path], field).map(lambda t: json.dumps({**t[0], t[1][0]: t[1][1]}).encode())
    unicode = st.tuples(valid[path], unpaired).map(lambda t: json.dumps(_with_surrogate(path, *t)).encode())
    # Nested past the bound, up to past the decoder's own recursion limit, in a field
    # the server accepts and ignores.
    deep = st.tuples(valid[path], st.integers(64, 3000)).map(
        lambda t: json.dumps(t[0]).encode()[:-1] + b', "metadata": {"k": ' + b"[" * t[1] + b"]" * t[1] + b"}}"
    )
    return one_field | unicode | deep


def _refusing(path: str):
    """A valid body with one refused field (an image block goes into the first message)."""

    def add(pair):
        body, (name, value) = pair
        if name == "image":
            first = body["messages"][0] if "messages" in body else None
            if first is None:
                return body, None
            return {**body, "messages": [{**first, "content": value}, *body["messages"][1:]]}, "messages.0.content"
        return {**body, name: value}, name

    return st.tuples(
        valid[path], st.sampled_from(sorted(refused)).flatmap(lambda name: st.tuples(st.just(name), refused[name]))
    ).map(add)


def bodies(path: str):
    broken = st.tuples(valid[path], st.sampled_from(FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
    return valid[path] | broken | json_values | st.binary(max_size=40) | hostile(path)


requests = st.sampled_from(sorted(valid)).flatmap(lambda path: st.tuples(st.just(path), bodies(path)))


@pytest.fixture(scope="module")
def client(loaded, tmp_path_factory):
    store = StoreConfig(l1_bytes=1 << 24, l2_bytes=1 << 24, store_dir=tmp_path_factory.mktemp("fuzz-store"))
    engine = Engine(loaded, EngineConfig(page_size=16, store=store))
    server = KVTierServer(engine, ServerConfig("kvtier-default", default_max_tokens=3))
    server.start()
    with TestClient(server.app, raise_server_exceptions=False) as test_client:
        yield test_client
    server.close()


def _fixed(client) -> str:
    body = {"prompt": "a fixed prompt that the fuzzing must not disturb", "max_tokens": 6, "temperature": 0}
    return client.post("/v1/completions", json=body).json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def before(client):
    return _fixed(client)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(request=requests)
def test_any_body_gets_a_result_or_an_error_object(client, before, request):
    path, body = request
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        assert set(response.json()["error"]) == ERROR_KEYS
    elif "text/event-stream" in response.headers["content-type"]:
        assert response.text.rstrip().endswith(("data: [DONE]", '{"type":"message_stop"}'))
    else:
        assert response.json()["usage"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(request=st.sampled_from(sorted(valid)).flatmap(lambda path: st.tuples(st.just(path), hostile(path))))
def test_out_of_range_seeds_lone_surrogates_and_deep_nesting_are_400s(client, before, request):
    path, content = request
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body["error"]) == ERROR_KEYS and "\n" not in body["error"]["message"]
    assert body.get("type") == ("error" if path == "/v1/messages" else None)  # Anthropic's shape there


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    request=st.sampled_from(["/v1/completions", "/v1/chat/completions"]).flatmap(
        lambda path: st.tuples(st.just(path), _refusing(path))
    )
)
def test_a_refused_field_is_a_400_naming_it_whatever_the_rest(client, before, request):
    path, (body, param) = request
    response = client.post(path, json=body)
    if param is None:
        return  # a completion has no message to put an image in
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["param"] == param and "not supported" in error["message"]


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    body=valid["/v1/completions"].map(
        lambda b: {**b, "logprobs": 2, "max_tokens": 3, "logit_bias": {"195": 100, "169": 99}}
    )
)
def test_text_and_logprobs_agree_in_any_valid_completion(client, before, body):
    """Whatever the other settings, with the bytes of "é" (C3 A9) pushed up so that
    max_tokens often cuts one: no U+FFFD ends the text, and one logprob entry per token."""
    response = client.post("/v1/completions", json=body)
    assert response.status_code in (200, 400), response.text
    if response.status_code != 200:
        return
    if body.get("stream"):
        events = [
            json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line.startswith("data: {")
        ]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        entries = [
            t
            for e in events
            if e["choices"] and e["choices"][0]["logprobs"]
            for t in e["choices"][0]["logprobs"]["token_logprobs"]
        ]
        tokens = next(e["usage"] for e in events if e.get("usage"))["completion_tokens"]
    else:
        choice = response.json()["choices"][0]
        text, entries = choice["text"], choice["logprobs"]["token_logprobs"]
        tokens = response.json()["usage"]["completion_tokens"]
    assert not text.endswith("\ufffd")
    assert len(entries) == tokens


def test_the_store_and_the_output_survive_the_fuzzing(client, before):
    assert client.get("/health").json()["status"] == "ok"
    assert _fixed(client) == before
