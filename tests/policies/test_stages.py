"""The composable scheduling stages: the block ledger, each stage on its own, stacks that are
accepted or refused, typed options, the capability check, and service accounting."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import make_requests, make_resident, move_to_host
from fakes import HashRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.errors import CapabilityError, PolicyError
from quanta.core.loop import EngineLoop
from quanta.core.output import RunnerCapabilities, RunnerOutput
from quanta.core.plan import PoolView, StepPlan
from quanta.core.request import Request, RequestStatus, SamplingParams
from quanta.core.view import SchedulerView
from quanta.costmodel import PROFILES
from quanta.policies import make_policy, parse_policy, register_system
from quanta.policies.common import ArrivalQueues, arrival_order
from quanta.policies.fcfs import ArrivalOrder
from quanta.policies.mlfq import SkipJoinMLFQ
from quanta.policies.mlfq_memory import ProactiveSwap
from quanta.policies.packers import InOrderPacker, PriorityPacker
from quanta.policies.stages import Admission, Lane, Observer, Placement, Ranking, Stage
from quanta.policies.systems import Stages, System, SystemOptions


def request(rid: str, prompt: int, out: int = 8, t: float = 0.0) -> Request:
    sp = SamplingParams(max_tokens=out, ignore_eos=True)
    return Request(rid, [1 + j % 40 for j in range(prompt)], sp, t, seed=1)


def resident(bm: BlockManager, rid: str, tokens: int, t: float = 0.0) -> Request:
    return make_resident(bm, request(rid, tokens, t=t))


def swapped(bm: BlockManager, rid: str, tokens: int) -> Request:
    return move_to_host(bm, resident(bm, rid, tokens))


def view_of(bm: BlockManager, *reqs: Request, now: float = 0.0) -> SchedulerView:
    by = {s: [r for r in reqs if r.status is s] for s in RequestStatus}
    return SchedulerView(
        now,
        by[RequestStatus.WAITING],
        by[RequestStatus.RUNNING],
        by[RequestStatus.SWAPPED],
        PoolView(bm),
    )


# -- the ledger -------------------------------------------------------------------------------
def test_plan_counts_like_the_applier_and_refuses_what_it_cannot_do():
    bm = BlockManager(4, 6, 2)
    a, b = resident(bm, "a", 8), resident(bm, "b", 8)  # 2 + 2 blocks; 2 free
    tiny_host = BlockManager(4, 9, 0)
    with pytest.raises(PolicyError, match="host blocks"):
        StepPlan(PoolView(tiny_host)).preempt_req(resident(tiny_host, "x", 12), PreemptMode.SWAP)
    plan = StepPlan(PoolView(bm))
    assert plan.evict(a, PreemptMode.SWAP) == 2 and plan.free_device == 4
    assert plan.free_host == 0
    assert plan.evict(b, PreemptMode.SWAP) == 2  # host full: falls back to recompute
    assert plan.decision().preempt == (
        Preemption("a", PreemptMode.SWAP),
        Preemption("b", PreemptMode.RECOMPUTE),
    )
    with pytest.raises(PolicyError, match="repeated or preempted"):
        plan.run_req(a, 1)
    with pytest.raises(PolicyError, match="twice"):
        plan.evict(a, PreemptMode.SWAP)


def test_a_swap_in_does_not_credit_host_space_to_a_swap_out():
    """The applier swaps out before it swaps in: the host blocks a swap-in frees are not
    there yet for this step's swap-outs."""
    bm = BlockManager(4, 8, 2)
    x = swapped(bm, "x", 8)  # the host is now full
    a = resident(bm, "a", 8)
    plan = StepPlan(PoolView(bm))
    plan.swap_in_req(x)
    with pytest.raises(PolicyError, match="host blocks"):
        plan.preempt_req(a, PreemptMode.SWAP)


