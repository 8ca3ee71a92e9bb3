"""The server's wire shapes and stop-string cutting, without a server."""

import json

import pytest

from kvtier.engine import api
from kvtier.engine.text import OutputText


class _Detokenizer:
    """Each token is one character (what a byte tokenizer does on ASCII)."""

    def __init__(self) -> None:
        self.text, self._offset = "", 0

    def add_token(self, token: int) -> None:
        self.text += chr(token)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment, self._offset = self.text[self._offset:], len(self.text)
        return segment


def _feed(text: str, stops: list[str]) -> tuple[list[str], OutputText]:
    out = OutputText(_Detokenizer(), stops)
    pieces = []
    for ch in text:
        pieces.append(out.add(ord(ch)))
        if out.stop_string is not None:
            break
    else:
        pieces.append(out.finish())
    return pieces, out


def test_stop_string_cuts_text_and_is_never_streamed():
    pieces, out = _feed("hello END world", ["END"])
    assert "".join(pieces) == out.text == "hello "
    assert out.stop_string == "END"


def test_text_that_only_looks_like_a_stop_start_is_released():
    pieces, out = _feed("an ENd, then EN", ["END"])
    assert "".join(pieces) == out.text == "an ENd, then EN"
    assert out.stop_string is None
    assert pieces[3] == "" and pieces[4] == ""  # "E" and "N" of "ENd" were held back


def test_earliest_of_several_stop_strings_wins():
    _, out = _feed("abc xy;z", ["z", "xy"])
    assert out.text == "abc " and out.stop_string == "xy"


def test_without_stops_every_token_is_released_at_once():
    pieces, _ = _feed("abc", [])
    assert pieces == ["a", "b", "c", ""]


@pytest.mark.parametrize("raw, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"prompt": 5}', "prompt", "string"),
    (b'{}', "prompt", "required"),
    (b'{"prompt": "x", "temperature": -1}', "temperature", "greater than or equal"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "greater than"),
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "integer"),
    (b'{"prompt": "x", "n": 2}', "n", "n = 1"),
    (b'{"prompt": "x", "stop": ["a", ""]}', "stop", "empty"),
    (b'{"prompt": ""}', "prompt", "empty"),
    (b'{"prompt": [1, "a"]}', "prompt", None),
])
def test_bad_completion_bodies_name_the_field(raw, param, words):
    with pytest.raises(api.APIError) as caught:
        api.parse_body(raw, api.CompletionRequest)
    err = caught.value
    assert err.status == 400 and err.param == param
    assert words is None or words in err.message
    body = err.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert api.APIError(404, "m").body(anthropic=True)["type"] == "error"


def test_chat_and_messages_bodies_become_template_messages():
    chat = api.parse_body(json.dumps({
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7}).encode(), api.ChatCompletionRequest)
    assert chat.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert chat.max_tokens == 7
    messages = api.parse_body(json.dumps({
        "max_tokens": 3, "system": "sys",
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}],
    }).encode(), api.MessagesRequest)
    rendered = messages.template_messages()
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert json.loads(rendered[3]["content"])["content"] == "x"
    with pytest.raises(api.APIError):
        api.parse_body(b'{"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
                       api.MessagesRequest)


def _done(sources: dict, completion: int = 5) -> api.Finished:
    prompt = api.PromptUsage(sum(sources.values()), sources, 16, {"restore_pages": 2})
    return api.Finished("text", completion, "length", None, prompt)


def test_usage_splits_the_prompt_by_source_without_double_counting():
    done = _done({"L1": 16, "L2": 0, "L3": 32, "recomputed": 9})
    usage = api.usage(done)
    details = usage["prompt_tokens_details"]
    assert usage["prompt_tokens"] == sum(details["sources"].values()) == 57
    assert details["cached_tokens"] == 48
    assert usage["total_tokens"] == 62
    assert usage["kvtier"]["plan"] == {"restore_pages": 2}
    anthropic = api.anthropic_usage(done.prompt, done.completion_tokens)
    assert anthropic["cache_read_input_tokens"] == 48 and anthropic["input_tokens"] == 9


def test_streamed_openai_tail_carries_usage_and_ends_with_done():
    shape = api.OpenAIShape(chat=True, model="m")
    done = _done({"L1": 0, "L2": 0, "L3": 0, "recomputed": 4})
    with_usage = shape.final_chunks(done, include_usage=True)
    assert with_usage[-1] == "data: [DONE]\n\n"
    last = json.loads(with_usage[1][len("data: "):])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 4
    without = shape.final_chunks(done, include_usage=False)
    assert json.loads(without[0][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert json.loads(without[0][len("data: "):])["usage"]["completion_tokens"] == 5


def test_anthropic_events_in_order():
    shape = api.AnthropicShape("m")
    done = _done({"L1": 16, "L2": 0, "L3": 0, "recomputed": 1})
    events = shape.start_events(done.prompt) + [shape.delta_event("hi")] + shape.final_events(done)
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    delta = json.loads(events[4].split("\n")[1].removeprefix("data: "))
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["cache_read_input_tokens"] == 16
