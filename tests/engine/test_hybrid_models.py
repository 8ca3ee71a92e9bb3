"""Recurrent hybrids (mlx-lm ``ArraysCache`` layers between attention layers): the state
after a page is a snapshot, restored from every tier with the pages before it, greedy
output equal to mlx-lm's own."""

from __future__ import annotations

import json

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.links import Link
from kvtier.tiers.page import ChainRoot, snapshot_key

from .. import cli
from ..tiers.lmdb_files import damage_last_byte
from .conftest import chat_turns, mlx_lm_greedy, stored_once, text_prompt
from .kind_models import restoring_wins, write_model

PAGE = 16
SPACING = 2  # a snapshot every 2 pages, and at each prompt's last full page
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / "lfm2", "lfm2")))


@pytest.fixture(scope="module", params=["lfm2", "falcon_h1"])
def hybrid(request, tmp_path_factory):
    """Both hybrid layouts: state layers between attention layers (lfm2), and a
    ``CacheList`` of a Mamba-2 state and a KV cache in every layer (falcon_h1)."""
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / request.param, request.param)))


def make_engine(
    loaded, store_dir, l1_bytes: int = 1 << 26, step: int = 2048, snapshot_l1: int = 1 << 20, answers: bool = False
) -> Engine:
    store = StoreConfig(
        l1_bytes=l1_bytes,
        l2_bytes=1 << 26,
        store_dir=store_dir,
        snapshot_l1_bytes=snapshot_l1,
        snapshot_l2_bytes=1 << 20,
    )
    config = EngineConfig(
        page_size=PAGE, store=store, prefill_step_size=step, snapshot_spacing=SPACING, publish_answers=answers
    )
    return restoring_wins(Engine(loaded, config))


def run_one(engine: Engine, prompt: list[int]):
    (request,) = engine.generate([prompt], GREEDY)
    return request


def sources(l1=0, l2=0, l3=0, recomputed=0) -> dict:
    return {"L1": l1, "L2": l2, "L3": l3, "recomputed": recomputed}


@pytest.mark.parametrize("step", [8, 2048])  # prefill chunks within a page, and the whole prompt at once
def test_hybrid_restored_from_l1_and_lmdb_equals_mlx_lm(hybrid, tmp_path, step):
    prompt = text_prompt(hybrid, 150, seed=3)  # 9 full pages before the last token
    expected = mlx_lm_greedy(hybrid, prompt, GREEDY.max_tokens)
    engine = make_engine(hybrid, tmp_path, step=step)
    assert engine.geometry.snapshot_nbytes and "state" in engine.namespace.layers
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    kept = engine.store.accounts.view().snapshots[0].pages
    engine.close()
    assert cold.output == expected and cold.sources() == sources(recomputed=150)
    # the snapshot after page 9 (the prompt's last full page); the partial page's state is
    # after all 150 tokens, which a prompt that must compute its last token cannot use
    assert warm.output == expected and warm.sources() == sources(l1=144, recomputed=6)
    assert kept == 5  # after pages 2, 4, 6, 8 and 9

    engine = make_engine(hybrid, tmp_path, step=step)  # a restart: LMDB has the pages and snapshots
    restored = run_one(engine, prompt)
    stats = engine.stats()
    engine.close()
    assert restored.output == expected and restored.sources() == sources(l3=144, recomputed=6)
    read = stats.store.snapshots.links[Link.L3_L1]
    assert read.pages == 1 and read.bytes > engine.geometry.snapshot_nbytes  # one record, its header on top


def test_hybrid_restored_from_l2(lfm2, tmp_path):
    prompt = text_prompt(lfm2, 100, seed=4)
    expected = mlx_lm_greedy(lfm2, prompt, GREEDY.max_tokens)
    engine = make_engine(lfm2, None, l1_bytes=1, snapshot_l1=1)  # no page or snapshot stays in L1
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    stats = engine.stats()
    engine.close()
    assert cold.output == expected and warm.output == expected
    assert warm.sources() == sources(l2=96, recomputed=4)
    joined = stats.store.snapshots.links[Link.L2_L1]
    assert joined.bytes == engine.geometry.snapshot_nbytes and joined.pages == 1


def test_corrupt_snapshot_falls_back_to_an_earlier_one(lfm2, tmp_path):
    prompt = text_prompt(lfm2, 150, seed=5)
    expected = mlx_lm_greedy(lfm2, prompt, GREEDY.max_tokens)
    keys = stored_once(make_engine(lfm2, tmp_path), prompt)
    damage_last_byte(tmp_path, [snapshot_key(keys[8])])  # the snapshot after page 9
    engine = make_engine(lfm2, tmp_path)
    restored = run_one(engine, prompt)
    failures = engine.stats().store.tiers["L3"].checksum_failures
    engine.close()
    assert restored.output == expected and failures == 1
    assert restored.sources() == sources(l3=128, recomputed=22)  # from the snapshot after page 8


def test_missing_snapshots_recompute(lfm2):
    """Pages without any snapshot after them (the snapshot tiers too small to keep one)
    are not restored: attention KV never goes without its state."""
    prompt = text_prompt(lfm2, 100, seed=6)
    expected = mlx_lm_greedy(lfm2, prompt, GREEDY.max_tokens)
    store = StoreConfig(l1_bytes=1 << 26, l2_bytes=1 << 26, snapshot_l1_bytes=1, snapshot_l2_bytes=1)
    engine = restoring_wins(Engine(lfm2, EngineConfig(page_size=PAGE, store=store, snapshot_spacing=SPACING)))
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    pages = engine.store.accounts.view().l1.pages
    engine.close()
    assert cold.output == expected and warm.output == expected
    assert pages >= 6 and warm.sources() == sources(recomputed=100)  # the pages were there


