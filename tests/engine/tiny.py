"""A tiny in-memory model (2-layer Qwen2, random weights, byte vocabulary) for engine
tests where text does not matter: the engine's bookkeeping runs at full speed."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.models import qwen2
from mlx_lm.models.cache import make_prompt_cache

from kvtier.engine.models.load import LoadedModel


class ByteTokenizer:
    """Bytes are token ids; no EOS unless a test sets one."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = set(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")


def tiny_model(eos_token_ids: tuple[int, ...] = (), tokenizer=None) -> LoadedModel:
    """With ``tokenizer`` (an mlx-lm tokenizer), a model of its vocabulary that uses it."""
    mx.random.seed(7)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256 if tokenizer is None else len(tokenizer.vocab),
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = qwen2.Model(args)
    # Larger than the default init, so each output depends on the whole context.
    model.update(tree_map_with_path(lambda name, w: w if "norm" in name else 4 * w, model.parameters()))
    mx.eval(model.parameters())
    tokenizer = tokenizer or ByteTokenizer(eos_token_ids)
    return LoadedModel("tiny", Path("tiny"), "tiny", model, tokenizer, "tiny-fingerprint")


def greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """The oracle: the model's greedy continuation, one token at a time, no engine."""
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(max_tokens):
        token = mx.argmax(logits[0, -1]).item()
        out.append(token)
        logits = loaded.model(mx.array([[token]]), cache=cache)
    return out
