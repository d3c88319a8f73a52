"""Tenants a client cannot multiply: under the fair orderings a request whose tenant no API
key vouches for counts as one pooled tenant, so sending each request under a fresh name buys
no share (the rotating-name, or Sybil, attack), while an authenticated tenant keeps its fair
share. The counters with both lifts and their sweep, the same in Redis, the option, the
request field over Triton and the gateway, the workload model, the attack in the simulator
and on a live server."""

from __future__ import annotations

import importlib.util
import random
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from quanta.core.config import SchedulerConfig
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.costmodel import PROFILES
from quanta.policies import fair_state, fair_stores, make_policy
from quanta.policies.fair import POOL, VTCOrder
from quanta.policies.fair_state import ServiceCounters
from quanta.sim import SimSetup, simulate
from quanta.sim.fairness import fairness
from quanta.workloads import (
    WorkloadError,
    WorkloadRequest,
    load_workload,
    make_workload,
    save_workload,
    tenant_mix,
)
from test_fair import view

ROOT = Path(__file__).resolve().parents[2]


def req(rid: str, tenant: str, *, authenticated: bool = False, t: float = 0.0) -> Request:
    meta = RequestMetadata(tenant=tenant, tenant_authenticated=authenticated)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(rid, [1 + j % 40 for j in range(30)], sp, t, seed=1, metadata=meta)


# -- the counters -----------------------------------------------------------------------------
def test_unauthenticated_names_share_one_counter_served_in_arrival_order():
    order = VTCOrder(SchedulerConfig())
    first, second = req("a", "sybil-1", t=0.0), req("b", "sybil-2", t=1.0)
    victim = req("v", "victim", t=0.5)
    for r in (first, victim, second):
        order.on_admit(r, view(r))
    assert order.user(first) == order.user(second) == order.user(victim) == POOL
    assert order.service.of(POOL) == 3 * 30  # each prompt charged to the pool
    assert order.service.of("sybil-2") == 0.0
    ranked = [r.request_id for r in order.rank(view(second, victim, first)).order]
    assert ranked == ["a", "v", "b"]  # first come, first served among them


def test_an_authenticated_tenant_is_ranked_against_the_pool_as_one_tenant():
    order = VTCOrder(SchedulerConfig())
    sybils = [req(f"s{i}", f"sybil-{i}", t=0.1 * i) for i in range(5)]
    for r in sybils:
        order.on_admit(r, view(r))
    victim = req("v", "victim", authenticated=True, t=1.0)
    order.on_admit(victim, view(victim))
    assert order.user(victim) == "victim"
    # lifted to the pool's 150 (VTC's rule: min over the active tenants), then its prompt
    assert order.service.of("victim") == 5 * 30 + 30
    newcomer = req("n", "sybil-9", t=2.0)
    order.on_admit(newcomer, view(newcomer))
    ranked = [r.request_id for r in order.rank(view(newcomer, victim, *sybils)).order]
    assert ranked[0] == "s0" and ranked.index("v") < ranked.index("n")


def test_the_old_behaviour_lets_every_fresh_name_jump_the_queue():
    """``unauthenticated_tenants=min`` (names trusted, VTC's lift): a steady tenant that
    has been served waits behind a request sent a moment ago under a new name; ``max``
    puts the new name behind it."""
    for lift, first in (("min", "n"), ("max", "v")):
        order = VTCOrder(SchedulerConfig(), unauthenticated=lift)  # type: ignore[arg-type]
        victim = req("v", "victim", t=0.0)
        other = req("o", "other", t=0.0)
        for r in (victim, other):
            order.on_admit(r, view(r))
        order.service.add("victim", 500.0)
        newcomer = req("n", "sybil-1", t=5.0)
        order.on_admit(newcomer, view(newcomer))
        assert order.rank(view(newcomer, victim)).order[0].request_id == first, lift


def test_max_lift_starts_a_fresh_name_at_the_most_served_active_counter():
    c = ServiceCounters()
    c.enter("ann")
    c.add("ann", 10.0)
    c.enter("bob")
    c.add("bob", 40.0)
    c.enter("new", "max")
    assert c.of("new") == 50.0
    c.enter("low")
    assert c.of("low") == 10.0  # VTC's lift: the least-served active


