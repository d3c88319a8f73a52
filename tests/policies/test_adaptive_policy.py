"""Apt-Serve's adaptive scheduling (``apt``): the value function and the greedy by hand, the
factor-2 bound against brute force, the choice of prefill or decode step, the SLO fallback,
the cache modes, switching, and whole workloads through the loop and the applier."""

from __future__ import annotations

import itertools
import math

import pytest
from conftest import make_requests
from fakes import HashRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.cli import app
from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.errors import CapabilityError
from quanta.core.loop import EngineLoop
from quanta.core.plan import PoolView
from quanta.core.request import (
    CacheKind,
    Request,
    RequestMetadata,
    RequestStatus,
    SamplingParams,
)
from quanta.core.view import SchedulerView
from quanta.costmodel import PROFILES
from quanta.policies import StagedPolicy, make_policy, parse_policy
from quanta.policies.adaptive import AdaptivePacker
from quanta.policies.fair import WSCOrder
from quanta.policies.knapsack import NEAR_ZERO, Item, greedy_knapsack, options
from quanta.policies.throttle import OITAdmission
from quanta.sim import SimRunner, SimSetup, build_requests
from quanta.sim.driver import drive, make_sim_policy
from quanta.workloads import make_workload
from quanta_lab.sim.bench import bench_scheduler
from typer.testing import CliRunner

KV, HIDDEN = CacheKind.KV, CacheKind.HIDDEN
COST = PROFILES["a100-opt13b"]
NO_SLO = {"ttft_slo_s": None, "tbt_slo_s": None}


def request(rid: str, prompt: int, *, t: float = 0.0, out: int = 8, **meta: float) -> Request:
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    return Request(rid, [1] * prompt, params, t, seed=1, metadata=RequestMetadata(**meta))


def resident(bm: BlockManager, req: Request, last_token: float, kind: CacheKind = KV) -> Request:
    """``req`` with its prompt computed into a ``kind`` cache and one token to decode."""
    req.num_computed_tokens = req.num_prompt_tokens
    req.append_token(1, last_token)
    req.set_status(RequestStatus.RUNNING)
    assert bm.allocate_slots(req.request_id, req.num_prompt_tokens, kind) is not None
    return req


def view_of(bm: BlockManager, *reqs: Request, now: float) -> SchedulerView:
    by = {s: [r for r in reqs if r.status is s] for s in RequestStatus}
    waiting, running, swapped = (by[s] for s in ("waiting", "running", "swapped"))
    return SchedulerView(now, waiting, running, swapped, PoolView(bm))


def apt(**options: object) -> StagedPolicy:
    return make_policy("apt", SchedulerConfig(), **options)


def schedule(policy: StagedPolicy, bm: BlockManager, *reqs: Request, now: float) -> Decision:
    """One decision, checked by the applier against the pool it was made for."""
    decision = policy.schedule(view_of(bm, *reqs, now=now))
    DecisionApplier(bm).validate(decision, {r.request_id: r for r in reqs})
    return decision


# -- the value function and the greedy, by hand -----------------------------------------------
def test_options_are_the_papers_marginal_gains():
    item = Item(value=1.0, kv_blocks=4, hidden_blocks=2)
    (h, w_h, v_h), (k, w_k, v_k) = options(item, factor=0.1, memory=10)
    assert (h, w_h, k, w_k, v_k) == (HIDDEN, 2, KV, 4, 1.0)
    assert v_h == pytest.approx(1.0 - 0.1 * 4)  # g = p - (|W| + |R|) rho m
    assert v_h / w_h == pytest.approx(2 * 1.0 / 4 - 2 * 0.1)  # 0 -> m/2: 2p/m - 2(|W|+|R|)rho
    assert (v_k - v_h) / (w_k - w_h) == pytest.approx(2 * 0.1)  # m/2 -> m: 2(|W|+|R|)rho
    assert options(item, 0.125, 10)[0] == (HIDDEN, 2, 0.5)  # worth exactly half of KV: kept
    assert options(item, 0.2, 10) == [(KV, 4, 1.0)]  # worth less than half: dropped
    assert options(Item(1.0, 1, 1), 0.0, 10) == [(KV, 1, 1.0)]  # one block saves nothing
    assert options(item, 0.1, 3) == [(HIDDEN, 2, pytest.approx(0.6))]  # KV alone is too big
    assert options(Item(1.0, 4, 2, kv=False), 1.0, 10) == [(HIDDEN, 2, NEAR_ZERO)]