def test_plan_keeps_the_token_budget_and_seats():
    bm = BlockManager(4, 16, 0)
    a, b = request("a", 10), request("b", 10)
    plan = StepPlan(PoolView(bm), budget=12, seats=1)
    plan.take(a, 10)
    assert not plan.has_room() and plan.budget == 2
    with pytest.raises(PolicyError, match="budget or seats"):
        plan.take(b, 2)


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 24), st.booleans()), min_size=1, max_size=8),
    free=st.integers(0, 12),
    budget=st.one_of(st.none(), st.integers(1, 64)),
    seats=st.one_of(st.none(), st.integers(0, 6)),
)
def test_take_if_fits_is_check_then_take(sizes, free, budget, seats):
    """``take_if_fits`` takes what checking ``has_room`` and ``blocks_to_grow`` first would
    take, and records nothing of what it refuses."""
    held = sum(-(-n // 4) for n, on_host in sizes if on_host)
    bm = BlockManager(4, held + free, held)
    reqs = [
        swapped(bm, f"s{i}", n) if on_host else request(f"w{i}", n)
        for i, (n, on_host) in enumerate(sizes)
    ]
    fits, checked = (StepPlan(PoolView(bm), budget=budget, seats=seats) for _ in range(2))
    for req in reqs:
        n = req.num_uncomputed_tokens
        took = fits.take_if_fits(req, n)
        if checked.has_room(n) and checked.blocks_to_grow(req, n) <= checked.free_device:
            checked.take(req, n)
            assert took
        else:
            assert not took
        assert (fits.free_device, fits.free_host, fits.budget, fits.seats) == (
            checked.free_device,
            checked.free_host,
            checked.budget,
            checked.seats,
        )
    assert fits.decision() == checked.decision()


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    free=st.integers(0, 6),
    host=st.integers(0, 12),
    data=st.data(),
)
def test_anything_a_plan_accepts_the_applier_accepts(held, free, host, data):
    bm = BlockManager(4, sum(held) + free, host)
    reqs = [resident(bm, f"r{i}", 4 * n) for i, n in enumerate(held)]
    plan = StepPlan(PoolView(bm))
    for r in reqs:
        action = data.draw(st.sampled_from(["evict", "run", "skip"]))
        try:
            if action == "evict":
                plan.evict(r, data.draw(st.sampled_from(list(PreemptMode))))
            elif action == "run":
                plan.run_req(r, 1)
        except PolicyError:
            pass
    DecisionApplier(bm).validate(plan.decision(), {r.request_id: r for r in reqs})


# -- stages on their own ----------------------------------------------------------------------
def test_arrival_order_is_running_then_swapped_then_waiting():
    bm = BlockManager(4, 32, 32)
    late_running = resident(bm, "late", 4, t=5.0)
    early_swapped = swapped(bm, "sw", 4)
    first_waiting = request("w", 4, t=-1.0)
    ranking = ArrivalOrder(SchedulerConfig()).rank(
        view_of(bm, first_waiting, early_swapped, late_running)
    )
    assert [r.request_id for r in ranking.order] == ["late", "sw", "w"]


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=60, max_size=60), st.randoms()),
        min_size=1,
        max_size=8,
    ),
)
def test_the_kept_arrival_order_is_the_sorted_one_at_every_step(
    times: list[int], steps: list[tuple[list[int], object]]
) -> None:
    """Requests join, leave and move between the queues, which the view lists in any order;
    arrivals tie, so the id decides: the kept order is the sorted one at every step, and
    joining all at once (a sort of the whole queue) or one by one gives the same, whether or
    not the queues heard that a request ended."""
    reqs = [request(f"r{i}", 4, t=float(t)) for i, t in enumerate(times)]
    queues = ArrivalQueues()
    for where, rng in steps:
        lists: tuple[list[Request], ...] = ([], [], [], [])  # running, swapped, waiting, gone
        for req, w in zip(reqs, where, strict=False):
            lists[w].append(req)
        for req in lists[3]:
            if rng.random() < 0.5:  # type: ignore[attr-defined]
                queues.forget(req)  # it ended (or never came): the loop says so, or not
        for queue in lists[:3]:
            rng.shuffle(queue)  # type: ignore[attr-defined]
        view = SimpleNamespace(running=lists[0], swapped=lists[1], waiting=lists[2])
        assert queues.order(view) == arrival_order(view)  # type: ignore[arg-type]