def test_the_sweep_forgets_only_counters_that_a_lift_would_raise_anyway(monkeypatch):
    """Two counters fed the same entries, exits and service, one sweeping every few
    entries: every user's counter reads the same after each entry, while the sweeping
    table stays bounded under a stream of fresh names."""
    monkeypatch.setattr(fair_state, "SWEEP_SLACK", 8)
    sweeping = ServiceCounters()
    keeping = ServiceCounters()
    keeping._sweep_at = 10**9
    rng = random.Random(0)
    live: list[str] = []
    for k in range(3000):
        op = rng.random() if len(live) < 10 else 0.5  # NOTE: a bounded queue
        if op < 0.45 or not live:
            user = f"fresh-{k}" if rng.random() < 0.7 else f"old-{rng.randrange(20)}"
            lift = rng.choice(["min", "max"])
            sweeping.enter(user, lift)  # type: ignore[arg-type]
            keeping.enter(user, lift)  # type: ignore[arg-type]
            live.append(user)
            assert sweeping.of(user) == keeping.of(user)
        elif op < 0.8:
            user = live.pop(rng.randrange(len(live)))
            sweeping.leave(user)
            keeping.leave(user)
        else:  # NOTE: mostly the least served, as a fair order serves them
            pick = rng.choice(live) if rng.random() < 0.3 else min(live, key=keeping.of)
            amount = rng.uniform(0, 30)
            sweeping.add(pick, amount)
            keeping.add(pick, amount)
        for user in set(live):
            assert sweeping.of(user) == keeping.of(user)
    assert len(sweeping.counters) < len(keeping.counters) / 3


# -- the option and the field -----------------------------------------------------------------
def test_the_option_defaults_to_the_pool_and_refuses_other_values():
    policy = make_policy("fair", SchedulerConfig())
    assert policy.ordering.unauthenticated == "pool"
    policy = make_policy("vtc", SchedulerConfig(), unauthenticated_tenants="min")
    assert policy.ordering.unauthenticated == "min"
    with pytest.raises(ValueError, match="unauthenticated_tenants"):
        make_policy("wsc", SchedulerConfig(), unauthenticated_tenants="trusted")


def test_only_the_server_sets_tenant_authenticated():
    """Triton's input carries it (the gateway sets it from an API key); a gateway body
    that names it is refused, so a client cannot claim it."""
    import numpy as np
    from pydantic import ValidationError
    from quanta.frontends.openai.protocol import CompletionRequest
    from quanta.frontends.triton.client import request_inputs
    from quanta.frontends.triton.inputs import parse_request

    arrays = {
        "text_input": np.array([b"hi"], dtype=np.object_),
        "tenant": np.array([b"alice"], dtype=np.object_),
        "tenant_authenticated": np.array([True]),
    }
    assert parse_request(arrays.get).metadata.tenant_authenticated is True
    del arrays["tenant_authenticated"]
    assert parse_request(arrays.get).metadata.tenant_authenticated is False
    meta = RequestMetadata(tenant="alice", tenant_authenticated=True)
    inputs = request_inputs("hi", SamplingParams(), stream=False, metadata=meta)
    assert inputs["tenant_authenticated"] is True
    body = CompletionRequest(model="quanta", prompt="hi", user="alice")
    assert body.metadata().tenant_authenticated is False
    with pytest.raises(ValidationError, match="tenant_authenticated"):
        CompletionRequest(model="quanta", prompt="hi", tenant_authenticated=True)


# -- the workload model -----------------------------------------------------------------------
def test_a_tenant_mix_names_rotating_and_unauthenticated_tenants(tmp_path):
    mix = tenant_mix("victim:1,sybil*:8,anon?:2")
    assert [(t.name, t.rotate_names, t.authenticated) for t in mix] == [
        ("victim", False, True),
        ("sybil", True, False),
        ("anon", False, False),
    ]
    with pytest.raises(WorkloadError, match="bad tenant mix"):
        tenant_mix("*:1")
    rows = make_workload("sharegpt", 200, 4.0, seed=3, tenants="victim:1,sybil*:8")
    plain = make_workload("sharegpt", 200, 4.0, seed=3)
    assert [(r.arrival_time, r.prompt_tokens) for r in rows] == [
        (r.arrival_time, r.prompt_tokens) for r in plain
    ]
    sybils = [r for r in rows if r.tenant != "victim"]
    assert len({r.tenant for r in sybils}) == len(sybils) > 100
    assert not any(r.tenant_authenticated for r in sybils)
    assert all(r.tenant_authenticated for r in rows if r.tenant == "victim")
    path = tmp_path / "w.jsonl"
    save_workload(path, rows)
    assert load_workload(path) == rows
    with pytest.raises(WorkloadError, match="has its own users"):
        make_workload("agents", 10, 1.0, tenants="a:1")


