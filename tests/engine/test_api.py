"""The server's wire shapes and stop-string cutting, without a server."""

import json

import pytest

from kvtier.engine.serve import api, render, responses
from kvtier.engine.text import OutputText, verbatim


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
        segment, self._offset = self.text[self._offset :], len(self.text)
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


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b'{"prompt": 5}', "prompt", "string"),
        (b"{}", "prompt", "required"),
        (b'{"prompt": "x", "temperature": -1}', "temperature", "greater than or equal"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "greater than"),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "integer"),
        (b'{"prompt": "x", "n": 2}', "n", "n = 1"),
        (b'{"prompt": "x", "stop": ["a", ""]}', "stop", "empty"),
        (b'{"prompt": ""}', "prompt", "empty"),
        (b'{"prompt": [1, "a"]}', "prompt", None),
    ],
)
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
    chat = api.parse_body(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                ],
                "max_completion_tokens": 7,
            }
        ).encode(),
        api.ChatCompletionRequest,
    )
    assert render.chat_messages(chat) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert chat.max_tokens == 7
    messages = api.parse_body(
        json.dumps(
            {
                "max_tokens": 3,
                "system": "sys",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
                ],
            }
        ).encode(),
        api.MessagesRequest,
    )
    rendered, origins = render.anthropic_messages(messages)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert origins == [(None, "system"), (0, "user"), (1, "assistant"), (2, "user")]  # the request's own indexes
    assert rendered[2]["tool_calls"][0]["function"] == {"name": "ls", "arguments": {}}
    assert rendered[3] == {"role": "tool", "tool_call_id": "t1", "content": "x"}
    with pytest.raises(api.APIError):
        api.parse_body(
            b'{"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "image"}]}]}', api.MessagesRequest
        )


def _done(sources: dict, completion: int = 5) -> responses.Finished:
    prompt = responses.PromptUsage(sum(sources.values()), sources, 16, {"restore_pages": 2})
    return responses.Finished("text", completion, "length", None, prompt)


def test_usage_splits_the_prompt_by_source_without_double_counting():
    done = _done({"L1": 16, "L2": 0, "L3": 32, "recomputed": 9})
    usage = responses.usage(done)
    details = usage["prompt_tokens_details"]
    assert usage["prompt_tokens"] == sum(details["sources"].values()) == 57
    assert details["cached_tokens"] == 48
    assert usage["total_tokens"] == 62
    assert usage["kvtier"]["plan"] == {"restore_pages": 2}
    anthropic = responses.anthropic_usage(done.prompt, done.completion_tokens)
    assert anthropic["cache_read_input_tokens"] == 48 and anthropic["input_tokens"] == 9


