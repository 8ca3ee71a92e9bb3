"""Random JSON bodies against the server app (in process): every answer is 200 or an
error object with a 4xx status, the server keeps serving, and greedy output for a
fixed prompt is the same before and after (nothing in the store was harmed)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.server import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

ERROR_KEYS = {"message", "type", "param", "code"}

text = st.text(st.characters(codec="utf-8"), max_size=30)
tokens = st.lists(st.integers(0, 255), min_size=1, max_size=20)
# Valid bodies (max_tokens small, so that they run quickly) ...
sampling = {
    "model": st.just("kvtier-default"),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "seed": st.integers(0, 2**31),
    "stream": st.booleans(),
}
openai = {**sampling, "max_tokens": st.integers(1, 3), "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
          "n": st.just(1), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                 "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                   "text": text}), max_size=2)})
valid = {
    "/v1/completions": st.fixed_dictionaries({"prompt": text.filter(bool) | tokens}, optional=openai),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)},
                                                  optional={**openai, "max_completion_tokens": st.integers(1, 3)}),
    "/v1/messages": st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 3),
         "messages": st.lists(message.map(lambda m: {**m, "role": "user"}), min_size=1, max_size=2)},
        optional={**sampling, "system": text, "stop_sequences": st.lists(st.text(min_size=1, max_size=3),
                                                                        max_size=2)}),
}
# ... and any JSON in any field, whole bodies of any JSON, and bytes that are not JSON.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(-2, 3, allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = sorted({*openai, "prompt", "messages", "system", "stop_sequences", "max_completion_tokens"})


def bodies(path: str):
    broken = st.tuples(valid[path], st.sampled_from(FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
    return valid[path] | broken | json_values | st.binary(max_size=40)


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


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
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


def test_the_store_and_the_output_survive_the_fuzzing(client, before):
    assert client.get("/health").json()["status"] == "ok"
    assert _fixed(client) == before