def test_greedy_takes_hidden_first_then_upgrades_in_gain_per_block_order():
    a = b = Item(1.0, 4, 2)
    assert greedy_knapsack([a, b], 4, 0.1) == {0: HIDDEN, 1: HIDDEN}  # 1.2 beats one KV's 1.0
    six = greedy_knapsack([a, b], 6, 0.1)
    assert list(six.items()) == [(0, KV), (1, HIDDEN)]  # one upgrade fits; ties: earlier first
    assert greedy_knapsack([a, b], 8, 0.1) == {0: KV, 1: KV}
    assert greedy_knapsack([a, b], 8, 0.1, seats=1) == {0: KV}


def test_one_option_worth_more_than_the_whole_walk_is_taken_alone():
    small, big = Item(1.0, 1, 1, hidden=False), Item(5.0, 10, 5, hidden=False)
    assert greedy_knapsack([small, big], 10, 0.0) == {1: KV}  # the walk takes small, then 1.0


def test_greedy_keeps_the_token_budget_and_may_chunk_the_last_prefill():
    long, short = Item(1.0, 4, 2, tokens=10), Item(0.5, 4, 2, tokens=5)
    assert greedy_knapsack([long, short], 8, 0.1, tokens=12) == {0: KV}
    assert greedy_knapsack([long, short], 8, 0.1, tokens=12, chunked=True) == {0: KV, 1: KV}


def _weight(item: Item, kind: CacheKind) -> int:
    return item.kv_blocks if kind is KV else item.hidden_blocks


def _worth(item: Item, kind: CacheKind, factor: float) -> float:
    return item.value - (factor * item.kv_blocks if kind is HIDDEN else 0.0)


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.floats(0, 10), st.integers(1, 9), st.sampled_from(["both", "kv", "hidden"])),
        min_size=1,
        max_size=6,
    ),
    memory=st.integers(0, 24),
    factor=st.floats(0, 1),
)
def test_greedy_is_worth_at_least_half_the_optimum(specs, memory, factor):
    """max sum g s.t. sum blocks <= M, against every assignment of none / hidden / KV."""
    items = []
    for p, m, kinds in specs:
        if kinds == "hidden":  # NOTE: a hidden-only item worth less than nothing is floored
            p = max(p, factor * m + 0.01)
        items.append(Item(p, m, math.ceil(m / 2), kinds != "hidden", kinds != "kv"))
    chosen = greedy_knapsack(items, memory, factor)
    assert sum(_weight(items[i], k) for i, k in chosen.items()) <= memory
    got = sum(_worth(items[i], k, factor) for i, k in chosen.items())
    best = 0.0
    open_kinds = [
        [None] + [k for k, ok in ((KV, it.kv), (HIDDEN, it.hidden)) if ok] for it in items
    ]
    for pick in itertools.product(*open_kinds):
        taken = [(it, k) for it, k in zip(items, pick, strict=True) if k is not None]
        if sum(_weight(it, k) for it, k in taken) <= memory:
            best = max(best, sum(_worth(it, k, factor) for it, k in taken))
    assert got >= best / 2 - 1e-9


# -- the step: prefill or decode, SLOs ---------------------------------------------------------
@pytest.mark.parametrize(("arrival", "runs"), [(-5.0, ["wait"]), (0.5, ["run"])])
def test_the_queue_that_waited_longer_gets_the_step(arrival, runs):
    """The resident's last token was 1 s ago; the newcomer waited 6 s or 0.5 s."""
    bm = BlockManager(4, 64, 0)
    run = resident(bm, request("run", 8, t=-2.0), last_token=0.0)
    wait = request("wait", 8, t=arrival)
    decision = schedule(apt(cache="kv", **NO_SLO), bm, run, wait, now=1.0)
    assert [rid for rid, _ in decision.run] == runs


def test_a_step_whose_queue_cannot_run_falls_back_to_the_other():
    bm = BlockManager(4, 4, 0)
    run = resident(bm, request("run", 8, t=-9.0), last_token=0.0)  # 2 blocks, grows to 3
    wait = request("wait", 12, t=-5.0)  # waited longer, but needs 3 blocks of the 2 free
    decision = schedule(apt(cache="kv", **NO_SLO), bm, run, wait, now=1.0)
    assert decision.run == (("run", 1),)


@pytest.mark.parametrize(
    ("options", "late_slo_ms", "runs"),
    [
        ({"fallback": "zero"}, None, "fresh"),  # late is worth ~0: the fresh one runs
        ({"fallback": "decay"}, None, "late"),  # 0.4 x 3 s > 0.5 s
        ({"fallback": "zero"}, 5000.0, "late"),  # its own TTFT SLO: not late yet
        ({"ttft_slo_s": None}, None, "late"),  # no SLO: pending time alone
    ],
)
def test_a_request_past_its_slo_falls_back(options, late_slo_ms, runs):
    bm = BlockManager(4, 3, 0)  # room for one of the two 2-block prompts
    late = request("late", 8, t=-3.0, ttft_slo_ms=late_slo_ms)
    fresh = request("fresh", 8, t=-0.5)
    policy = apt(**{"cache": "kv", "ttft_slo_s": 1.0, **options})
    assert [rid for rid, _ in schedule(policy, bm, late, fresh, now=0.0).run] == [runs]


