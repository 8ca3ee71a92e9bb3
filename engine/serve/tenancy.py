"""Who calls ``kvtier serve`` and where their keys start (DESIGN §9a).

A tenant is a key-chain root, not a store of its own: its root is an HMAC under the
server secret (``tiers.l3.secret``) of the namespace and its name, so nobody can
compute another tenant's keys, whatever they send; a request's ``cache_salt`` narrows
it (``derive(secret, b"salt", root, salt)``). Every page, partial page, snapshot and
single flight keyed from a root is found only by requests of that root, except the
whole pages of a prefix the operator declared shared (``--shared-prefix``): those are
keyed from the namespace's digest, as everyone's, and the caller's root is mixed in at
the first page past them (``tiers.page.key_chain``). Without API keys every caller is
the one implicit tenant, whose root is the namespace's digest: today's keys.

API keys come as ``Authorization: Bearer KEY`` (OpenAI) or ``x-api-key: KEY``
(Anthropic) and are compared in constant time: the SHA-256 of what was sent against
every key's, with no early exit. ``/health`` answers anyone; the server's own numbers
(``/metrics``, ``/v1/kvtier/stats``, ``/v1/kvtier/events``) need a key flagged ``admin``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier.tiers.l3.secret import derive
from kvtier.tiers.page import IMPLICIT_ROOT, ChainRoot, reusable_pages, shared_start

from .admin import ADMIN_PREFIX
from .api import APIError
from .dashboard import FEED_PATH, STATIC_PREFIX
from .events import EVENTS_PATH

# A load balancer's probe, and the dashboard's page and files (a browser fetches them
# without a key; they hold no data: the page asks the feed for it, with the key typed in).
OPEN_PATHS = ("/health", "/", "/dashboard")
OPEN_PREFIXES = (STATIC_PREFIX,)
# The whole server's numbers, every tenant's requests (the dashboard's feed), what its
# tiers hold (the events a fleet router reads) and its actions.
ADMIN_PATHS = ("/metrics", "/v1/kvtier/stats", FEED_PATH, EVENTS_PATH)
ADMIN_PREFIXES = (ADMIN_PREFIX + "/",)


@dataclass(frozen=True)
class Caller:
    """The tenant an API key belongs to, and whether it may read the server's numbers."""

    tenant: str
    admin: bool = False


class KeyFileError(ValueError):
    """A line of an API keys file that is not ``KEY [TENANT] [admin]``."""


def own_tenant(key: str) -> str:
    """The tenant of a key that names none: its own, stable across restarts (its pages
    outlive the process in L3), and not the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_key_file(path: Path) -> dict[str, Caller]:
    """The keys of ``path``: one a line, ``KEY [TENANT] [admin]``, ``#`` starts a comment.
    KeyFileError names the first bad line (a key given twice is one)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise KeyFileError(f"cannot read the API keys file {path}: {getattr(err, 'strerror', None) or err}") from None
    keys: dict[str, Caller] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        key, rest = words[0], words[1:]
        admin = bool(rest) and rest[-1] == "admin"
        rest = rest[:-1] if admin else rest
        if len(rest) > 1 or key in keys:
            why = "the key is given twice" if key in keys else "expected KEY [TENANT] [admin]"
            raise KeyFileError(f"{path} line {number}: {why}")
        keys[key] = Caller(rest[0] if rest else own_tenant(key), admin)
    if not keys:
        raise KeyFileError(f"{path} holds no API key")
    return keys


def system_prefixes(tokenizer, text: str) -> list[list[int]]:
    """The token prefixes a shared system prompt is declared as: its text as a completion
    prompt starts, and the chat template's rendering of it as the system message."""
    raw = list(tokenizer.encode(text))
    try:
        chat = tokenizer.apply_chat_template([{"role": "system", "content": text}], add_generation_prompt=False)
    except Exception:  # a template that renders no system message alone: the raw prefix only
        return [raw]
    return [raw, list(chat)]


class Tenancy:
    """The API keys, the server secret, the declared shared prefixes: who calls, and the
    root of each request's key chain."""

    def __init__(
        self,
        keys: Mapping[str, Caller],
        secret: bytes,
        namespace_digest: bytes,
        page_size: int,
        shared: Sequence[Sequence[int]] = (),
    ) -> None:
        self._digests = [(hashlib.sha256(key.encode()).digest(), caller) for key, caller in keys.items()]
        self.secret, self.namespace, self.page_size = secret, namespace_digest, page_size
        self.shared = [list(prefix) for prefix in shared if len(prefix) >= page_size]

    @property
    def keyed(self) -> bool:
        return bool(self._digests)

    def caller(self, headers: Mapping[str, str]) -> Caller | None:
        """The caller of a request with these headers; None without keys (the implicit
        tenant). A missing or wrong key is a 401."""
        if not self.keyed:
            return None
        sent = headers.get("x-api-key")
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if sent is None and scheme.lower() == "bearer":
            sent = token.strip()
        if not sent:
            raise APIError(
                401,
                "an API key is required: send Authorization: Bearer KEY or x-api-key: KEY",
                "authentication_error",
                code="missing_api_key",
            )
        digest = hashlib.sha256(sent.encode()).digest()
        found = None
        for known, caller in self._digests:  # every key compared: the time says nothing about which
            if hmac.compare_digest(digest, known):
                found = caller
        if found is None:
            raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return found

    def root(self, caller: Caller | None, cache_salt: str | None, tokens: Sequence[int]) -> ChainRoot:
        """Where the key chain of ``tokens`` starts for ``caller``: its tenant's root (the
        namespace's for the implicit tenant), narrowed by ``cache_salt``; the whole pages of
        the longest declared shared prefix it starts with stay the namespace's."""
        own = (
            self.namespace if caller is None else derive(self.secret, b"tenant", self.namespace, caller.tenant.encode())
        )
        if cache_salt:
            own = derive(self.secret, b"salt", own, cache_salt.encode())
        if own == self.namespace:
            return IMPLICIT_ROOT
        common = max((shared_start(prefix, tokens) for prefix in self.shared), default=0)
        return ChainRoot(own, min(common // self.page_size, reusable_pages(len(tokens), self.page_size)))


class Authenticate:
    """ASGI middleware: every request but ``OPEN_PATHS`` (and ``OPEN_PREFIXES``) carries
    a valid key (401), the ``ADMIN_PATHS`` (and ``ADMIN_PREFIXES``) an admin's (403); the
    caller goes to the handler as ``request.state.caller``. Errors in the endpoint's
    style (``anthropic_paths``)."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy, anthropic_paths: Sequence[str]) -> None:
        self.app, self.tenancy, self.anthropic_paths = app, tenancy, tuple(anthropic_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
            caller = None if is_open else self.tenancy.caller(headers)
            admin_only = path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)
            if caller is not None and admin_only and not caller.admin:
                raise APIError(403, f"{path} needs an admin API key", "permission_error", code="admin_required")
        except APIError as err:
            extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
            body = err.body(anthropic=path in self.anthropic_paths)
            await JSONResponse(body, status_code=err.status, headers=extra)(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)
