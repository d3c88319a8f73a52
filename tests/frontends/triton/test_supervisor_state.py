"""The supervisor never gives up unless told to, and says what it is doing: the backoff, the
restart loop on a fake server, the state the gateway reads, and the gateway's 503 with
Retry-After while Triton is down (a gateway in front of a port nobody serves, or of a server
its supervisor knows is down). No tritonserver is started here;
tests/frontends/triton/test_supervision.py kills real ones."""

from __future__ import annotations

import json
import random
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from typing import Any

import pytest
from quanta.frontends.triton import supervise as sup
from quanta.frontends.triton.launcher import LaunchError, free_port
from quanta.frontends.triton.supervisor_state import (
    SupervisorState,
    metrics_text,
    register,
    state_for,
    unregister,
)

MODEL = "quanta"


def test_the_backoff_doubles_up_to_its_cap_with_jitter_in_the_upper_half():
    rng = random.Random(0)
    for n, full in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)]:
        for _ in range(50):
            delay = sup.backoff_delay(n, 30.0, rng)
            assert full / 2 <= delay <= full, (n, delay)
    assert sup.backoff_delay(10, 2.0, rng) <= 2.0
    assert len({round(sup.backoff_delay(3, 30.0, rng), 6) for _ in range(20)}) > 1  # jittered


class FakeServer:
    """Dies ``deaths`` times (exit code 134, as an abort), then is shut down (code 0);
    ``failing`` restarts raise LaunchError instead of becoming ready."""

    def __init__(self, deaths: int, failing: tuple[int, ...] = ()) -> None:
        self.state = SupervisorState(f"127.0.0.1:{free_port()}")
        self.codes: Iterator[int] = iter([134] * deaths + [0])
        self.failing = failing
        self.restarts = 0
        self.phases: list[str] = []  # the state each wait() saw
        self.stops = 0

    def wait(self) -> int:
        self.phases.append(self.state.phase)
        return next(self.codes)

    def exit_status(self) -> str:
        return "signal 6 (SIGABRT)"

    def log_tail(self, n: int) -> list[str]:
        return ["proto_buffer_writer.h:65] ASSERTION FAILED"]

    def restart(self) -> FakeServer:
        self.restarts += 1
        return self

    def wait_ready(self, timeout: float) -> None:
        if self.restarts in self.failing:
            raise LaunchError("tritonserver exited with code 1")

    def stop(self, *, remove_backend_dir: bool = True) -> None:
        self.stops += 1


