"""``kvtier top [URL]``: the dashboard's live view in the terminal (``rich``), for a server
reached over SSH. It polls the server's dashboard feed (``/v1/kvtier/dashboard``, the
same JSON the page reads) every ``--interval`` seconds and redraws: tiers, requests and
reuse, prompt tokens by source since the last poll, links, latency percentiles, the
cost model's error, the last requests (each prompt as a strip scaled to the terminal,
coloured by source) and the L3 namespaces.

A URL that is not http(s), or a server that does not answer the first poll, is one
error line (exit 2); a server that stops answering later is said in the frame, and the
view keeps trying. Ctrl-C ends it (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvtier.tiers.text import format_bytes

from .common import UsageError

FEED_PATH = "/v1/kvtier/dashboard"  # engine/serve/dashboard.py
SOURCES = ("L1", "L2", "L3", "recomputed")
# Okabe-Ito, as the page; recomputed is also drawn with another character.
STYLES = {"L1": "#0072b2", "L2": "#009e73", "L3": "#e69f00", "recomputed": "#bbbbbb"}
CELLS = {"L1": "█", "L2": "█", "L3": "█", "recomputed": "░"}
STRIP_WIDTH = 40
SHOWN_REQUESTS = 8


def cmd_top(args: argparse.Namespace) -> int:
    url, key = feed_url(args.url), args.api_key or os.environ.get("KVTIER_API_KEY")
    console = Console()
    feed = fetch(url, key)  # the first poll: a server that does not answer is the user's error
    if args.once:
        console.print(view(feed, None))
        return 0
    try:
        if console.is_terminal:
            with Live(view(feed, None), console=console, auto_refresh=False) as live:
                follow(url, key, feed, args.interval, lambda frame: live.update(frame, refresh=True))
        else:  # a pipe or a file: one frame after another
            console.print(view(feed, None))
            follow(url, key, feed, args.interval, lambda frame: console.print(frame))
    except KeyboardInterrupt:
        pass
    return 0


def follow(url: str, key: str | None, feed: dict, interval: float, show: Callable[[RenderableType], None]) -> None:
    """Poll forever (until Ctrl-C); a missed poll is said in the frame."""
    previous = feed
    while True:
        time.sleep(interval)
        try:
            feed = fetch(url, key)
        except UsageError as err:
            show(Text(f"no answer from {url}: {err}; retrying", style="bold red"))
            continue
        show(view(feed, previous))
        previous = feed


def feed_url(url: str) -> str:
    """The feed's URL on the server at ``url`` (``host:port`` means http://host:port)."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"bad URL {url!r}: expected http://HOST:PORT of a kvtier server")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as err:
        raise UsageError(f"bad URL {url!r}: {err}") from None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, FEED_PATH, "", ""))


