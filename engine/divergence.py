"""Where a prompt left the cache (DESIGN §8a): the token at which the longest stored
match ended, and a few tokens on either side of it as text.

Only the request's own tokens are shown: the text before the point is the request's
own prompt, which the store matched; nothing of another tenant's prompt (whose pages
may be the ones that matched, or the ones that did not) is ever read.
"""

from __future__ import annotations

from .request import Request
from .text import REPLACEMENT, without_broken_end

CONTEXT_TOKENS = 8  # tokens shown on either side


def divergence(request: Request, tokenizer) -> dict:
    """``token``: where the longest stored match ended (``prompt_tokens`` when all of the
    prompt but its last, always recomputed, token was stored); ``before`` / ``after``:
    the prompt's text on either side."""
    prompt, at = request.prompt, request.matched_tokens
    return {
        "token": at,
        "prompt_tokens": len(prompt),
        "before": tokenizer.decode(prompt[max(0, at - CONTEXT_TOKENS) : at]).lstrip(REPLACEMENT),
        "after": without_broken_end(tokenizer.decode(prompt[at : at + CONTEXT_TOKENS])),
    }