@pytest.fixture
def delays(monkeypatch) -> list[float]:
    """The supervisor's sleeps, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(sup.time, "sleep", slept.append)
    return slept


def test_it_restarts_forever_by_default(delays, capsys):
    server = FakeServer(deaths=12)  # more than twice the old limit of 5
    assert sup.supervise(server, 0, 10.0, max_delay=4.0) == 0
    assert server.restarts == 12
    assert server.phases == ["up"] * 13  # every wait was on a server that came back
    assert server.state.phase == "stopped"
    assert (server.state.restarts, server.state.deaths) == (12, 12)
    assert delays[0] <= 1.0 and all(d <= 4.0 for d in delays) and max(delays) > 2.0
    err = capsys.readouterr()
    assert "giving up" not in err.err
    assert "restart 12 in" in err.err and "restarting until stopped" in err.err
    assert err.out.count("ready again after restart") == 12


def test_max_restarts_n_gives_up_after_n_restarts_in_a_row(delays, capsys):
    server = FakeServer(deaths=5)
    assert sup.supervise(server, 2, 10.0) == 134
    assert server.restarts == 2
    assert server.state.phase == "failed"
    assert "(--max-restarts 2); giving up" in capsys.readouterr().err


def test_a_restart_that_fails_counts_as_a_death_and_is_retried(delays, capsys):
    server = FakeServer(deaths=1, failing=(1, 2))
    assert sup.supervise(server, 0, 10.0) == 0
    assert server.restarts == 3  # two failed, the third became ready
    assert server.stops == 2  # each failed one was stopped, not waited on
    assert server.state.deaths == 3
    assert len(delays) == 3 and delays[2] > delays[0]  # still backing off
    assert capsys.readouterr().err.count("restart") >= 2


def test_the_state_says_when_it_is_expected_back():
    state = SupervisorState("127.0.0.1:1", startup_s=6.0)
    state.mark_up()
    assert state.available and state.retry_after() is None
    state.mark_down("signal 6 (SIGABRT)", 4.0, 1)
    assert not state.available
    assert 9.0 < state.retry_after() <= 10.0  # the backoff left plus a start as long as the last
    assert "SIGABRT" in state.describe()
    state.mark_restarting()
    assert 1.0 <= state.retry_after() <= 6.0
    state.mark_up(5.0)
    assert state.available and state.startup_s == 5.0
    state.mark_failed("signal 6 (SIGABRT)")
    assert not state.available and state.retry_after() is None


def test_the_metrics_show_each_registered_server():
    state = register(SupervisorState("127.0.0.1:7", restarts=3, deaths=4))
    try:
        state.mark_restarting()
        text = metrics_text()
        assert 'quanta_supervisor_restarts_total{server="127.0.0.1:7"} 4' in text
        assert 'quanta_supervisor_deaths_total{server="127.0.0.1:7"} 4' in text
        assert 'quanta_supervisor_up{server="127.0.0.1:7"} 0' in text
        assert 'quanta_supervisor_state{server="127.0.0.1:7",state="restarting"} 1' in text
        assert 'quanta_supervisor_state{server="127.0.0.1:7",state="up"} 0' in text
        assert state_for("grpc://127.0.0.1:7") is state
    finally:
        unregister(state)
    assert state_for("127.0.0.1:7") is None


# -- the gateway while Triton is down ---------------------------------------------------------
def _post(url: str, body: dict[str, Any]) -> tuple[int, Message, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def gateway_to_nowhere():
    from quanta.frontends.openai.server import start_gateway

    triton = f"127.0.0.1:{free_port()}"
    gateway = start_gateway(triton, host="127.0.0.1", port=free_port(), model_name=MODEL)
    try:
        yield gateway, triton
    finally:
        gateway.stop()


def test_the_gateway_answers_503_with_retry_after_when_triton_cannot_be_reached(
    gateway_to_nowhere,
):
    gateway, _ = gateway_to_nowhere
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    status, headers, answer = _post(f"{gateway.url}/v1/completions", body)
    assert status == 503, answer
    assert int(headers["Retry-After"]) >= 1
    assert answer["error"]["type"] == "server_error"
    assert answer["error"]["code"] == "backend_unavailable"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, headers, answer = _post(f"{gateway.url}/v1/chat/completions", chat)
    assert status == 503 and "Retry-After" in headers, answer


def test_the_gateway_answers_503_while_its_supervisor_restarts_triton(gateway_to_nowhere):
    """With the supervisor's state: no round trip, the 503 says why and Retry-After says
    when; readiness fails and /metrics shows the state; once up, requests go through again
    (here to the port nobody serves: the usual unreachable 503, with no supervisor text)."""
    gateway, triton = gateway_to_nowhere
    state = register(SupervisorState(triton, startup_s=20.0))
    try:
        state.mark_down("signal 6 (SIGABRT)", 8.0, 3)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        status, headers, answer = _post(f"{gateway.url}/v1/completions", body)
        assert status == 503
        assert 20 < int(headers["Retry-After"]) <= 28
        assert "is down (signal 6 (SIGABRT))" in answer["error"]["message"]
        assert answer["error"]["code"] == "backend_unavailable"
        assert _get(f"{gateway.url}/health")[0] == 503
        metrics = _get(f"{gateway.url}/metrics")[1]
        assert re.search(rf'quanta_supervisor_state{{server="{triton}",state="down"}} 1', metrics)
        state.mark_restarting()
        status, headers, answer = _post(f"{gateway.url}/reset_prefix_cache", {})
        assert status == 503 and "is restarting" in answer["error"]["message"]
        assert 1 <= int(headers["Retry-After"]) <= 20
        state.mark_up(5.0)
        status, _, answer = _post(f"{gateway.url}/v1/completions", body)
        assert status == 503 and "restart" not in answer["error"]["message"]
    finally:
        unregister(state)


def test_the_gateway_opens_a_fresh_channel_after_each_restart():
    """A channel that saw the server die backs its reconnects off; after a restart the
    upstream drops it for a new one (and only then)."""
    import asyncio

    from quanta.frontends.openai.upstream import TritonGrpc

    async def run() -> None:
        upstream = TritonGrpc(f"127.0.0.1:{free_port()}")
        state = register(SupervisorState(upstream.url))
        try:
            state.mark_up()
            first = upstream.client
            assert upstream.client is first
            state.mark_down("signal 6 (SIGABRT)", 1.0, 1)
            assert upstream.unavailable() is not None
            assert upstream.client is first  # not while it is down: nothing to connect to
            state.mark_restarting()
            state.mark_up(2.0)
            second = upstream.client
            assert second is not first and upstream.client is second
            assert upstream.unavailable() is None
        finally:
            unregister(state)
            await upstream.close()
            await asyncio.sleep(0)  # the old channel's close runs

    asyncio.run(run())