def test_a_shared_prefix_found_in_the_store_gets_a_snapshot_at_its_end(lfm2, tmp_path):
    """A new conversation on another's system prompt (90 tokens: 5 pages and 10 tokens;
    snapshots every 2 pages): the first to share it restores 4 pages and keeps the state
    after the 5th, and after the 90th token (it leaves the first's 6th page there), so
    the next restores all 90 tokens."""
    system = text_prompt(lfm2, 150, seed=13)[:90]
    first, second, third = (
        system + lfm2.tokenizer.encode(f"{c} ") + text_prompt(lfm2, 40, seed=s) for c, s in zip("xyz", (14, 15, 16))
    )
    engine = make_engine(lfm2, tmp_path)
    turns = [run_one(engine, prompt) for prompt in (first, second, third)]
    engine.close()
    assert [t.output for t in turns] == [mlx_lm_greedy(lfm2, p, GREEDY.max_tokens) for p in (first, second, third)]
    assert [t.sources()["L1"] for t in turns] == [0, 64, 90]


def test_next_chat_turn_reuses_the_whole_previous_prompt(lfm2, tmp_path):
    first = text_prompt(lfm2, 90, seed=7)
    answer = mlx_lm_greedy(lfm2, first, GREEDY.max_tokens)
    second = first + answer + text_prompt(lfm2, 30, seed=8)
    expected = mlx_lm_greedy(lfm2, second, GREEDY.max_tokens)
    engine = make_engine(lfm2, tmp_path)
    run_one(engine, first)
    turn = run_one(engine, second)
    engine.close()
    # its 5 pages and the partial page after them with the state at the prompt's end
    assert turn.output == expected and turn.sources()["L1"] == len(first)


def test_next_chat_turn_restores_the_previous_prompt_and_answer(lfm2):
    """With answers published (a server's setting): the answer's pages as they fill, and
    its end in L1 with the state after the whole turn."""
    engine = make_engine(lfm2, None, answers=True)
    next_turn, previous = chat_turns(lfm2, engine, GREEDY.max_tokens)
    kept = engine.store.accounts.view().snapshots[0].pages
    engine.close()
    assert next_turn.sources()["L1"] == previous
    assert kept == 6  # after pages 2, 4, 5 (the first prompt's last full page), 6, 8 (its answer), 9 (the second's)


def test_a_restored_and_a_fresh_request_in_one_batch(hybrid, tmp_path):
    """With the snapshot spacing the cost model chooses (the prompt's last full page is
    always one)."""
    shared = text_prompt(hybrid, 120, seed=9)
    other = text_prompt(hybrid, 70, seed=10)
    store = StoreConfig(1 << 26, 1 << 26, store_dir=tmp_path, snapshot_l2_bytes=1 << 20)
    engine = restoring_wins(Engine(hybrid, EngineConfig(page_size=PAGE, store=store)))
    run_one(engine, shared)
    restored, fresh = engine.generate([shared, other], GREEDY)
    engine.close()
    assert restored.output == mlx_lm_greedy(hybrid, shared, GREEDY.max_tokens) and restored.sources()["L1"] == 112
    assert fresh.output == mlx_lm_greedy(hybrid, other, GREEDY.max_tokens) and fresh.sources()["recomputed"] == 70


def test_snapshot_counters_persist_in_the_store(lfm2, tmp_path):
    prompt = text_prompt(lfm2, 150, seed=12)
    engine = make_engine(lfm2, tmp_path)
    run_one(engine, prompt)
    taken = engine.stats().store.snapshots.tiers["L1"].inserts
    engine.close()  # flushes the snapshots to L3 and adds this run's counters to the store's
    done = cli.run(["stats", "--store", tmp_path, "--json"])
    snapshots = json.loads(done.stdout)["snapshots"]
    assert taken == 5 and snapshots["tiers"]["L1"]["inserts"] == taken
    written = snapshots["links"]["L1->L3"]
    assert written["pages"] == taken and written["bytes"] == taken * engine.geometry.snapshot_nbytes
    metrics = cli.run(["stats", "--store", tmp_path, "--prometheus"]).stdout
    assert f'kvtier_snapshot_link_pages_total{{snapshot_link="L1->L3"}} {float(taken)}' in metrics


def test_tenant_roots_keep_a_hybrid_models_turns_apart(lfm2, tmp_path):
    """Two callers' roots (DESIGN §9a) with the first prompt's 5 pages declared shared:
    the caller who sent it restores it all, its partial page and state included (they
    follow the shared pages under her root); the other finds the shared pages and the
    snapshot after them, nothing of hers past them."""
    first = text_prompt(lfm2, 90, seed=7)
    second = first + mlx_lm_greedy(lfm2, first, GREEDY.max_tokens) + text_prompt(lfm2, 30, seed=8)
    expected = mlx_lm_greedy(lfm2, second, GREEDY.max_tokens)
    alice, bob = ChainRoot(b"a" * 32, shared_pages=5), ChainRoot(b"b" * 32, shared_pages=5)
    engine = make_engine(lfm2, tmp_path)
    turns = []
    for prompt, root in ((first, alice), (second, alice), (second, bob)):
        turns.append(engine.submit(prompt, GREEDY, root))
        engine.run()
    engine.close()
    _, hers, his = turns
    assert hers.output == his.output == expected
    assert hers.sources()["L1"] == len(first) and his.sources()["L1"] == 5 * PAGE
