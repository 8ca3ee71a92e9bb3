"""Tenants of ``kvtier serve`` (DESIGN §9a): what one API key's requests can learn about
another's through the cache. The app runs in process on the small generated model (its
text is gibberish; tokens, usage and cache sources are exact); the store is L1 and L2."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.engine.serve.tenancy import Caller, Tenancy, system_prefixes
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import ChainRoot, shared_start

from .. import cli

PAGE = 16
SECRET = bytes(range(32))
KEYS = {
    "key-a": Caller("alice"),
    "key-a2": Caller("alice"),  # a second key of the same tenant
    "key-b": Caller("bob"),
    "key-admin": Caller("ops", admin=True),
}
SYSTEM = "You answer questions about the vault. Be brief, and never reveal a PIN to anyone."
TEMPLATE = "Account record for the customer, kept by the bank's assistant. The vault PIN is {pin}. Never say it."


@pytest.fixture(scope="module")
def served(loaded):
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None), publish_answers=True))
    shared = system_prefixes(loaded.tokenizer, SYSTEM)
    server = KVTierServer(engine, ServerConfig("kvtier-tiny"), Tenancy(KEYS, SECRET, engine.root, PAGE, shared))
    server.start()
    with TestClient(server.app) as http:
        yield http
    server.close()


@pytest.fixture(scope="module")
def open_server(loaded):
    """No keys: every caller is the one implicit tenant."""
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None)))
    server = KVTierServer(engine, ServerConfig("kvtier-tiny"))
    server.start()
    with TestClient(server.app) as http:
        yield http
    server.close()


def _complete(http, key: str | None, prompt: str, **body) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **body}, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]


def _cached(http, key: str | None, prompt: str, **body) -> int:
    return _complete(http, key, prompt, **body)["prompt_tokens_details"]["cached_tokens"]


def _pin_attack(http, victim: str, attacker: str, pin: str) -> list[int]:
    """The victim sends the template with its PIN; the attacker first sends it with a PIN
    of its own (so that its probes all find that one), then one probe per candidate
    first digit, and reads ``cached_tokens``: the true digit matches further."""
    _complete(http, victim, TEMPLATE.format(pin=pin))
    _complete(http, attacker, TEMPLATE.format(pin="0000"))
    return [_cached(http, attacker, TEMPLATE.format(pin=f"{d}{pin[1:]}")) for d in range(1, 10)]


def test_another_tenant_reads_nothing_of_a_pin_from_cached_tokens(served):
    cached = _pin_attack(served, "key-a", "key-b", "4821")
    assert len(set(cached)) == 1, cached  # every guess alike: the best one is at chance


def test_within_one_tenant_the_pin_attack_works(served):
    """The same attack between two keys of one tenant (who share their cache on purpose):
    the true digit stands out, so the test above could fail."""
    cached = _pin_attack(served, "key-a", "key-a2", "7315")
    best = max(cached)
    assert cached.count(best) == 1 and cached.index(best) + 1 == 7, cached


def test_keys_of_one_tenant_share_and_other_tenants_do_not(served):
    prompt = "tenant sharing check: the same prompt from three keys, " * 3
    assert _cached(served, "key-a", prompt) == 0
    assert _cached(served, "key-b", prompt) == 0  # bob finds nothing of alice's
    assert _cached(served, "key-a2", prompt) > 2 * PAGE  # alice's other key finds her pages


def test_a_declared_shared_prefix_is_found_across_tenants_and_the_rest_is_not(served, loaded):
    def chat(key: str, user: str) -> dict:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], "max_tokens": 1}
        answer = served.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]

    tokenizer = loaded.tokenizer
    system_only = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    user = "what is the PIN of account 1234?"
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], add_generation_prompt=True
    )
    shared = shared_start(system_only, prompt) // PAGE * PAGE
    assert shared >= 2 * PAGE  # the test means something only if the prefix spans pages
    chat("key-a", user)
    bob = chat("key-b", user)  # the same prompt: only the declared pages are found
    assert bob["cached_tokens"] == shared and bob["sources"]["L1"] == shared, bob
    assert chat("key-a", user)["cached_tokens"] > shared  # alice's own pages past the prefix are hers


def test_cache_salt_narrows_within_a_tenant(served, open_server):
    for http, key in ((served, "key-a"), (open_server, None)):
        prompt = f"salted prompt for {key}: the pages of one salt are that salt's only. " * 2
        assert _cached(http, key, prompt, cache_salt="one") == 0
        assert _cached(http, key, prompt, cache_salt="two") == 0
        assert _cached(http, key, prompt) == 0  # nor unsalted
        assert _cached(http, key, prompt, cache_salt="one") > 2 * PAGE


def test_a_divergence_report_never_compares_with_another_tenants_turn(served):
    def message(key: str, previous: str | None) -> dict:
        body = {
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "diagnostics of a turn, long enough to span pages " * 2}],
            "diagnostics": {"previous_message_id": previous},
        }
        answer = served.post("/v1/messages", json=body, headers={"x-api-key": key})
        assert answer.status_code == 200, answer.text
        return answer.json()

    first = message("key-a", None)
    assert message("key-a2", first["id"]).get("diagnostics") is None  # her own turn: found, nothing missed
    bob = message("key-b", first["id"])
    assert bob["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}


def test_the_server_log_never_names_another_tenants_turn(served, caplog):
    """A conversation key (OpenAI's ``user``) is the caller's own: bob's request under
    alice's key recomputes all she had, yet the INFO line of a lost conversation never
    names her turn."""

    def chat(key: str) -> str:
        body = {"messages": [{"role": "user", "content": "a conversation by key " * 6}], "max_tokens": 1, "user": "u"}
        answer = served.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        return answer.json()["id"]

    alice = chat("key-a")
    with caplog.at_level("INFO", logger="kvtier.engine.serve.conversations"):
        chat("key-b")
    assert all(alice not in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "path, headers, status",
    [
        ("/v1/models", {}, 401),
        ("/v1/models", {"Authorization": "Bearer nope"}, 401),
        ("/v1/models", {"Authorization": "Bearer key-b"}, 200),
        ("/v1/models", {"x-api-key": "key-b"}, 200),
        ("/health", {}, 200),
        ("/metrics", {"Authorization": "Bearer key-b"}, 403),
        ("/v1/kvtier/stats", {"x-api-key": "key-a"}, 403),
        ("/v1/kvtier/stats", {"Authorization": "Bearer key-admin"}, 200),
        ("/metrics", {"x-api-key": "key-admin"}, 200),
        ("/dashboard", {}, 200),  # the page and its files hold no data: a browser fetches them keyless
        ("/dashboard/static/dashboard.js", {}, 200),
        ("/v1/kvtier/dashboard", {}, 401),  # its feed shows every tenant's requests
        ("/v1/kvtier/dashboard", {"Authorization": "Bearer key-b"}, 403),
        ("/v1/kvtier/dashboard", {"Authorization": "Bearer key-admin"}, 200),
        ("/v1/kvtier/admin/requests/0/tokens", {"x-api-key": "key-a"}, 403),
    ],
)
def test_keys_and_admin_keys(served, path, headers, status):
    answer = served.get(path, headers=headers)
    assert answer.status_code == status, answer.text
    if status != 200:
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == ("authentication_error" if status == 401 else "permission_error")


def test_an_anthropic_endpoint_refuses_in_anthropic_style(served):
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    answer = served.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert answer.status_code == 401
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "authentication_error"


# 192.0.2.1 (TEST-NET-1) is never this machine's: a bind to it fails, so no test listens off loopback.


def test_without_keys_a_host_off_loopback_is_refused(tmp_path):
    done = cli.run(["serve", "--host", "192.0.2.1", "--port", "0", "--store", tmp_path / "store"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("kvtier: error: refusing to serve on 192.0.2.1 without API keys")


def test_insecure_no_auth_warns_in_one_line(tmp_path):
    done = cli.run(["serve", "--host", "192.0.2.1", "--port", "0", "--insecure-no-auth", "--store", tmp_path / "s"])
    warning, error = done.stderr.splitlines()
    assert warning.startswith("kvtier: warning: serving on 192.0.2.1 without API keys")
    assert error.startswith("kvtier: error: cannot listen on 192.0.2.1") and done.returncode == 2


@pytest.mark.parametrize(
    "text, words",
    [
        ("key-1 alice\nkey-2 alice admin extra\n", "line 2: expected KEY [TENANT] [admin]"),
        ("# only a comment\n\n", "holds no API key"),
        ("key-1\nkey-1 bob\n", "line 2: the key is given twice"),
    ],
)
def test_a_bad_api_keys_file_is_one_line_naming_it(tmp_path, text, words):
    keys = tmp_path / "keys"
    keys.write_text(text)
    done = cli.run(["serve", "--api-keys", keys, "--host", "192.0.2.1", "--port", "0", "--store", tmp_path / "s"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("kvtier: error: ") and words in done.stderr


def test_identical_prompts_of_two_tenants_never_share_a_flight(loaded):
    """Exact-input single flight is per caller: a follower's answer, and when it comes,
    would tell that another tenant sent the same prompt."""
    config = EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None), single_flight="after-prefill")
    with Engine(loaded, config) as engine:
        prompt = list(range(40, 40 + 3 * PAGE))
        for own in (b"a" * 32, b"a" * 32, b"b" * 32):
            engine.submit(prompt, SamplingParams(max_tokens=1), ChainRoot(own))
        flights = sorted(len(followers) for _, followers in engine.view().flights.flights.values())
        assert flights == [0, 1]  # the two of one root in one flight, the other's alone
        engine.run()


def test_a_missing_shared_prefix_file_is_one_line(tmp_path):
    done = cli.run(["serve", "--shared-prefix", tmp_path / "none.txt", "--port", "0", "--store", tmp_path / "s"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvtier: error: --shared-prefix {tmp_path / 'none.txt'}: ")


@pytest.mark.slow  # starts a server process
def test_a_shared_prefix_shorter_than_a_page_is_one_warning_line(tmp_path):
    from .test_server import ServerProcess

    short = tmp_path / "short.txt"
    short.write_text("Hi")  # 12 tokens as a system message of kvtier-tiny's template
    server = ServerProcess(tmp_path / "store", "--shared-prefix", str(short))
    try:
        warnings = [line for line in server.log if "--shared-prefix" in line]
        assert len(warnings) == 1 and warnings[0].startswith(f"kvtier: warning: --shared-prefix {short} is "), warnings
        assert "less than a page (16): nothing of it is shared" in warnings[0]
    finally:
        assert server.stop() == 0
