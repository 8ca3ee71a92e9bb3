"""Tool calls on ``kvtier serve`` through the official ``openai`` and ``anthropic`` clients,
in process (Starlette's test client is the clients' HTTP transport), with the tokenizer of
``kvtier-tiny-tools`` (Qwen2.5's tool-calling template, which mlx-lm reads as its
``json_tools`` family) on a two-layer model, so that a hundred tokens take a moment. The
model's text is gibberish, so a test that needs a call forces the answer's tokens
(``SamplingParams.forced``) through a scripted engine."""

from __future__ import annotations

import logging
import time

import anthropic
import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.defaults import TOOLS_MODEL, ensure_tools_model
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import IMPLICIT_ROOT

from .tiny import tiny_model

PAGE = 16
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}
# Keys in an order no sorting gives: the order must survive parsing and rendering.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}\n</tool_call>'


class ScriptedEngine(Engine):
    """The engine, with every answer starting with ``script`` while one is set (and ending
    there, with EOS, unless ``then_free``)."""

    script: str | None = None
    then_free = False

    def submit(self, prompt, params=None, root=IMPLICIT_ROOT):
        if self.script is not None and params is not None:
            tokenizer = self.loaded.tokenizer
            params.forced = tokenizer.encode(self.script) + ([] if self.then_free else [tokenizer.eos_token_id])
        return super().submit(prompt, params, root)


@pytest.fixture(scope="module")
def served():
    loaded = tiny_model(tokenizer=load_tokenizer(ensure_tools_model()))
    engine = ScriptedEngine(
        loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None), publish_answers=True)
    )
    server = KVTierServer(engine, ServerConfig(TOOLS_MODEL))
    server.start()
    with TestClient(server.app) as http:
        yield server, http
    server.close()


@pytest.fixture
def script(served):
    server, _ = served

    def set_script(text: str | None, then_free: bool = False) -> None:
        server.engine.script, server.engine.then_free = text, then_free

    yield set_script
    server.engine.script, server.engine.then_free = None, False


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=served[1], max_retries=0)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=served[1], max_retries=0)


def _chat(oai, messages, **kw):
    return oai.chat.completions.create(model=TOOLS_MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 120), **kw)


# -- tools out ----------------------------------------------------------------------------


def test_openai_tool_call_is_parsed_and_streamed(oai, script):
    script("Let me look." + CALL)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    full = _chat(oai, messages, tools=[WEATHER])
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments == '{"unit": "C", "city": "Paris"}'

    chunks = list(_chat(oai, messages, tools=[WEATHER], stream=True))
    pieces = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [[(t.index, t.function.name, t.function.arguments) for t in p] for p in pieces] == [
        [(0, "get_weather", call.function.arguments)]
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me look."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_tool_use_is_parsed_and_streamed(claude, script):
    script(CALL)
    request = {
        "model": TOOLS_MODEL,
        "max_tokens": 120,
        "tools": [ANTHROPIC_WEATHER],
        "messages": [{"role": "user", "content": "weather in Paris?"}],
    }
    message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert list(block.input.items()) == [("unit", "C"), ("city", "Paris")]

    with claude.messages.stream(**request) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
        ("text", None),
        ("tool_use", {"unit": "C", "city": "Paris"}),
    ]
    assert "input_json" in events


def test_a_call_that_does_not_parse_comes_back_as_text_with_a_warning(oai, script, caplog):
    broken = "<tool_call>\n{not json}\n</tool_call>"
    script(broken)
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.serve.tools"):
        full = _chat(oai, [{"role": "user", "content": "weather?"}], tools=[WEATHER])
    choice = full.choices[0]
    assert choice.message.content == broken and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "does not parse" in caplog.text


# -- tools in -----------------------------------------------------------------------------