def test_streamed_openai_tail_carries_usage_and_ends_with_done():
    shape = responses.OpenAIShape(chat=True, model="m")
    done = _done({"L1": 0, "L2": 0, "L3": 0, "recomputed": 4})
    with_usage = shape.final_chunks(done, include_usage=True)
    assert with_usage[-1] == "data: [DONE]\n\n"
    last = json.loads(with_usage[1][len("data: ") :])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 4
    without = shape.final_chunks(done, include_usage=False)
    assert json.loads(without[0][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert json.loads(without[0][len("data: ") :])["usage"]["completion_tokens"] == 5


def test_anthropic_events_in_order():
    shape = responses.AnthropicShape("m")
    done = _done({"L1": 16, "L2": 0, "L3": 0, "recomputed": 1})
    events = shape.start_events(done.prompt) + [shape.delta_event("hi")] + shape.final_events(done)
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    delta = json.loads(events[4].split("\n")[1].removeprefix("data: "))
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["cache_read_input_tokens"] == 16


# -- whole characters only -------------------------------------------------------------

H, E_ACUTE, EURO = [0x68], [0xC3, 0xA9], [0xE2, 0x82, 0xAC]  # "h", "é", "€" as the byte tokenizer's ids


def test_a_completion_keeps_the_space_its_first_token_starts_with(loaded):
    """mlx-lm's byte-level detokenizer drops the space that starts the text (an answer's
    first word); a completion's text is what the model generated, " Paris." included."""
    tokens = loaded.tokenizer.encode(" Paris.")
    kept = OutputText(verbatim(loaded.tokenizer.detokenizer), ["."])
    pieces = [kept.add(token) for token in tokens] + [kept.finish()]
    assert "".join(pieces) == kept.text == " Paris" and kept.stop_string == "."
    trimmed = OutputText(loaded.tokenizer.detokenizer, [])
    assert "".join([trimmed.add(token) for token in tokens] + [trimmed.finish()]) == "Paris."


@pytest.mark.parametrize(
    "tokens, stops, text",
    [
        (H + E_ACUTE + EURO[:2], [], "hé"),  # max_tokens cut the euro sign after two of its three bytes
        (H + E_ACUTE[:1], [], "h"),
        (E_ACUTE[:1], [], ""),
        (H + E_ACUTE + EURO, [], "hé€"),
        (H + EURO + E_ACUTE[:1], ["é"], "h€"),  # held back for a stop string that never came
    ],
)
def test_text_never_ends_in_half_a_character(loaded, tokens, stops, text):
    """With the real byte-level tokenizer of the tiny model: the streamed pieces and the
    final text are whole characters; none holds U+FFFD."""
    out = OutputText(loaded.tokenizer.detokenizer, stops)
    pieces = [out.add(token) for token in tokens] + [out.finish()]
    assert "".join(pieces) == out.text == text
    assert not any("\ufffd" in piece for piece in pieces)


# -- fields the server does not implement ---------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "x"}]}
MESSAGES = {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    "body, kind, param",
    [
        ({"prompt": "x", "echo": True}, api.CompletionRequest, "echo"),
        ({"prompt": "x", "best_of": 3}, api.CompletionRequest, "best_of"),
        ({"prompt": "x", "suffix": "end"}, api.CompletionRequest, "suffix"),
        ({"prompt": "x", "n": 2}, api.CompletionRequest, "n"),
        ({**CHAT, "n": 2}, api.ChatCompletionRequest, "n"),
        ({**CHAT, "response_format": {"type": "json_object"}}, api.ChatCompletionRequest, "response_format"),
        (
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
            api.ChatCompletionRequest,
            "response_format",
        ),
        ({**CHAT, "modalities": ["text", "audio"]}, api.ChatCompletionRequest, "modalities"),
        ({**CHAT, "functions": [{"name": "f"}]}, api.ChatCompletionRequest, "functions"),
        ({**CHAT, "reasoning_effort": "high"}, api.ChatCompletionRequest, "reasoning_effort"),
        (
            {**CHAT, "stream_options": {"include_obfuscation": True}},
            api.ChatCompletionRequest,
            "stream_options.include_obfuscation",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]},
            api.ChatCompletionRequest,
            "messages.0.content",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            api.ChatCompletionRequest,
            "messages.0.content",
        ),
        ({"prompt": "x", "frobnicate": 1}, api.CompletionRequest, "frobnicate"),
        (
            {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            api.MessagesRequest,
            "messages.0.content",
        ),
        (
            {
                **MESSAGES,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}
                        ],
                    }
                ],
            },
            api.MessagesRequest,
            "messages.0.content.0.content",
        ),
        ({**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}, api.MessagesRequest, "thinking"),
        ({**MESSAGES, "seed": 1}, api.MessagesRequest, "seed"),
    ],
)
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(body, kind, param):
    with pytest.raises(api.APIError) as caught:
        api.parse_body(json.dumps(body).encode(), kind)
    err = caught.value
    assert err.status == 400 and err.param == param
    assert err.message.startswith(f"{param}: ") and "not supported" in err.message and "\n" not in err.message


