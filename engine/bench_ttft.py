"""``kvtier bench ttft``: time to first token against prompt length, recomputed and with
the prompt's stored prefix restored from each tier, all measured in one run.

Per round and prompt length, on a prompt of its own (no two share a page):

- ``recompute`` then ``L1``: one engine runs the prompt twice; the second run finds
  its pages in L1, and its last partial page (so only its last token is computed);
- ``L2``: an engine without L3 whose L1 holds nothing: the first run spills the pages
  to L2, the second restores them from there;
- ``L3``: once the first engine has closed (its pages flushed to the store), a fresh
  engine on the same store with empty L1 and L2, as after a restart (the OS page
  cache still warm);
- ``Redis`` (given a URL): the same restart against a scratch prefix on that server;
- ``L3 aes`` (``--encrypt-l3``): the L3 restart from a store of encrypted records (a
  throwaway key), in a scratch store of its own; ``encryption`` is its TTFT as a ratio
  to the plain L3 one's, per length.

Every restoring engine is given a cost profile whose links are free, so its plan
restores every stored page (never recomputes or overlaps one): the bench times the
tiers, not the planner. A restoring engine restores once, so online refinement never
refits those links. Each run's source labels are checked to be the named tier's.
Each cell is the best of ``rounds`` runs and is reported as a ratio to recomputing
the same length in the same run; machines drift, ratios are what compare.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from kvtier.costmodel.bandwidth import throwaway_cipher
from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.plan import Profile
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.l3.cipher import RecordCipher
from kvtier.tiers.l3.open import scratch_location
from kvtier.tiers.page import Source, reusable_pages

from .engine import Engine, EngineConfig
from .limits import context_length
from .models.load import LoadedModel
from .request import SamplingParams

RECOMPUTE = "recompute"
REDIS = "Redis"
ENCRYPTED_L3 = "L3 aes"
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
FIRST_TOKEN = SamplingParams(max_tokens=1)
_WORDS = (
    "cache",
    "page",
    "tier",
    "restore",
    "token",
    "prefix",
    "model",
    "host",
    "disk",
    "store",
    "layer",
    "head",
    "value",
    "key",
    "prompt",
    "batch",
    "step",
    "offload",
    "memory",
    "bytes",
)


class BenchError(RuntimeError):
    """A run did not measure what its cell names (e.g. a Redis server evicted the pages)."""


def default_lengths(loaded: LoadedModel) -> list[int]:
    """512 to 8,192 tokens, each capped so that the prompt and its first token fit the context."""
    most = context_tokens(loaded) - FIRST_TOKEN.max_tokens
    return sorted({min(n, most) for n in DEFAULT_LENGTHS})


def context_tokens(loaded: LoadedModel) -> int:
    return context_length(loaded) or 1 << 20


def runs_per_round(lengths: Sequence[int], redis: bool, encrypted: bool = False) -> int:
    """Prompts one round runs (for a progress bar)."""
    return len(lengths) * (5 + 2 * redis + 2 * encrypted)


def prompt(loaded: LoadedModel, n: int, seed: str) -> list[int]:
    """``n`` tokens of words in an order drawn from ``seed``: no two seeds share a page.
    Encoded a sentence at a time (a text longer than the context makes tokenizers warn)."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += loaded.tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(64)) + ".\n")
    return tokens[:n]


def run(
    loaded: LoadedModel,
    lengths: Sequence[int],
    page_size: int,
    store_dir: Path,
    redis_url: str | None = None,
    rounds: int = 1,
    tick: Callable[[], None] = lambda: None,
    encrypted: bool = False,
) -> dict:
    """The report behind ``kvtier bench ttft --json``: one row per length, each with
    every source's best TTFT, its ratio to recomputing, and the runs' source labels."""
    lengths = sorted(lengths)
    _warm_up(loaded, page_size)
    tiers = [Source.L1.value, Source.L2.value, Source.L3.value] + ([REDIS] if redis_url else [])
    tiers += [ENCRYPTED_L3] if encrypted else []
    cipher = throwaway_cipher() if encrypted else None
    best: dict[int, dict[str, float]] = {n: {} for n in lengths}
    labels: dict[int, dict[str, dict]] = {n: {} for n in lengths}
    with ExitStack() as stack:
        scratch = stack.enter_context(scratch_location(store_dir))
        remote = stack.enter_context(scratch_location(redis_url)) if redis_url else None
        sealed = stack.enter_context(scratch_location(store_dir)) if encrypted else None
        for r in range(rounds):
            bench = _Round(loaded, page_size, {n: prompt(loaded, n, f"{r}/{n}") for n in lengths}, tick)
            measured = bench.recompute_then_l1(scratch) | bench.l2() | bench.restarted(scratch, Source.L3.value)
            if remote is not None:
                bench.fill(remote)
                measured |= bench.restarted(remote, REDIS)
            if sealed is not None:
                bench.fill(sealed, cipher)
                measured |= bench.restarted(sealed, ENCRYPTED_L3, cipher)
            for (source, n), (seconds, sources) in measured.items():
                if seconds < best[n].get(source, math.inf):
                    best[n][source] = seconds
                labels[n][source] = sources
    rows = [
        {
            "prompt_tokens": n,
            "restored_tokens": reusable_pages(n, page_size) * page_size,
            "ttft_s": {s: round(best[n][s], 6) for s in [RECOMPUTE, *tiers]},
            "ratio_to_recompute": {s: round(best[n][s] / best[n][RECOMPUTE], 4) for s in tiers},
            "sources": labels[n],
        }
        for n in lengths
    ]
    report = {
        "model": loaded.label,
        "page_size": page_size,
        "rounds": rounds,
        "sources": [RECOMPUTE, *tiers],
        "rows": rows,
        "break_even_tokens": break_even_tokens(rows, tiers),
    }
    if encrypted:
        report["encryption"] = [
            {"prompt_tokens": n, "ratio": round(best[n][ENCRYPTED_L3] / best[n][Source.L3.value], 4)} for n in lengths
        ]
    return report