# -- the attack in the simulator --------------------------------------------------------------
def _attack(mix: str) -> list[WorkloadRequest]:
    """A victim sends 1 in 9 of ShareGPT-like requests at 8 per second, about 3x what the
    server serves; the attacker the rest, under one name or a fresh name each."""
    return make_workload("sharegpt", 300, 8.0, seed=0, tenants=mix)


def _victim(policy: str, trace: list[WorkloadRequest], **options: Any) -> tuple[int, float]:
    """The victim's requests finished while the load lasted, and its share of fair share."""
    res = simulate(trace, SimSetup(policy, PROFILES["a100-opt13b"], policy_options=options))
    end = max(r.arrival_time for r in trace)
    victim = [r for r in res.requests if r.metadata.tenant == "victim"]
    done = sum(1 for r in victim if r.finish_time is not None and r.finish_time <= end)
    return done, fairness(res.requests)["by_tenant"]["victim"]["share_received"]


def test_rotating_names_get_the_victim_no_less_than_fcfs_without_keys():
    """No keys (every name the client's own): trusting names lets the rotating attacker
    push the victim below what FCFS gives it; the pool gives it what FCFS does."""
    trace = _attack("victim?:1,sybil*:8")
    fcfs, _ = _victim("fcfs", trace)
    trusted, _ = _victim("fair", trace, unauthenticated_tenants="min")
    pooled, _ = _victim("fair", trace)
    assert fcfs > 0
    assert trusted < fcfs <= pooled, (trusted, fcfs, pooled)


def test_with_a_key_the_victim_gets_its_fair_share_against_rotating_names():
    """The victim authenticated, the attacker not: the victim is one tenant against the
    pool and finishes as much as against a one-name attacker, far more than under FCFS."""
    rotating = _attack("victim:1,sybil*:8")
    one_name = _attack("victim:1,attacker:8")
    fcfs, _ = _victim("fcfs", rotating)
    keyed, _ = _victim("fair", rotating)
    against_one, share = _victim("fair", one_name)
    _, fcfs_share = _victim("fcfs", one_name)
    # the one-name attacker, both with keys: most of its fair share (its last requests are
    # not done when the load ends), against a quarter under FCFS
    assert share >= 0.75 and share >= 3 * fcfs_share, (share, fcfs_share)
    assert keyed >= 0.9 * against_one and keyed >= 2 * fcfs, (keyed, against_one, fcfs)


# -- Redis ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_url():
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from test_fair_redis import RedisServer

    server = RedisServer()
    server.start()
    yield server.url
    server.stop()


def test_the_lifts_and_the_sweep_in_redis_are_the_in_process_ones(redis_url, monkeypatch):
    import redis
    from quanta.policies import fair_redis
    from quanta.policies.fair_redis import RedisState

    monkeypatch.setattr(fair_state, "SWEEP_SLACK", 8)
    monkeypatch.setattr(fair_redis, "SWEEP_SLACK", 8)
    redis.Redis.from_url(redis_url).flushdb()
    replicas = [RedisState(redis_url) for _ in range(2)]
    local = ServiceCounters()
    rng = random.Random(1)
    live: list[str] = []
    for k in range(400):
        counters = replicas[k % 2].service
        op = rng.random()
        if op < 0.45 or not live:
            user = f"fresh-{k}" if rng.random() < 0.7 else f"old-{rng.randrange(5)}"
            lift = rng.choice(["min", "max"])
            local.enter(user, lift)  # type: ignore[arg-type]
            counters.enter(user, lift)  # type: ignore[arg-type]
            live.append(user)
        elif op < 0.8:
            user = live.pop(rng.randrange(len(live)))
            local.leave(user)
            counters.leave(user)
        else:
            user, amount = rng.choice(live), float(rng.randrange(1, 30))
            local.add(user, amount)
            counters.add(user, amount)
            counters.sync()
    replicas[0].service.sync()
    assert replicas[0].service._snapshot == pytest.approx(local.counters)
    assert replicas[0].errors == replicas[1].errors == 0