def test_the_time_between_tokens_slo_applies_after_the_first_token():
    bm = BlockManager(4, 16, 0)
    slow = resident(bm, request("slow", 8), last_token=0.0)
    own = resident(bm, request("own", 8, tpot_slo_ms=5000.0), last_token=0.0)
    for fallback, worth in (("zero", NEAR_ZERO), ("decay", 0.4 * 2.0)):
        packer = apt(tbt_slo_s=1.0, fallback=fallback).packer
        assert isinstance(packer, AdaptivePacker)
        assert packer.value(slow, 2.0) == pytest.approx(worth)
        assert packer.value(own, 2.0) == 2.0  # its own SLO, 5 s, is not past
        assert packer.value(slow, 0.5) == 0.5


# -- cache kinds and switching -----------------------------------------------------------------
def test_kv_mode_never_asks_for_a_hidden_cache_and_runs_on_any_runner():
    assert not apt(cache="kv").requires.hidden_cache
    with pytest.raises(CapabilityError, match="hidden_cache"):
        EngineLoop(
            runner=HashRunner(8, 8, 4),
            policy=apt(),
            blocks=BlockManager(4, 8, 8),
            clock=VirtualClock(),
            max_model_len=64,
        )


def _switch_case(device_blocks: int) -> tuple[BlockManager, Request, Request, StagedPolicy]:
    """Two 16-token KV residents about to grow to 5 blocks each (3 as hidden), each with one
    token left to generate (so a hidden cache is paid for one step); "b" has waited 10 s
    since its last token, "a" 2 s; (|W| + |R|) * rho = 0.1 s per block."""
    bm = BlockManager(4, device_blocks, 0)
    b = resident(bm, request("b", 16, t=-20.0, out=2), last_token=-10.0)
    a = resident(bm, request("a", 16, t=-10.0, out=2), last_token=-2.0)
    return bm, a, b, apt(rho=0.05, **NO_SLO)


def test_a_kv_resident_the_greedy_wants_hidden_is_switched_when_its_kv_cannot_run():
    """Pool 9: b as KV (5) and a as hidden (3) is the greedy's batch; a's KV cannot grow in
    the block left, so it is dropped for recompute and restarts hidden."""
    bm, a, b, policy = _switch_case(9)
    decision = schedule(policy, bm, a, b, now=0.0)
    assert decision.run == (("b", 1),)
    assert decision.preempt == (Preemption("a", PreemptMode.RECOMPUTE),)
    DecisionApplier(bm).apply(decision, {"a": a, "b": b}, 0.0)
    bm.free("b")  # the whole pool is free: a's KV would fit, but it restarts as chosen
    b.set_status(RequestStatus.FINISHED_STOPPED)
    restart = schedule(policy, bm, a, now=1.0)
    assert restart.run == (("a", 17),) and restart.hidden == {"a"}


def test_no_switch_when_both_fit_as_kv_and_no_switch_back_from_hidden():
    bm, a, b, policy = _switch_case(10)
    decision = schedule(policy, bm, a, b, now=0.0)
    assert sorted(decision.run) == [("a", 1), ("b", 1)] and not decision.preempt
    bm = BlockManager(4, 64, 0)
    h = resident(bm, request("h", 16), last_token=-0.01, kind=HIDDEN)  # hidden is worth little
    decision = schedule(apt(**NO_SLO), bm, h, now=0.0)
    assert decision.run == (("h", 1),) and decision.hidden == {"h"} and not decision.preempt


