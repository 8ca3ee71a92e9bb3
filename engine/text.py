"""Output text of one request, token by token, cut at the first stop string.

Streaming must never send text that a stop string later claims, so the end of the
text that could begin a stop string is held back until more text shows that it does
not (or the request ends).

Nor does the text ever end in half a character: mlx-lm's streaming detokenizers hold
back bytes that do not yet make a whole UTF-8 character, and when generation ends
there (``max_tokens`` cut a character), their ``finalize`` turns them into U+FFFD,
which is dropped here.
"""

from __future__ import annotations

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, StreamingDetokenizer

REPLACEMENT = "\ufffd"  # what a UTF-8 decoder makes of bytes that are not a whole character


def without_broken_end(text: str) -> str:
    """``text`` without the replacement characters that end it: the bytes of a character
    whose rest was never generated. (A model that generates U+FFFD itself as the very last
    character loses it too; after decoding the two cannot be told apart.)"""
    return text.rstrip(REPLACEMENT)


def verbatim(detokenizer: StreamingDetokenizer) -> StreamingDetokenizer:
    """``detokenizer`` (a copy of its own, as ``TokenizerWrapper.detokenizer`` gives),
    made to keep the space that starts the first token's text.

    mlx-lm's SentencePiece and byte-level BPE detokenizers drop it, so that an answer
    starts at its first word; but a completion continues its prompt, and its text is
    what the model generated: " Paris." after "The capital of France is", as OpenAI's
    completions return it. Other detokenizers decode the tokens as they are."""
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    elif isinstance(detokenizer, BPEStreamingDetokenizer):
        detokenizer.__class__ = _VerbatimBPE  # its state stays; only the trimming goes
    return detokenizer


class _VerbatimBPE(BPEStreamingDetokenizer):
    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


class OutputText:
    def __init__(self, detokenizer, stops: list[str]) -> None:
        self._detokenizer = detokenizer  # an mlx-lm StreamingDetokenizer of its own
        self._stops = stops
        self._pending = ""  # decoded, not yet handed out
        self.text = ""  # everything handed out
        self.stop_string: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> str:
        """Feed one generated token; the text that is now safe to send."""
        self._detokenizer.add_token(token)
        return self._take(self._detokenizer.last_segment, final=False)

    def finish(self) -> str:
        """The generation ended: whatever text is still held back."""
        self._detokenizer.finalize()
        return self._take(without_broken_end(self._detokenizer.last_segment), final=True)

    def _take(self, segment: str, final: bool) -> str:
        if self.stop_string is not None:
            return ""
        self._pending += segment
        found = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if found:
            cut, self.stop_string = min(found)
            out, self._pending = self._pending[:cut], ""
        else:
            cut = len(self._pending) - (0 if final else self._could_start_stop())
            out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return out

    def _could_start_stop(self) -> int:
        """Length of the longest end of the pending text that is the start of a stop string."""
        for n in range(min(max(map(len, self._stops), default=0), len(self._pending)), 0, -1):
            if any(stop.startswith(self._pending[-n:]) for stop in self._stops):
                return n
        return 0
