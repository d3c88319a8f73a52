"""The paths that keep a step short with a long queue decide exactly as the plain algorithms
they replaced: Apt-Serve's greedy walked from a heap that items join only as the walk comes
near them, and stopped early, against a full sort; its items and their bounds, built in one
pass with fewer calls, against the way they were built; the orderings' sorts per queue
against one sort of every candidate by the old keys; turns read lazily against the dicts
built before; FastServe's ENST in one pass against ``mlfq_enst`` over its two mappings;
ConServe's budget search started from a guess against the plain bisection. On random inputs,
and at every step of a seeded workload through the loop for each system the schedule-step
bench times."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.core.blocks import BlockManager, Tier
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision
from quanta.core.loop import EngineLoop
from quanta.core.output import RunnerCapabilities, RunnerOutput, SchedulerOutput
from quanta.core.request import (
    CacheKind,
    Request,
    RequestMetadata,
    SamplingParams,
    blocks_for,
)
from quanta.core.view import SchedulerView
from quanta.costmodel import PROFILES
from quanta.policies import adaptive, make_policy
from quanta.policies.common import QUEUE_RANK, arrival_key, is_online, largest, outside
from quanta.policies.coserve import ClassOrder
from quanta.policies.fair import WSCOrder, _CounterOrder
from quanta.policies.fcfs import ArrivalOrder
from quanta.policies.knapsack import (
    NEAR_ZERO,
    Item,
    _has_room,
    greedy_knapsack,
    item_bounds,
    options,
)
from quanta.policies.mlfq import Job, PriorityOrder, SkipJoinMLFQ
from quanta.policies.mlfq_memory import Enst, execute_times, mlfq_enst
from quanta.policies.packers import chunk
from quanta.policies.stages import Ranking, Turns


def old_value(packer: adaptive.AdaptivePacker, req: Request, now: float) -> float:
    """``AdaptivePacker.value`` as it was: the SLO read from the metadata at each call."""
    p, md = req.pending_time(now), req.metadata
    if req.last_token_time is None:
        slo = md.ttft_slo_ms / 1e3 if md.ttft_slo_ms is not None else packer.ttft_slo_s
    else:
        slo = md.tpot_slo_ms / 1e3 if md.tpot_slo_ms is not None else packer.tbt_slo_s
    if slo is None or p <= slo:
        return p
    return NEAR_ZERO if packer.fallback == "zero" else packer.decay * p


def old_items(
    packer: adaptive.AdaptivePacker, queue: list[Request], step: adaptive._Step, switchable: bool
) -> tuple[list[Request], list[Item]]:
    """``AdaptivePacker._items`` as it was: the plan asked per request, the hit counted."""
    reqs, items = [], []
    plan, now, size = step.plan, step.view.now, step.view.block_size
    left, chunked = step.tokens(), step.chunked
    mean = packer._mean_output()
    for req in queue:
        n = chunk(req, req.num_uncomputed_tokens if left is None else left, chunked)
        if n == 0:
            continue
        held = plan.cache_kind(req)
        kv, hidden = packer._open_kinds(req, held, switchable)
        hit = plan.prefix_hit(req) if held is None else None
        shared = len(hit.of(Tier.DEVICE)) if hit is not None else 0
        m = blocks_for(req.num_context_tokens + n, size) - shared
        half = blocks_for(req.num_computed_tokens + n, size, CacheKind.HIDDEN)
        steps = 1.0
        if kv and hidden:
            steps = mean if mean is not None else packer.steps_ahead(req)
        items.append(Item(old_value(packer, req, now), m, half, kv, hidden, n, steps))
        reqs.append(req)
    return reqs, items


def sorted_walk(
    items: list[Item],
    memory: int,
    factor: float,
    *,
    seats: int | None = None,
    tokens: int | None = None,
    chunked: bool = False,
) -> dict[int, CacheKind]:
    """The greedy as it was: every increment sorted, the whole order walked."""
    opts = [options(it, factor, memory) for it in items]
    alone = [_has_room(it, seats, tokens, chunked) for it in items]
    steps = []
    for i, choices in enumerate(opts):
        prev_w, prev_v = 0, 0.0
        for stage, (_, w, v) in enumerate(choices):
            steps.append((-(v - prev_v) / (w - prev_w), i, stage, w - prev_w, v - prev_v))
            prev_w, prev_v = w, v
    steps.sort()
    chosen: dict[int, CacheKind] = {}
    total = 0.0
    for _, i, stage, dw, dv in steps:
        if dw > memory:
            continue
        if stage == 0:
            if not _has_room(items[i], seats, tokens, chunked):
                continue
            seats = None if seats is None else seats - 1
            tokens = None if tokens is None else tokens - min(items[i].tokens, tokens)
        elif i not in chosen:
            continue
        chosen[i] = opts[i][stage][0]
        memory -= dw
        total += dv
    best = None
    for i, choices in enumerate(opts):
        for kind, _, v in choices:
            if alone[i] and (best is None or v > best[0]):
                best = (v, i, kind)
    if best is not None and best[0] > total:
        return {best[1]: best[2]}
    return chosen


item_strategy = st.builds(
    Item,
    value=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]),  # NOTE: few values, so ratios tie
    kv_blocks=st.integers(1, 8),
    hidden_blocks=st.integers(1, 4),
    kv=st.booleans(),
    hidden=st.booleans(),
    tokens=st.integers(0, 6),
    hidden_steps=st.sampled_from([1.0, 2.0]),
)


@settings(max_examples=400, deadline=None)
@given(
    items=st.lists(item_strategy, max_size=12),
    memory=st.integers(0, 30),
    factor=st.sampled_from([0.0, 0.05, 0.1, 0.5]),
    seats=st.none() | st.integers(0, 5),
    tokens=st.none() | st.integers(0, 12),
    chunked=st.booleans(),
)
def test_the_heap_walk_chooses_as_the_sorted_walk(items, memory, factor, seats, tokens, chunked):
    kw = {"seats": seats, "tokens": tokens, "chunked": chunked}
    got = greedy_knapsack(items, memory, factor, **kw)
    want = sorted_walk(items, memory, factor, **kw)
    assert list(got.items()) == list(want.items())  # the order taken too


@settings(max_examples=300, deadline=None)
@given(
    edge=st.integers(-1, 40),
    hi=st.integers(0, 40),
    guess=st.none() | st.integers(-2, 45),
)
def test_the_search_from_a_guess_finds_what_the_bisection_finds(edge, hi, guess):
    calls: list[int] = []

    def fits(x: int) -> bool:  # NOTE: holds up to ``edge`` and not beyond, as a step time
        calls.append(x)
        return x <= edge

    plain = largest(hi, fits)
    assert largest(hi, fits, guess) == plain
    assert all(0 <= x <= hi for x in calls)


@settings(max_examples=200, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 15), st.sampled_from([0.0, 0.5, 2.0, 2.9, 3.0, 7.25])),
        max_size=40,
    ),
    now=st.sampled_from([0.0, 1.0, 3.0, 9.5]),
    batch=st.integers(1, 8),
    iterations=st.integers(0, 2500),
)
def test_the_enst_in_one_pass_is_mlfq_enst(jobs, now, batch, iterations):
    order = SkipJoinMLFQ(SchedulerConfig(max_num_seqs=batch), PROFILES["a100-opt13b"])
    order._iterations = iterations
    params = SamplingParams(max_tokens=1)
    queue = [
        Job(Request(f"j{i}", [1], params, 0.0, i), level, last_run=last)
        for i, (level, last) in enumerate(jobs)
    ]
    next_check = (
        order.starve_check_every - iterations % order.starve_check_every
    ) * order.cost.min_iteration_time
    want = mlfq_enst(
        {j.request.request_id: j.level for j in queue},
        {
            j.request.request_id: max(next_check, order.starve_limit - (now - j.last_run))
            for j in queue
        },
        order.quanta,
        batch,
    )
    got = order._enst(queue, now, {j.request.request_id: j for j in queue})
    assert list(got.items()) == list(want.items())


@settings(max_examples=300, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.5, 2.0, 2.9, 3.0])), max_size=40
    ),
    by_queue=st.booleans(),
    idle_every=st.integers(1, 3),
    k=st.integers(0, 12),
    next_check=st.sampled_from([0.0, 0.01, 0.5, 10.0]),
    now=st.sampled_from([0.0, 3.0, 9.5]),
)
def test_the_first_idle_jobs_by_enst_are_those_of_a_full_sort(
    jobs, by_queue, idle_every, k, next_check, now
):
    """ProactiveSwap's MaxBatchSize idle jobs of smallest (ENST, position), read as far as
    they can be among them, against a heap over every key."""
    if by_queue:
        jobs = sorted(jobs, key=lambda j: j[0])
    params = SamplingParams(max_tokens=1)
    order = [Request(f"j{i}", [1], params, 0.0, i) for i in range(len(jobs))]
    levels = [level for level, _ in jobs]
    t_exec = execute_times(levels, [0.1 * 2**q for q in range(6)], 2)
    ranked = [Job(r, level, last_run=last) for r, (level, last) in zip(order, jobs, strict=True)]
    enst = Enst(
        ranked,
        {j.request.request_id: j for j in ranked},
        t_exec,
        next_check=next_check,
        limit=3.0,
        now=now,
        by_queue=by_queue,
    )
    assert dict(enst) == mlfq_enst(
        dict(zip(enst, levels, strict=True)),
        {
            r.request_id: max(next_check, 3.0 - (now - last))
            for r, (_, last) in zip(order, jobs, strict=True)
        },
        [0.1 * 2**q for q in range(6)],
        2,
    )
    pos = {r.request_id: i for i, r in enumerate(order)}
    idle = order[::idle_every]
    keys = [(enst[r.request_id], pos[r.request_id], r) for r in idle]
    assert enst.first(idle, k, pos) == [r for _, _, r in heapq.nsmallest(k, keys)]


def test_turns_read_as_the_dict_of_positions():
    order = [Request(f"r{i}", [1], SamplingParams(max_tokens=1), 0.0, i) for i in range(10)]
    turns = Turns(order, 4, 0.25)
    assert dict(turns) == {r.request_id: (i // 4) * 0.25 for i, r in enumerate(order)}
    assert len(turns) == 10 and list(turns) == [r.request_id for r in order]
    ranking = Ranking(order, turns)
    assert ranking.position() == {r.request_id: i for i, r in enumerate(order)}


# -- every step of a seeded workload ------------------------------------------------------------
class _InstantRunner:
    """Samples token 5 for every row that samples; offers all an engine may offer."""

    capabilities = RunnerCapabilities(hidden_cache=True, layer_safepoints=True)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(
            tuple(s.request_id for s in so.seqs), tuple(5 if s.sample else None for s in so.seqs)
        )


def _old_order(ordering: object, view: SchedulerView) -> list[Request]:
    """One sort of every candidate by the key each ordering sorted with before."""
    if isinstance(ordering, ClassOrder):
        return sorted(view.candidates, key=lambda r: (not is_online(r), *arrival_key(r)))
    if isinstance(ordering, ArrivalOrder):
        return sorted(view.candidates, key=arrival_key)
    assert isinstance(ordering, _CounterOrder)

    def key(r: Request) -> tuple[float, ...]:
        group = QUEUE_RANK[r.status]
        if group == 0:
            return (0, 0, 0.0, r.arrival_time)
        served = (ordering.service.of(ordering.user(r)),)
        if isinstance(ordering, WSCOrder):
            served = (0 if ordering.tracker.continues(r, view.now) else 1, *served)
        return (group, *served, r.arrival_time)

    return sorted(view.candidates, key=key)


def _checked_rank(ordering: object, checks: list[int], wrong: list[str]):
    """``ordering.rank`` that notes every step whose ranking differs from the old one (the
    loop contains what a policy raises, so a mismatch is noted, not raised)."""
    rank = ordering.rank

    def checked(view: SchedulerView) -> Ranking:
        ranking = rank(view)
        if isinstance(ordering, PriorityOrder):  # NOTE: rank joins and promotes: sort after
            jobs = sorted((ordering.jobs[r.request_id] for r in view.candidates), key=ordering._key)
            want = [j.request for j in jobs]
        else:
            want = _old_order(ordering, view)
        if [r.request_id for r in ranking.order] != [r.request_id for r in want]:
            wrong.append(f"rank at {view.now}")
        checks[0] += 1
        return ranking

    return checked


@pytest.mark.parametrize("system", ["fcfs", "sj-mlfq", "fair", "vtc", "conserve", "apt"])
def test_every_step_of_a_seeded_workload_ranks_and_packs_as_before(system, monkeypatch):
    checks, wrong, requests, _ = _every_step(system, monkeypatch, kept=False)
    assert wrong == []
    assert [r.error for r in requests if r.error] == []
    assert checks[0] > 100
    assert (checks[1] > 100 and checks[2] > 100) or system != "apt"


# Apt-Serve's variants the seeded workloads run (requests then bring SLOs of their own)
APT_VARIANTS = [
    {"rho": 1e-6},  # NOTE: hidden caches worth choosing, and switches
    {"cache": "kv"},
    {"cache": "hidden"},
    {"fallback": "decay", "allow_swap": True, "ttft_slo_s": 0.2, "tbt_slo_s": 0.1},
]


@pytest.mark.parametrize("options", [{}, *APT_VARIANTS])
def test_apt_decides_from_its_kept_queues_as_from_the_lists(options, monkeypatch):
    """With the lane in arrival order Apt-Serve keeps its prefill queue and its residents
    across steps; every decision of a seeded workload is the one the lists of the lane's
    requests give, and every kept prefill step's greedy chose as the list's would."""
    slos = bool(options)
    _, _, listed, want = _every_step("apt", monkeypatch, kept=False, slos=slos, **options)
    checks, wrong, kept, got = _every_step("apt", monkeypatch, kept=True, slos=slos, **options)
    assert wrong == []
    assert checks[3] > 100
    assert len(got) == len(want) > 100
    assert [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b] == []
    assert [r.error for r in kept] == [r.error for r in listed]


@pytest.mark.parametrize("options", APT_VARIANTS)
def test_every_step_of_apt_with_its_options_packs_as_before(options, monkeypatch):
    """The items, their bounds and the greedy of Apt-Serve's variants, with requests that
    bring SLOs of their own, at every step."""
    checks, wrong, requests, _ = _every_step("apt", monkeypatch, kept=False, slos=True, **options)
    assert wrong == []
    assert [r.error for r in requests if r.error] == []
    assert checks[1] > 100 and checks[2] > 100


def _every_step(
    system: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    kept: bool,
    slos: bool = False,
    **options: object,
) -> tuple[list[int], list[str], list[Request], list[Decision]]:
    """A seeded workload through the loop, every ranking, greedy and set of items checked
    against the old way, and every prefill step Apt-Serve takes from its kept queue against
    the list of the lane's waiting requests: (checks made per kind, what differed, the
    requests, every decision). Without ``kept`` the arrival ranking does not say it is one,
    so Apt-Serve walks the lists."""
    rng = random.Random(7)
    checks, wrong = [0, 0, 0, 0], []
    decisions: list[Decision] = []
    monkeypatch.undo()  # NOTE: a test may call this twice: start from the real functions

    def greedy(items, memory, factor, *, bounds, **kwargs):  # type: ignore[no-untyped-def]
        got = greedy_knapsack(items, memory, factor, bounds=bounds, **kwargs)
        if list(got.items()) != list(sorted_walk(items, memory, factor, **kwargs).items()):
            wrong.append("greedy")
        if bounds != item_bounds(items, factor):  # NOTE: the packer counts them as it goes
            wrong.append("bounds")
        checks[1] += 1
        return got

    monkeypatch.setattr(adaptive, "greedy_knapsack", greedy)
    items = adaptive.AdaptivePacker._items

    def checked_items(self, queue, pending, step, *, switchable):  # type: ignore[no-untyped-def]
        got = items(self, queue, pending, step, switchable=switchable)
        if got[:2] != old_items(self, queue, step, switchable):
            wrong.append("items")
        checks[2] += 1
        return got

    monkeypatch.setattr(adaptive.AdaptivePacker, "_items", checked_items)
    prefill_kept, walk = adaptive.AdaptivePacker._prefill_kept, adaptive.greedy_walk

    def checked_kept(self, step, placement):  # type: ignore[no-untyped-def]
        plan, now = step.plan, step.view.now
        waiting = list(outside(step.lane.order, plan))
        waits = [r.pending_time(now) for r in waiting]
        if self._queue.total_pending(now) != math.fsum(waits):
            wrong.append("total pending")
        reqs, its, bounds = items(self, waiting, waits, step, switchable=False)
        want = greedy_knapsack(its, plan.free_device, step.factor, seats=plan.seats,
                               tokens=step.tokens(), chunked=step.chunked,
                               bounds=bounds)  # fmt: skip
        got: list[tuple[str, CacheKind]] = []

        def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
            chosen = walk(*args, **kwargs)
            got.extend((key[2], kind) for key, kind in chosen.items())
            return chosen

        monkeypatch.setattr(adaptive, "greedy_walk", recorded)
        prefill_kept(self, step, placement)
        monkeypatch.setattr(adaptive, "greedy_walk", walk)
        if got != [(reqs[i].request_id, kind) for i, kind in want.items()]:
            wrong.append(f"kept queue at {now}")
        checks[3] += 1

    monkeypatch.setattr(adaptive.AdaptivePacker, "_prefill_kept", checked_kept)
    clock = VirtualClock()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128)
    policy = make_policy(system, config, **options)
    rank = _checked_rank(policy.ordering, checks, wrong)
    policy.ordering.rank = rank if kept else lambda view: replace(rank(view), by_arrival=False)
    schedule = policy.schedule

    def recorded(view: SchedulerView) -> Decision:
        decisions.append(schedule(view))
        return decisions[-1]

    policy.schedule = recorded  # type: ignore[method-assign]
    loop = EngineLoop(
        runner=_InstantRunner(),
        policy=policy,
        blocks=BlockManager(16, 120, 60, prefix_caching=True),
        clock=clock,
        max_model_len=1024,
    )
    shared = [rng.randrange(1, 50) for _ in range(64)]  # NOTE: a prefix some prompts share
    requests: list[Request] = []
    for i in range(120):  # NOTE: faster than they are served, so a queue builds
        prompt = shared[: rng.choice([0, 16, 48])] + [rng.randrange(1, 50) for _ in range(20)]
        meta = RequestMetadata(
            tenant=f"t{rng.randrange(3)}",
            tenant_authenticated=rng.random() < 0.7,
            priority_class=rng.choice(["online", "offline"]),
        )
        if slos:
            meta = meta.model_copy(
                update={
                    "ttft_slo_ms": rng.choice([None, 100.0, 600.0]),
                    "tpot_slo_ms": rng.choice([None, 50.0]),
                }
            )
        params = SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True, temperature=0)
        request = Request(f"r{i}", prompt, params, clock.now(), i, metadata=meta)
        loop.submit(request, lambda _: None)
        requests.append(request)
        if i % 3 == 0:
            loop.step()
            clock.advance(rng.choice([0.01, 0.05, 0.3]))
    loop.run_until_idle()
    return checks, wrong, requests, decisions


def test_the_first_jobs_by_turn_are_the_first_of_a_full_sort():
    """ProactiveSwap takes the MaxBatchSize idle jobs of smallest (ENST, position): from a
    heap over keys read in C, or, for turns by position, the first ones as they stand."""
    rng = random.Random(3)
    ids = [f"j{i}" for i in range(200)]
    enst = {rid: rng.choice([0.0, 0.5, 1.0, 2.5]) for rid in ids}
    pos = {rid: i for i, rid in enumerate(ids)}
    full = sorted(ids, key=lambda rid: (enst[rid], pos[rid]))[:16]
    keys = zip(map(enst.__getitem__, ids), map(pos.__getitem__, ids), ids, strict=True)
    assert [rid for _, _, rid in heapq.nsmallest(16, keys)] == full
    order = [Request(rid, [1], SamplingParams(max_tokens=1), 0.0, i) for i, rid in enumerate(ids)]
    turns = Turns(order, 8, 0.1)
    assert sorted(ids, key=lambda rid: (turns[rid], pos[rid]))[:16] == ids[:16]


@pytest.mark.parametrize("system", ["fcfs", "sj-mlfq", "fair", "vtc", "conserve", "apt"])
def test_the_schedule_step_bench_times_every_system(system):
    """Its stand-in runner offers what the model runner offers a multi-head model (layer
    safepoints, the hidden cache), so ConServe and Apt-Serve are timed too."""
    from quanta_lab.sim.step_time import time_steps, workload_prompts

    timing = time_steps(workload_prompts("chat", 40), system, prefix_caching=True,
                        max_num_seqs=4, steps=3)  # fmt: skip
    assert timing.steps == 3 and timing.num_waiting > 0 and timing.median_ms > 0
