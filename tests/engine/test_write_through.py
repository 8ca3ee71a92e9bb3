"""Write-through on the engine and the CLI (``--l3-write-through``): two engines of one
L3, the second restores from L3 what the first computed while the first is still
running with those pages in its L1; the flag reaches the store; it needs a store."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace

import pytest

from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.store_config import open_l3_of

from .. import cli
from .conftest import on_tiny_model, text_prompt

PAGE = 16
GREEDY = SamplingParams(max_tokens=4)


@contextmanager
def two_engines(loaded, store_dir, through: bool):
    """Engine A (write-through or not) and engine B over one L3, opened once (one process)."""
    shared = open_l3_of(StoreConfig(store_dir=store_dir))
    engines = [
        Engine(
            loaded,
            EngineConfig(page_size=PAGE, store=StoreConfig(shared_l3=shared, l3_write_through=on)),
        )
        for on in (through, False)
    ]
    try:
        yield engines
    finally:
        for engine in engines:
            engine.close()
        shared.close()


@pytest.mark.parametrize("through", [True, False])
def test_a_prompt_one_engine_computed_is_restored_from_l3_by_the_other(loaded, tmp_path, through):
    prompt = text_prompt(loaded, 5 * PAGE + 3, seed=11)
    with two_engines(loaded, tmp_path / "l3", through) as (a, b):
        (first,) = a.generate([prompt], GREEDY)
        a.store.settle()  # the queued writes committed (A is still open: nothing flushed)
        (second,) = b.generate([prompt], GREEDY)
    assert first.sources()["recomputed"] == len(prompt)
    assert second.output == first.output
    if through:
        assert second.sources()["L3"] == 5 * PAGE  # every full page; the last token is computed
    else:
        assert second.sources()["recomputed"] == len(prompt)  # write-back: A's pages are in its L1 only


def test_pages_computed_beside_an_overlapped_restore_are_not_written_through(loaded, tmp_path):
    """An overlapped plan computes its first pages while the rest load from L3: those pages
    are below already, so publishing them copies nothing to L3 before the first token."""
    prompt = text_prompt(loaded, 12 * PAGE + 7, seed=30)
    with Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path))) as first:
        first.generate([prompt], GREEDY)  # closed: every page flushed to L3
    per_page = 0.05
    store = StoreConfig(store_dir=tmp_path, throttle={"L3": 1.5 * loaded.geometry(PAGE).nbytes / per_page})
    with Engine(loaded, EngineConfig(page_size=PAGE, store=replace(store, l3_write_through=True))) as engine:
        engine.profile = Profile(
            {**Profile.defaults().links, "L3->L1": LinkModel.of(0.0, 1 << 40)},
            ComputeModel([0.0, per_page / PAGE, 0.0]),
        )
        (request,) = engine.generate([prompt], GREEDY)
        assert request.plan.overlap_pages > 0 and request.plan.first_loaded > 0
        assert request.sources()["recomputed"] == len(prompt) - 12 * PAGE + request.plan.first_loaded * PAGE
        assert engine.store.links["L1->L3"].pages == 0


PROMPT = "the system prompt of an agent with tools " * 3  # ~120 tokens: 7 pages of 16


def links(*args: str) -> dict:
    done = cli.run(
        on_tiny_model(["run", "--json", "--page-size", "16", "--max-tokens", "1", "--prompt", PROMPT, *args])
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])["counters"]["links"]


@pytest.mark.slow
def test_the_flag_reaches_the_store_a_page_spilled_after_its_write_through_is_not_written_again(tmp_path):
    small_l1 = ["--l1-bytes", "1MiB", "--no-auto-calibrate"]  # two of the tiny model's pages of 16
    back = links("--store", str(tmp_path / "back"), *small_l1)
    through = links("--store", str(tmp_path / "through"), *small_l1, "--l3-write-through")
    for counted in (back, through):
        assert counted["L1->L2"]["pages"] == 6 and counted["L1->L3"]["pages"] + counted["L2->L3"]["pages"] == 7
    assert back["L2->L3"]["pages"] == 6  # write-back: the spilled pages are written from L2 at close
    assert through["L2->L3"]["pages"] < 6  # only the pages L1 refused at publish; the others were in L3
    listing = cli.run(["store", "ls", "--json", "--store", str(tmp_path / "through")])
    assert json.loads(listing.stdout)["pages"] == 7


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--prompt", "hi", "--l3-write-through"],
        ["run", "--prompt", "hi", "--l3-write-through", "--no-offload", "--store", "{store}"],
        ["serve", "--port", "0", "--l3-write-through"],
    ],
    ids=["run without --store", "run --no-offload", "serve without --store"],
)
def test_write_through_without_a_store_is_one_line_exit_2(tmp_path, argv):
    argv = [str(tmp_path / "store") if a == "{store}" else a for a in argv]
    done = cli.run(on_tiny_model(argv))
    assert done.returncode == 2
    assert "--l3-write-through needs --store" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_write_through_with_a_write_budget_is_one_line_exit_2(tmp_path, command):
    store = tmp_path / "store"
    done = cli.run(
        on_tiny_model([*command, "--store", str(store), "--l3-write-through", "--l3-write-budget", "1GiB/h"])
    )
    assert done.returncode == 2
    assert "--l3-write-through and --l3-write-budget exclude each other" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not store.exists()
