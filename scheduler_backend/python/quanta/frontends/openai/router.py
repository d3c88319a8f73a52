"""Several Triton replicas behind one gateway (``quanta openai --upstream URL --upstream URL``).

The router is the gateway's upstream: each request's stream goes to one replica, chosen when
the stream is first read. Policies, as production routers spell them:

- ``least-outstanding`` (default): the replica with the fewest requests in flight from here;
- ``round-robin``;
- ``prefix-affinity``: the replica the prompt's first ``AFFINITY_CHARS`` characters (or first
  16 token ids) hash to, so requests sharing a system prompt meet their cached prefix there,
  unless that replica has more than twice the mean in flight (plus a few), when the least
  loaded takes it (as SGLang's cache-aware router balances). The simulator's router
  (``quanta.sim.replicas``) does the same on token blocks.

A replica that cannot be reached, or that is draining (Triton refuses new requests with
UNAVAILABLE), is out of rotation for ``retry_s``. A request that it had not started (no
response yet) is sent to another replica. A stream that had started ends with the error, which
the gateway sends as an error event. ``/health`` answers 200 while any replica has the
model ready, and ``/metrics`` gives each replica's load in Prometheus' text format.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any

from quanta.frontends.openai.upstream import GenerationStream, TritonGrpc, UpstreamError

ROUTER_POLICIES = ("least-outstanding", "round-robin", "prefix-affinity")
AFFINITY_CHARS = 256
AFFINITY_SLACK = 2.0


@dataclass(eq=False)
class Replica:
    """One Triton server and what the gateway knows of it."""

    grpc: TritonGrpc
    outstanding: int = 0  # requests in flight from this gateway
    requests: int = 0  # requests sent, retried ones counted where they went
    failures: int = 0  # times it could not be reached
    down_until: float = 0.0  # out of rotation until this monotonic time

    @property
    def url(self) -> str:
        return self.grpc.url

    def up(self, now: float) -> bool:
        return now >= self.down_until


class ReplicaRouter:
    """The gateway's upstream over several Triton servers (module docstring)."""

    def __init__(
        self,
        urls: list[str],
        *,
        policy: str = "least-outstanding",
        timeout_s: float | None = None,
        retry_s: float = 5.0,
        replicas: list[TritonGrpc] | None = None,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router {policy!r}; known: {', '.join(ROUTER_POLICIES)}")
        clients = replicas or [TritonGrpc(u, timeout_s=timeout_s) for u in urls]
        if not clients:
            raise ValueError("the router needs at least one upstream")
        self.replicas = [Replica(c) for c in clients]
        self.policy, self.retry_s = policy, retry_s
        self._turn = itertools.cycle(range(len(self.replicas)))
        self.url = ",".join(r.url for r in self.replicas)

    # -- the upstream interface the gateway uses ------------------------------------------------
    def stream(
        self, model: str, inputs: dict[str, Any], *, request_id: str | None = None
    ) -> RoutedStream:
        return RoutedStream(self, model, inputs, request_id or uuid.uuid4().hex)

    async def is_model_ready(self, model: str) -> bool:
        """Ready when any replica is; each replica's answer also puts it in or out of rotation."""
        answers = await asyncio.gather(*(r.grpc.is_model_ready(model) for r in self.replicas))
        now = time.monotonic()
        for replica, ready in zip(self.replicas, answers, strict=True):
            if ready:
                replica.down_until = 0.0
            elif replica.up(now):
                replica.down_until = now + self.retry_s
        return any(answers)

    async def close(self) -> None:
        for r in self.replicas:
            await r.grpc.close()

    # -- choosing ------------------------------------------------------------------------------
    def pick(self, key: str, exclude: set[int]) -> int | None:
        """The replica for a request with affinity ``key``, none of ``exclude``; replicas out
        of rotation only when no other is left (they may be back)."""
        now = time.monotonic()
        left = [i for i in range(len(self.replicas)) if i not in exclude]
        if not left:
            return None
        up = [i for i in left if self.replicas[i].up(now)] or left
        least = min(up, key=lambda i: (self.replicas[i].outstanding, i))
        if self.policy == "round-robin":
            for _ in range(len(self.replicas)):
                i = next(self._turn)
                if i in up:
                    return i
            return least
        if self.policy == "least-outstanding":
            return least
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        home = int.from_bytes(digest, "little") % len(self.replicas)
        mean = sum(r.outstanding for r in self.replicas) / len(self.replicas)
        if home in up and self.replicas[home].outstanding <= AFFINITY_SLACK * mean + 4:
            return home
        return least

    def mark_down(self, i: int) -> None:
        replica = self.replicas[i]
        replica.failures += 1
        replica.down_until = time.monotonic() + self.retry_s

    # -- metrics -------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        """Each replica's load and state, in Prometheus' text exposition format."""
        now = time.monotonic()
        families = (
            ("quanta_gateway_upstream_outstanding", "gauge", "Requests in flight.", "outstanding"),
            ("quanta_gateway_upstream_requests_total", "counter", "Requests sent.", "requests"),
            (
                "quanta_gateway_upstream_failures_total",
                "counter",
                "Times the replica could not be reached.",
                "failures",
            ),
        )
        lines = []
        for name, kind, doc, field in families:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{upstream="{r.url}"}} {getattr(r, field)}' for r in self.replicas]
        lines += [
            "# HELP quanta_gateway_upstream_up 1 while the replica is in rotation.",
            "# TYPE quanta_gateway_upstream_up gauge",
        ]
        lines += [
            f'quanta_gateway_upstream_up{{upstream="{r.url}"}} {int(r.up(now))}'
            for r in self.replicas
        ]
        return "\n".join(lines) + "\n"


