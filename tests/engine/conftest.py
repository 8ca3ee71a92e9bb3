import pytest
from mlx_lm.generate import stream_generate

from kvtier.engine.model import load_model


@pytest.fixture(scope="session")
def loaded():
    return load_model()


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
