"""The argument types of the ``kvtier`` command line: sizes, counts, rates, ports and
store addresses, each one ``argparse`` type that turns bad text into one clear line;
and the page codec flags that several commands share."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path

from kvtier.tiers.l3.record import QUANTIZED

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """Bytes from ``512MiB``, ``4GiB``, ``1.5GB`` or a plain number. Kept over a library:
    bitmath refuses plain bytes and ``4gib`` (lenient, it reads ``4k`` as 4096);
    humanfriendly has no release since 2021."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 512MiB, 4GiB or bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def positive_size(text: str) -> int:
    """A size that must hold something: resizing a store to 0 bytes would only empty it (``kvtier store clear``
    does that). A new store's cap of 0 is allowed: its L3 drops every write."""
    if (size := parse_size(text)) <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return size


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A duration: a finite number of seconds, 0 or more."""
    if (value := _number(text)) < 0:
        raise argparse.ArgumentTypeError(f"must be 0 seconds or more, got {text!r}")
    return value


def positive_number(text: str) -> float:
    if (value := _number(text)) <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def temperature(text: str) -> float:
    if (value := _number(text)) < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {text!r}")
    return value


def top_p(text: str) -> float:
    if not 0 < (value := _number(text)) <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """``512,1024,2048`` -> [512, 1024, 2048]."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}")
    return [int(part) for part in parts]


def port_number(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return int(text)


def parse_throttle(text: str) -> tuple[str, float]:
    """``L3=2MiB/s`` -> ("L3", bytes per second)."""
    tier, _, rate = text.partition("=")
    if tier not in ("L2", "L3") or not rate.endswith("/s"):
        raise argparse.ArgumentTypeError(f"bad throttle {text!r} (use e.g. L3=2MiB/s or L2=1GiB/s)")
    bytes_per_s = parse_size(rate[:-2])
    if bytes_per_s <= 0:
        raise argparse.ArgumentTypeError(f"throttle rate must be positive in {text!r}")
    return tier, float(bytes_per_s)


_PER = {"s": 1, "min": 60, "h": 3600, "day": 86400}


def parse_rate(text: str) -> float:
    """Bytes per second from ``20GiB/day``, ``1GiB/h``, ``5MiB/min`` or ``2MiB/s`` (more than 0)."""
    size, _, per = text.rpartition("/")
    try:
        nbytes = parse_size(size) if per.lower() in _PER else 0
    except argparse.ArgumentTypeError:
        nbytes = 0
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"bad rate {text!r} (use e.g. 20GiB/day, 1GiB/h or 2MiB/s; more than 0)")
    return nbytes / _PER[per.lower()]


def rate_list(text: str) -> list[float | None]:
    """Comma-separated rates (``parse_rate``), or ``none`` for no limit."""
    return [None if part == "none" else parse_rate(part) for part in text.split(",")]


def name_list(allowed: Sequence[str]):
    """An argparse type: a comma-separated list of names from ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"bad choice {bad[0] if bad else text!r} (choose from {', '.join(allowed)})"
            )
        return names

    return parse


def l2_sweep(text: str) -> list[int]:
    """``l2-bytes=1GiB,4GiB`` -> L2 sizes in bytes."""
    name, _, sizes = text.partition("=")
    if name != "l2-bytes" or not sizes:
        raise argparse.ArgumentTypeError(f"bad sweep {text!r} (use e.g. l2-bytes=1GiB,4GiB,16GiB)")
    return [parse_size(size) for size in sizes.split(",")]


def store_arg(text: str) -> Path | str:
    """A ``--store``: a Redis / Valkey URL as it is, anything else a directory."""
    from kvtier.tiers.l3.open import is_url

    return text if is_url(text) else Path(text)


def redis_url(text: str) -> str:
    from kvtier.tiers.l3.open import is_url

    if not is_url(text):
        raise argparse.ArgumentTypeError(f"expected a redis://, rediss:// or redis+cluster:// URL, got {text!r}")
    return text


def add_codec_flag(parser: argparse.ArgumentParser) -> None:
    """``--l3-codec`` (also spelled ``--codec``, its older name) and ``--l2-codec``: how
    each tier stores pages."""
    parser.add_argument(
        "--l2-codec",
        choices=["raw", *QUANTIZED],
        default="raw",
        help="L2 page codec: q8, q4 and k8v4 quantize (lossy), so L2 holds 2-4x the pages",
    )
    parser.add_argument(
        "--l3-codec",
        "--codec",
        dest="codec",
        choices=["raw", "zstd", *QUANTIZED],
        default="raw",
        help="L3 page codec; q8, q4 and k8v4 (keys 8-bit, values 4-bit) quantize: lossy, "
        "and their pages are apart from raw ones",
    )