def make_upstream(
    url: str, upstreams: tuple[str, ...], policy: str, timeout_s: float | None
) -> TritonGrpc | ReplicaRouter:
    """The gateway's upstream: a router over ``upstreams`` when any are given, else the one
    Triton at ``url`` (no routing in the way)."""
    if upstreams:
        return ReplicaRouter(list(upstreams), policy=policy, timeout_s=timeout_s)
    return TritonGrpc(url, timeout_s=timeout_s)


def _affinity_key(inputs: dict[str, Any]) -> str:
    if "text_input" in inputs:
        return str(inputs["text_input"])[:AFFINITY_CHARS]
    return repr(list(inputs.get("input_ids", []))[:16])


class RoutedStream:
    """A ``GenerationStream`` on the replica the router picks when it is first read; retried
    on another replica while no response has come."""

    def __init__(
        self, router: ReplicaRouter, model: str, inputs: dict[str, Any], request_id: str
    ) -> None:
        self._router, self._model, self._inputs = router, model, inputs
        self.request_id = request_id
        self._inner: GenerationStream | None = None
        self._at: int | None = None  # the replica it counts against while in flight
        self.replica: str | None = None  # where it went (None before it was sent)
        self._cancelled = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done or (self._inner is not None and self._inner.done)

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._inner is None:
            return await self._first()
        try:
            event = await self._inner.__anext__()
        except BaseException:
            self._release()
            raise
        if self._inner.done:
            self._release()
        return event

    async def _first(self) -> dict[str, Any]:
        tried: set[int] = set()
        key = _affinity_key(self._inputs)
        errors: list[str] = []
        retry: list[float] = []  # when each replica that refused expects to be back
        while not self._cancelled:
            i = self._router.pick(key, tried)
            if i is None:
                break
            tried.add(i)
            replica = self._router.replicas[i]
            inner = replica.grpc.stream(self._model, self._inputs, request_id=self.request_id)
            self._inner, self._at, self.replica = inner, i, replica.url
            replica.outstanding += 1
            replica.requests += 1
            try:
                event = await inner.__anext__()
            except UpstreamError as exc:
                self._release()
                self._inner = None
                if not exc.unavailable or self._cancelled:
                    raise
                self._router.mark_down(i)
                errors.append(exc.message)
                retry += [exc.retry_after] if exc.retry_after is not None else []
                continue
            except BaseException:
                self._release()
                raise
            if inner.done:
                self._release()
            return event
        self._done = True
        detail = "; ".join(errors) or "the request was cancelled"
        raise UpstreamError(
            f"no Triton replica took the request: {detail}",
            unavailable=True,
            retry_after=min(retry, default=None),
        )

    def _release(self) -> None:
        """The request no longer counts against its replica (idempotent)."""
        if self._at is not None:
            self._router.replicas[self._at].outstanding -= 1
            self._at = None

    def cancel(self) -> None:
        self._cancelled = True
        if self._inner is not None:
            self._inner.cancel()
        self._release()
        self._done = True

    async def aclose(self) -> None:
        self.cancel()
