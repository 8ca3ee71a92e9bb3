"""The engine's sampling settings beyond temperature and top_p: logit_bias, presence and
frequency penalties, logprobs; and the text of a result (``kvtier run --json``) on whole characters."""

import pytest

from kvtier.engine.engine import Engine, EngineConfig, InputError
from kvtier.engine.request import SamplingParams

ACCENTS = {"logit_bias": {0xC3: 100.0, 0xA9: 99.0}, "presence_penalty": 1.5}  # "é" is C3 A9


@pytest.fixture(scope="module")
def engine(loaded):
    with Engine(loaded, EngineConfig(offload=False)) as engine:
        yield engine


def _run(engine, loaded, **params):
    [request] = engine.generate([loaded.tokenizer.encode("the cache")], SamplingParams(**params))
    return request


def test_bias_and_penalty_steer_and_the_result_text_ends_on_a_whole_character(engine, loaded):
    alternating = _run(engine, loaded, max_tokens=5, **ACCENTS)
    assert alternating.output == [0xC3, 0xA9, 0xC3, 0xA9, 0xC3]  # the presence penalty alternates them
    assert engine.result(alternating)["text"] == "éé"  # the third é lost its second byte to max_tokens
    repeated = _run(engine, loaded, max_tokens=5, logit_bias={0xC3: 100.0})
    assert repeated.output == [0xC3] * 5 and engine.result(repeated)["text"] == ""  # no whole character
    frequency = _run(engine, loaded, max_tokens=4, logit_bias=ACCENTS["logit_bias"], frequency_penalty=2.0)
    assert frequency.output[:2] == [0xC3, 0xA9]


def test_logprobs_are_those_greedy_chose_from(engine, loaded):
    request = _run(engine, loaded, max_tokens=6, logprobs=4)
    assert len(request.logprobs) == len(request.output) == 6
    for token, entry in zip(request.output, request.logprobs):
        assert entry.top[0] == (token, entry.logprob) and len(entry.top) == 4
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    assert _run(engine, loaded, max_tokens=2).logprobs == []


def test_a_bias_outside_the_vocabulary_is_an_input_error(engine, loaded):
    with pytest.raises(InputError, match="logit_bias token id 999") as caught:
        engine.submit(loaded.tokenizer.encode("x"), SamplingParams(logit_bias={999: 1.0}))
    assert caught.value.param == "logit_bias"
