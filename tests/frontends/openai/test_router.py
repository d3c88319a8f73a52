"""The gateway's router over several Triton replicas: how it picks, what it does when a
replica cannot be reached, and a live gateway in front of the shared server and a dead port."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
from quanta.frontends.openai.app import GatewaySettings
from quanta.frontends.openai.router import ReplicaRouter
from quanta.frontends.openai.server import GatewayServer
from quanta.frontends.openai.upstream import UpstreamError
from quanta.frontends.triton.launcher import free_port


class FakeReplica:
    """A replica answering with two events; ``down`` refuses as an unreachable server does,
    ``break_after`` fails a stream after its first event."""

    def __init__(self, url: str, *, down: bool = False, break_after: bool = False) -> None:
        self.url, self.down, self.break_after = url, down, break_after
        self.received: list[dict[str, Any]] = []

    def stream(self, model: str, inputs: dict[str, Any], **_: Any) -> FakeStream:
        return FakeStream(self, inputs)

    async def is_model_ready(self, model: str) -> bool:
        return not self.down

    async def close(self) -> None:
        pass


class FakeStream:
    def __init__(self, replica: FakeReplica, inputs: dict[str, Any]) -> None:
        self.replica, self.inputs, self.sent, self.done = replica, inputs, 0, False

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.replica.down:
            self.done = True
            raise UpstreamError(f"UNAVAILABLE at {self.replica.url}", unavailable=True)
        if self.sent == 0:
            self.replica.received.append(self.inputs)
        if self.sent == 1 and self.replica.break_after:
            self.done = True
            raise UpstreamError(f"UNAVAILABLE at {self.replica.url}", unavailable=True)
        self.sent += 1
        self.done = self.sent == 2
        return {"text_output": "x", **({"finish_reason": "length"} if self.done else {})}

    def cancel(self) -> None:
        self.done = True


def _router(replicas: list[FakeReplica], policy: str = "least-outstanding") -> ReplicaRouter:
    return ReplicaRouter([], policy=policy, replicas=replicas)  # type: ignore[arg-type]


async def _drain(stream: Any) -> list[dict[str, Any]]:
    events = []
    while not stream.done:
        events.append(await stream.__anext__())
    return events


def test_least_outstanding_spreads_what_is_in_flight():
    async def run() -> list[int]:
        replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
        router = _router(replicas)
        streams = [router.stream("m", {"text_input": f"p{i}"}) for i in range(6)]
        for s in streams:
            await s.__anext__()  # each stays in flight after its first event
        counts = [r.outstanding for r in router.replicas]
        for s in streams:
            await _drain(s)
        assert [r.outstanding for r in router.replicas] == [0, 0, 0]
        return counts

    assert asyncio.run(run()) == [2, 2, 2]


def test_a_dead_replica_leaves_rotation_and_its_requests_go_elsewhere():
    async def run() -> ReplicaRouter:
        dead, live = FakeReplica("dead", down=True), FakeReplica("live")
        router = _router([dead, live], policy="round-robin")
        for i in range(4):
            events = await _drain(router.stream("m", {"text_input": f"p{i}"}))
            assert events[-1]["finish_reason"] == "length"
        assert len(live.received) == 4
        return router

    router = asyncio.run(run())
    dead = router.replicas[0]
    assert dead.failures == 1  # tried once, then out of rotation
    text = router.metrics_text()
    assert 'quanta_gateway_upstream_up{upstream="dead"} 0' in text
    assert 'quanta_gateway_upstream_requests_total{upstream="live"} 4' in text


def test_a_started_stream_ends_with_the_error_and_is_not_resent():
    async def run() -> tuple[ReplicaRouter, FakeReplica]:
        broken, other = FakeReplica("a", break_after=True), FakeReplica("b")
        router = _router([broken, other])
        stream = router.stream("m", {"text_input": "p"})
        await stream.__anext__()
        with pytest.raises(UpstreamError):
            await stream.__anext__()
        return router, other

    router, other = asyncio.run(run())
    assert other.received == [] and router.replicas[0].outstanding == 0


def test_no_reachable_replica_is_an_unavailable_error():
    async def run() -> None:
        router = _router([FakeReplica("a", down=True), FakeReplica("b", down=True)])
        with pytest.raises(UpstreamError, match="no Triton replica took the request") as exc:
            await router.stream("m", {"text_input": "p"}).__anext__()
        assert exc.value.unavailable

    asyncio.run(run())


def test_prefix_affinity_keeps_a_shared_prompt_on_one_replica():
    async def run() -> list[int]:
        replicas = [FakeReplica(str(i)) for i in range(4)]
        router = _router(replicas, policy="prefix-affinity")
        system = "You are a helpful assistant. " * 12  # longer than the affinity key
        for i in range(8):
            await _drain(router.stream("m", {"text_input": system + f"question {i}"}))
        return [len(r.received) for r in replicas]

    counts = asyncio.run(run())
    assert sorted(counts) == [0, 0, 0, 8]


def test_a_gateway_routes_around_a_dead_replica(triton):
    """A live gateway with two upstreams, the shared server and a port nothing listens on:
    every completion is answered, and /metrics says which replica is down."""
    dead = f"127.0.0.1:{free_port()}"
    settings = GatewaySettings(
        triton_grpc_url="unused:1",
        model_name="quanta",
        upstreams=(dead, triton.grpc_url),
        router="round-robin",
        state_dir=triton.root / "router-state",
    )
    gateway = GatewayServer(settings, port=free_port()).start()
    try:
        for i in range(3):
            body = json.dumps(
                {"model": "quanta", "prompt": f"Hello {i}", "max_tokens": 4, "ignore_eos": True}
            )
            request = urllib.request.Request(
                f"{gateway.url}/v1/completions",
                body.encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as answer:
                assert json.loads(answer.read())["choices"][0]["finish_reason"] == "length"
        with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        with urllib.request.urlopen(f"{gateway.url}/health", timeout=10) as answer:
            assert answer.status == 200
    finally:
        gateway.stop()
    assert f'quanta_gateway_upstream_up{{upstream="{dead}"}} 0' in metrics
    assert f'quanta_gateway_upstream_requests_total{{upstream="{triton.grpc_url}"}} 3' in metrics
