"""What a model can take: its context length and the check every prompt passes.

The one copy: the engine checks each submitted prompt, the server checks a request
before it builds one, ``kvtier run`` before it builds an engine, and ``bench ttft``
sizes its prompts to the same context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .request import SamplingParams

if TYPE_CHECKING:
    from .models.load import LoadedModel

_NO_LIMIT = 10**9  # tokenizers without a limit report a huge sentinel (transformers' VERY_LARGE_INTEGER)


class InputError(ValueError):
    """A prompt or setting the model cannot take (one clear line); ``param`` names the setting."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def context_length(loaded: LoadedModel) -> int | None:
    """Tokens the model attends over: its config's ``max_position_embeddings``, else the
    tokenizer's limit; None when neither names one."""
    length = getattr(getattr(loaded.model, "args", None), "max_position_embeddings", None)
    length = length or getattr(loaded.tokenizer, "model_max_length", None)
    return int(length) if length and length < _NO_LIMIT else None


def check_prompt(loaded: LoadedModel, tokens: Sequence[int], params: SamplingParams) -> None:
    """InputError unless the model can take ``tokens`` and generate ``params.max_tokens``
    after them (callers may check before building an engine: nothing is touched)."""
    vocab = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    context = context_length(loaded)
    if not tokens:
        raise InputError("empty prompt")
    if context and len(tokens) + params.max_tokens > context:
        raise InputError(
            f"prompt of {len(tokens)} tokens plus max_tokens {params.max_tokens} exceeds "
            f"the model's context of {context} tokens"
        )
    # A model whose config names no vocab_size (mlx-lm's vision-language ones nest it)
    # still refuses negative ids.
    vocabulary = f"the vocabulary (0..{vocab - 1})" if vocab else "the vocabulary"
    bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise InputError(f"token id {bad[0]} is outside {vocabulary}")
    bad = [t for t in params.logit_bias or {} if t < 0 or (vocab and t >= vocab)]
    if bad:  # mlx-lm would fail the whole batch on it
        raise InputError(f"logit_bias token id {bad[0]} is outside {vocabulary}", "logit_bias")
