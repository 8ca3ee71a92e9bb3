"""An agent conversation as Claude Code sends it, through kvtier serve and the ``anthropic``
client: a long system prompt with tool definitions, then turns of tool_use / tool_result,
with one change injected at the start of the system block at one turn. Per turn it
prints the prompt, the tokens restored, the tokens the turn shares with the previous
turn's prompt and answer (what could have been restored, in full pages), the time to the
first event (message_start, sent with the first token) and where the prompt left the
cache (the divergence report's role).

Runs in process on ``kvtier-tiny-tools`` (the default model, SmolLM2, has no tool
calling): the answers are forced to a tool call (``SamplingParams.forced``), since the
generated model's own text is gibberish. ``--background N`` sends N unrelated prompts
between turns, each as long as L1 (``--l1-pages``), to evict what is not held; run it
with ``--tool-warm 0`` and without to see warm-while-a-tool-runs.

    python bench/agent_turns.py [--system-tokens 10000] [--tools 20] [--turns 20] [--change-at 10]
                                [--background 0] [--l1-pages 256] [--tool-warm 120] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anthropic
from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.defaults import TOOLS_MODEL
from kvtier.engine.models.load import load_model
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import IMPLICIT_ROOT


class ToolCallingEngine(Engine):
    """Every answer is the next scripted tool call, then EOS."""

    calls: list[str] = []

    def submit(self, prompt, params=None, root=IMPLICIT_ROOT):
        if params is not None and self.calls:
            tokenizer = self.loaded.tokenizer
            params.forced = tokenizer.encode(self.calls.pop(0)) + [tokenizer.eos_token_id]
        return super().submit(prompt, params, root)


def tools(n: int) -> list[dict]:
    schema = {"type": "object", "properties": {"path": {"type": "string", "description": "a file in the repository"}}}
    return [
        {"name": f"tool_{i}", "description": f"Tool {i} of the agent's kit.", "input_schema": schema} for i in range(n)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system-tokens", type=int, default=10000)
    parser.add_argument("--tools", type=int, default=20)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--change-at", type=int, default=10, help="the turn whose system block changes (0: none)")
    parser.add_argument("--background", type=int, default=0, help="unrelated prompts between turns")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--l1-pages", type=int, default=256)
    parser.add_argument("--tool-warm", type=float, default=120.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model(TOOLS_MODEL)
    page_bytes = loaded.geometry(args.page_size).nbytes
    store = StoreConfig(l1_bytes=args.l1_pages * page_bytes, l2_bytes=4 * page_bytes, store_dir=None)
    engine = ToolCallingEngine(loaded, EngineConfig(page_size=args.page_size, store=store, publish_answers=True))
    server = KVTierServer(engine, ServerConfig(TOOLS_MODEL, tool_warm_s=args.tool_warm))
    server.start()
    system = "You are a coding agent. Read before you write; run the tests after each change. " * (
        args.system_tokens // 80
    )  # the byte tokenizer: a token a character
    rows, messages, previous = [], [{"role": "user", "content": "Fix the failing test in the repository."}], None
    try:
        with TestClient(server.app) as http:
            client = anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=http)
            for turn in range(1, args.turns + 1):
                block = system if turn < args.change_at or not args.change_at else "Reminder: today. " + system
                name = f"tool_{turn % args.tools}"
                engine.calls = [
                    f'<tool_call>\n{{"name": "{name}", "arguments": {{"path": "src/m{turn}.py"}}}}\n</tool_call>'
                ]
                request = {"model": TOOLS_MODEL, "max_tokens": 200, "system": block, "tools": tools(args.tools)}
                t0 = time.perf_counter()
                with client.messages.stream(**request, messages=messages) as stream:
                    first = None
                    for _event in stream:
                        first = first or time.perf_counter() - t0
                    message = stream.get_final_message()
                usage = message.usage
                prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
                report = usage.model_extra["kvtier"]["divergence"]
                shared = None if previous is None else previous // args.page_size * args.page_size
                rows.append(
                    {
                        "turn": turn,
                        "prompt_tokens": prompt,
                        "restored": usage.cache_read_input_tokens,
                        "shared_pages_tokens": shared,
                        "ttft_s": round(first or 0.0, 3),
                        "left_cache_in": report["role"],
                    }
                )
                previous = prompt + usage.output_tokens
                (call,) = [b for b in message.content if b.type == "tool_use"]
                messages += [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": f"ok {turn} " * 40}],
                    },
                ]
                for i in range(args.background):
                    other = f"background request {turn}.{i} " * (args.l1_pages * args.page_size // 25)
                    client.messages.create(
                        model=TOOLS_MODEL, max_tokens=1, messages=[{"role": "user", "content": other}]
                    )
    finally:
        server.close()
    if args.json:
        print(json.dumps({"args": vars(args), "turns": rows}))
        return 0
    print(f"page {args.page_size}, L1 {args.l1_pages} pages, background {args.background}, tool-warm {args.tool_warm}s")
    print(f"{'turn':>4} {'prompt':>7} {'restored':>9} {'shared':>7} {'of shared':>9} {'ttft s':>7}  left the cache in")
    for r in rows:
        ratio = (
            f"{min(r['restored'], r['shared_pages_tokens']) / r['shared_pages_tokens']:.0%}"
            if r["shared_pages_tokens"]
            else "-"
        )
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['restored']:>9} {r['shared_pages_tokens'] or '-':>7} "
            f"{ratio:>9} {r['ttft_s']:>7}  {r['left_cache_in']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
