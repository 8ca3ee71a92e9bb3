"""How much of a chat's next turn comes from cache: a 5-turn greedy chat with the model's
chat template through kvtier serve. Turn N+1's prompt holds turn N's prompt and answer;
with answer pages published and the last partial page kept in L1, all of both should
come back. Per turn it prints the prompt, the cached tokens, the tokens turn N+1 shares
with turn N (its prompt, its answer and the end-of-turn token) and what full pages alone
would give, floor(shared / page) * page.

    python bench/serve_multiturn.py [--model DIR] [--page-size 16] [--turns 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_common import kvtier_server, stream_chat  # noqa: E402

QUESTIONS = [
    "What is a KV cache, in two sentences?",
    "Why does it grow with the prompt?",
    "Where can it be kept when the accelerator is full?",
    "What does restoring it save?",
    "Summarise our conversation in one line.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: kvtier's default model)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = kvtier_server(
        args.model, args.port, Path(tempfile.mkdtemp(prefix="kvtier-chat-")), "--page-size", str(args.page_size)
    ).start()
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}]
    rows, shared = [], None
    try:
        with httpx.Client(timeout=600) as client:
            for turn in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                reply = stream_chat(client, server, messages, args.max_tokens)
                usage = reply.usage
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                bound = None if shared is None else shared // args.page_size * args.page_size
                rows.append(
                    {
                        "turn": turn + 1,
                        "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": cached,
                        "shared_with_previous": shared,
                        "page_bound": bound,
                        "completion_tokens": usage["completion_tokens"],
                    }
                )
                # the answer, and its end-of-turn token if it ended with one (fed back into the
                # cache too), begin the next prompt
                shared = usage["prompt_tokens"] + usage["completion_tokens"] + (reply.finish_reason == "stop")
                messages.append({"role": "assistant", "content": reply.text})
    finally:
        server.stop()
    if args.json:
        print(json.dumps({"page_size": args.page_size, "turns": rows}))
        return 0
    print(f"page size {args.page_size}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'shared':>7} {'bound':>7} {'cached/shared':>14}")
    for r in rows:
        ratio = f"{r['cached_tokens'] / r['shared_with_previous']:.0%}" if r["shared_with_previous"] else "-"
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['shared_with_previous'] or '-':>7} "
            f"{r['page_bound'] or '-':>7} {ratio:>14}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