def test_in_order_packer_blocks_behind_the_first_waiting_request_that_does_not_fit():
    bm = BlockManager(4, 4, 0)
    big, small = request("big", 20, t=0.0), request("small", 4, t=1.0)
    view = view_of(bm, big, small)
    plan = view.plan(budget=64, seats=8)
    ranking = ArrivalOrder(SchedulerConfig()).rank(view)
    InOrderPacker(SchedulerConfig()).pack(
        Lane("all", ranking.order), view, plan, ranking, Placement()
    )
    assert plan.run == []  # strict FCFS: small does not overtake big


def test_priority_packer_skips_what_does_not_fit_and_lets_smaller_jobs_run():
    bm = BlockManager(4, 4, 0)
    big, small = request("big", 20), request("small", 4)
    view = view_of(bm, big, small)
    plan = view.plan(budget=64, seats=8)
    ranking = Ranking([big, small], {"big": 0.0, "small": 1.0})
    PriorityPacker(SchedulerConfig()).pack(
        Lane("all", ranking.order), view, plan, ranking, Placement()
    )
    assert plan.run == [("small", 4)]


def test_decode_first_keeps_a_residents_token_when_a_prefill_ranks_above_it():
    bm = BlockManager(4, 64, 0)
    old = resident(bm, "old", 8)
    new = request("new", 100)
    view = view_of(bm, new, old)
    ranking = Ranking([new, old], {"new": 0.0, "old": 1.0})
    for decode_first, expected in ((False, [("new", 16)]), (True, [("old", 1), ("new", 15)])):
        plan = view.plan(budget=16, seats=4)
        packer = PriorityPacker(
            SchedulerConfig(max_num_batched_tokens=16), decode_first=decode_first
        )
        packer.pack(Lane("all", ranking.order), view, plan, ranking, Placement())
        assert plan.run == expected


def test_headroom_keeps_free_blocks_for_residents_to_grow():
    bm = BlockManager(4, 24, 0)
    old = resident(bm, "old", 4)  # 1 block in use: 23 free
    newcomer = request("n", 16)  # 4 blocks
    view = view_of(bm, newcomer, old)
    ranking = Ranking([newcomer], {"n": 0.0})
    for headroom, runs in ((0.0, True), (0.9, False)):
        plan = view.plan(budget=64, seats=4)
        PriorityPacker(SchedulerConfig(), headroom=headroom).pack(
            Lane("all", ranking.order), view, plan, ranking, Placement()
        )
        assert bool(plan.run) is runs


def test_headroom_never_keeps_a_large_job_out_of_an_empty_pool():
    bm = BlockManager(4, 10, 0)
    big = request("big", 32)  # 8 of 10 blocks: more than the pool less a 50% headroom
    view = view_of(bm, big)
    ranking = Ranking([big], {"big": 0.0})
    plan = view.plan(budget=64, seats=4)
    PriorityPacker(SchedulerConfig(), headroom=0.5).pack(
        Lane("all", ranking.order), view, plan, ranking, Placement()
    )
    assert plan.run == [("big", 32)]