def test_tools_reach_the_prompt_and_count_tokens_counts_them(served, oai, claude):
    server, _ = served
    plain = [{"role": "user", "content": "hi"}]
    without = _chat(oai, plain, max_tokens=1).usage.prompt_tokens
    with_tools = _chat(oai, plain, tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    rendered = server.tokenizer.apply_chat_template(plain, tools=[WEATHER], add_generation_prompt=True)
    assert with_tools == len(rendered) > without
    request = {"model": TOOLS_MODEL, "tools": [ANTHROPIC_WEATHER], "system": "be brief", "messages": plain}
    counted = claude.messages.count_tokens(**request).input_tokens
    answered = claude.messages.create(**request, max_tokens=1).usage
    assert counted == answered.input_tokens + answered.cache_read_input_tokens


def test_a_tool_result_turn_reuses_the_whole_previous_turn(oai, claude, script):
    """The second turn's prompt starts with the first turn's prompt and answer, token for
    token (arguments rendered as sent, key order kept), so all its full pages come from the
    store: the pages the answer filled included."""
    script(CALL)
    first = [{"role": "system", "content": "You answer with tools. " * 4}, {"role": "user", "content": "Paris?"}]
    answer = _chat(oai, first, tools=[WEATHER])
    (call,) = answer.choices[0].message.tool_calls
    second = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    script(None)
    usage = _chat(oai, second, tools=[WEATHER], max_tokens=1).usage
    turn_one = answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= (turn_one // PAGE) * PAGE > answer.usage.prompt_tokens

    script(CALL)
    request = {"model": TOOLS_MODEL, "max_tokens": 120, "tools": [ANTHROPIC_WEATHER], "system": "Tools. " * 8}
    asked = [{"role": "user", "content": "Lyon?"}]
    message = claude.messages.create(**request, messages=asked)
    (block,) = message.content
    script(None)
    answered = [
        *asked,
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "12 C"}]},
    ]
    usage = claude.messages.create(**{**request, "max_tokens": 1}, messages=answered).usage
    turn_one = message.usage.input_tokens + message.usage.cache_read_input_tokens + message.usage.output_tokens
    assert usage.cache_read_input_tokens >= (turn_one // PAGE) * PAGE


@pytest.mark.parametrize(
    "choice, starts",
    [
        ("required", "<tool_call>"),
        ({"type": "function", "function": {"name": "get_time"}}, '<tool_call>\n{"name": "get_time'),
    ],
)
def test_tool_choice_required_and_named_force_the_call(oai, choice, starts):
    full = _chat(oai, [{"role": "user", "content": "x"}], tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=40)
    message = full.choices[0].message
    # The tiny model writes gibberish after the forced start: the call does not parse, so
    # it comes back as text, which shows what the answer began with.
    assert (message.content or "").startswith(starts) or message.tool_calls


def test_tool_choice_none_bans_the_call(oai, served, script):
    """The answer is forced to the start marker but its last token, which a bias then
    makes the only likely one: the marker is written unless tool_choice is none."""
    server, _ = served
    start = server.tokenizer.tool_call_start
    script(start[:-1], then_free=True)
    bias = {str(server.tokenizer.encode(start[-1])[0]): 100}
    messages = [{"role": "user", "content": "x"}]
    free = _chat(oai, messages, tools=[WEATHER], logit_bias=bias, max_tokens=12).choices[0].message
    assert free.content.startswith(start)  # an unclosed call of gibberish: text
    banned = _chat(oai, messages, tools=[WEATHER], logit_bias=bias, tool_choice="none", max_tokens=12)
    message = banned.choices[0].message
    assert message.content.startswith(start[:-1]) and start not in message.content and not message.tool_calls


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"tool_choice": "required"}, "has no tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ],
)
def test_tool_choice_that_cannot_be_met_is_a_400(oai, kw, words):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(oai, [{"role": "user", "content": "x"}], **kw)
    assert caught.value.body["param"] == "tool_choice" and words in caught.value.body["message"]


