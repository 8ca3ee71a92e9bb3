"""Models with sliding-window layers and recurrent state together, and no global layer
needed: RecurrentGemma (``ArraysCache`` recurrent blocks and ``RotatingKVCache``
attention blocks, every attention layer a window) and Baichuan-M1 (a ``CacheList`` per
layer of a short-convolution state over K/V and a window or global KV cache). A restore
is a snapshot and the window rows before it; greedy output equal to mlx-lm's own."""

from __future__ import annotations

import pytest

from kvtier.engine.models.load import load_model

from .conftest import mlx_lm_greedy, shared_start_after_restart, text_prompt
from .kind_models import write_model
from .test_hybrid_models import GREEDY, make_engine, run_one, sources


@pytest.fixture(scope="module", params=["recurrent_gemma", "baichuan_m1"])
def model(request, tmp_path_factory):
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / request.param, request.param)))


def test_restored_from_l1_l2_and_lmdb_after_a_restart_equals_mlx_lm(model, tmp_path):
    prompt = text_prompt(model, 150, seed=3)  # 9 full pages before the last token
    expected = mlx_lm_greedy(model, prompt, GREEDY.max_tokens)
    engine = make_engine(model, tmp_path)
    kinds = {k.name for k in engine.geometry.kinds}
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    engine.close()
    assert kinds >= {"window", "state"} and engine.geometry.window.window == 32
    assert cold.output == expected and cold.sources() == sources(recomputed=150)
    assert warm.output == expected and warm.sources() == sources(l1=144, recomputed=6)

    engine = make_engine(model, tmp_path)  # a restart: LMDB has the pages and snapshots
    restored = run_one(engine, prompt)
    engine.close()
    assert restored.output == expected and restored.sources() == sources(l3=144, recomputed=6)

    engine = make_engine(model, None, l1_bytes=1, snapshot_l1=1)  # no page or snapshot stays in L1
    cold, warm = run_one(engine, prompt), run_one(engine, prompt)
    engine.close()
    assert cold.output == expected and warm.output == expected and warm.sources() == sources(l2=144, recomputed=6)


def test_a_shorter_shared_start_restores_from_an_earlier_snapshot(model, tmp_path):
    """70 shared tokens: 4 full pages, the snapshot after page 4 (one every 2 pages) and
    the window rows of pages 3 and 4, read from LMDB after a restart."""
    request, expected = shared_start_after_restart(model, make_engine, tmp_path, 70, GREEDY.max_tokens)
    assert request.output == expected and request.sources() == sources(l3=64, recomputed=46)
