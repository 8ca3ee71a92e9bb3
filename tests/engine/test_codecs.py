"""`kvtier run` with quantizing page codecs (--l3-codec, --l2-codec) on the tiny model."""

import json

from .. import cli
from .conftest import on_tiny_model

PROMPT = " ".join(["the system prompt of an agent with tools and a long history"] * 8)  # ~480 tokens
PAGE = 128


def run_json(store, *args: str) -> tuple[dict, dict]:
    argv = ["run", "--json", "--max-tokens", "8", "--no-auto-calibrate", "--store", str(store), "--prompt", PROMPT]
    done = cli.run(on_tiny_model([*argv, *args]))
    assert done.returncode == 0, done.stderr
    result, counters = (json.loads(line) for line in done.stdout.splitlines())
    return result, counters["counters"]


def test_a_q8_l3_restores_the_same_tokens_every_time_and_moves_fewer_bytes(tmp_path):
    """The pages a run left in a q8 L3 are restored from L3 by the next runs, decoded
    into L2 (``L3->L2`` carries the quantized bytes), and two restores give the same
    greedy tokens: the codec is lossy (no equality to the recompute is claimed) but
    deterministic. A raw run on the same store finds none of them."""
    first, _ = run_json(tmp_path, "--l3-codec", "q8")
    second, counters = run_json(tmp_path, "--l3-codec", "q8")
    third, _ = run_json(tmp_path, "--codec", "q8")  # the flag's older name
    n = first["prompt_tokens"]
    assert first["sources"]["recomputed"] == n
    assert second["sources"]["L3"] == third["sources"]["L3"] == (n - 1) // PAGE * PAGE
    assert second["output_token_ids"] == third["output_token_ids"]
    links = counters["links"]
    assert links["L3->L1"]["bytes"] == 0 and links["L2->L1"]["pages"] == (n - 1) // PAGE
    assert links["L3->L2"]["bytes"] < 0.6 * links["L2->L1"]["bytes"]
    raw, _ = run_json(tmp_path)
    assert raw["sources"]["recomputed"] == n


def test_a_q8_l2_restores_within_the_process(tmp_path):
    """With L1 too small for a page, pages go to a q8 L2 and the prompt's second run in
    the same process restores them from there."""
    argv = ["--l2-codec", "q8", "--l1-bytes", "1MiB", "--sequential", "--prompt", PROMPT]
    done = cli.run(
        on_tiny_model(
            [
                "run",
                "--json",
                "--max-tokens",
                "8",
                "--no-auto-calibrate",
                "--store",
                str(tmp_path),
                *argv,
                "--prompt",
                PROMPT,
            ]
        )
    )
    assert done.returncode == 0, done.stderr
    first, second, counters = (json.loads(line) for line in done.stdout.splitlines())
    n = first["prompt_tokens"]
    assert second["sources"]["L2"] == (n - 1) // PAGE * PAGE
    tiers = counters["counters"]["tiers"]
    assert tiers["L2"]["bytes_used"] < 0.6 * counters["counters"]["links"]["L1->L2"]["bytes"]
