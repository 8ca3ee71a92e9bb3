"""Engine behaviour against the outside oracle (mlx_lm's own greedy generation)."""

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvtier.engine.engine import Engine, EngineConfig, InputError
from kvtier.engine.limits import check_prompt
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import page_keys, reusable_pages

from .conftest import mlx_lm_greedy, text_prompt

PAGE = 64
GREEDY = SamplingParams(max_tokens=8)


def make_engine(loaded, store_dir=None, l1_bytes=1 << 30, l2_bytes=1 << 30, step=2048) -> Engine:
    store = StoreConfig(l1_bytes=l1_bytes, l2_bytes=l2_bytes, l3_bytes=1 << 30, store_dir=store_dir)
    return Engine(loaded, EngineConfig(page_size=PAGE, store=store, prefill_step_size=step))


def run_one(engine: Engine, prompt: list[int]):
    (request,) = engine.generate([prompt], GREEDY)
    return request


# page-aligned + 1, page-aligned, short, and over 1,000 tokens
PROMPTS = {"aligned+1": 4 * PAGE + 1, "aligned": 3 * PAGE, "short": 100, "long": 1100}


@pytest.mark.parametrize("name", PROMPTS)
def test_restored_output_equals_mlx_lm_from_every_tier(loaded, tmp_path, name):
    prompt = text_prompt(loaded, PROMPTS[name], seed=len(name))
    expected = mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    reusable = reusable_pages(len(prompt), PAGE) * PAGE

    engine = make_engine(loaded, tmp_path)
    cold = run_one(engine, prompt)
    warm = run_one(engine, prompt)  # its pages, and the start of its last page (partial or full) in L1
    engine.close()
    assert cold.output == expected and cold.sources()["recomputed"] == len(prompt)
    assert warm.output == expected and warm.sources()["L1"] == len(prompt) - 1

    engine = make_engine(loaded, tmp_path)  # a restart: only L3 has the pages (partial pages are not kept)
    from_l3 = run_one(engine, prompt)
    # every page from_l3 restored is kept in L1, and so is the page it computed over L3's copy
    # (an aligned prompt's last page); from_l3 left its partial page: all but the last token are L1
    again = run_one(engine, prompt)
    engine.close()
    assert (
        from_l3.output == expected
        and from_l3.sources()["L3"] == reusable == len(prompt) - from_l3.sources()["recomputed"]
    )
    assert again.output == expected and again.sources()["L1"] == len(prompt) - 1


def test_restored_output_equals_mlx_lm_from_l2(loaded):
    prompt = text_prompt(loaded, 5 * PAGE + 7, seed=3)
    engine = make_engine(loaded, None, l1_bytes=0)
    run_one(engine, prompt)
    again = run_one(engine, prompt)
    assert again.sources()["L2"] == 5 * PAGE
    assert again.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)


class CountingModel:
    """The model, counting the tokens it is run over (every forward pass, whoever calls it)."""

    def __init__(self, model) -> None:
        self.model, self.tokens = model, 0

    def __call__(self, inputs, *args, **kwargs):
        self.tokens += inputs.size
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_recomputed_tokens_are_the_tokens_run_through_the_model(loaded):
    """The ``recomputed`` label equals the prompt tokens the model really ran over: a
    run's forward tokens minus those of decoding (mlx-lm feeds every token it samples
    back, the last one and an EOS, not in the output, too). The last prompt token is always
    among them. Each prompt runs twice: once after the others (which may share its
    first tokens), once more after itself."""
    counting = CountingModel(loaded.model)
    engine = make_engine(dataclasses.replace(loaded, model=counting))
    for n in (1, PAGE, PAGE + 1, 2 * PAGE, 2 * PAGE + 5):
        prompt = text_prompt(loaded, n, seed=n)
        for _ in range(2):
            counting.tokens = 0
            request = run_one(engine, prompt)
            decoding = len(request.output) + (request.finish_reason == "stop")
            assert request.sources()["recomputed"] == counting.tokens - decoding >= 1
            assert sum(request.sources().values()) == n
        assert request.sources()["recomputed"] == 1