def test_proactive_swap_leaves_alone_a_job_that_would_be_back_before_its_copies():
    """Below the reserve an idle resident leaves for the host only when its next turn is
    further away than copying its blocks out and back."""
    slow_link = PROFILES["a100-opt13b"].model_copy(update={"swap_bandwidth": 1e6})
    kv = ProactiveSwap(
        max_batch_size=1,
        cost=slow_link,
        reserve_window=1.0,
        min_reserve_blocks=8,
        max_reserve_fraction=1.0,
    )
    bm = BlockManager(16, 10, 100)
    a, z = resident(bm, "a", 16), resident(bm, "z", 64)
    y = request("y", 4)  # next in line, so z is the idle resident that may leave
    view = view_of(bm, a, y, z)
    for gap, moved in ((0.5, ()), (1e9, ("z",))):
        plan = view.plan(budget=64, seats=1)
        plan.take(a, 1)
        kv._link_budget = lambda _view: 1000  # type: ignore[method-assign]
        kv.after_batch(view, plan, Ranking([a, y, z], {"a": 0.0, "y": 0.1, "z": gap}))
        assert tuple(p.request_id for p in plan.preempt) == moved


# -- service accounting ----------------------------------------------------------------------
@pytest.mark.parametrize(("service", "sinks"), [("own", False), ("step", True)])
def test_a_job_that_prefilled_does_not_sink_below_arrivals_that_have_not(service, sinks):
    """j decodes alongside three 2,000-token prefill chunks. Charged its own share it stays
    in its queue; charged each whole step (the public code's reading) it sinks a queue per
    step, below a newcomer whose 512-token prefill puts it in Q3."""
    cost = PROFILES["a100-opt13b"]
    order = SkipJoinMLFQ(SchedulerConfig(), cost, service=service)
    bm = BlockManager(16, 1000, 0)
    j = resident(bm, "j", 64)
    big = request("big", 6000)
    order.on_admit(j, view_of(bm, j, big))
    order.on_admit(big, view_of(bm, j, big))
    level = order.jobs["j"].level
    for k in range(3):
        big.num_computed_tokens += 2000
        j.num_computed_tokens += 1
        j.append_token(1, 0.0)
        step = cost.step_time([(1, j.num_computed_tokens - 1), (2000, 2000 * k)])
        out = RunnerOutput(("j", "big"), (1, None))
        order.on_step(Decision(run=(("j", 1), ("big", 2000))), out, step)
    assert (order.jobs["j"].level > level) is sinks
    newcomer = request("late", 512)
    order.on_admit(newcomer, view_of(bm, j, newcomer))
    assert order.jobs["late"].level == 2
    ranked = [r.request_id for r in order.rank(view_of(bm, j, newcomer)).order]
    assert (ranked.index("j") > ranked.index("late")) is sinks


# -- stacks, options, capabilities ----------------------------------------------------------
class _Gate(Admission):
    def admit(self, request: Request, view: SchedulerView) -> str | None:
        return "tenant is blocked" if request.metadata.tenant == "blocked" else None


class _Count(Observer):
    def __init__(self) -> None:
        self.steps = 0
        self.finished: list[str] = []

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        self.steps += 1

    def on_finish(self, request: Request) -> None:
        self.finished.append(request.request_id)


class _GateOptions(SystemOptions):
    strict: bool = True


class _Hidden(Stage):
    requires = RunnerCapabilities(hidden_cache=True)


COUNTERS: list[_Count] = []


def _gate_stages(config: SchedulerConfig, o: _GateOptions) -> Stages:
    COUNTERS.append(_Count())
    return Stages(admission=_Gate(), observers=(COUNTERS[-1],))


register_system(System("test-gate", _GateOptions, _gate_stages))
register_system(System("test-hidden", SystemOptions, lambda c, o: Stages(observers=(_Hidden(),))))


def test_two_systems_that_supply_the_same_stage_are_refused():
    with pytest.raises(ValueError, match=r"both supply the .* stage"):
        make_policy("fcfs+sj-mlfq", SchedulerConfig())
    with pytest.raises(ValueError, match="both supply the admission stage"):
        make_policy("srpt+test-gate", SchedulerConfig())
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("sj-mlfq+nope", SchedulerConfig())


