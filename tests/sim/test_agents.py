"""Agent workloads (FairServe): the generator, the interaction keys of the file format, the
simulator's dependency-aware replay and abandonment, the fairness figures, and the CLIs."""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from quanta.cli import app
from quanta.core.config import SchedulerConfig
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.costmodel import PROFILES
from quanta.policies import register_system
from quanta.policies.stages import Admission
from quanta.policies.systems import Stages, System, SystemOptions
from quanta.sim import SimSetup, simulate, summarize
from quanta.sim.fairness import fairness
from quanta.workloads import (
    PromptIds,
    WorkloadError,
    WorkloadRequest,
    agent_apps,
    agents,
    load_workload,
    make_workload,
    save_workload,
    scale_time,
    scale_tokens,
)
from typer.testing import CliRunner

COST = PROFILES["a100-opt13b"]
WIDE = {"COLUMNS": "1000"}


class _RefuseStageOneOfBad(Admission):
    """Throttles the second call of tenant ``bad``'s interactions: a mid-interaction refusal."""

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        meta = request.metadata
        if meta.tenant == "bad" and meta.interaction_stage == 1:
            return "test: over the limit"
        return None


register_system(
    System(
        "test-refuse-bad",
        SystemOptions,
        lambda config, o: Stages(admission=_RefuseStageOneOfBad()),
    )
)


def by_interaction(rows: list[WorkloadRequest]) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in rows:
        assert r.interaction_id is not None
        out[r.interaction_id].append(r)
    return {k: sorted(v, key=lambda r: r.interaction_stage or 0) for k, v in out.items()}


# -- the generator -----------------------------------------------------------------------------
def test_agents_are_seeded_and_sized():
    trace = agents(300, 4.0, num_users=8, abusers=2, seed=3)
    assert trace == agents(300, 4.0, num_users=8, abusers=2, seed=3)
    assert trace != agents(300, 4.0, num_users=8, abusers=2, seed=4)
    assert len(trace) == 300
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)
    assert len({r.request_id for r in trace}) == 300 and trace[0].request_id == "r0"
    assert make_workload("agents", 300, 4.0, seed=3, num_users=8, abusers=2) == trace
    assert make_workload("agents", 10, 1.0)[0].tenant.startswith("u")  # 20 users, no abusers
    with pytest.raises(WorkloadError, match="agents"):
        make_workload("sharegpt", 10, 1.0, num_users=3)
    with pytest.raises(WorkloadError):
        agents(10, 1.0, num_users=0, abusers=0)


def test_interactions_are_well_formed():
    trace = agents(1500, 5.0, num_users=12, abusers=1, seed=0, max_len=2048)
    for iid, calls in by_interaction(trace).items():
        assert [c.interaction_stage for c in calls] == list(range(len(calls))), iid
        assert [c.interaction_last for c in calls] == [False] * (len(calls) - 1) + [True]
        assert len({(c.tenant, c.app) for c in calls}) == 1
        assert iid.startswith(calls[0].tenant + "-i")
        assert calls[0].think_time_s == 0.0
        for before, after in itertools.pairwise(calls):
            assert 0.5 <= after.think_time_s <= 2.0
            assert after.arrival_time == pytest.approx(before.arrival_time + after.think_time_s)
    assert all(0 <= r.system_tokens <= r.prompt_tokens for r in trace)
    assert all(r.prompt_tokens + r.output_tokens <= 2048 for r in trace)
    assert max(len(c) for c in by_interaction(trace).values()) > 10
    assert min(len(c) for c in by_interaction(trace).values()) == 1


def test_the_app_catalogue_has_single_and_long_multi_call_apps():
    for seed in range(6):
        apps = agent_apps(seed)
        assert 4 <= len(apps) <= 6
        assert any(a.calls == (1, 1) for a in apps) and max(a.calls[1] for a in apps) == 20
        multi = next(a for a in apps if a.calls[1] > 1)
        assert len(set(multi.system_tokens)) > 1  # system prompts vary by stage
    assert agent_apps(0) != agent_apps(1)


def test_abusers_start_interactions_far_more_often_and_outputs_are_heavy_tailed():
    trace = agents(4000, 8.0, num_users=20, abusers=2, seed=1)
    starts = Counter(r.tenant for r in trace if r.interaction_stage == 0)
    abusers = [n for t, n in starts.items() if t.startswith("abuser")]
    benign = [starts.get(f"u{i}", 0) for i in range(20)]
    assert len(abusers) == 2
    assert min(abusers) > 8 * statistics.mean(benign)
    long_outputs = sum(r.output_tokens > 500 for r in trace) / len(trace)
    assert 0.08 < long_outputs < 0.4
    calls = len(trace) / trace[-1].arrival_time
    assert calls == pytest.approx(8.0, rel=0.35)  # the rate is calls per second


