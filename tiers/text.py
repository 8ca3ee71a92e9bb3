"""How numbers and errors read in one line: shared by the store's messages, the CLI and
its reports. A leaf module (no backend, no mlx), so printing a size loads no store."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``12 KiB``, ``512 B``: sizes as people read them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__