def test_a_stack_takes_each_stage_from_its_system_and_routes_options():
    spec = parse_policy("test-gate+sj-mlfq", {"strict": False, "starve_limit": 2.0})
    assert spec.name == "test-gate+sj-mlfq"
    assert spec.options() == {"strict": False, "starve_limit": 2.0}
    policy = spec.build(SchedulerConfig())
    assert isinstance(policy.admission, _Gate)
    assert isinstance(policy.ordering, SkipJoinMLFQ) and policy.ordering.starve_limit == 2.0
    with pytest.raises(ValueError, match=r"unknown nonsense; known: .*strict"):
        parse_policy("test-gate+sj-mlfq", {"nonsense": 1})
    with pytest.raises(ValueError, match="starve_limit: Input should be greater than 0"):
        parse_policy("sj-mlfq", {"starve_limit": -1})


class _ShapeOptions(SystemOptions):
    gate: bool = False


register_system(
    System(
        "test-shape-shifter",
        _ShapeOptions,
        lambda c, o: Stages(admission=_Gate()) if o.gate else Stages(ordering=ArrivalOrder(c)),
    )
)


def test_a_systems_slots_are_what_its_builder_returns_whatever_its_options():
    assert parse_policy("test-gate").parts[0].system.slots == {"admission"}
    assert parse_policy("sj-mlfq").parts[0].system.slots == {"ordering", "packer", "placement"}
    with pytest.raises(ValueError, match="both supply the ordering stage"):
        parse_policy("test-shape-shifter+fcfs")
    with pytest.raises(ValueError, match="slots must not depend on its options"):
        make_policy("test-shape-shifter", SchedulerConfig(), gate=True)


def test_a_stacked_admission_stage_throttles_and_every_event_reaches_the_observer(make_loop):
    loop = make_loop(policy="test-gate+sj-mlfq")
    ok, blocked = make_requests(2, max_tokens=3)
    blocked.metadata = blocked.metadata.model_copy(update={"tenant": "blocked"})
    streams = [loop.submit(r) for r in (ok, blocked)]
    loop.run_until_idle()
    assert str(streams[1].result(timeout=0).error) == "tenant is blocked"
    assert streams[0].result(timeout=0).error is None
    assert sorted(COUNTERS[-1].finished) == ["r0", "r1"]  # once each, whatever way it ended
    assert COUNTERS[-1].steps > 0


def test_a_policy_needing_a_capability_the_runner_lacks_is_refused_at_start():
    policy = make_policy("fcfs+test-hidden", SchedulerConfig())
    assert policy.requires.hidden_cache
    with pytest.raises(CapabilityError, match=r"hidden_cache.*HashRunner"):
        EngineLoop(
            runner=HashRunner(8, 8, 4),
            policy=policy,
            blocks=BlockManager(4, 8, 8),
            clock=VirtualClock(),
            max_model_len=64,
        )


def test_core_does_not_import_policies():
    code = (
        "import json, sys, quanta.core.loop, quanta.core.apply, quanta.core.policy; "
        "print(json.dumps([m for m in sys.modules if m.startswith('quanta.policies')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_fastserve_systems_start_with_the_load_signal_and_naive_mlfq_does_not():
    """sj-mlfq and its swap variants default to the adaptive load signal (FCFS below
    capacity); a user's option overrides it, and naive MLFQ stays the paper's baseline."""
    from quanta.policies.fastserve import OVERLOAD_AFTER_RUNS

    for name in ("sj-mlfq", "sj-mlfq-reactive", "sj-mlfq-recompute"):
        options = parse_policy(name).parts[0].options
        assert options.overload_after_runs == OVERLOAD_AFTER_RUNS > 0, name  # type: ignore[attr-defined]
    assert parse_policy("mlfq").parts[0].options.overload_after_runs == 0  # type: ignore[attr-defined]
    chosen = parse_policy("sj-mlfq", {"overload_after_runs": 0}).parts[0].options
    assert chosen.overload_after_runs == 0  # type: ignore[attr-defined]
