"""API keys on the OpenAI gateway, through the official ``openai`` client.

The gateway runs as in production (uvicorn on a thread, every route and middleware) in front
of ``RecordingTriton``, which records what reached it: that is how the tests see the tenant
a key gave a request, whatever its body claimed.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_fakes import MODEL, RecordingTriton, serve
from quanta.cli import app as cli_app
from quanta.cli_options import with_key_weights
from quanta.frontends.openai.app import GatewaySettings, auth_warning
from quanta.frontends.openai.auth import (
    ApiKeys,
    KeyPolicy,
    KeysFileError,
    RateLimiter,
    key_policies,
    read_keys_file,
)
from quanta.frontends.openai.errors import OpenAIError
from typer.testing import CliRunner

openai = pytest.importorskip("openai")

ALICE, BOB, OFFLINE = "sk-alice-0123456789", "sk-bob-9876543210", "sk-reports-000111"
KEYS = {
    ALICE: KeyPolicy(tenant="alice", weight=2.0),
    BOB: KeyPolicy(tenant="bob"),
    OFFLINE: KeyPolicy(tenant="reports", priority_class="offline"),
}


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[str, RecordingTriton]]:
    upstream = RecordingTriton()
    server = serve(tmp_path / "state", upstream, api_keys=KEYS)
    try:
        yield server.url, upstream
    finally:
        server.stop()


def client(url: str, key: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def post(url: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    """Status and JSON body of a POST (or GET without ``body``), errors included."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers=headers)
    if path == "/reset_prefix_cache":
        request.method = "POST"
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw.startswith(b"{") else raw
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- who may call --------------------------------------------------------------------------
def test_a_missing_or_wrong_key_is_a_401_in_openais_shape(keyed):
    url, upstream = keyed
    for key in ("sk-wrong", ALICE[:-1], ALICE + "x"):
        with client(url, key) as c, pytest.raises(openai.AuthenticationError) as info:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        error = info.value.body
        assert error["code"] == "invalid_api_key", error
        assert error["type"] == "invalid_request_error"
        assert info.value.response.headers["www-authenticate"].startswith("Bearer")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    status, answer = post(url, "/v1/completions", body)  # no Authorization header at all
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert "didn't provide an API key" in answer["error"]["message"]
    assert upstream.inputs() == []  # nothing reached Triton
    with client(url, ALICE) as c:
        assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_health_and_metrics_stay_open_and_everything_else_needs_the_key(keyed):
    url, _ = keyed
    assert post(url, "/health")[0] == 200
    assert post(url, "/metrics")[0] == 200
    for path in ("/v1/models", "/v1/files", "/v1/batches", "/openapi.json"):
        assert post(url, path)[0] == 401, path
        assert post(url, path, key=BOB)[0] == 200, path


def test_reset_prefix_cache_needs_the_key(keyed):
    url, upstream = keyed
    assert post(url, "/reset_prefix_cache")[0] == 401
    assert not any(i.get("reset_prefix_cache") for i in upstream.inputs())
    status, body = post(url, "/reset_prefix_cache", key=ALICE)
    assert status == 200 and body["status"] == "ok"
    assert any(i.get("reset_prefix_cache") for i in upstream.inputs())


# -- whose request it is ---------------------------------------------------------------------
def test_the_tenant_is_the_keys_and_user_or_tenant_cannot_impersonate(keyed):
    url, upstream = keyed
    with client(url, ALICE) as c:
        c.completions.create(model=MODEL, prompt="a", max_tokens=1, user="bob")
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "b"}],
            max_tokens=1,
            extra_body={"tenant": "bob"},
        )
    with client(url, BOB) as c:
        c.completions.create(model=MODEL, prompt="c", max_tokens=1)
    seen = [(i["tenant"], i.get("tenant_authenticated")) for i in upstream.inputs()]
    assert seen == [("alice", True), ("alice", True), ("bob", True)]


