"""Sliding-window, recurrent-hybrid and window-and-state models restored from Redis
after a restart: the window segments, the state snapshots and the rows of two shapes
(Gemma 4) or of keys wider than values (DeepSeek-V3) go through the same record
format. RecurrentGemma has recurrent blocks and window-only attention (a snapshot and
the window rows before it); Falcon-H1 a ``CacheList`` of a Mamba-2 state and KV per
layer."""

from __future__ import annotations

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.links import Link

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .conftest import mlx_lm_greedy, text_prompt
from .kind_models import restoring_wins, write_model

pytestmark = [pytest.mark.slow, needs_redis]

PAGE = 16
GREEDY = SamplingParams(max_tokens=8)


ARCHITECTURES = [
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v32",
    "lfm2",
    "recurrent_gemma",
    "falcon_h1",
]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_restored_from_redis_after_a_restart(redis_server, tmp_path, architecture):  # noqa: F811
    loaded = load_model(str(write_model(tmp_path / architecture, architecture)))
    prompt = text_prompt(loaded, 150, seed=11)
    expected = mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)

    def engine() -> Engine:
        store = StoreConfig(1 << 26, 1 << 26, store_dir=redis_server.url, snapshot_l2_bytes=1 << 20)
        return restoring_wins(Engine(loaded, EngineConfig(page_size=PAGE, store=store, snapshot_spacing=2)))

    first = engine()
    (cold,) = first.generate([prompt], GREEDY)
    first.close()
    second = engine()
    (restored,) = second.generate([prompt], GREEDY)
    stats, geometry = second.stats().store, second.geometry
    second.close()
    assert cold.output == expected and restored.output == expected
    assert restored.sources() == {"L1": 0, "L2": 0, "L3": 144, "recomputed": 6}
    assert stats.l3.backend == "redis" and stats.links[Link.L3_L1].pages == 9
    if geometry.snapshot_nbytes:  # the state after page 9, with them
        assert stats.snapshots.links[Link.L3_L1].pages == 1
    if geometry.window is not None:  # the window layers' rows of 2 of the 9 pages only
        assert stats.links[Link.L3_L1].bytes < 9 * geometry.nbytes
