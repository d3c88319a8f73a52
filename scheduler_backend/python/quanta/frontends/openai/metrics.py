"""The gateway's own Prometheus metrics: requests, errors, latency and requests in flight by
route, and whether the engine behind it serves.

Why a middleware: every route is counted the same way, the answers given before any route
runs included (a 401 from the key check, a 413 from the body limit, a 404), and a route added
later is counted with no code of its own. Every label value comes from the server, never from
the client: the route's template (``/v1/models/{model}``, not the path sent), the status, the
OpenAI error code the gateway chose, and the tenant of an API key the operator declared, or
``pool`` for every request without one. A tenant a client names in its request (``user``,
metadata) never becomes a label, so no client can mint series: the cardinality attack of a
label taken from user input.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quanta.frontends.openai.auth import principal_of

POOL = "pool"  # the tenant label of requests without an API key's tenant
UNMATCHED = "unmatched"  # the route label of a path no route serves
# fmt: off
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0, 320.0)
# fmt: on
_READY_TIMEOUT_S = 3.0  # under a scrape's timeout
_ERROR_BODY_BYTES = 8192  # an error body is read this far for its code
_CODE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


class GatewayMetrics:
    """The gateway's metric families, in a registry of their own (one per app, so two apps in
    one process, as in tests, never share counts)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "quanta_gateway_requests",
            "HTTP requests answered, by route, status and tenant (an API key's, else pool).",
            ["route", "status", "tenant"],
            registry=self.registry,
        )
        self.errors = Counter(
            "quanta_gateway_errors",
            "HTTP requests answered with an error (status >= 400), by route, status, the "
            "OpenAI error code of the answer (none when it has none) and tenant.",
            ["route", "status", "code", "tenant"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "quanta_gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its answer (the last event of a "
            "stream), by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "quanta_gateway_requests_in_flight",
            "HTTP requests being answered, by route.",
            ["route"],
            registry=self.registry,
        )
        self.upstream_healthy = Gauge(
            "quanta_gateway_upstream_healthy",
            "1 when Triton answered at this scrape that the model is ready (any replica, "
            "with several), else 0; whether its engine serves is quanta_engine_healthy.",
            registry=self.registry,
        )
        self._codes: set[str] = set()

    def code_label(self, code: object) -> str:
        """An error code as a label: the gateway's codes are a short fixed list, yet the set is
        capped anyway, so no answer can grow the series without bound."""
        if not isinstance(code, str) or not _CODE.match(code):
            return "none"
        if code not in self._codes and len(self._codes) >= 64:
            return "other"
        self._codes.add(code)
        return code

    async def exposition(self, ready: Callable[[], Awaitable[bool]]) -> str:
        """The families in Prometheus' text format, after asking ``ready`` for the upstream
        gauge.

        Why readiness and not the engine's health check: a health check is a request, which
        the router counts and sends to one replica, so every scrape would add traffic to what
        it measures; the engine reports its own health (``quanta_engine_healthy``)."""
        try:
            healthy = await asyncio.wait_for(ready(), _READY_TIMEOUT_S)
        except TimeoutError:
            healthy = False
        self.upstream_healthy.set(1.0 if healthy else 0.0)
        return generate_latest(self.registry).decode()


class MetricsMiddleware:
    """Counts and times every HTTP request into ``metrics``; see the module docstring."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _route_of(scope)
        status = 500  # NOTE: what the client gets when the app ends without answering
        error_body = bytearray()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif status >= 400 and len(error_body) < _ERROR_BODY_BYTES:
                error_body.extend(message.get("body", b"")[:_ERROR_BODY_BYTES])
            await send(message)

        in_flight = self.metrics.in_flight.labels(route)
        in_flight.inc()
        start = time.perf_counter()
        try:
            await self.app(scope, receive, sending)
        finally:
            in_flight.dec()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
            principal = principal_of(scope)
            tenant = principal.tenant if principal is not None else POOL
            self.metrics.requests.labels(route, str(status), tenant).inc()
            if status >= 400:
                code = self.metrics.code_label(_error_code(bytes(error_body)))
                self.metrics.errors.labels(route, str(status), code, tenant).inc()


def _route_of(scope: Scope) -> str:
    """The template of the route that serves ``scope``'s path (a wrong method still names it),
    or ``unmatched``."""
    app: Any = scope.get("app")
    return _template(getattr(getattr(app, "router", None), "routes", ()), scope) or UNMATCHED


def _template(routes: Any, scope: Scope) -> str | None:
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.NONE:
            continue
        path = getattr(route, "path", None)
        if path is not None:
            return str(path)
        # NOTE: FastAPI keeps an included router as one route (no path of its own) that
        # matches every path of its router; that router's routes name the template
        inner = getattr(getattr(route, "original_router", None), "routes", None)
        return None if inner is None else _template(inner, scope)
    return None


def _error_code(body: bytes) -> object:
    """``error.code`` of an OpenAI-shaped error body, None when it is not one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def engine_metrics(url: str, timeout_s: float = 2.0) -> str:
    """Triton's metrics text at ``url`` (the engine's ``quanta_*`` and Triton's ``nv_*``),
    or nothing when it does not answer: its port stays on the pod's loopback, so the gateway's
    port is the one a scraper needs. A restarting server is seen on the upstream gauge."""

    def read() -> str:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.read().decode()

    try:
        text = await asyncio.to_thread(read)
    except (OSError, http.client.HTTPException):
        return ""
    return text if text.endswith("\n") or not text else text + "\n"