def test_make_workload_passes_the_abuse_factor_and_only_to_agents():
    trace = make_workload("agents", 3000, 8.0, seed=1, num_users=20, abusers=1, abuse_factor=100)
    starts = Counter(r.tenant for r in trace if r.interaction_stage == 0)
    benign = statistics.mean(starts.get(f"u{i}", 0) for i in range(20))
    assert starts["abuser0"] > 50 * benign
    with pytest.raises(WorkloadError, match="agents"):
        make_workload("sharegpt", 5, 1.0, abuse_factor=2.0)


def test_calls_of_an_app_share_its_system_prompt_and_nothing_else():
    trace = agents(200, 4.0, num_users=6, seed=2)
    assert all(r.prefix_group == r.app and r.prefix_tokens == r.system_tokens for r in trace)
    ids = PromptIds()
    prompts = {r.request_id: ids.of(r) for r in trace}
    for a, b in itertools.combinations(trace[:60], 2):
        shared = min(a.system_tokens, b.system_tokens) if a.app == b.app else 0
        pa, pb = prompts[a.request_id], prompts[b.request_id]
        assert pa[:shared] == pb[:shared]
        assert pa[shared : shared + 4] != pb[shared : shared + 4]


# -- the file format ---------------------------------------------------------------------------
def test_interaction_keys_round_trip_and_defaults_stay_out(tmp_path):
    trace = agents(60, 2.0, num_users=4, abusers=1, seed=5)
    path = save_workload(tmp_path / "a.jsonl", trace)
    assert load_workload(path) == trace
    first, *_ = (json.loads(line) for line in path.read_text().splitlines())
    assert "think_time_s" not in first and "interaction_last" not in first
    assert first["interaction_stage"] == 0
    plain = save_workload(tmp_path / "p.jsonl", [WorkloadRequest(0.0, 3, 4, "x")])
    assert set(json.loads(plain.read_text())) == {
        "request_id",
        "arrival_time",
        "prompt_tokens",
        "output_tokens",
    }
    assert trace[0].metadata()["system_tokens"] == trace[0].system_tokens
    assert "think_time_s" not in trace[0].metadata()


BASE = '"prompt_tokens": 20, "output_tokens": 5, "interaction_id": "i"'


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ('"interaction_stage": -1', "interaction_stage must be an integer >= 0"),
        ('"interaction_stage": 1.5', "interaction_stage must be an integer"),
        ('"interaction_last": "yes"', "interaction_last must be true or false"),
        ('"system_tokens": 21', r"system_tokens \(21\) must be <= prompt_tokens \(20\)"),
        ('"system_tokens": -2', "system_tokens must be an integer >= 0"),
        ('"interaction_stage": 1, "think_time_s": -1', "think_time_s must be a number >= 0"),
        ('"interaction_stage": 0, "think_time_s": 1', "think_time_s applies only"),
        ('"think_time_s": 1', "think_time_s applies only"),
    ],
)
def test_bad_interaction_keys_name_the_line(tmp_path, extra, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"prompt_tokens": 3, "output_tokens": 4}}\n{{{BASE}, {extra}}}\n')
    with pytest.raises(WorkloadError, match=rf"bad\.jsonl:2: .*{problem}"):
        load_workload(path, rate=1.0)


def test_a_stage_needs_an_interaction(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 3, "output_tokens": 4, "interaction_stage": 0}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:1: interaction_stage needs"):
        load_workload(path, rate=1.0)


def test_rescaling_keeps_system_prompts_inside_prompts_and_scales_think_times():
    row = WorkloadRequest(
        4.0,
        100,
        5,
        "a",
        interaction_id="i",
        interaction_stage=1,
        system_tokens=60,
        think_time_s=2.0,
    )
    (short,) = scale_tokens([row], 0.5)
    assert (short.prompt_tokens, short.system_tokens) == (50, 30)
    (fast,) = scale_time([row], 2.0)
    assert (fast.arrival_time, fast.think_time_s) == (2.0, 1.0)


# -- the simulator -----------------------------------------------------------------------------
def call(rid: str, t: float, tenant: str, stage: int, last: bool, **kw: object) -> WorkloadRequest:
    return WorkloadRequest(
        t,
        40,
        8,
        rid,
        tenant=tenant,
        app="chat",
        interaction_id=f"{tenant}-i0",
        interaction_stage=stage,
        interaction_last=last,
        system_tokens=10,
        **kw,  # type: ignore[arg-type]
    )


