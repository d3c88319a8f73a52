"""The gateway's own /metrics: requests, errors, latency and in-flight requests by route, the
engine's health, and label values no client can choose.

The gateway runs as in production (uvicorn on a thread, every middleware) in front of
``RecordingTriton``; /metrics is read with Prometheus' own text parser, as a scraper reads it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_fakes import MODEL, RecordingTriton, serve
from prometheus_client.parser import text_string_to_metric_families
from quanta.frontends.openai.auth import KeyPolicy

ALICE = "sk-alice-0123456789"


def samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on ``url``/metrics, keyed by (name, labels), parsed as Prometheus does."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def label_values(found: dict, name: str, label: str) -> set[str]:
    return {dict(key)[label] for n, key in found if n == name and label in dict(key)}


def call(url: str, path: str, body: Any = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[str]:
    server = serve(tmp_path / "state", RecordingTriton())
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[str]:
    server = serve(
        tmp_path / "state", RecordingTriton(), api_keys={ALICE: KeyPolicy(tenant="alice")}
    )
    try:
        yield server.url
    finally:
        server.stop()


def test_requests_are_counted_by_route_template_and_status_and_timed(gateway):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for _ in range(3):
        assert call(gateway, "/v1/completions", body) == 200
    assert call(gateway, "/v1/completions", {**body, "max_tokens": -1}) == 400
    assert call(gateway, f"/v1/models/{MODEL}") == 200
    assert call(gateway, "/v1/models/no-such-model") == 404
    found = samples(gateway)
    route = "/v1/completions"
    ok = value(found, "quanta_gateway_requests_total", route=route, status="200", tenant="pool")
    assert ok == 3
    bad = {"route": route, "status": "400", "tenant": "pool"}
    assert value(found, "quanta_gateway_requests_total", **bad) == 1
    assert value(found, "quanta_gateway_errors_total", **bad, code="none") == 1
    # the template, not the path a client sent: one series however many model names are tried
    models = {"route": "/v1/models/{model}", "tenant": "pool"}
    assert value(found, "quanta_gateway_requests_total", **models, status="200") == 1
    assert value(found, "quanta_gateway_requests_total", **models, status="404") == 1
    assert "/v1/models/no-such-model" not in label_values(
        found, "quanta_gateway_requests_total", "route"
    )
    assert value(found, "quanta_gateway_request_duration_seconds_count", route=route) == 4
    assert value(found, "quanta_gateway_request_duration_seconds_sum", route=route) > 0
    assert value(found, "quanta_gateway_requests_in_flight", route=route) == 0
    # the scrape itself is in flight while it is taken
    assert value(found, "quanta_gateway_requests_in_flight", route="/metrics") == 1
    assert value(found, "quanta_gateway_upstream_healthy") == 1


def test_no_client_chosen_value_becomes_a_label(gateway):
    """Tenants a client names, and paths no route serves, all land in one series each."""
    for _ in range(5):
        name = f"tenant-{uuid.uuid4().hex}"
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "user": name, "tenant": name}
        assert call(gateway, "/v1/completions", body) == 200
        assert call(gateway, f"/{uuid.uuid4().hex}") == 404
    found = samples(gateway)
    assert label_values(found, "quanta_gateway_requests_total", "tenant") == {"pool"}
    routes = label_values(found, "quanta_gateway_requests_total", "route")
    assert routes == {"/v1/completions", "unmatched"}  # the scrape counts once it is answered
    unmatched = {"route": "unmatched", "status": "404", "tenant": "pool"}
    assert value(found, "quanta_gateway_requests_total", **unmatched) == 5


def test_routes_of_included_routers_are_labelled_by_their_template(gateway):
    """The tokenizer, embeddings, responses and Batch API routes live on routers of their own
    that the app includes; each is still counted under its template, not as ``unmatched``."""
    assert call(gateway, "/detokenize", {"tokens": [1]}) == 400  # no tokenizer here
    assert call(gateway, "/v1/responses", {"model": MODEL, "input": "Hi", "bogus": 1}) == 400
    assert call(gateway, "/v1/embeddings", {"model": MODEL, "input": "Hi", "dimensions": 8}) == 400
    assert call(gateway, "/v1/files/file-none") == 404
    assert call(gateway, "/version") == 200
    routes = label_values(samples(gateway), "quanta_gateway_requests_total", "route")
    included = {"/detokenize", "/v1/responses", "/v1/embeddings", "/v1/files/{file_id}", "/version"}
    assert included <= routes
    assert "unmatched" not in routes


def test_an_api_keys_tenant_is_the_label_and_refusals_count_by_error_code(keyed):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "user": "mallory"}
    assert call(keyed, "/v1/completions", body, key=ALICE) == 200
    assert call(keyed, "/v1/completions", body, key="sk-wrong") == 401
    found = samples(keyed)
    route = "/v1/completions"
    ok = {"route": route, "status": "200", "tenant": "alice"}
    assert value(found, "quanta_gateway_requests_total", **ok) == 1
    refused = {"route": route, "status": "401", "tenant": "pool"}
    assert value(found, "quanta_gateway_errors_total", **refused, code="invalid_api_key") == 1
    assert "mallory" not in label_values(found, "quanta_gateway_requests_total", "tenant")


class DownTriton(RecordingTriton):
    async def is_model_ready(self, model: str) -> bool:
        return False


def test_the_upstream_gauge_says_when_the_engine_does_not_serve(tmp_path):
    server = serve(tmp_path / "state", DownTriton())
    try:
        assert value(samples(server.url), "quanta_gateway_upstream_healthy") == 0
        assert call(server.url, "/health") == 503
        found = samples(server.url)
        down = {"route": "/health", "status": "503", "tenant": "pool"}
        assert value(found, "quanta_gateway_errors_total", **down, code="backend_unavailable") == 1
    finally:
        server.stop()
