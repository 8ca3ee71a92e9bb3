"""Sliding-window models (mlx-lm ``RotatingKVCache`` layers beside global ones): restored
from every tier with mlx-lm's own greedy output, and only the window read for them; a
Gemma 3 layout (one row shape), a Gemma 4 one (window and global rows of different
shapes, so a page is flat: ``PageGeometry.uniform``) and gpt-oss's (attention sinks)."""

from __future__ import annotations

import os

import pytest
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import ModelError, layer_kind, load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.links import Link
from kvtier.tiers.page import reusable_pages

from .. import cli
from ..tiers.lmdb_files import damage_last_byte
from .conftest import chat_turns, mlx_lm_greedy, shared_start_after_restart, stored_once, text_prompt
from .kind_models import CONFIGS, restoring_wins, write_model

PAGE = 16
WINDOW = CONFIGS["gemma3_text"]["sliding_window"]
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3's layout: the window model other modules' tests restore."""
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / "gemma3_text", "gemma3_text")))


@pytest.fixture(scope="module", params=["gemma3_text", "gemma4_text", "gpt_oss"])
def windowed(tmp_path_factory, request):
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / request.param, request.param)))


def make_engine(loaded, store_dir, l1_bytes: int = 1 << 26, step: int = 2048, answers: bool = False) -> Engine:
    store = StoreConfig(l1_bytes=l1_bytes, l2_bytes=1 << 26, store_dir=store_dir)
    config = EngineConfig(page_size=PAGE, store=store, prefill_step_size=step, publish_answers=answers)
    return restoring_wins(Engine(loaded, config))


def run_one(engine: Engine, prompt: list[int]):
    (request,) = engine.generate([prompt], GREEDY)
    return request


def window_read_bytes(engine: Engine, pages: int) -> int:
    """Raw bytes a restore of ``pages`` pages reads: every page's global rows, and the
    window rows of the last pages only, those that hold the window's tokens (the
    prefix ends on a page boundary)."""
    global_rows, window_rows = engine.geometry.segments
    return pages * global_rows + min(pages, WINDOW // PAGE) * window_rows


@pytest.mark.parametrize("step", [8, 2048])  # prefill chunks within a page, and the whole prompt at once
def test_window_model_restored_from_l1_and_lmdb_equals_mlx_lm(windowed, tmp_path, step):
    prompt = text_prompt(windowed, 150, seed=3)
    expected = mlx_lm_greedy(windowed, prompt, GREEDY.max_tokens)
    pages = reusable_pages(len(prompt), PAGE)
    engine = make_engine(windowed, tmp_path, step=step)
    assert engine.geometry.window is not None and engine.namespace.layers  # the kinds are in the namespace
    assert engine.geometry.uniform == (windowed.path.name != "gemma4_text")  # Gemma 4's pages are flat
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    engine.close()
    assert cold.output == expected and cold.sources()["recomputed"] == len(prompt)
    assert warm.output == expected and warm.sources()["L1"] == len(prompt) - 1

    engine = make_engine(windowed, tmp_path, step=step)  # a restart: LMDB has the pages
    restored = run_one(engine, prompt)
    read = engine.stats().store.links[Link.L3_L1]
    engine.close()
    assert restored.output == expected
    assert restored.sources() == {"L1": 0, "L2": 0, "L3": pages * PAGE, "recomputed": len(prompt) - pages * PAGE}
    raw = window_read_bytes(engine, pages)
    assert raw < pages * engine.geometry.nbytes  # the window layers of the early pages were not read
    assert read.pages == pages and raw <= read.bytes < raw + pages * 1024  # each record's header on top


def test_window_model_restored_from_l2_reads_only_the_window(windowed, tmp_path):
    prompt = text_prompt(windowed, 120, seed=4)
    expected = mlx_lm_greedy(windowed, prompt, GREEDY.max_tokens)
    pages = reusable_pages(len(prompt), PAGE)
    engine = make_engine(windowed, None, l1_bytes=1)  # L1 holds no page: every published page goes to L2
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    joined = engine.stats().store.links[Link.L2_L1]
    engine.close()
    assert cold.output == expected and warm.output == expected
    assert warm.sources() == {"L1": 0, "L2": pages * PAGE, "L3": 0, "recomputed": len(prompt) - pages * PAGE}
    assert joined.bytes == window_read_bytes(engine, pages) and joined.pages == pages


def test_window_model_shared_start_restores_at_another_length(windowed, tmp_path):
    """A second prompt sharing only the first pages restores a shorter prefix: its
    window is other pages' window rows, read from LMDB after a restart."""
    request, expected = shared_start_after_restart(windowed, make_engine, tmp_path, 70, GREEDY.max_tokens)
    assert request.output == expected and request.sources()["L3"] == 64  # 4 pages of the 70 shared tokens