def test_a_later_call_is_sent_after_the_previous_one_finished_plus_think_time():
    trace = [
        call("a0", 0.0, "ann", 0, False),
        call("a1", 0.0, "ann", 1, False, think_time_s=1.0),  # lower bound before the finish
        call("a2", 50.0, "ann", 2, True, think_time_s=0.5),  # lower bound after it
        WorkloadRequest(0.2, 30, 4, "solo"),
    ]
    res = simulate(trace, SimSetup("fcfs", COST))
    by_id = {r.request_id: r for r in res.requests}
    a0, a1, a2 = by_id["a0"], by_id["a1"], by_id["a2"]
    assert a0.finish_time is not None and a1.finish_time is not None
    assert a1.arrival_time == pytest.approx(a0.finish_time + 1.0)
    assert a1.first_scheduled_time is not None and a1.first_scheduled_time >= a1.arrival_time
    assert a2.arrival_time == 50.0 and a2.first_scheduled_time >= 50.0  # type: ignore[operator]
    assert by_id["solo"].arrival_time == 0.2
    assert all(r.error is None for r in res.requests) and not res.throttled and not res.abandoned


def throttled_trace() -> list[WorkloadRequest]:
    return [
        call("b0", 0.0, "bad", 0, False),
        call("b1", 0.0, "bad", 1, False, think_time_s=0.5),
        call("b2", 0.0, "bad", 2, True, think_time_s=0.5),
        call("g0", 0.0, "good", 0, False),
        call("g1", 0.0, "good", 1, True, think_time_s=0.5),
    ]


def test_a_throttled_call_abandons_the_rest_of_its_interaction():
    res = simulate(throttled_trace(), SimSetup("test-refuse-bad+fcfs", COST))
    by_id = {r.request_id: r for r in res.requests}
    assert res.throttled == {"b1"} and res.abandoned == ("b2",)
    assert by_id["b1"].status is RequestStatus.FINISHED_ERROR and "over the limit" in (
        by_id["b1"].error or ""
    )
    b2 = by_id["b2"]
    assert b2.first_scheduled_time is None and b2.status is RequestStatus.FINISHED_ABORTED
    assert b2.error is not None and b2.error.startswith("abandoned")
    assert all(by_id[r].error is None for r in ("b0", "g0", "g1"))


