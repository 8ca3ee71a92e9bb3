"""A request body's JSON, checked before anything else reads it: nesting bounded and
every string valid Unicode (DESIGN §8a).

Python's ``json`` accepts what no later step can take: a lone UTF-16 surrogate
(``"\\ud800"`` escaped, or raw in a UTF-16 body) makes a ``str`` that tokenizers and
UTF-8 encoders refuse with a ``TypeError`` deep inside them, and nesting past the
interpreter's recursion limit raises ``RecursionError`` from the decoder, or later
from pydantic, a chat template or ``json.dumps``. Both are the client's fault, so
both are a 400 here, before pydantic sees the body; past this point every string is
encodable and no value is nested more than ``MAX_DEPTH`` deep.
"""

from __future__ import annotations

import json
from typing import Any

# Levels of arrays and objects, the body itself the first. Real bodies stay far below
# it (a tool's JSON schema nests two levels per schema level); every later recursive
# step (pydantic, jinja, json.dumps) stays far from the interpreter's limit of ~1000.
MAX_DEPTH = 64


class BodyError(ValueError):
    """What is wrong with the body's JSON (one line); ``param`` is where, when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def load(raw: bytes) -> Any:
    """The body as Python values, or BodyError: not JSON, nested deeper than
    ``MAX_DEPTH``, or holding a string that is not valid Unicode."""
    try:
        data = json.loads(raw)
    except RecursionError:  # the decoder's own recursion, at the interpreter's limit
        raise BodyError(f"body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise BodyError(f"body is not valid JSON: {err}") from None
    _check(data)
    return data


def _check(data: Any) -> None:
    """Walk the values without recursion: depth of each container, Unicode of each
    string and object key."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _unicode(value, path)
        if not isinstance(value, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            raise BodyError(f"body is nested deeper than {MAX_DEPTH} levels", _param(path[:1]))  # the field
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _unicode(key, path)
            if isinstance(item, (str, list, dict)):  # numbers, booleans and null need nothing
                stack.append((item, depth + 1, (*path, key)))


def _unicode(text: str, path: tuple) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as err:
        where = _param(path)
        raise BodyError(
            f"{where + ': ' if where else ''}text is not valid Unicode "
            f"(a lone UTF-16 surrogate, U+{ord(text[err.start]):04X}, at character {err.start})",
            where,
        ) from None


def _param(path: tuple) -> str | None:
    """``messages.0.content``, as pydantic's errors name a field."""
    return ".".join(map(str, path)) or None