def test_next_chat_turn_restores_the_previous_prompt_and_answer(windowed):
    """With answers published (a server's setting), the answer's pages are published as
    they fill: by the end a window layer holds only its last tokens."""
    engine = make_engine(windowed, None, answers=True)
    next_turn, previous = chat_turns(windowed, engine, GREEDY.max_tokens)
    engine.close()
    assert next_turn.sources()["L1"] == previous  # 8 pages and the partial page after them


def test_a_restored_and_a_fresh_request_in_one_batch(windowed, tmp_path):
    shared = text_prompt(windowed, 120, seed=9)
    other = text_prompt(windowed, 70, seed=10)
    engine = make_engine(windowed, tmp_path)
    run_one(engine, shared)
    restored, fresh = engine.generate([shared, other], GREEDY)
    engine.close()
    assert restored.output == mlx_lm_greedy(windowed, shared, GREEDY.max_tokens) and restored.sources()["L1"] == 119
    assert fresh.output == mlx_lm_greedy(windowed, other, GREEDY.max_tokens) and fresh.sources()["recomputed"] == 70


def test_what_cannot_be_served_is_refused_in_one_line_naming_it(windowed):
    with pytest.raises(ModelError, match=r"^kvtier cannot serve RotatingKVCache\(keep=4\)"):
        layer_kind(RotatingKVCache(max_size=64, keep=4))  # what make_prompt_cache(max_kv_size=...) builds
    with pytest.raises(ModelError, match=r"^kvtier cannot serve ChunkedKVCache layers: mlx-lm's BatchGenerator"):
        layer_kind(ChunkedKVCache(32))  # Llama 4's chunked attention: no merge, so no batch
    with pytest.raises(ModelError, match=r"^page size 64 is larger than this model's sliding window \(32 tokens\)$"):
        windowed.geometry(64)


@pytest.mark.parametrize(
    "damaged, restored_pages",
    [
        ([8], 8),  # the last page: the 8 before it, with page 6's window rows read now
        ([8, 6], 6),  # and the window rows of page 6, which the first read skipped: 6 pages
    ],
)
def test_a_window_restore_cut_short_by_a_bad_page_restores_up_to_it(windowed, tmp_path, damaged, restored_pages):
    prompt = text_prompt(windowed, 150, seed=11)  # 9 pages; the window (2 pages) sees pages 7 and 8
    expected = mlx_lm_greedy(windowed, prompt, GREEDY.max_tokens)
    keys = stored_once(make_engine(windowed, tmp_path), prompt)
    damage_last_byte(tmp_path, [keys[i] for i in damaged])  # a window row's byte
    engine = make_engine(windowed, tmp_path)
    restored = run_one(engine, prompt)
    failures = engine.stats().store.tiers["L3"].checksum_failures
    engine.close()
    assert restored.output == expected and failures == len(damaged)
    tokens = restored_pages * PAGE
    assert restored.sources() == {"L1": 0, "L2": 0, "L3": tokens, "recomputed": len(prompt) - tokens}


def test_a_quantizing_codec_is_refused_before_any_work_on_pages_of_two_row_shapes(windowed, tmp_path):
    """The quantizing codecs group each row's K and V of one shape; a Gemma 4 page
    stays raw, and asking for q8 is one line before calibration or a model run."""
    calibrating = {k: v for k, v in os.environ.items() if k != "KVTIER_NO_AUTO_CALIBRATE"}  # a store's first use
    done = cli.run(
        [
            "run",
            "--model",
            windowed.path,
            "--page-size",
            PAGE,
            "--store",
            tmp_path,
            "--l3-codec",
            "q8",
            "--prompt",
            "hi",
        ],
        env=calibrating,
    )
    if windowed.path.name != "gemma4_text":
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2 and not done.stdout and not list(tmp_path.iterdir())
    assert (
        done.stderr == "kvtier: error: the q8 codec needs pages whose rows have one shape, keys as wide as values; "
        "this model's pages cannot be quantized\n"
    )
