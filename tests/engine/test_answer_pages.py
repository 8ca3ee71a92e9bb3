"""What a serving engine adds for multi-turn chat: pages filled while answering are
published (keyed by the generated tokens), and seeded sampling is reproducible."""

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import mlx_lm_greedy, text_prompt

PAGE = 16


def make_engine(loaded, **config) -> Engine:
    config = {"publish_answers": True, **config}
    return Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None), **config))


def test_the_next_turn_restores_prompt_and_answer_exactly(loaded):
    prompt = text_prompt(loaded, 3 * PAGE + 5)
    with make_engine(loaded) as engine:
        (first,) = engine.generate([prompt], SamplingParams(max_tokens=2 * PAGE))
        history = prompt + first.output  # the next turn's prompt holds both, then more
        follow_up = history + text_prompt(loaded, 7, seed=1)
        (second,) = engine.generate([follow_up], SamplingParams(max_tokens=6))
    # past the prompt's 3 pages: the answer's full pages, and its last partial page
    assert second.sources()["L1"] == len(history) > len(history) // PAGE * PAGE
    assert second.output == mlx_lm_greedy(loaded, follow_up, 6)  # the answer's pages hold its exact KV


def test_without_publish_answers_only_prompt_pages_are_stored(loaded):
    prompt = text_prompt(loaded, 2 * PAGE + 3, seed=2)
    with make_engine(loaded, publish_answers=False) as engine:
        (first,) = engine.generate([prompt], SamplingParams(max_tokens=PAGE))
        (second,) = engine.generate([prompt + first.output + [65]], SamplingParams(max_tokens=1))
    assert second.sources()["L1"] == len(prompt)  # its pages and its last partial page, not the answer


def test_answer_pages_wait_for_the_end_when_publication_does(loaded):
    prompt = text_prompt(loaded, 2 * PAGE + 3, seed=2)
    with make_engine(loaded, publish="at-completion") as engine:
        (first,) = engine.generate([prompt], SamplingParams(max_tokens=PAGE))
        (second,) = engine.generate([prompt + first.output + [65]], SamplingParams(max_tokens=1))
    assert second.sources()["L1"] == len(prompt) + len(first.output)


def test_a_seed_samples_the_same_tokens_whatever_shares_the_batch(loaded):
    prompt = text_prompt(loaded, 20, seed=4)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    with make_engine(loaded) as engine:
        alone = engine.generate([prompt], seeded)[0].output
        batch = engine.generate(
            [prompt, text_prompt(loaded, 30, seed=5), prompt], SamplingParams(max_tokens=12, temperature=1.0)
        )
        together = engine.generate([text_prompt(loaded, 25, seed=6), prompt], seeded)[1].output
        other = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=8))[0].output
    assert together == alone != other
    assert batch[0].t_admit is not None and batch[0].t_submit <= batch[0].t_admit <= batch[0].t_first_token