def break_even_tokens(rows: list[dict], tiers: Sequence[str]) -> dict[str, int | None]:
    """Per tier, the shortest measured prompt length from which restoring beats
    recomputing at every longer length measured (None: not at the longest)."""
    found: dict[str, int | None] = {}
    for tier in tiers:
        found[tier] = None
        for row in reversed(rows):
            if row["ratio_to_recompute"][tier] >= 1:
                break
            found[tier] = row["prompt_tokens"]
    return found


def _warm_up(loaded: LoadedModel, page_size: int) -> None:
    """One short prompt first, so no measured run pays for first-use work."""
    with Engine(loaded, EngineConfig(page_size=page_size, offload=False)) as engine:
        engine.generate([prompt(loaded, 2 * page_size, "warm-up")], FIRST_TOKEN)


def _free_links() -> Profile:
    """A profile whose links cost nothing: the plan restores every stored page."""
    return Profile(
        {name: LinkModel.of(0.0, math.inf) for name in Profile.defaults().links}, ComputeModel([1e-3, 1e-3, 0.0])
    )


class _Round:
    """One round of every cell, on this round's prompts (one per length)."""

    def __init__(
        self, loaded: LoadedModel, page_size: int, prompts: dict[int, list[int]], tick: Callable[[], None]
    ) -> None:
        self.loaded, self.page_size, self.prompts, self.tick = loaded, page_size, prompts, tick
        nbytes = loaded.geometry(page_size).nbytes
        self.room = {n: (reusable_pages(n, page_size) + 1) * nbytes for n in prompts}  # one prompt's pages

    def recompute_then_l1(self, store: Path | str) -> dict:
        """Each prompt computed, then run again from L1; the pages end in ``store``."""
        measured = {}
        with self._engine(StoreConfig(sum(self.room.values()), 0, None, store)) as engine:
            for n, tokens in self.prompts.items():
                measured[RECOMPUTE, n] = self._ttft(engine, tokens, Source.RECOMPUTED.value)
                measured[Source.L1.value, n] = self._ttft(engine, tokens, Source.L1.value)
        return measured

    def fill(self, store: Path | str, cipher: RecordCipher | None = None) -> None:
        """Each prompt computed once and its pages flushed to ``store`` (encrypted with ``cipher``)."""
        with self._engine(StoreConfig(sum(self.room.values()), 0, None, store, cipher=cipher)) as engine:
            for tokens in self.prompts.values():
                self._ttft(engine, tokens, Source.RECOMPUTED.value)

    def l2(self) -> dict:
        """Each prompt spilled to L2 by its first run (L1 holds nothing), restored by its second."""
        measured = {}
        for n, tokens in self.prompts.items():
            with self._engine(StoreConfig(0, self.room[n], None, None)) as engine:
                self._ttft(engine, tokens, Source.RECOMPUTED.value)
                measured[Source.L2.value, n] = self._ttft(engine, tokens, Source.L2.value)
        return measured

    def restarted(self, store: Path | str, name: str, cipher: RecordCipher | None = None) -> dict:
        """Each prompt restored from ``store``'s L3 by a fresh engine (empty L1 and L2)."""
        measured = {}
        for n, tokens in self.prompts.items():
            with self._engine(StoreConfig(0, 0, None, store, cipher=cipher)) as engine:
                measured[name, n] = self._ttft(engine, tokens, Source.L3.value)
        return measured

    def _engine(self, store: StoreConfig) -> Engine:
        engine = Engine(self.loaded, EngineConfig(page_size=self.page_size, store=store))
        engine.profile = _free_links()
        return engine

    def _ttft(self, engine: Engine, tokens: list[int], label: str) -> tuple[float, dict]:
        """TTFT of ``tokens`` and its source labels, which must name ``label`` for every
        reusable page (``recomputed``: no page restored). Less than a page may also come
        from L1: the start of a page another prompt (or, for L1, this one) left there."""
        (request,) = engine.generate([tokens], FIRST_TOKEN)
        self.tick()
        result = engine.result(request)
        sources = result["sources"]
        restored = (len(tokens) - sources[Source.RECOMPUTED.value]) // self.page_size
        if label == Source.RECOMPUTED.value:
            measured = restored == 0
        else:
            measured = sources[label] // self.page_size == restored == reusable_pages(len(tokens), self.page_size)
        if result["error"] or not measured:
            raise BenchError(
                f"a run of {len(tokens)} tokens meant to use {label} used {sources}"
                + (f" ({result['error']})" if result["error"] else "")
            )
        return result["ttft_s"], sources
