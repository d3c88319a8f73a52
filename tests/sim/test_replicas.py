"""Replicas in the simulator: the router, one replica equal to the plain simulator, and fair
shares across replicas kept by a shared state and lost without one."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from quanta.cli import app
from quanta.core.config import SchedulerConfig
from quanta.core.request import Request, SamplingParams
from quanta.costmodel import load_profile
from quanta.sim import SimSetup, simulate
from quanta.sim.replicas import Router, simulate_replicas
from quanta.workloads import make_workload
from replica_workloads import two_tenants
from typer.testing import CliRunner

COST = load_profile("a100-opt13b")
SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048)


def _request(ids: list[int]) -> Request:
    return Request("r", ids, SamplingParams(max_tokens=1), 0.0, 0)


def test_routers_pick_as_their_names_say():
    rr = Router("round-robin", 3, 4)
    assert [rr.pick(_request([1]), [9, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert Router("least-outstanding", 3, 4).pick(_request([1]), [2, 0, 1]) == 1
    sticky = Router("prefix-affinity", 3, 4)
    a, b = _request([5, 6, 7, 8, 1]), _request([5, 6, 7, 8, 2, 3])
    home = sticky.home(a)
    assert sticky.home(b) == home  # the same first block: the same replica
    assert sticky.pick(a, [0, 0, 0]) == home
    crowded = [0, 0, 0]
    crowded[home] = 50
    assert sticky.pick(a, crowded) != home  # far above the mean: balanced away
    with pytest.raises(ValueError, match="unknown router"):
        Router("random", 2, 4)


@pytest.mark.parametrize(("workload", "policy"), [("sharegpt", "sj-mlfq"), ("agents", "fair")])
def test_one_replica_is_the_plain_simulator(workload, policy):
    trace = make_workload(workload, 120, 3.0, seed=1, max_len=COST.max_model_len)
    setup = SimSetup(policy, COST, SCHED)
    plain = simulate(trace, setup)
    replicated = simulate_replicas(trace, setup, 1)
    assert [(r.request_id, r.first_token_time, r.finish_time) for r in plain.requests] == [
        (r.request_id, r.first_token_time, r.finish_time) for r in replicated.requests
    ]


def test_every_request_is_served_once_across_replicas():
    trace = make_workload("agents", 200, 8.0, seed=2, max_len=COST.max_model_len)
    for router in ("least-outstanding", "round-robin", "prefix-affinity"):
        run = simulate_replicas(trace, SimSetup("fair", COST, SCHED), 3, router=router)
        assert sum(p["routed"] for p in run.per_replica) == len(trace)
        assert all(r.status.finished for r in run.requests)
        assert min(p["routed"] for p in run.per_replica) > 0 or router == "prefix-affinity"


def _service(shared: bool, policy: str = "wsc") -> dict[str, float]:
    run = simulate_replicas(
        two_tenants(4),
        SimSetup(policy, COST, SCHED),
        4,
        router="prefix-affinity",
        shared_state=shared,
        until=20.0,
        affinity_slack=float("inf"),
    )
    service: dict[str, float] = defaultdict(float)
    for r in run.requests:
        if r.status.finished and r.error is None:
            service[r.metadata.tenant] += r.num_prompt_tokens + r.num_output_tokens
    return service


def test_shared_state_keeps_fair_shares_across_replicas():
    """Per-replica counters give "wide" half of the narrow tenant's replicas and all of the
    others (3x "narrow"'s service on 4 replicas); shared counters let the narrow replicas
    serve "narrow" until the cluster-wide counters meet."""
    own = _service(shared=False)
    shared = _service(shared=True)
    assert own["wide"] > 2 * own["narrow"], own
    assert abs(shared["wide"] - shared["narrow"]) < 0.15 * (shared["wide"] + shared["narrow"])


def test_the_cli_runs_replicas(tmp_path):
    out = tmp_path / "r.json"
    args = ["simulate", "--workload", "agents", "--num-requests", "40", "--rate", "4"]
    args += ["--policy", "fair", "--replicas", "3", "--router", "round-robin"]
    args += ["--shared-state", "on", "--output", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["replicas"]["count"] == 3 and figures["replicas"]["shared_state"] == "on"
    assert [p["routed"] for p in figures["replicas"]["per_replica"]] == [14, 13, 13]


def test_serve_refuses_a_state_url_the_policy_cannot_use():
    for args, message in (
        (["--policy", "fcfs"], "unknown state_url"),
        (["--policy", "fair"], "state_url must be memory://NAME"),
        ([], "--state-url needs --policy"),
    ):
        url = "redis://h:1/0" if args != ["--policy", "fair"] else "mem://x"
        result = CliRunner().invoke(app, ["serve", *args, "--state-url", url])
        text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # the error box undone
        assert result.exit_code == 2 and message in text, result.output
