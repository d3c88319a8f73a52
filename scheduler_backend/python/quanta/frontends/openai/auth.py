"""API keys: who may call the gateway, as which tenant, with what weight and how fast.

Why the tenant comes from the key: a fair policy shares the engine between tenants, so a tenant
that is whatever name a client sends can be impersonated, or multiplied into fresh names that
each start with an empty service counter. With keys configured, a request's tenant, weight and
highest priority class are its key's; ``user`` and ``tenant`` in the body no longer choose it.

Keys are given as ``--api-key KEY`` (vLLM's flag; each such key is tenant ``default``) or in a
keys file (``--api-key-file``, YAML or JSON) that maps each key to its tenant, weight,
priority class and rate limits::

    sk-alice-0123:
      tenant: alice
      weight: 2
      priority_class: online
      requests_per_minute: 600
      tokens_per_minute: 200000
    sk-batch-4567: {tenant: reports, priority_class: offline}

Every route but ``/health`` and ``/ping`` (liveness), ``/version``, ``/metrics`` and the chat
page's HTML takes the key as ``Authorization: Bearer <key>``, the way the ``openai`` SDK sends
``api_key``. A key is found by its SHA-256 digest, so the time a lookup takes says nothing an
attacker can use about the keys
(it depends only on the digest of what was sent); the keys themselves are kept only as
digests.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from quanta.frontends.openai.errors import OpenAIError, send_error

DEFAULT_TENANT = "default"  # the tenant of a key given with --api-key
# Liveness, Prometheus' scrape (load and restart counts, no tenant's data: open as vLLM's is,
# so a scraper needs no secret) and the chat page's static HTML (it sends the key it is given).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/"})
PRINCIPAL = "quanta.principal"  # the scope["state"] entry the middleware sets

ApiKey = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[\x21-\x7e]+$")]


class KeyPolicy(BaseModel):
    """One key's entry in a keys file."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    tenant: str = Field(min_length=1, max_length=128)
    weight: float = Field(1.0, gt=0)  # the tenant's share under a fair policy
    # the highest class the key's requests get; a request may still ask for "offline"
    priority_class: Literal["online", "offline"] = "online"
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion tokens


_KEYS_FILE = TypeAdapter(dict[ApiKey, KeyPolicy])


class KeysFileError(ValueError):
    """A keys file that cannot be read or does not describe keys; the message says where."""


def read_keys_file(path: Path) -> dict[str, KeyPolicy]:
    """The keys of a YAML or JSON keys file (module docstring), checked entry by entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeysFileError(f"cannot read the API keys file {path}: {exc}") from None
    try:
        if path.suffix == ".json":
            raw: Any = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except (ValueError, ImportError) as exc:  # json and yaml errors are ValueErrors
        raise KeysFileError(f"{path} is not valid YAML or JSON: {exc}") from None
    except Exception as exc:  # yaml.YAMLError
        raise KeysFileError(f"{path} is not valid YAML or JSON: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise KeysFileError(
            f"{path} must map each API key to its settings ({{KEY: {{tenant: NAME, ...}}}})"
        )
    try:
        return _KEYS_FILE.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise KeysFileError(f"{path}: {problems}") from None


def _where(loc: tuple[Any, ...]) -> str:
    """A location in the keys file that does not print the key itself."""
    rest = [str(p) for p in loc[1:] if p != "[key]"]
    return ".".join(["<key>", *rest]) if loc else "file"


def key_policies(keys: Iterable[str] = (), key_file: Path | None = None) -> dict[str, KeyPolicy]:
    """Every configured key: each ``--api-key`` as tenant ``default``, then the file's."""
    policies: dict[str, KeyPolicy] = {}
    adapter = TypeAdapter(ApiKey)
    for key in keys:
        try:
            adapter.validate_python(key)
        except ValidationError:
            raise KeysFileError(
                "an --api-key must be 1-512 printable ASCII characters without spaces"
            ) from None
        policies[key] = KeyPolicy(tenant=DEFAULT_TENANT)
    if key_file is not None:
        for key, policy in read_keys_file(key_file).items():
            if key in policies and policies[key] != policy:
                raise KeysFileError(f"{key_file}: a key is also given with --api-key")
            policies[key] = policy
    return policies


@dataclass
class TokenBucket:
    """``rate_per_min`` units a minute, at most a minute's worth saved up.

    ``take`` may drive the level below zero (a request's actual token count is only known
    when it ends); nothing more is admitted until it is positive again.
    """

    rate_per_min: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    _at: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = self.rate_per_min
        self._at = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.rate_per_min, self.level + (now - self._at) * self.rate_per_min / 60)
        self._at = now

    def wait_s(self, need: float) -> float:
        """Seconds until ``need`` units are there (0: now); ``need`` is capped at the
        capacity, so one request larger than a minute's worth still gets through alone."""
        self._refill()
        need = min(need, self.rate_per_min)
        missing = need - self.level
        return 0.0 if missing <= 0 else missing * 60 / self.rate_per_min

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