def test_without_keys_user_names_the_tenant_as_before(tmp_path):
    upstream = RecordingTriton()
    server = serve(tmp_path / "state", upstream)
    try:
        with client(server.url, "unused") as c:
            c.completions.create(model=MODEL, prompt="a", max_tokens=1, user="carol")
    finally:
        server.stop()
    (inputs,) = upstream.inputs()
    assert inputs["tenant"] == "carol"
    assert not inputs.get("tenant_authenticated")


def test_an_offline_key_sends_offline_work_whatever_the_body_asks(keyed):
    url, upstream = keyed
    with client(url, OFFLINE) as c:
        c.completions.create(
            model=MODEL, prompt="a", max_tokens=1, extra_body={"priority_class": "online"}
        )
    with client(url, ALICE) as c:  # an online key may still ask for offline
        c.completions.create(
            model=MODEL, prompt="a", max_tokens=1, extra_body={"priority_class": "offline"}
        )
        c.completions.create(model=MODEL, prompt="a", max_tokens=1)
    classes = [i.get("priority_class", "online") for i in upstream.inputs()]
    assert classes == ["offline", "offline", "online"]


# -- the Batch API ---------------------------------------------------------------------------
def batch_file(user: str) -> bytes:
    line = {
        "custom_id": "r0",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "hello", "max_tokens": 2, "user": user},
    }
    return (json.dumps(line) + "\n").encode()