def fetch(url: str, key: str | None = None) -> dict:
    """The server's dashboard feed (an admin's ``key`` when the server has API keys)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            feed = json.load(answer)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise UsageError(f"{url} answered {err.code}: it needs an admin API key (--api-key)") from None
        raise UsageError(f"{url} answered {err.code}: is this a kvtier server?") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UsageError(f"cannot reach {url}: {reason}") from None
    except ValueError:
        raise UsageError(f"{url} did not answer JSON: is this a kvtier server?") from None
    if not isinstance(feed, dict) or "stats" not in feed:
        raise UsageError(f"{url} did not answer a kvtier dashboard feed")
    return feed


def view(feed: dict, previous: dict | None) -> Group:
    stats = feed["stats"]
    return Group(
        Text(f"kvtier top: {feed.get('model', '?')}  {time.strftime('%H:%M:%S', time.localtime(feed['time']))}"),
        _tiers(stats),
        _figures(feed, previous),
        _links(stats),
        _requests(feed),
        _namespaces(feed),
    )


def _tiers(stats: dict) -> Table:
    table = Table("tier", "used", "capacity", "pages", "hit pages", "evictions", title="tiers", title_justify="left")
    for name, tier in stats.get("tiers", {}).items():
        share = tier["bytes_used"] / tier["capacity"] if tier["capacity"] else 0.0
        table.add_row(
            name,
            f"{format_bytes(tier['bytes_used'])} ({share:.0%})",
            format_bytes(tier["capacity"]),
            str(tier["pages"]),
            str(tier["hit_pages"]),
            str(tier["evictions"]),
        )
    return table


def _figures(feed: dict, previous: dict | None) -> Table:
    stats, latency = feed["stats"], feed["latency"]
    engine = stats.get("engine", {})
    sources = engine.get("sources", {})
    total = sum(sources.values())
    table = Table(show_header=False, box=None)
    table.add_row("waiting / running", f"{stats['server']['waiting']} / {stats['server']['running']}")
    table.add_row("served, prompt tokens", f"{engine.get('requests', 0)}, {engine.get('prompt_tokens', 0)}")
    reuse = (total - sources.get("recomputed", 0)) / total if total else None
    table.add_row("reuse ratio", "-" if reuse is None else f"{reuse:.1%}")
    if previous is not None:
        was = previous["stats"].get("engine", {}).get("sources", {})
        table.add_row("since last poll", _legend({s: sources.get(s, 0) - was.get(s, 0) for s in SOURCES}))
    table.add_row(
        f"TTFT p50 / p95 ({latency['requests']} in {latency['span_s']:.0f} s)",
        f"{_ms(latency['ttft_p50_s'])} / {_ms(latency['ttft_p95_s'])}",
    )
    table.add_row("queue p50 / p95", f"{_ms(latency['queue_p50_s'])} / {_ms(latency['queue_p95_s'])}")
    return table


def _links(stats: dict) -> Table:
    costmodel = stats.get("costmodel") or {}
    profile = costmodel.get("links", {})
    table = Table("link", "bytes", "seconds", "measured", "profile", "error p50", title="links", title_justify="left")
    for name, link in stats.get("links", {}).items():
        measured = f"{link['bytes'] / link['seconds'] / 2**30:.2f} GiB/s" if link["seconds"] > 0 else "-"
        fit = profile.get(name)
        error = fit["error"].get("median") if fit else None
        table.add_row(
            name,
            format_bytes(link["bytes"]),
            f"{link['seconds']:.4f}",
            measured,
            f"{fit['gib_s']:.2f} GiB/s" if fit else "-",
            "-" if error is None else f"{error:.0%}",
        )
    compute = costmodel.get("compute")
    if compute and compute["error"].get("median") is not None:
        table.caption = f"prefill prediction error: median {compute['error']['median']:.0%}"
    return table


def _requests(feed: dict) -> Table:
    table = Table("id", "prompt", "sources", "TTFT", "plan", title="last requests", title_justify="left")
    for record in feed["requests"][:SHOWN_REQUESTS]:
        plan = record["plan"]
        table.add_row(
            str(record["rid"]),
            str(record["prompt_tokens"]),
            Group(strip(record["strip"], record["prompt_tokens"]), _legend(record["sources"])),
            _ms(record["ttft_s"]),
            f"{plan['restore_pages']}/{len(plan['matched'])} pages" if plan else "-",
        )
    return table


def strip(runs: list, tokens: int, width: int = STRIP_WIDTH) -> Text:
    """A prompt's runs of sources drawn in ``width`` cells: each cell shows the source of
    the token at its middle, so every run of at least tokens/width tokens shows."""
    cells = Text()
    bounds, at = [], 0
    for source, n in runs:
        at += n
        bounds.append((at, source))
    for i in range(min(width, tokens)):
        middle = (i + 0.5) * tokens / min(width, tokens)
        source = next(s for end, s in bounds if middle < end)
        cells.append(CELLS[source], style=STYLES[source])
    return cells


def _legend(counts: dict) -> Text:
    text = Text()
    for source in SOURCES:
        text.append(f"{CELLS[source]} {source} {counts.get(source, 0)}  ", style=STYLES[source])
    return text


def _namespaces(feed: dict) -> Table:
    table = Table("namespace", "model", "pages", "bytes", "last use", title="L3 namespaces", title_justify="left")
    for ns in feed["namespaces"]:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns["last_use"])) if ns["last_use"] else "-"
        table.add_row(ns["namespace"][:12], str(ns["model"]), str(ns["pages"]), format_bytes(ns["bytes"]), used)
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