@pytest.mark.parametrize(
    "body, kind",
    [
        (
            {
                **CHAT,
                "user": "u1",
                "metadata": {"k": "v"},
                "store": False,
                "service_tier": "auto",
                "response_format": {"type": "text"},
                "tool_choice": "auto",
                "parallel_tool_calls": True,
                "n": 1,
                "modalities": ["text"],
                "logprobs": False,
                "presence_penalty": 0,
                "prompt_cache_key": "c",
            },
            api.ChatCompletionRequest,
        ),
        (
            {"prompt": "x", "echo": False, "best_of": 1, "suffix": "", "user": "u1", "logprobs": None},
            api.CompletionRequest,
        ),
        (
            {
                **MESSAGES,
                "metadata": {"user_id": "u"},
                "thinking": {"type": "disabled"},
                "tool_choice": {"type": "auto"},
                "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            },
            api.MessagesRequest,
        ),
    ],
)
def test_fields_that_change_nothing_here_are_accepted(body, kind):
    assert api.parse_body(json.dumps(body).encode(), kind)


@pytest.mark.parametrize(
    "bias, words", [({"a": 1}, "token ids"), ({"7": 101}, "[-100, 100]"), ({"7": "1"}, "valid number")]
)
def test_logit_bias_is_checked(bias, words):
    with pytest.raises(api.APIError) as caught:
        api.parse_body(json.dumps({"prompt": "x", "logit_bias": bias}).encode(), api.CompletionRequest)
    assert caught.value.param.startswith("logit_bias") and words in caught.value.message


def test_sampling_settings_reach_the_engine_as_token_ids():
    body = api.parse_body(
        json.dumps(
            {
                **CHAT,
                "logit_bias": {"65": -100, "7": 2.5},
                "presence_penalty": 0.5,
                "frequency_penalty": -1,
                "logprobs": True,
                "top_logprobs": 3,
            }
        ).encode(),
        api.ChatCompletionRequest,
    )
    assert body.sampling() == {
        "logit_bias": {65: -100, 7: 2.5},
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "logprobs": 3,
    }
    plain = api.parse_body(json.dumps({"prompt": "x", "logprobs": 0}).encode(), api.CompletionRequest)
    assert plain.sampling()["logprobs"] == 0 and plain.sampling()["logit_bias"] is None
    with pytest.raises(api.APIError, match="top_logprobs: needs logprobs"):
        api.parse_body(json.dumps({**CHAT, "top_logprobs": 2}).encode(), api.ChatCompletionRequest)


def test_logprobs_in_openai_shapes():
    tokens = [responses.TokenChoice("ab", -0.5, [("ab", -0.5), ("x", -1.5)]), responses.TokenChoice("\ufffd", -0.1, [])]
    chat = responses.OpenAIShape(chat=True, model="m").logprobs(tokens)
    assert chat["content"][0] == {
        "token": "ab",
        "logprob": -0.5,
        "bytes": [97, 98],
        "top_logprobs": [
            {"token": "ab", "logprob": -0.5, "bytes": [97, 98]},
            {"token": "x", "logprob": -1.5, "bytes": [120]},
        ],
    }
    assert chat["content"][1]["bytes"] is None  # part of a character: no bytes of its own in its text
    shape = responses.OpenAIShape(chat=False, model="m")
    first, second = shape.logprobs(tokens[:1]), shape.logprobs(tokens[1:])  # two chunks of one stream
    assert first == {
        "tokens": ["ab"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"ab": -0.5, "x": -1.5}],
        "text_offset": [0],
    }
    assert second["text_offset"] == [2]
    assert shape.logprobs(None) is None
    plain = responses.OpenAIShape(chat=False, model="m").response(_done({"L1": 0, "L2": 0, "L3": 0, "recomputed": 1}))
    assert plain["choices"][0]["logprobs"] is None


DEEP = b"[" * 100 + b"]" * 100


@pytest.mark.parametrize(
    "raw, kind, param, words",
    [
        (b'{"prompt": "x", "seed": -1}', api.CompletionRequest, "seed", "greater than or equal to 0"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', api.CompletionRequest, "seed", "less than"),
        (b'{"prompt": "ab\\ud800"}', api.CompletionRequest, "prompt", "U+D800, at character 2"),
        (
            b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
            api.ChatCompletionRequest,
            "messages.0.content",
            None,
        ),
        (b'{"max_tokens": 1, "system": "\\udfff", "messages": []}', api.MessagesRequest, "system", "surrogate"),
        (b'{"prompt": "x", "metadata": {"\\ud800": 1}}', api.CompletionRequest, "metadata", "surrogate"),
        ('{"prompt": "x\\ud800"}'.encode("utf-16"), api.CompletionRequest, "prompt", "surrogate"),
        (b'{"prompt": "x", "metadata": {"k": ' + DEEP + b"}}", api.CompletionRequest, "metadata", "deeper than 64"),
        (b"[" * 5000 + b"]" * 5000, api.CompletionRequest, None, "deeper than 64"),
        (b'{"prompt": "x", "logit_bias": {"\\u00b2": 1}}', api.CompletionRequest, "logit_bias", "token ids"),
        (json.dumps({"prompt": "x", "stop": ["s"] * 65}).encode(), api.CompletionRequest, "stop", "limit is 64"),
        (json.dumps({"prompt": "x", "stop": "s" * 1001}).encode(), api.CompletionRequest, "stop", "longer"),
        (json.dumps({**MESSAGES, "stop_sequences": ["s"] * 65}).encode(), api.MessagesRequest, "stop_sequences", None),
        (
            json.dumps({**MESSAGES, "diagnostics": {"previous_message_id": [1]}}).encode(),
            api.MessagesRequest,
            "diagnostics.previous_message_id",
            "string",
        ),
    ],
)
def test_what_once_reached_mlx_or_the_recursion_limit_is_a_400(raw, kind, param, words):
    """Each of these answered 500: a seed mlx's random.key refuses, a lone UTF-16
    surrogate the tokenizer refuses, nesting past the decoder's recursion, int() of a
    non-ASCII digit, an unhashable conversation id; and stop strings bound the per-token work."""
    with pytest.raises(api.APIError) as caught:
        api.parse_body(raw, kind)
    err = caught.value
    assert err.status == 400 and err.param == param and "\n" not in err.message
    assert words is None or words in err.message, err.message


def test_nesting_up_to_the_bound_and_paired_surrogates_are_accepted():
    body = api.parse_body(
        b'{"prompt": "\\ud83d\\ude00", "metadata": {"k": ' + b"[" * 62 + b"]" * 62 + b"}}", api.CompletionRequest
    )
    assert body.prompt == "\U0001f600"
