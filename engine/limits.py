"""What a model can take: its context length and the check every prompt passes.

The one copy: the engine checks each submitted prompt, the server checks a request
before it builds one, ``kvtier run`` before it builds an engine, and ``bench ttft``
sizes its prompts to the same context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


# Unicode normalization can shrink text before a tokenizer splits it: NFC composes a
# Hangul syllable's three jamo (9 bytes) into one character (3 bytes), the most any
# composition shrinks; NFKC's compatibility forms shrink less.
_NORMALIZED_SHRINK = 3


@dataclass(frozen=True)
class TextLimit:
    """The most text a context can hold, known without tokenizing it: no token stands for
    more than ``token_bytes`` bytes of UTF-8 text, so text of ``n`` bytes is at least
    ``n / token_bytes`` tokens. A prompt past the context is refused from its size
    before the tokenizer spends time and memory on all of it; text under the bound is
    tokenized and checked exactly, as before."""

    context: int
    token_bytes: int  # bytes of text one token may stand for, normalization included

    @classmethod
    def measure(cls, tokenizer: Any, context: int) -> TextLimit | None:
        """From the vocabulary: its longest token's text, one byte more (a decoder may drop
        a token's leading space, SentencePiece's ``▁``), times ``_NORMALIZED_SHRINK``.
        None for a tokenizer that does not list its vocabulary."""
        try:
            ids = list(tokenizer.get_vocab().values())
            texts = tokenizer.batch_decode([[i] for i in ids])
        except AttributeError:
            return None
        longest = max((len(text.encode()) for text in texts), default=0)
        return cls(context, (longest + 1) * _NORMALIZED_SHRINK)

    def check(self, text_bytes: int) -> None:
        """InputError when text of ``text_bytes`` bytes cannot fit in the context."""
        fewest = -(-text_bytes // self.token_bytes)
        if fewest >= self.context:
            raise InputError(
                f"the prompt is {text_bytes} bytes of text, at least {fewest} tokens "
                f"(a token is at most {self.token_bytes} bytes); this model's context is {self.context}"
            )
