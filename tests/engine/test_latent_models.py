"""Multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-4.7-Flash): a ``KVCache`` per
layer whose keys (a latent) are wider than its values (a rope part). A page row holds
them side by side (``RowShape.fused``); DeepSeek-V3.2 adds an indexer's keys in each
layer, rows of another shape (``PageGeometry.blocks``). Restored from L1, L2 and LMDB
after a restart with mlx-lm's own greedy output."""

from __future__ import annotations

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.links import Link
from kvtier.tiers.page import RowShape, reusable_pages

from .. import cli
from .conftest import chat_turns, mlx_lm_greedy, shared_start_after_restart, text_prompt
from .kind_models import CONFIGS, restoring_wins, write_model

PAGE = 16
GREEDY = SamplingParams(max_tokens=8)
LATENT, ROPE = CONFIGS["deepseek_v3"]["kv_lora_rank"], CONFIGS["deepseek_v3"]["qk_rope_head_dim"]
INDEXER = CONFIGS["deepseek_v32"]["index_head_dim"]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def deepseek(tmp_path_factory, request):
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / request.param, request.param)))


def make_engine(loaded, store_dir, l1_bytes: int = 1 << 26, answers: bool = False) -> Engine:
    store = StoreConfig(l1_bytes=l1_bytes, l2_bytes=1 << 26, store_dir=store_dir)
    return restoring_wins(Engine(loaded, EngineConfig(page_size=PAGE, store=store, publish_answers=answers)))


def test_a_page_row_is_the_latent_and_the_rope_part_side_by_side(deepseek):
    g = make_engine(deepseek, None).geometry
    latent = RowShape(1, LATENT, ROPE)
    if deepseek.path.name == "deepseek_v3":
        assert g.fused and set(g.shapes) == {latent}
        assert g.shape == (2, 1, 1, PAGE, LATENT + ROPE)  # 2 layers, 1 latent "head"
        assert g.bytes_per_token == 2 * (LATENT + ROPE) * 4  # float32: not a 2 x 32-wide K and V
        return
    indexer = RowShape(1, INDEXER, INDEXER)  # each layer's latent, then its indexer's keys
    assert g.shapes == (latent, indexer) * 2 and g.rows == (0, 2, 1, 3) and not g.uniform
    assert g.bytes_per_token == 2 * (LATENT + ROPE) * 4 + 2 * 2 * INDEXER * 4


def test_restored_from_l1_l2_and_lmdb_equals_mlx_lm(deepseek, tmp_path):
    prompt = text_prompt(deepseek, 150, seed=3)
    expected = mlx_lm_greedy(deepseek, prompt, GREEDY.max_tokens)
    pages = reusable_pages(len(prompt), PAGE)
    restored = {"L1": 0, "L2": 0, "L3": 0, "recomputed": len(prompt) - pages * PAGE}

    engine = make_engine(deepseek, tmp_path)
    (cold,) = engine.generate([prompt], GREEDY)
    (warm,) = engine.generate([prompt], GREEDY)
    engine.close()
    assert cold.output == expected and cold.sources()["recomputed"] == len(prompt)
    assert warm.output == expected and warm.sources()["L1"] == len(prompt) - 1

    engine = make_engine(deepseek, tmp_path)  # a restart: LMDB has the pages
    (from_l3,) = engine.generate([prompt], GREEDY)
    links = engine.stats().store.links
    engine.close()
    assert from_l3.output == expected and from_l3.sources() == {**restored, "L3": pages * PAGE}
    assert links[Link.L3_L1].pages == pages

    engine = make_engine(deepseek, None, l1_bytes=1)  # L1 holds no page: each goes to L2
    engine.generate([prompt], GREEDY)
    (from_l2,) = engine.generate([prompt], GREEDY)
    joined = engine.stats().store.links[Link.L2_L1]
    engine.close()
    assert from_l2.output == expected and from_l2.sources() == {**restored, "L2": pages * PAGE}
    assert joined.bytes == pages * engine.geometry.nbytes


def test_a_shared_start_restores_at_another_length(deepseek, tmp_path):
    request, expected = shared_start_after_restart(deepseek, make_engine, tmp_path, 70, GREEDY.max_tokens)
    assert request.output == expected and request.sources()["L3"] == 64


def test_next_chat_turn_reuses_the_previous_prompt_and_answer(deepseek):
    engine = make_engine(deepseek, None, answers=True)
    next_turn, previous = chat_turns(deepseek, engine, GREEDY.max_tokens)
    engine.close()
    assert next_turn.sources()["L1"] == previous  # its pages and the partial page after them


def test_a_quantizing_codec_is_refused_in_one_line(deepseek, tmp_path):
    """The quantizing codecs cut groups by layer, K and V of one width: a latent page stays raw."""
    done = cli.run(["run", "--model", deepseek.path, "--page-size", PAGE, "--l2-codec", "q8", "--prompt", "hi"])
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == (
        "kvtier: error: the q8 codec needs pages whose rows have one shape, keys as wide as values; "
        "this model's pages cannot be quantized\n"
    )