def test_anthropic_settings_are_honoured_or_refused(claude, script):
    script(None)
    base = {"model": TOOLS_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    # The current SDK no longer names the sampling settings; clients send them as extra fields.
    top1 = claude.messages.create(**base, extra_body={"temperature": 1.0, "top_k": 1})
    greedy = claude.messages.create(**base, extra_body={"temperature": 0.0})
    assert top1.content[0].text == greedy.content[0].text  # top_k 1 is greedy whatever the temperature
    system_blocks = [
        {"type": "text", "text": "be "},
        {"type": "text", "text": "brief", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    as_blocks = claude.messages.count_tokens(model=TOOLS_MODEL, system=system_blocks, messages=base["messages"])
    as_text = claude.messages.count_tokens(model=TOOLS_MODEL, system="be brief", messages=base["messages"])
    assert as_blocks.input_tokens == as_text.input_tokens
    claude.messages.create(**base, metadata={"user_id": "u"}, extra_body={"context_management": {"edits": []}})
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(**base, extra_body={"temperature": 1.5})
    assert "temperature" in caught.value.message


def test_a_template_without_tools_is_a_400_naming_the_reason(loaded):
    server = KVTierServer(Engine(loaded, EngineConfig(page_size=PAGE, offload=False)), ServerConfig("kvtier-tiny"))
    server.start()
    with TestClient(server.app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="kvtier-tiny", messages=[{"role": "user", "content": "x"}], tools=[WEATHER], max_tokens=1
            )
        assert caught.value.body["param"] == "tools" and "no tool calling" in caught.value.body["message"]
        history = [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
        ]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="kvtier-tiny", messages=history, max_tokens=1)
        assert "no tool calling" in caught.value.body["message"]
        bad = [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
            }
        ]
        response = http.post("/v1/chat/completions", json={"messages": bad})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "messages.0.tool_calls.0.function.arguments"
    server.close()


# -- where the prompt left the cache ---------------------------------------------------------


def test_the_divergence_report_names_the_message_that_changed(claude, oai, script, caplog):
    """Turn two edits the first user message (as a client that rewrites history does): the
    report points into it, by index and role, with the request's own text either side,
    and the server says at INFO what the conversation lost."""
    script(None)
    system = "You are a coding agent with tools. " * 3
    history = [
        {"role": "user", "content": "read the file src/app.py and fix the failing test " * 2},
        {"role": "assistant", "content": "Done: the test passes now."},
        {"role": "user", "content": "now run the whole suite and tell me what fails"},
    ]
    request = {"model": TOOLS_MODEL, "max_tokens": 2, "system": system, "metadata": {"user_id": "session-1"}}
    claude.messages.create(**request, messages=history)
    edited = [{**history[0], "content": history[0]["content"].replace("src/app.py", "src/cli.py")}, *history[1:]]
    with caplog.at_level(logging.INFO, logger="kvtier.engine.serve.conversations"):
        usage = claude.messages.create(**request, messages=edited).usage
    report = usage.model_extra["kvtier"]["divergence"]
    assert (report["message"], report["role"]) == (0, "user")
    assert "src/" in report["before"] + report["after"] and "cli.py" not in report["before"]
    assert report["token"] == usage.cache_read_input_tokens < report["prompt_tokens"] - PAGE
    (line,) = [r.getMessage() for r in caplog.records]
    assert "message 0 (user)" in line and "differs from the previous turn" in line

    same = claude.messages.create(**request, messages=edited).usage.model_extra["kvtier"]["divergence"]
    assert same["role"] == "user" and same["message"] == 2  # all but the last page came from the store
    changed_system = oai.chat.completions.create(
        model=TOOLS_MODEL,
        max_tokens=2,
        messages=[{"role": "system", "content": "x" + system}, {"role": "user", "content": "hi"}],
    )
    assert changed_system.usage.model_extra["kvtier"]["divergence"]["role"] == "system"


# -- pages held in the fast tiers ----------------------------------------------------------

SMALL_L1, SMALL_L2 = 160, 8  # pages: the pressure below evicts everything not held


@pytest.fixture(scope="module")
def small(served):
    """A server on a store of a few pages (no L3), with the same scripted engine."""
    loaded = served[0].engine.loaded
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=SMALL_L1 * page_bytes, l2_bytes=SMALL_L2 * page_bytes, store_dir=None)
    engine = ScriptedEngine(loaded, EngineConfig(page_size=PAGE, store=store, publish_answers=True))
    server = KVTierServer(engine, ServerConfig(TOOLS_MODEL))
    server.start()
    with TestClient(server.app) as http:
        client = anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=http, max_retries=0)
        yield server, client
    server.close()


def _pressure(client, rounds: int = 4) -> None:
    """Prompts of their own, enough to fill L1 and L2 several times over."""
    for i in range(rounds):
        text = f"unrelated traffic {i} " * 60  # 80 pages
        client.messages.create(model=TOOLS_MODEL, max_tokens=1, messages=[{"role": "user", "content": text}])


def test_cache_control_holds_the_prefix_through_pressure(small):
    server, client = small
    system = "A long agent system prompt that every turn shares. " * 2  # 6 pages of 16
    for cached in (False, True):
        block = {"type": "text", "text": f"{cached} {system}"}
        if cached:
            block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
        request = {"model": TOOLS_MODEL, "max_tokens": 1, "system": [block]}
        first = client.messages.create(**request, messages=[{"role": "user", "content": "turn one"}]).usage
        _pressure(client)
        again = client.messages.create(**request, messages=[{"role": "user", "content": "turn two"}]).usage
        if not cached:
            assert first.cache_creation_input_tokens == 0 and again.cache_read_input_tokens <= 2 * PAGE  # its start
            continue
        held = first.model_extra["kvtier"]["held"]["cache_control"]
        assert held >= len(system) // PAGE * PAGE - PAGE  # the prefix's full pages (the template adds a few tokens)
        assert first.cache_creation_input_tokens == held - first.cache_read_input_tokens  # the shared first page
        assert again.cache_read_input_tokens >= held and again.cache_creation_input_tokens == 0
        total = again.input_tokens + again.cache_read_input_tokens + again.cache_creation_input_tokens
        assert total == again.model_extra["kvtier"]["divergence"]["prompt_tokens"]  # no token counted twice
    assert server.holds.pages() <= SMALL_L1 // 2  # never more than the cap