def test_replicas_charge_unauthenticated_requests_to_the_pool(redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    url = redis_url
    a = make_policy("vtc", SchedulerConfig(), state_url=url).ordering
    b = make_policy("vtc", SchedulerConfig(), state_url=url).ordering
    for order, r in ((a, req("x", "sybil-1")), (b, req("y", "sybil-2"))):
        order.on_admit(r, view(r))
    a.service.sync()
    assert a.service.of(POOL) == 60 and a.service.of("sybil-1") == 0.0
    fair_stores.forget_state(url)


# -- the attack on a live server --------------------------------------------------------------
def _load_attack_script() -> Any:
    name = "tenant_attack.py"
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "trust" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _triton_sender(http_url: str, model: str, authenticated: bool) -> Any:
    """Requests as the gateway sends them to Triton: with an API key, the key's tenant and
    ``tenant_authenticated``; without, the name the client gave."""
    from quanta.frontends.triton.client import http_events, request_inputs

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def send(tenant: str) -> bool:
        meta = RequestMetadata(tenant=tenant, tenant_authenticated=authenticated)
        inputs = request_inputs("Tell me a story.", params, stream=False, metadata=meta)
        try:
            return bool(list(http_events(http_url, model, inputs, stream=False, timeout=60)))
        except Exception:
            return False

    return send


@pytest.mark.live
def test_a_live_server_keeps_the_victim_served_under_the_rotating_name_attack(triton):
    """One seat, so the order alone decides who is served next; a closed-loop victim
    against twelve closed-loop attackers that use a fresh name per request, 6 s a run. FCFS
    serves the victim about once per thirteen; fair without keys the same (the pool is first
    come, first served); fair with the victim's key about every other time. Counts of
    completions, compared with wide margins (the runs are seconds long on a shared CPU)."""
    script = _load_attack_script()
    seconds, attackers = 6.0, 12

    def victim_count(model: str, victim_authenticated: bool = False) -> int:
        attacker = _triton_sender(triton.http_url, model, False)
        victim = _triton_sender(triton.http_url, model, victim_authenticated)
        run = script.run_phase(victim, attacker, seconds=seconds, attackers=attackers, rotate=True)
        assert run["victim_failed"] == 0 and run["attacker_completed"] > 0, run
        return run["victim_completed"]

    fcfs = victim_count("quanta-one-seq")
    pooled = victim_count("quanta-fair-one-seq")
    keyed = victim_count("quanta-fair-one-seq", victim_authenticated=True)
    print(f"victim completions: fcfs {fcfs}, fair {pooled}, fair with a key {keyed}")
    assert fcfs >= 1, fcfs
    assert pooled >= fcfs // 2, (pooled, fcfs)
    assert keyed >= 2 * max(fcfs, pooled), (keyed, fcfs, pooled)


@pytest.mark.live
def test_the_attack_script_reports_each_phase(triton):
    """bench/trust/tenant_attack.py at a tiny size against a gateway."""
    import json

    script = _load_attack_script()
    url = triton.openai_url("quanta-one-seq")
    args = ["--url", url, "--model", "quanta-one-seq", "--seconds", "1", "--attackers", "2"]
    out = _capture(script.main, [*args, "--max-tokens", "4", "--json"])
    report = json.loads(out)
    assert set(report) >= {"alone", "one_name", "rotating"}
    assert report["alone"]["victim_completed"] > 0
    assert report["rotating"]["attacker_names"] >= report["rotating"]["attacker_completed"] > 0
    assert report["one_name"]["attacker_names"] == 1


def _capture(main: Any, argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def test_a_flagged_row_reaches_the_policy_as_authenticated():
    row = replace(WorkloadRequest(0.0, 10, 5, "r0", tenant="t"), tenant_authenticated=False)
    assert RequestMetadata(**row.metadata()).tenant_authenticated is False
    assert RequestMetadata(**WorkloadRequest(0.0, 10, 5).metadata()).tenant_authenticated