class RateLimiter:
    """A key's requests-per-minute and tokens-per-minute limits (either may be absent).

    Tokens are reserved when a request is admitted (its prompt estimate plus every choice's
    ``max_tokens``) and settled with the actual usage when it ends, so a client that asks for
    much and uses little is charged what it used.
    """

    def __init__(
        self,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._requests = (
            None if requests_per_minute is None else TokenBucket(requests_per_minute, clock)
        )
        self._tokens = None if tokens_per_minute is None else TokenBucket(tokens_per_minute, clock)
        self._lock = threading.Lock()  # NOTE: batch lines and routes share one event loop; the
        # lock keeps the limiter correct if a caller uses it from another thread too

    def admit(self, tokens: int) -> Reservation:
        """Admit a request expected to use ``tokens``, or raise a 429 with ``Retry-After``."""
        with self._lock:
            waits = []
            if self._requests is not None:
                waits.append(("requests", self._requests.wait_s(1)))
            if self._tokens is not None:
                waits.append(("tokens", self._tokens.wait_s(tokens)))
            blocked = [(kind, s) for kind, s in waits if s > 0]
            if blocked:
                kind, wait = max(blocked, key=lambda b: b[1])
                raise OpenAIError(
                    429,
                    f"rate limit of this API key reached ({kind} per minute); retry after "
                    f"{math.ceil(wait)} s",
                    retry_after=wait,
                )
            if self._requests is not None:
                self._requests.take(1)
            if self._tokens is not None:
                self._tokens.take(tokens)
        return Reservation(self, tokens)

    def _settle(self, reserved: int, used: int) -> None:
        if self._tokens is not None:
            with self._lock:
                self._tokens.take(used - reserved)


@dataclass
class Reservation:
    """Tokens reserved for one request; ``settle`` charges what it used instead (once)."""

    limiter: RateLimiter | None
    reserved: int
    settled: bool = False

    def settle(self, used: int) -> None:
        if self.limiter is not None and not self.settled:
            self.settled = True
            self.limiter._settle(self.reserved, used)


NO_RESERVATION = Reservation(None, 0, settled=True)


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: its key's tenant, weight, highest class and limits."""

    tenant: str
    weight: float = 1.0
    priority_class: Literal["online", "offline"] = "online"
    limiter: RateLimiter | None = field(default=None, compare=False)

    def admit(self, tokens: int) -> Reservation:
        return NO_RESERVATION if self.limiter is None else self.limiter.admit(tokens)


class ApiKeys:
    """The configured keys, kept as SHA-256 digests; see the module docstring."""

    def __init__(self, policies: Mapping[str, KeyPolicy]) -> None:
        if not policies:
            raise ValueError("ApiKeys needs at least one key")
        self._by_digest = {
            _digest(key): Principal(
                p.tenant,
                p.weight,
                p.priority_class,
                None
                if p.requests_per_minute is None and p.tokens_per_minute is None
                else RateLimiter(p.requests_per_minute, p.tokens_per_minute),
            )
            for key, p in policies.items()
        }
        self.tenants = frozenset(p.tenant for p in policies.values())

    def __len__(self) -> int:
        return len(self._by_digest)

    def principal(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header value, or a 401."""
        if not authorization:
            raise unauthorized(
                "You didn't provide an API key. Give it as 'Authorization: Bearer <key>' "
                "(the openai client's api_key)."
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("The Authorization header must be 'Bearer <key>'.")
        found = self._by_digest.get(_digest(token.strip()))
        if found is None:
            raise unauthorized("Incorrect API key provided.")
        return found

    def owner(self, tenant: str | None) -> Principal | None:
        """A principal of ``tenant`` (the first key's), for work a key started earlier (batch
        lines): its weight and class, without its rate limits. None when no key has it."""
        for principal in self._by_digest.values():
            if principal.tenant == tenant:
                return Principal(principal.tenant, principal.weight, principal.priority_class)
        return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key")


class AuthMiddleware:
    """Checks the key of every HTTP request but those to ``open_paths``; a request that
    passes carries its ``Principal`` in ``scope["state"][PRINCIPAL]``."""

    def __init__(
        self, app: ASGIApp, keys: ApiKeys, open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            principal = self.keys.principal(header)
        except OpenAIError as exc:
            await send_error(exc, send, {"WWW-Authenticate": 'Bearer realm="quanta"'})
            return
        scope.setdefault("state", {})[PRINCIPAL] = principal
        await self.app(scope, receive, send)


def principal_of(scope: Mapping[str, Any]) -> Principal | None:
    """The principal the middleware found for a request (None: no keys configured)."""
    state = scope.get("state") or {}
    return state.get(PRINCIPAL)
