"""The fairness state in a real Redis server (Debian's ``redis-server``, started on a free
local port and stopped after; the tests skip where it is not installed): replicas see each
other's service, windows and interactions; the lift rule is the in-process one; an outage
fails open and what was added reaches Redis once it answers again."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.core.config import SchedulerConfig
from quanta.costmodel import load_profile
from quanta.frontends.triton.launcher import free_port
from quanta.policies.fair_redis import RedisState
from quanta.policies.fair_state import ServiceCounters
from quanta.policies.fair_stores import fairness_state, forget_state
from quanta.sim import SimSetup
from quanta.sim.replicas import simulate_replicas
from replica_workloads import two_tenants
from serving import wait_for

pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            ["redis-server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        wait_for(lambda: _pings(client), what="redis-server to answer")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def _pings(client) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def server():
    s = RedisServer()
    s.start()
    yield s
    s.stop()


@pytest.fixture
def url(server):
    """A clean database for each test."""
    import redis

    redis.Redis.from_url(server.url).flushdb()
    return server.url


def test_replicas_see_each_others_service(url):
    a, b = RedisState(url), RedisState(url)
    a.service.enter("alice")
    b.service.enter("bob")
    a.service.add("alice", 100.0)
    b.service.add("bob", 30.0)
    assert b.service.of("alice") == 0.0  # not synced yet: a step later
    a.service.sync()
    b.service.sync()
    assert b.service.of("alice") == 100.0 and a.service.of("bob") == 0.0  # a read before b sent
    a.service.sync()
    assert a.service.of("bob") == 30.0
    assert a.errors == b.errors == 0


@settings(max_examples=25)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["enter", "leave", "add"]),
            st.sampled_from(["u1", "u2", "u3"]),
            st.integers(1, 50),
            st.integers(0, 2),
        ),
        max_size=30,
    )
)
def test_the_lift_rule_is_the_in_process_one(server, ops):
    """Any sequence of entries, exits and service, spread over three replicas, leaves the
    counters the single in-process ``ServiceCounters`` would hold."""
    import redis

    redis.Redis.from_url(server.url).flushdb()
    replicas = [RedisState(server.url) for _ in range(3)]
    local = ServiceCounters()
    live: dict[str, int] = defaultdict(int)
    for op, user, amount, at in ops:
        counters = replicas[at].service
        if op == "enter":
            local.enter(user)
            counters.enter(user)
            live[user] += 1
        elif op == "leave" and live[user] > 0:
            local.leave(user)
            counters.leave(user)
            live[user] -= 1
        elif op == "add":
            local.add(user, float(amount))
            counters.add(user, float(amount))
            counters.sync()  # NOTE: as a step ends and the next ranks
    for r in replicas:
        r.service.sync()
    for user in ("u1", "u2", "u3"):
        assert replicas[0].service.of(user) == pytest.approx(local.of(user)), user


def test_windows_and_interactions_are_the_clusters(url):
    a, b = RedisState(url), RedisState(url)
    users_a, users_b = a.windows("users", 60.0), b.windows("users", 60.0)
    assert [users_a.note("alice", 0.0), users_b.note("alice", 0.0)] == [1, 2]
    assert users_b.note("bob", 0.0) == 1
    ia, ib = a.interactions(30.0), b.interactions(30.0)
    ia.open("chat-1", "alice", 1.0)
    assert ib.is_open("chat-1", 1.0)
    ia.close("chat-1")
    assert not ib.is_open("chat-1", 2.0)  # NOTE: a new ``now``: the cache is per ranking
    short = RedisState(url).interactions(0.05)
    short.open("chat-2", "bob", 0.0)
    time.sleep(0.2)
    assert not ib.is_open("chat-2", 3.0)  # expired in Redis after its idle time


def test_an_outage_fails_open_and_the_service_catches_up(server):
    import redis

    redis.Redis.from_url(server.url).flushdb()
    a = RedisState(server.url, retry_s=0.1)
    a.service.enter("alice")
    server.stop()
    try:
        a.service.add("alice", 40.0)
        a.service.sync()  # fails open: keeps what it added
        a.service.enter("bob")
        assert a.windows("users", 60.0).note("bob", 0.0) == 1  # this replica's own window
        assert a.service.of("alice") == 40.0
        assert a.errors > 0
    finally:
        server.start()
    time.sleep(0.15)
    a.service.sync()
    other = RedisState(server.url)
    other.service.sync()
    assert other.service.of("alice") == 40.0  # sent once Redis answered


def test_policies_share_a_redis_state_and_keep_fair_shares(url):
    """The simulator's two-tenant case (tests/sim/test_replicas.py) with every replica's policy on
    the Redis state instead of a shared in-process one: the shares even out as well."""
    try:
        run = simulate_replicas(
            two_tenants(4),
            SimSetup(
                "wsc",
                load_profile("a100-opt13b"),
                SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
                policy_options={"state_url": url},
            ),
            4,
            router="prefix-affinity",
            until=20.0,
            affinity_slack=float("inf"),
        )
        assert fairness_state(url).errors == 0
    finally:
        forget_state(url)
    service: dict[str, float] = defaultdict(float)
    for r in run.requests:
        if r.status.finished and r.error is None:
            service[r.metadata.tenant] += r.num_prompt_tokens + r.num_output_tokens
    assert abs(service["wide"] - service["narrow"]) < 0.15 * sum(service.values()), service