def test_batches_need_the_key_run_as_its_tenant_and_are_the_tenants_own(keyed):
    url, upstream = keyed
    with client(url, "sk-nobody") as nobody, pytest.raises(openai.AuthenticationError):
        nobody.files.create(file=("in.jsonl", batch_file("bob")), purpose="batch")
    with client(url, ALICE) as alice, client(url, BOB) as bob:
        file = alice.files.create(file=("in.jsonl", batch_file("bob")), purpose="batch")
        batch = alice.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 20
        while (batch := alice.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
        assert alice.files.content(batch.output_file_id).text
        # bob sees none of it, and cannot run alice's file as his batch
        assert [f.id for f in bob.files.list()] == []
        assert [b.id for b in bob.batches.list()] == []
        for call in (
            lambda: bob.batches.retrieve(batch.id),
            lambda: bob.files.retrieve(file.id),
            lambda: bob.files.content(batch.output_file_id),
            lambda: bob.files.delete(file.id),
            lambda: bob.batches.create(
                input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert {f.id for f in alice.files.list()} == {file.id, batch.output_file_id}
    (line,) = upstream.inputs()
    assert (line["tenant"], line["priority_class"]) == ("alice", "offline")


# -- rate limits -----------------------------------------------------------------------------
def test_requests_per_minute_answer_429_with_retry_after(tmp_path):
    keys = {ALICE: KeyPolicy(tenant="alice", requests_per_minute=2)}
    server = serve(tmp_path / "state", RecordingTriton(), api_keys=keys)
    try:
        with client(server.url, ALICE) as c:
            for _ in range(2):
                c.completions.create(model=MODEL, prompt="a", max_tokens=1)
            with pytest.raises(openai.RateLimitError) as info:
                c.completions.create(model=MODEL, prompt="a", max_tokens=1)
    finally:
        server.stop()
    assert info.value.body["code"] == "rate_limit_exceeded"
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 30  # 1 request per 30 s


def test_tokens_per_minute_count_what_was_used():
    """A reservation of max_tokens is settled with the actual usage: a request that used
    little leaves room; one that would pass the minute's budget waits."""
    now = [0.0]
    limiter = RateLimiter(None, 100, clock=lambda: now[0])
    limiter.admit(90).settle(10)  # asked for 90, used 10
    limiter.admit(80).settle(80)  # 90 of 100 used
    with pytest.raises(OpenAIError) as info:
        limiter.admit(20)
    assert info.value.status == 429 and info.value.retry_after == pytest.approx(6.0)
    now[0] = 6.0  # 10 more tokens a minute / 60 s * 6 s
    limiter.admit(20)


# -- the keys file ---------------------------------------------------------------------------
def test_a_keys_file_in_yaml_or_json_maps_keys_to_tenants(tmp_path):
    yaml_file = tmp_path / "keys.yaml"
    yaml_file.write_text(
        "sk-a1: {tenant: alice, weight: 2, requests_per_minute: 60}\n"
        "sk-b1:\n  tenant: bob\n  priority_class: offline\n  tokens_per_minute: 1000\n"
    )
    json_file = tmp_path / "keys.json"
    json_file.write_text(json.dumps({"sk-c1": {"tenant": "carol"}}))
    keys = read_keys_file(yaml_file) | read_keys_file(json_file)
    assert keys["sk-a1"].weight == 2.0 and keys["sk-a1"].requests_per_minute == 60
    assert keys["sk-b1"].priority_class == "offline"
    assert keys["sk-c1"].tenant == "carol"
    both = key_policies(["sk-plain"], json_file)
    assert both["sk-plain"].tenant == "default" and both["sk-c1"].tenant == "carol"
    assert ApiKeys(both).principal("Bearer sk-c1").tenant == "carol"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sk-a: {tenant: alice, weight: '2'}", "weight"),  # strict: a string is not a number
        ("sk-a: {tenant: alice, weight: 0}", "weight"),
        ("sk-a: {tenant: alice, prio: online}", "prio"),
        ("sk-a: {weight: 1}", "tenant"),
        ("sk-a: {tenant: alice, priority_class: urgent}", "priority_class"),
        ("- sk-a", "must map each API key"),
        ("sk-a: [", "not valid YAML"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_problem_not_the_key(tmp_path, text, expected):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileError) as info:
        read_keys_file(path)
    assert expected in str(info.value)
    if "sk-a:" in text and "[" not in text:
        assert "sk-a" not in str(info.value).replace(str(path), "")


def test_the_gateway_command_refuses_a_bad_keys_file_before_starting(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("sk-a: {tenant: alice, weight: -1}")
    result = CliRunner().invoke(cli_app, ["openai", "--api-key-file", str(path)])
    assert result.exit_code == 2, result.output
    assert "weight" in result.output
    result = CliRunner().invoke(cli_app, ["serve", "--api-key", "sk-a"])
    assert result.exit_code == 2 and "--openai-port" in result.output


def test_the_log_warns_about_serving_without_keys():
    settings = GatewaySettings(triton_grpc_url="x:1")
    assert "unauthenticated" in (auth_warning(settings, "127.0.0.1") or "")
    assert "ANYONE WHO CAN REACH THIS PORT" in (auth_warning(settings, "0.0.0.0") or "")
    assert "ANYONE" in (auth_warning(settings, "::") or "")
    keyed = GatewaySettings(triton_grpc_url="x:1", api_keys=KEYS)
    assert auth_warning(keyed, "0.0.0.0") is None


def test_key_weights_become_the_fair_policies_tenant_weights():
    assert with_key_weights("vtc", None, KEYS) == {"weights": {"alice": 2.0}}
    assert with_key_weights("fair", {"window_s": 5}, KEYS) == {
        "window_s": 5,
        "priorities": {"alice": 2.0},
    }
    assert with_key_weights("vtc", {"weights": {"x": 3}}, KEYS) == {"weights": {"x": 3}}
    assert with_key_weights("fcfs", None, KEYS) is None


# -- the Host allow-list ---------------------------------------------------------------------
def test_allowed_hosts_refuse_other_host_headers(tmp_path):
    server = serve(tmp_path / "state", RecordingTriton(), allowed_hosts=("127.0.0.1",))
    try:
        assert post(server.url, "/v1/models")[0] == 200
        request = urllib.request.Request(f"{server.url}/v1/models", headers={"Host": "evil.test"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 400
    finally:
        server.stop()
