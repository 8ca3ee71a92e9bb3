"""kvtier serve against mlx_lm.server on the same model, over HTTP, with an agent-like
workload: 8 conversations share a long system prompt with tool definitions, 6 turns
each, every answer appended to its history and every follow-up carrying a tool result
(``--tool-tokens``, 512 by default: what a coding agent's file read or test report
adds each turn; 0 gives the bare "Go on." follow-ups), the conversations interleaved
(turn t of every conversation before turn t+1 of any). Then both servers restart and
the same workload runs again: mlx_lm.server's prompt cache lived in its RAM; kvtier's
pages were flushed to L3 on SIGTERM. Both run with their defaults: mlx_lm.server's
prompt cache holds 10 sequences (``--prompt-cache-size``), so from about 10
conversations on it loses each conversation's history before the conversation comes
back, and recomputes it after the shared system prompt; kvtier's tiers keep them.

    python bench/serve_head_to_head.py [--model DIR] [--conversations 8] [--turns 6]
                                       [--tool-tokens 512] [--max-tokens 32]
                                       [--system-tokens 3000] [--json]

Reports TTFT p50 / p95 and total time per server and pass, and the ratios kvtier /
mlx_lm.server (the goals: TTFT p50 <= 1 at 8 conversations, where both caches hold
everything; <= 0.3 at 32 conversations and after the restart). Also the TTFT of the
pass's first request, and the TTFT p50 of each conversation's first turn apart from
the later turns: after a restart, the first request finds mlx_lm.server's RAM cache
empty; its other first turns reuse that request's system prompt, and its later turns
the earlier turns of the same pass, as on the first pass. And per turn, each server's
TTFT p50 and the share of the turn's prompt tokens it reported cached
(``prompt_tokens_details.cached_tokens``): the reuse each server gets, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_common import Server, default_model_dir, kvtier_server, mlx_lm_server, percentile, stream_chat  # noqa: E402

TOOLS = [
    {
        "name": name,
        "description": f"{what} Use it whenever the task needs it; never guess its output.",
        "parameters": {
            "type": "object",
            "properties": {arg: {"type": "string", "description": f"the {arg}"} for arg in args},
            "required": list(args),
        },
    }
    for name, what, args in [
        ("read_file", "Read a file of the repository and return its text.", ["path"]),
        ("write_file", "Write text to a file of the repository, replacing it.", ["path", "text"]),
        ("list_dir", "List the entries of a directory of the repository.", ["path"]),
        ("run_tests", "Run the test suite, or the tests matching a pattern, and return the report.", ["pattern"]),
        ("grep", "Search the repository for a regular expression; return matching lines.", ["pattern", "path"]),
        ("git_diff", "Show the uncommitted changes of the repository.", ["path"]),
        ("web_search", "Search the documentation of the libraries the project uses.", ["query"]),
        ("ask_user", "Ask the user a question and wait for the answer.", ["question"]),
    ]
]
SYSTEM = (
    "You are a coding agent working in a Python repository. Think step by step, call one tool "
    'at a time by answering with a JSON object {"tool": name, "arguments": {...}}, and explain '
    "briefly what you do. Keep changes small and run the tests after each one.\n\nTools:\n"
    + "\n".join(json.dumps(tool) for tool in TOOLS)
)
NOTES = (
    "Project notes: pages are written once and never changed; a restore checks each page's checksum; "
    "the tests run under pytest-xdist, so they use free ports and temporary directories only. "
)
TASKS = [
    "Fix the failing test in tests/test_cache.py.",
    "Add a --verbose flag to the CLI.",
    "Why is the restore slow for long prompts?",
    "Rename Page to KVPage everywhere.",
    "Write a docstring for the eviction policy.",
    "Find where the LMDB environment is opened.",
    "Add a test for an empty prompt.",
    "Summarise what the scheduler does.",
]
# What an agent's tools return (test reports, file contents): one line each, numbered per
# conversation and turn, so no two tool results share a page and each is the same on
# every run and pass.
TOOL_LINES = [
    "tests/test_cache.py::test_restore_{c}_{t}_{i} PASSED",
    "    def restore(self, keys: list[bytes]) -> int:  # line {i} of store_{c}.py, turn {t}",
    "E   AssertionError: expected {i} pages restored, got {t} (conversation {c})",
    "src/kvtier/tiers/page_{c}.py:{i}: page = self.pages[key]  # checksum verified",
]
# A coding agent's follow-up turns carry what its last tool call returned: a file read
# or a test report is a few hundred tokens to a few thousand (a failing test's report, a
# 60-line function, a grep over the repository). 512 tokens is a short one of those: it
# makes each turn's new text, not the 10-token "Go on.", what a server has to compute,
# and keeps 32 conversations x 6 turns within a 2-core machine's reach.
DEFAULT_TOOL_TOKENS = 512
FOLLOW_UPS = [
    "Go on.",
    "The tool returned: OK. What next?",
    "Run the tests now.",
    "The tests pass. Anything else?",
    "Commit it with a short message.",
]


def system_prompt(model: str, tokens: int) -> str:
    """SYSTEM followed by as many ``NOTES`` as bring it to ``tokens`` tokens of the model's
    tokenizer (an agent's long system prompt; 0: SYSTEM alone)."""
    from kvtier.engine.models.load import load_tokenizer

    tokenizer, _ = load_tokenizer(model)
    text = SYSTEM
    while len(tokenizer.encode(text)) < tokens:
        text += NOTES
    return text


def tool_results(model: str, conversations: int, turns: int, tokens: int) -> list[list[str]]:
    """``[c][t]``: the tool result conversation ``c`` appends with its follow-up after turn
    ``t``, at least ``tokens`` tokens of the model's tokenizer ("" each for 0)."""
    from kvtier.engine.models.load import load_tokenizer

    tokenizer, _ = load_tokenizer(model)
    results = []
    for c in range(conversations):
        row = []
        for t in range(turns):
            lines: list[str] = []
            while tokens and len(tokenizer.encode("\n".join(lines))) < tokens:
                lines.append(TOOL_LINES[len(lines) % len(TOOL_LINES)].format(c=c, t=t, i=len(lines)))
            row.append("\n".join(lines))
        results.append(row)
    return results


def follow_up(turn: int, tool_result: str) -> str:
    text = FOLLOW_UPS[turn % len(FOLLOW_UPS)]
    return f"Tool result:\n{tool_result}\n\n{text}" if tool_result else text


def run_pass(server: Server, system: str, tools: list[list[str]], turns: int, max_tokens: int) -> dict:
    """One pass of the workload: turn t of every conversation before turn t+1 of any.
    ``per_turn[t]``: that turn's TTFT p50 over the conversations and the share of its
    prompt tokens the server reported as cached (``prompt_tokens_details.cached_tokens``)."""
    histories = [
        [{"role": "system", "content": system}, {"role": "user", "content": TASKS[c % len(TASKS)]}]
        for c in range(len(tools))
    ]
    ttfts: list[float] = []
    per_turn = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            turn_ttfts, cached, prompt = [], 0, 0
            for c, history in enumerate(histories):
                reply = stream_chat(client, server, history, max_tokens)
                turn_ttfts.append(reply.ttft_s)
                details = reply.usage.get("prompt_tokens_details") or {}
                cached += details.get("cached_tokens") or 0
                prompt += reply.usage.get("prompt_tokens", 0)
                history += [
                    {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": follow_up(turn, tools[c][turn])},
                ]
            ttfts += turn_ttfts
            per_turn.append(
                {
                    "ttft_p50_s": percentile(turn_ttfts, 50),
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                    "cached_fraction": cached / prompt if prompt else None,
                }
            )
    first_turns, later = ttfts[: len(histories)], ttfts[len(histories) :]
    prompt = sum(t["prompt_tokens"] for t in per_turn)
    return {
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "first_request_ttft_s": ttfts[0],
        "first_turn_ttft_p50_s": percentile(first_turns, 50),
        "later_turns_ttft_p50_s": percentile(later, 50),
        "total_s": time.perf_counter() - t0,
        "requests": len(ttfts),
        "cached_fraction": sum(t["cached_tokens"] for t in per_turn) / prompt if prompt else None,
        "per_turn": per_turn,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: kvtier's default model)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--system-tokens", type=int, default=0, help="pad the system prompt to this many tokens")
    parser.add_argument(
        "--tool-tokens",
        type=int,
        default=DEFAULT_TOOL_TOKENS,
        help="tokens of tool result each follow-up carries (0: the bare follow-up)",
    )
    parser.add_argument("--port", type=int, default=8711)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = args.model or default_model_dir()
    system = system_prompt(model, args.system_tokens)
    tools = tool_results(model, args.conversations, args.turns, args.tool_tokens)
    store = Path(tempfile.mkdtemp(prefix="kvtier-h2h-"))
    servers = {
        "kvtier": lambda: kvtier_server(model, args.port, store, "--page-size", str(args.page_size)),
        "mlx_lm.server": lambda: mlx_lm_server(model, args.port + 1),
    }
    results: dict = {}
    for pass_name in ("first", "after_restart"):
        for name, make in servers.items():
            server = make().start()
            try:
                results.setdefault(name, {})[pass_name] = run_pass(server, system, tools, args.turns, args.max_tokens)
            finally:
                server.stop()
    ratios = {
        p: {
            k: results["kvtier"][p][k] / results["mlx_lm.server"][p][k]
            for k in (
                "ttft_p50_s",
                "ttft_p95_s",
                "first_request_ttft_s",
                "first_turn_ttft_p50_s",
                "later_turns_ttft_p50_s",
                "total_s",
            )
        }
        for p in ("first", "after_restart")
    }
    report = {
        "model": model,
        "page_size": args.page_size,
        "system_tokens": args.system_tokens,
        "tool_tokens": args.tool_tokens,
        "conversations": args.conversations,
        "turns": args.turns,
        "results": results,
        "kvtier_over_mlx_lm": ratios,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"model {model}, {args.conversations} conversations x {args.turns} turns, "
        f"{args.max_tokens} tokens per answer, page size {args.page_size}, "
        f"system prompt >= {args.system_tokens} tokens, tool results {args.tool_tokens} tokens"
    )
    print(
        f"{'server':<14} {'pass':<14} {'TTFT p50':>9} {'TTFT p95':>9} {'request 1':>9} {'turn 1':>8} {'later':>8} "
        f"{'total':>8} {'cached':>7}"
    )
    for name, passes in results.items():
        for pass_name, r in passes.items():
            cached = f"{r['cached_fraction']:.0%}" if r["cached_fraction"] is not None else "-"
            print(
                f"{name:<14} {pass_name:<14} {r['ttft_p50_s']:>8.3f}s {r['ttft_p95_s']:>8.3f}s "
                f"{r['first_request_ttft_s']:>8.3f}s {r['first_turn_ttft_p50_s']:>7.3f}s "
                f"{r['later_turns_ttft_p50_s']:>7.3f}s "
                f"{r['total_s']:>7.1f}s {cached:>7}"
            )
    print("per turn: TTFT p50 (cached share of the prompt tokens)")
    print(f"{'server':<14} {'pass':<14} " + " ".join(f"{'turn ' + str(t + 1):>14}" for t in range(args.turns)))
    for name, passes in results.items():
        for pass_name, r in passes.items():
            cells = [
                f"{t['ttft_p50_s']:.3f}s ({t['cached_fraction']:.0%})" if t["cached_fraction"] is not None else "-"
                for t in r["per_turn"]
            ]
            print(f"{name:<14} {pass_name:<14} " + " ".join(f"{cell:>14}" for cell in cells))
    for pass_name, r in ratios.items():
        print(
            f"kvtier / mlx_lm.server, {pass_name}: TTFT p50 {r['ttft_p50_s']:.2f}x, "
            f"p95 {r['ttft_p95_s']:.2f}x, first request {r['first_request_ttft_s']:.2f}x, "
            f"first turns p50 {r['first_turn_ttft_p50_s']:.2f}x, "
            f"later turns p50 {r['later_turns_ttft_p50_s']:.2f}x, total {r['total_s']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
