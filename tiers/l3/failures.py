"""Backend failures after open, logged without flooding: the first failure of each kind
(what failed, and the exception's type) is a warning, repeats are debug lines. Such
failures never reach a caller (a failed read is a miss, a failed write a dropped write),
so the log is where they show.
"""

from __future__ import annotations

import logging

from ..text import one_line

log = logging.getLogger(__name__)


class FailureLog:
    """The failures one store has logged, by kind."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, type]] = set()

    def report(self, what: str, exc: BaseException, detail: str = "") -> None:
        """Log a failure: the first of its kind as a warning, repeats at debug level."""
        kind = (what, type(exc))
        level = logging.DEBUG if kind in self._seen else logging.WARNING
        self._seen.add(kind)
        log.log(level, "L3 %s failed: %s%s", what, one_line(exc), detail)