# -- whole workloads through the loop ------------------------------------------------------------
def simulate_apt(policy: str = "apt", n: int = 40, **options: object):
    """A bursty ShareGPT-like workload on a tight pool; every decision passes the applier (a
    rejected one fails requests) and every block comes home."""
    trace = make_workload("sharegpt", n, 6.0, seed=3, cv=4.0)
    sched = SchedulerConfig(max_num_seqs=16)
    policy_obj = make_sim_policy(SimSetup(policy, COST, sched, policy_options=dict(options)))
    clock = VirtualClock()
    decisions: list[Decision] = []
    schedule_one = policy_obj.schedule

    def record(view: SchedulerView) -> Decision:
        decisions.append(schedule_one(view))
        return decisions[-1]

    policy_obj.schedule = record  # type: ignore[method-assign]
    loop = EngineLoop(
        runner=SimRunner(COST, clock, 16),
        policy=policy_obj,
        blocks=BlockManager(16, 300, 2000),
        clock=clock,
        max_model_len=COST.max_model_len,
    )
    requests = build_requests(trace)
    assert drive(loop, clock, requests) == []
    assert all(r.error is None and r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()
    return requests, decisions, loop.stats()


def test_hybrid_cache_under_bursts_keeps_every_block_accounted():
    requests, decisions, stats = simulate_apt(rho=1e-5)
    assert any(d.hidden for d in decisions)  # both kinds in use
    assert any(len(d.run) > len(d.hidden) for d in decisions)
    assert stats.num_preemptions_recompute > 0  # the pool was tight enough to evict
    again, _, _ = simulate_apt(rho=1e-5)
    assert [r.token_times for r in again] == [r.token_times for r in requests]  # deterministic


@pytest.mark.parametrize(("cache", "hidden"), [("kv", False), ("hidden", True)])
def test_cache_modes_decide_every_run(cache, hidden):
    _, decisions, _ = simulate_apt(n=20, cache=cache)
    runs = [d for d in decisions if d.run]
    assert runs and all(d.hidden == ({rid for rid, _ in d.run} if hidden else set()) for d in runs)


def test_kv_mode_on_the_hashing_runner_matches_fcfs_tokens_and_frees_every_block():
    """The hashing runner turns any bookkeeping slip under evictions into other tokens."""
    outputs = []
    for name, opts in (
        ("fcfs", {}),
        ("apt", {"cache": "kv"}),
        ("apt", {"cache": "kv", "allow_swap": True}),
    ):
        blocks = BlockManager(4, 12, 12)
        loop = EngineLoop(
            runner=HashRunner(12, 12, 4),
            policy=make_policy(name, SchedulerConfig(), **opts),
            blocks=blocks,
            clock=VirtualClock(),
            max_model_len=64,
        )
        reqs = make_requests(6, prompt_len=[5, 9, 3, 12, 7, 4], max_tokens=14, ignore_eos=True)
        for r in reqs:
            loop.submit(r)
        loop.run_until_idle()
        blocks.check_integrity()
        assert (
            blocks.all_free()
            and loop.stats().num_preemptions_recompute + loop.stats().num_preemptions_swap >= 0
        )
        outputs.append([r.output_token_ids for r in reqs])
    assert outputs[0] == outputs[1] == outputs[2]


# -- options, stacks, tools -------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [{"cache": "nope"}, {"decay": 0}, {"decay": 1.5}, {"fallback": "x"}, {"rho": -1}, {"x": 1}],
)
def test_bad_options_are_value_errors(bad):
    with pytest.raises(ValueError, match="bad options for policy 'apt'"):
        make_policy("apt", SchedulerConfig(), **bad)


def test_options_arrive_from_every_frontend_and_the_simulator_supplies_its_profile():
    spec = parse_policy("apt", {"cache": "hidden", "ttft_slo_s": "0.5"})  # --policy-option
    assert spec.options() == {"cache": "hidden", "ttft_slo_s": 0.5}
    toy = COST.model_copy(update={"name": "toy"})
    packer = make_sim_policy(SimSetup("apt", toy)).packer
    assert isinstance(packer, AdaptivePacker) and packer.cost is toy
    res = CliRunner().invoke(
        app,
        ["simulate", "--policy", "apt", "--policy-option", "cache=hidden", "--num-requests", "5"],
    )
    assert res.exit_code == 0, res.output


def test_fair_and_apt_stack():
    policy = make_policy("fair+apt", SchedulerConfig())
    assert isinstance(policy.ordering, WSCOrder) and isinstance(policy.admission, OITAdmission)
    assert isinstance(policy.packer, AdaptivePacker)
    requests, _, _ = simulate_apt("fair+apt", n=15)
    assert all(r.finished for r in requests)


def test_scheduler_bench_runs_apt():
    out = bench_scheduler(["apt"], [50, 200], repeats=1, echo=lambda _: None)
    assert set(out["apt"]) == {50, 200}


def test_profile_option_reads_a_measured_profile_file(tmp_path) -> None:
    from quanta.costmodel import get_profile, save_profile
    from quanta.policies.registry import parse_policy

    measured = get_profile("a100-opt13b").model_copy(
        update={"name": "measured", "hidden_projection_per_token_s": 1e-5}
    )
    path = save_profile(measured, tmp_path / "p.json")
    options = parse_policy("apt", {"profile": str(path)}).parts[0].options
    assert options.cost().rho(16) == pytest.approx(16e-5)
    with pytest.raises(ValueError, match="neither a preset"):
        parse_policy("apt", {"profile": str(tmp_path / "missing.json")})