def test_fairness_figures_on_a_hand_checked_run():
    res = simulate(throttled_trace(), SimSetup("test-refuse-bad+fcfs", COST))
    fair = summarize(res)["fairness"]
    assert fair["throttled_requests"] == 1 and fair["throttled_interactions"] == 1
    assert fair["abandoned_requests"] == 1
    assert fair["wasted_tokens"] == 40 + 8  # b0 was computed for an interaction never answered
    assert fair["num_users"] == 2 and fair["num_interactions"] == 2
    assert fair["served_users_fraction"] == 0.5  # good got an answer, bad did not
    assert fair["completed_requests"] == 3 and fair["service_provided_requests"] == 3 / 5
    assert fair["completed_interactions"] == 1 and fair["service_provided_interactions"] == 0.5
    # Every call asks the same, so each served call is one unit of normalized service.
    bad, good = fair["by_tenant"]["bad"], fair["by_tenant"]["good"]
    assert (bad["service"], good["service"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert fair["jain_index"] == pytest.approx(9 / 10)
    assert (bad["throttled"], bad["abandoned"], bad["completed_interactions"]) == (1, 1, 0)
    assert (good["requests"], good["completed_interactions"], good["wasted_tokens"]) == (2, 1, 0)
    assert fair["delayed_users_fraction"] == 0.0


def test_delayed_users_follow_the_threshold():
    trace = [
        WorkloadRequest(0.0, 40, 200, "x0", tenant="x"),
        WorkloadRequest(0.0, 40, 8, "y0", tenant="y"),
    ]
    res = simulate(trace, SimSetup("fcfs", COST, SchedulerConfig(max_num_seqs=1)))
    y = next(r for r in res.requests if r.request_id == "y0")
    waited = y.first_scheduled_time - y.arrival_time  # type: ignore[operator]
    assert waited > 1.0  # queued behind x's 200 tokens
    assert fairness(res.requests, delay_threshold_s=waited / 2)["delayed_users_fraction"] == 0.5
    assert fairness(res.requests, delay_threshold_s=waited * 2)["delayed_users_fraction"] == 0.0
    quiet = fairness(res.requests)
    assert quiet["served_users_fraction"] == 1.0 and quiet["wasted_tokens"] == 0
    assert quiet["num_interactions"] == 2  # a call without an interaction is its own


def test_delayed_within_counts_only_calls_that_continue_an_interaction():
    """z's follow-up queues behind x's long call; y's first call does, its follow-up not."""

    def call(t: float, rid: str, out: int, user: str, stage: int | None = None, last: bool = False):
        inter = None if stage is None else f"{user}-i0"
        return WorkloadRequest(
            t,
            40,
            out,
            rid,
            tenant=user,
            interaction_id=inter,
            interaction_stage=stage,
            think_time_s=0.0 if not stage else 0.1,
            interaction_last=last,
        )

    trace = [
        call(0.0, "z0", 4, "z", 0),
        call(0.001, "x0", 200, "x"),
        call(0.002, "y0", 4, "y", 0),
        call(0.1, "z1", 4, "z", 1, last=True),
        call(0.1, "y1", 4, "y", 1, last=True),
    ]
    res = simulate(trace, SimSetup("fcfs", COST, SchedulerConfig(max_num_seqs=1)))
    wait = {r.request_id: r.first_scheduled_time - r.arrival_time for r in res.requests}
    assert wait["z1"] > 1.0 and wait["y0"] > 1.0  # both behind x's 200 tokens
    assert wait["z0"] < 1.0 and wait["y1"] < 1.0 and wait["x0"] < 1.0
    fair = fairness(res.requests, delay_threshold_s=1.0)
    assert fair["delayed_users_fraction"] == pytest.approx(2 / 3)
    assert fair["delayed_within_users_fraction"] == pytest.approx(1 / 3)
    rows = fair["by_tenant"]
    assert [rows[u]["delayed_within"] for u in "xyz"] == [False, False, True]
    assert [rows[u]["delayed"] for u in "xyz"] == [False, True, True]


def test_fair_share_water_fills_what_the_users_asked():
    """x's long call holds the only seat while y's short call waits: over the load period
    (until y's call was sent) x got everything, and y, who asked for less than half, was
    owed all it asked (its max-min fair share) and got none of it."""
    trace = [
        WorkloadRequest(0.0, 40, 400, "x0", tenant="x"),
        WorkloadRequest(0.5, 40, 8, "y0", tenant="y"),
    ]
    res = simulate(trace, SimSetup("fcfs", COST, SchedulerConfig(max_num_seqs=1)))
    by = fairness(res.requests)["by_tenant"]
    x, y = by["x"], by["y"]
    total = x["service_in_load"] + y["service_in_load"]
    assert y["service_in_load"] == 0 and 0 < x["service_in_load"] < 1  # x half done by 0.5 s
    assert y["fair_share"] == pytest.approx(min(1.0, total / 2))  # y asks 1 unit (its mean)
    assert x["fair_share"] + y["fair_share"] == pytest.approx(total)
    assert y["share_received"] == 0 and x["share_received"] > 1


# -- the CLIs ----------------------------------------------------------------------------------
def test_cli_writes_an_agents_workload_and_simulates_it_with_fairness(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    args = ["bench", "workload", str(out), "--dataset", "agents", "--num-users", "5"]
    res = CliRunner().invoke(app, [*args, "--abusers", "1", "--num-requests", "40", "--seed", "0"])
    assert res.exit_code == 0, res.output
    rows = load_workload(out)
    assert len(rows) == 40 and {r.tenant for r in rows} <= {*(f"u{i}" for i in range(5)), "abuser0"}
    assert sum(r.interaction_last for r in rows) == len({r.interaction_id for r in rows})
    report = tmp_path / "r.json"
    sim = ["simulate", "--workload", str(out), "--policy", "fcfs", "--output", str(report)]
    res = CliRunner().invoke(app, [*sim, "--delay-threshold", "0.5"])
    assert res.exit_code == 0, res.output
    assert "fairness" in res.output and "served_users_fraction" in res.output
    fair = json.loads(report.read_text())["fairness"]
    assert fair["delay_threshold_s"] == 0.5 and fair["throttled_requests"] == 0
    assert fair["served_users_fraction"] == 1.0 and fair["service_provided_requests"] == 1.0
    assert set(fair["by_tenant"]) == {r.tenant for r in rows}


def test_cli_generates_agents_in_simulate_and_refuses_misplaced_options(tmp_path: Path):
    report = tmp_path / "r.json"
    args = ["simulate", "--workload", "agents", "--num-users", "4", "--abusers", "1"]
    args += ["--num-requests", "30", "--rate", "2", "--policy", "fcfs", "--output", str(report)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(report.read_text())
    assert data["workload"]["num_users"] == 4 and data["workload"]["abusers"] == 1
    assert data["workload"]["abuse_factor"] is None  # the generator's default, 15
    assert data["fairness"]["num_interactions"] >= 1
    bad = CliRunner().invoke(app, ["simulate", "--num-users", "3", "--num-requests", "5"], env=WIDE)
    assert bad.exit_code == 2 and "agents" in bad.output
    bad = CliRunner().invoke(app, ["simulate", "--abuse-factor", "3", "--num-requests", "5"])
    assert bad.exit_code == 2 and "agents" in bad.output
    bad = CliRunner().invoke(
        app, ["bench", "workload", str(tmp_path / "x.jsonl"), "--abusers", "1"]
    )
    assert bad.exit_code == 2 and "--dataset agents" in bad.output
