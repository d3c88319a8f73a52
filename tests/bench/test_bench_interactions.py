"""Live replays honour multi-call interactions: the dependency bookkeeping
(``quanta.workloads.dependencies``), the asyncio client on a fake transport, and the live
fairness figures (``quanta.bench.fairness``) against the simulator's definitions.

The run against a real ``quanta serve`` is in ``test_bench_client.py`` (its server fixture).
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
from quanta.bench import client
from quanta.bench.client import ClientRequest, ClientResult, Target, replay
from quanta.bench.fairness import live_fairness
from quanta.workloads import WorkloadRequest
from quanta.workloads.dependencies import Call, Interactions

THROTTLE = "RuntimeError: [resource_exhausted] tenant over its share"


def chain_calls() -> list[Call]:
    """Interaction i0 of three calls (listed out of order), i1 of two, and a free call."""
    return [
        Call("a1", 0.5, "i0", 1, think_time_s=0.25),
        Call("a0", 0.0, "i0", 0),
        Call("b0", 0.1, "i1", 0),
        Call("x", 0.2, "i0"),  # an interaction id but no stage: free, as before
        Call("a2", 9.0, "i0", 2, think_time_s=1.0),
        Call("b1", 0.3, "i1", 1),
    ]


def test_only_first_stages_and_unstaged_calls_are_free():
    plan = Interactions(chain_calls())
    assert [c.request_id for c in plan.free()] == ["a0", "b0", "x"]
    assert [plan.waits(r) for r in ("a0", "a1", "a2", "b1", "x")] == [
        False,
        True,
        True,
        True,
        False,
    ]
    assert plan.pending == 3


def test_a_finished_call_releases_its_follower_after_think_time():
    plan = Interactions(chain_calls())
    assert plan.finished("x", 1.0, ok=True) == {}  # no follower
    assert plan.finished("a0", 2.0, ok=True) == {"a1": 2.25}  # end + think > arrival
    assert plan.finished("a1", 3.0, ok=True) == {"a2": 9.0}  # arrival is the later
    assert plan.finished("a2", 10.0, ok=True) == {}
    assert plan.pending == 1 and plan.abandoned == []


def test_a_failed_call_abandons_the_rest_of_its_interaction():
    plan = Interactions(chain_calls())
    assert plan.finished("a0", 1.0, ok=False) == {"a1": None, "a2": None}
    assert plan.abandoned == ["a1", "a2"]
    assert plan.finished("b0", 1.0, ok=True) == {"b1": 1.0}
    assert plan.pending == 0


class FakeSender:
    """A transport that takes 50 ms per request and throttles the ids in ``throttle``."""

    def __init__(self, throttle: set[str]) -> None:
        self.throttle = throttle

    def prepare(self, request: ClientRequest) -> ClientRequest:
        return request

    async def send(self, payload: ClientRequest, result: ClientResult, now) -> None:
        await asyncio.sleep(0.05)
        if payload.request_id in self.throttle:
            raise RuntimeError(THROTTLE.removeprefix("RuntimeError: "))
        result.chunk_s.append(now())
        result.num_output_tokens = payload.max_tokens
        result.num_prompt_tokens = payload.prompt if isinstance(payload.prompt, int) else None
        result.finish_reason = "length"


def fake_replay(monkeypatch, requests, throttle=frozenset()):
    @contextlib.asynccontextmanager
    async def fake(target):
        yield FakeSender(set(throttle))

    monkeypatch.setattr(client, "_sender", fake)
    return asyncio.run(replay(requests, Target(url="fake", transport="grpc")))


def test_client_sends_a_later_call_after_the_previous_one_finished(monkeypatch):
    requests = [
        ClientRequest("a0", 0.0, 4, 2, interaction_id="i0", interaction_stage=0),
        ClientRequest("a1", 0.0, 4, 2, interaction_id="i0", interaction_stage=1, think_time_s=0.1),
        ClientRequest("free", 0.0, 4, 2, interaction_id="i0"),
    ]
    a0, a1, free = fake_replay(monkeypatch, requests)
    assert all(r.ok for r in (a0, a1, free))
    assert free.send_s < 0.04  # not staged: at its arrival, as before
    assert a1.scheduled_s == pytest.approx(a0.end_s + 0.1)
    assert a1.send_s >= a0.end_s + 0.1


def test_client_abandons_the_rest_after_a_throttled_call(monkeypatch):
    requests = [
        ClientRequest("a0", 0.0, 4, 2, interaction_id="i0", interaction_stage=0),
        ClientRequest("a1", 0.0, 4, 2, interaction_id="i0", interaction_stage=1),
        ClientRequest("a2", 0.0, 4, 2, interaction_id="i0", interaction_stage=2),
        ClientRequest("b0", 0.0, 4, 2, interaction_id="i1", interaction_stage=0),
    ]
    results = fake_replay(monkeypatch, requests, throttle={"a0"})
    assert [r.request_id for r in results] == ["a0", "a1", "a2", "b0"]  # the given order
    a0, a1, a2, b0 = results
    assert a0.throttled and not a0.abandoned
    assert a1.abandoned and a2.abandoned and math.isnan(a1.send_s) and not a1.throttled
    assert b0.ok


def test_live_fairness_counts_throttles_abandons_and_waste():
    rows = [
        WorkloadRequest(0.0, 10, 4, "a0", tenant="u0", app="s", interaction_id="i0",
                        interaction_stage=0, system_tokens=4),
        WorkloadRequest(0.0, 12, 4, "a1", tenant="u0", app="s", interaction_id="i0",
                        interaction_stage=1, interaction_last=True),
        WorkloadRequest(0.0, 10, 4, "b0", tenant="u1", app="s", interaction_id="i1",
                        interaction_stage=0),
        WorkloadRequest(0.0, 12, 4, "b1", tenant="u1", app="s", interaction_id="i1",
                        interaction_stage=1, interaction_last=True),
    ]  # fmt: skip

    def done(rid: str, send: float, ttft: float, tokens: int = 4) -> ClientResult:
        res = ClientResult(rid, send, "u", None, send_s=send, end_s=send + ttft + 0.1)
        res.chunk_s, res.num_output_tokens = [send + ttft], tokens
        return res

    a0 = done("a0", 0.0, 0.1)
    a1 = done("a1", 0.3, 0.1)
    b0 = done("b0", 0.0, 3.0)  # waited past the 2 s threshold
    b1 = ClientResult("b1", 3.2, "u", None, send_s=3.2, end_s=3.3, error=THROTTLE)
    f = live_fairness(rows, [a0, a1, b0, b1], delay_threshold_s=2.0)
    assert f["num_interactions"] == 2 and f["completed_interactions"] == 1
    assert f["throttled_requests"] == 1 and f["throttled_interactions"] == 1
    assert f["abandoned_requests"] == 0
    assert f["wasted_tokens"] == 10 + 4  # b0's prompt and output, for an unanswered query
    assert f["delayed_users_fraction"] == 0.5 and f["served_users_fraction"] == 0.5
    assert f["completed_requests"] == 3
    assert set(f["by_tenant"]) == {"u0", "u1"} and f["by_tenant"]["u1"]["delayed"]
    assert 0.5 <= f["jain_index"] <= 1.0
    # an abandoned call counts as such, not as sent
    b1_abandoned = ClientResult("b1", 3.2, "u", None, error="abandoned, never sent: x")
    f = live_fairness(rows, [a0, a1, b0, b1_abandoned])
    assert f["abandoned_requests"] == 1 and f["throttled_requests"] == 0
    assert f["by_tenant"]["u1"]["abandoned"] == 1