def test_an_answer_that_calls_a_tool_stays_warm_while_the_tool_runs(small):
    server, client = small
    request = {"model": TOOLS_MODEL, "max_tokens": 120, "tools": [ANTHROPIC_WEATHER]}
    asked = [{"role": "user", "content": "weather in Paris? " * 3}]
    cold_read = None
    for warm in (0.0, 60.0):
        server.config.tool_warm_s, server.engine.script = warm, CALL
        try:
            message = client.messages.create(**request, messages=[{"role": "user", "content": f"{warm}"}, *asked])
        finally:
            server.engine.script = None
        (block,) = message.content
        _pressure(client)
        answered = [
            {"role": "user", "content": f"{warm}"},
            *asked,
            {"role": "assistant", "content": [block.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18 C"}]},
        ]
        usage = client.messages.create(**{**request, "max_tokens": 1}, messages=answered).usage
        turn_one = message.usage.input_tokens + message.usage.cache_read_input_tokens + message.usage.output_tokens
        if warm:
            held = message.usage.model_extra["kvtier"]["held"]["tool_wait"]
            assert held == turn_one + 1  # its pages and its last partial page (the cache holds the EOS too)
            assert held % PAGE  # (so the partial page is not empty)
            assert usage.cache_read_input_tokens >= turn_one > cold_read + 10 * PAGE  # the partial page too
        else:
            cold_read = usage.cache_read_input_tokens  # the template's start, which the pressure shares
            assert "held" not in message.usage.model_extra["kvtier"]


def test_a_tool_wait_hold_ends_on_time_without_traffic(small):
    server, client = small
    server.config.tool_warm_s, server.engine.script = 2.0, CALL
    try:
        message = client.messages.create(
            model=TOOLS_MODEL, max_tokens=120, tools=[ANTHROPIC_WEATHER], messages=[{"role": "user", "content": "wx"}]
        )
    finally:
        server.engine.script, server.config.tool_warm_s = None, 120.0
    # the pages of this hold, its partial page among them (other tests' holds may be there:
    # this one may have released an older tool wait to fit under the cap)
    pages = -(-message.usage.model_extra["kvtier"]["held"]["tool_wait"] // PAGE)
    after = server.holds.pages()
    assert pages > 0 and after >= pages
    deadline = time.monotonic() + 10
    while server.holds.pages() == after and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.holds.pages() == after - pages  # released by the server's sweeper: no request came


def test_anthropic_diagnostics_say_why_the_cache_missed(claude, script):
    script(None)
    system = "You are a coding agent with tools and a long system prompt. " * 3
    ask = {"model": TOOLS_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "list the files"}]}
    first = claude.messages.create(**ask, system=system, diagnostics={"previous_message_id": None})
    assert first.diagnostics is None  # nothing to compare with, nothing missed
    same = claude.messages.create(**ask, system=system, diagnostics={"previous_message_id": first.id})
    assert same.diagnostics is None
    changed = claude.messages.create(**ask, system="Today. " + system, diagnostics={"previous_message_id": same.id})
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens > PAGE
    tools = [ANTHROPIC_WEATHER]
    with_tools = claude.messages.create(**ask, system=system, tools=tools, diagnostics={"previous_message_id": None})
    renamed = [{**ANTHROPIC_WEATHER, "description": "Today's weather, by city."}]
    again = claude.messages.create(
        **ask, system=system, tools=renamed, diagnostics={"previous_message_id": with_tools.id}
    )
    reason = again.diagnostics.cache_miss_reason
    assert reason.type == "tools_changed" and reason.cache_missed_input_tokens > PAGE
    same_tools = claude.messages.create(
        **ask, system=system, tools=renamed, diagnostics={"previous_message_id": again.id}
    )
    assert same_tools.diagnostics is None
    moved = claude.messages.create(
        **ask, system="Today. " + system, tools=renamed, diagnostics={"previous_message_id": same_tools.id}
    )
    assert moved.diagnostics.cache_miss_reason.type == "system_changed"  # the same tools, another system text
    unknown = claude.messages.create(**ask, system=system, diagnostics={"previous_message_id": "msg_unknown"})
    assert unknown.diagnostics.cache_miss_reason.type == "previous_message_not_found"