# Restore-then-compute and one full forward reduce attention in different orders, so
# their float32 logits differ by rounding that depends on the BLAS (0 on mlx's reference
# BLAS; up to about 4e-4 of the largest logit with OpenBLAS's blocked kernels). The
# tolerance is scaled to the logits compared, with room for BLAS we cannot run here
# (Accelerate); what must be exact is what the engine uses: the argmax and the greedy tokens.
LOGIT_RTOL_OF_MAX = 5e-3


def test_next_token_logits_after_restore_match_full_recompute(loaded):
    prompt = text_prompt(loaded, 6 * PAGE + 10, seed=11)
    engine = make_engine(loaded)
    run_one(engine, prompt)
    keys = page_keys(engine.namespace, prompt)[: reusable_pages(len(prompt), PAGE)]
    restored = engine.store.restore(keys, prompt)
    cut = restored.num_pages * PAGE
    assert cut == 6 * PAGE
    cache = make_prompt_cache(loaded.model)
    for layer, (k, v) in zip(cache, restored.layers):
        layer.state = (k, v, cut)
    after_restore = np.array(loaded.model(mx.array([prompt[cut:]]), cache=cache)[0, -1])
    full = np.array(loaded.model(mx.array([prompt]))[0, -1])
    scale = float(np.abs(full).max())
    np.testing.assert_allclose(after_restore, full, atol=LOGIT_RTOL_OF_MAX * scale, rtol=0)
    assert after_restore.argmax() == full.argmax()
    greedy = [int(after_restore.argmax())]
    for _ in range(GREEDY.max_tokens - 1):
        greedy.append(int(mx.argmax(loaded.model(mx.array([greedy[-1:]]), cache=cache)[0, -1]).item()))
    expected = mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)  # EOS excluded: maybe shorter
    assert expected and greedy[: len(expected)] == expected


def test_pages_are_published_after_every_prefill_step(loaded):
    prompt = text_prompt(loaded, 8 * PAGE, seed=5)
    engine = make_engine(loaded, step=2 * PAGE)
    engine.submit(prompt, GREEDY)
    engine.step()
    assert engine.store.l1.counters.pages == 2, "the first step's full pages must be visible at once"
    engine.run()
    assert engine.store.l1.counters.pages == len(prompt) // PAGE  # the last page too, at the end


def test_burst_of_prompts_each_matches_mlx_lm(loaded):
    prompts = [text_prompt(loaded, n, seed=n) for n in (150, 300, 230)]
    engine = make_engine(loaded)
    requests = engine.generate(prompts, GREEDY)
    for prompt, request in zip(prompts, requests):
        assert request.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)


def test_no_offload_recomputes_everything(loaded):
    prompt = text_prompt(loaded, 3 * PAGE + 1, seed=9)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, offload=False))
    run_one(engine, prompt)
    assert run_one(engine, prompt).sources()["recomputed"] == len(prompt)


@pytest.mark.parametrize("prompt", [[], [10**9]])
def test_bad_prompts_are_refused(loaded, prompt):
    with pytest.raises(InputError):
        make_engine(loaded).submit(prompt)


def test_negative_ids_are_refused_without_a_vocab_size(loaded):
    """A model whose config names no vocab_size (mlx-lm's vision-language ones nest it
    in text_config) still gets its one-line InputError for a negative id."""
    bare = dataclasses.replace(loaded, model=nn.Module())
    with pytest.raises(InputError, match=r"^token id -1 is outside the vocabulary$"):
        check_prompt(bare, [1, -1], GREEDY)
    with pytest.raises(InputError, match=r"^logit_bias token id -3 is outside the vocabulary$") as caught:
        check_prompt(bare, [1], dataclasses.replace(GREEDY, logit_bias={-3: 1.0}))
    assert caught.value.param == "logit_bias"
