"""ConServe's policies on the fake runner: the SLO budget, offline work yielding to online work
(at scheduling, by checkpoint, at safepoints), the baselines, and block checkpoints."""

from __future__ import annotations

import pytest
from fakes import HashRunner, SafepointHashRunner, decode_chars
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager, Tier
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.errors import CapabilityError
from quanta.core.loop import EngineLoop
from quanta.core.request import Request, RequestMetadata, RequestStatus, SamplingParams
from quanta.costmodel import get_profile
from quanta.policies import make_policy
from quanta.policies.coserve import slo_token_budget
from quanta.policies.coserve_placement import CoservePlacement, MissesTTFT

COST = get_profile("a100-opt13b")


def request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    cls: str = "offline",
    arrival: float = 0.0,
    **meta: object,
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[(3 * len(rid) + 7 * j) % 50 for j in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.8),
        arrival_time=arrival,
        seed=hash(rid) % 1000,
        metadata=RequestMetadata(priority_class=cls, **meta),  # type: ignore[arg-type]
    )


def make_loop(
    policy: str,
    *,
    device: int = 20,
    host: int = 64,
    runner: type[HashRunner] = HashRunner,
    **options: object,
) -> EngineLoop:
    return EngineLoop(
        runner=runner(device, host, 4),
        policy=make_policy(policy, SchedulerConfig(max_num_batched_tokens=64), **options),
        blocks=BlockManager(4, device, host),
        clock=VirtualClock(),
        max_model_len=256,
        decode=decode_chars,
    )


def run(loop: EngineLoop, early: list[Request], late: list[Request], after: int = 4) -> dict:
    """Submit ``early``, step ``after`` times, submit ``late``, finish; outputs by id."""
    streams = {r.request_id: loop.submit(r) for r in early}
    for _ in range(after):
        loop.step()
    streams |= {r.request_id: loop.submit(r) for r in late}
    loop.run_until_idle()
    loop.blocks.check_integrity()
    assert loop.blocks.all_free(), "blocks leaked"
    return {rid: s.result(timeout=0).token_ids for rid, s in streams.items()}  # type: ignore


def workload() -> tuple[list[Request], list[Request]]:
    offline = [request(f"off{i}", 20, 12) for i in range(4)]  # fill a 20-block pool
    online = [request(f"on{i}", 10, 6, "online") for i in range(2)]
    return offline, online


def reference() -> dict:
    offline, online = workload()
    return run(make_loop("fcfs", device=512), offline, online)


# -- the budget ----------------------------------------------------------------------------
def test_budget_is_the_largest_step_the_cost_model_keeps_within_the_tpot_slo():
    decodes = [300] * 8
    tpot = 0.05
    budget = slo_token_budget(COST, decodes, tpot, max_tokens=4096)
    chunk = budget - len(decodes)
    assert chunk > 0
    base = [(1, c) for c in decodes]
    assert COST.step_time([*base, (chunk, 0)]) <= tpot < COST.step_time([*base, (chunk + 1, 0)])


def test_budget_is_capped_and_floored():
    assert slo_token_budget(COST, [10] * 4, 10.0, max_tokens=256) == 256
    # an SLO the decodes alone miss: the online prompt still advances by min_chunk
    assert slo_token_budget(COST, [10] * 4, 1e-6, max_tokens=256, min_chunk=16) == 20


def test_steps_with_online_work_keep_the_tpot_slo_and_offline_fills_them():
    tpot = 0.0230
    loop = make_loop("conserve", device=256, safepoints=False, tpot_slo_s=tpot)
    offline = [request(f"off{i}", 20, 12) for i in range(4)]
    online = [request(f"on{i}", 10, 6, "online") for i in range(2)]
    run(loop, offline, online, after=1)

    def predicted(so) -> float:
        return COST.step_time((s.num_new_tokens, s.start_pos) for s in so.seqs)

    def has(so, prefix: str) -> bool:
        return any(s.request_id.startswith(prefix) for s in so.seqs)

    online_steps = [so for so in loop.runner.steps if has(so, "on")]
    assert online_steps and all(predicted(so) <= tpot for so in online_steps)
    assert any(has(so, "off") for so in online_steps)  # offline work filled them
    # offline work alone ignores the budget
    assert any(predicted(so) > tpot for so in loop.runner.steps if not has(so, "on"))


# -- offline yields at scheduling ----------------------------------------------------------
def test_an_online_arrival_preempts_offline_work_at_scheduling():
    offline, online = workload()
    loop = make_loop("conserve", safepoints=False, checkpoint=False)
    out = run(loop, offline, online[:1])
    step = next(
        i for i, so in enumerate(loop.runner.steps) if any(s.request_id == "on0" for s in so.seqs)
    )
    assert loop.stats().num_preemptions_swap + loop.stats().num_preemptions_recompute > 0
    # it ran in the first step after it arrived: offline work made room
    assert step == 4
    expected = reference()
    assert all(out[rid] == expected[rid] for rid in out)


def test_priority_baseline_never_preempts_running_offline_work_for_a_newcomer():
    offline, online = workload()
    loop = make_loop("priority")
    out = run(loop, offline, online[:1])
    first = next(
        i for i, so in enumerate(loop.runner.steps) if any(s.request_id == "on0" for s in so.seqs)
    )
    assert first > 4  # it waited for offline work to finish and free blocks
    assert loop.runner.steps[first].swap_out == ()  # nothing was thrown out for it
    expected = reference()
    assert all(out[rid] == expected[rid] for rid in out)


def test_online_only_holds_offline_work_back_while_online_work_is_in_flight():
    offline, online = workload()
    loop = make_loop("online-only", device=256)
    out = run(loop, offline, online)
    steps = loop.runner.steps
    first = next(i for i, so in enumerate(steps) if any(s.request_id == "on0" for s in so.seqs))
    last = max(
        i for i, so in enumerate(steps) if any(s.request_id.startswith("on") for s in so.seqs)
    )
    assert first == 4
    for so in steps[first : last + 1]:
        assert not any(s.request_id.startswith("off") for s in so.seqs)
    expected = reference()
    assert all(out[rid] == expected[rid] for rid in out)


# -- checkpoints -----------------------------------------------------------------------------
def test_checkpointed_offline_work_yields_without_copies_and_outputs_hold():
    offline, online = workload()
    loop = make_loop("conserve", safepoints=False, checkpoint_threshold=1.0, prefetch=False)
    out = run(loop, offline, online)
    stats = loop.stats()
    assert stats.num_preemptions_checkpoint > 0
    assert stats.num_checkpoint_blocks_copied > 0
    expected = reference()
    assert all(out[rid] == expected[rid] for rid in out)


def test_a_complete_checkpoint_makes_a_swap_out_free():
    bm = BlockManager(4, 8, 8)
    applier = DecisionApplier(bm)
    r = request("a", 10, 4)
    live = {"a": r}
    so = applier.apply(Decision(run=(("a", 10),), checkpoint=("a",)), live, 0.0)
    assert [d for d, _ in so.checkpoint] == list(so.seqs[0].block_table)  # 3 blocks mirrored
    bm.confirm_checkpoints()
    r.num_computed_tokens = 10
    r.append_token(1, 0.0)
    assert bm.checkpointed_tokens("a") == 10
    so = applier.apply(Decision(preempt=(Preemption("a", PreemptMode.SWAP),)), live, 0.0)
    assert so.swap_out == ()
    assert bm.tier_of("a") is Tier.HOST and bm.num_free(Tier.DEVICE) == 8
    bm.check_integrity()


def test_a_partial_checkpoint_copies_only_what_it_lacks():
    bm = BlockManager(4, 8, 8)
    applier = DecisionApplier(bm)
    r = request("a", 10, 8)
    live = {"a": r}
    applier.apply(Decision(run=(("a", 10),), checkpoint=("a",)), live, 0.0)
    bm.confirm_checkpoints()
    r.num_computed_tokens = 10
    r.append_token(1, 0.0)
    so = applier.apply(Decision(run=(("a", 1),)), live, 0.0)  # token 11, not checkpointed
    r.num_computed_tokens = 11
    r.append_token(2, 0.0)
    table = bm.block_table("a")
    so = applier.apply(Decision(preempt=(Preemption("a", PreemptMode.SWAP),)), live, 0.0)
    # blocks 0 and 1 are full and mirrored; block 2 (tokens 8-10) is copied again
    assert [d for d, _ in so.swap_out] == [table[2]]
    assert bm.num_blocks("a") == 3
    bm.check_integrity()


def test_an_aborted_step_does_not_count_its_checkpoint():
    bm = BlockManager(4, 8, 8)
    applier = DecisionApplier(bm)
    live = {"a": request("a", 10, 4)}
    applier.apply(Decision(run=(("a", 10),), checkpoint=("a",)), live, 0.0)
    bm.drop_pending_checkpoints()
    assert bm.checkpointed_tokens("a") == 0
    assert bm.checkpoint_blocks("a") == 3  # owned, to be filled by a later checkpoint
    bm.free("a")
    assert bm.all_free()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("gcsiwf"), st.integers(1, 9)), max_size=40))
def test_checkpoint_accounting_is_exact(ops):
    """Any interleaving of growth, checkpoints (confirmed or dropped), swaps and frees keeps
    every block owned once or free, and a checkpoint never outlives the device residency."""
    bm = BlockManager(4, 12, 12)
    tokens = 0
    for op, n in ops:
        tier = bm.tier_of("a")
        if op == "g" and tier in (None, Tier.DEVICE):
            if bm.allocate_slots("a", tokens + n) is not None:
                tokens += n
        elif op in "cw" and tier is Tier.DEVICE and tokens:
            if bm.checkpoint("a", tokens) is not None:
                bm.confirm_checkpoints() if op == "c" else bm.drop_pending_checkpoints()
        elif op == "s" and tier is Tier.DEVICE:
            pairs = bm.swap_out("a", tokens)
            if pairs is not None:
                assert bm.checkpoint_blocks("a") == 0
        elif op == "i" and tier is Tier.HOST:
            bm.swap_in("a")
        elif op == "f":
            bm.free("a")
            tokens = 0
        bm.check_integrity()
    bm.free("a")
    assert bm.all_free()


# -- safepoints ------------------------------------------------------------------------------
def test_conserve_needs_an_engine_with_safepoints_unless_they_are_off():
    with pytest.raises(CapabilityError, match="layer_safepoints"):
        make_loop("conserve")
    make_loop("conserve", safepoints=False)
    make_loop("conserve", runner=SafepointHashRunner)


def test_only_steps_of_offline_work_are_preemptible():
    offline, online = workload()
    loop = make_loop("conserve", runner=SafepointHashRunner, device=256)
    seen: list[tuple[bool, bool]] = []
    inner = loop.policy.schedule

    def schedule(view):
        d = inner(view)
        has_online = any(rid.startswith("on") for rid, _ in d.run)
        seen.append((has_online, d.abort_when is not None))
        return d

    loop.policy.schedule = schedule  # type: ignore[method-assign]
    run(loop, offline, online)
    assert any(p for _, p in seen)
    assert all(not (o and p) for o, p in seen)


def test_abort_rule_is_the_ttft_arithmetic():
    placement = CoservePlacement(COST, ttft_slo_s=1.0)
    rule = MissesTTFT(end=10.0, placement=placement)
    short = request("s", 10, 1, "online")
    own = COST.prefill_time(10)
    assert rule(short, 9.0 + own / 2)  # waits 1 - own/2, then its prefill: misses 1.0 s
    assert not rule(short, 9.0 + own * 2)
    assert not rule(request("o", 10, 1, "offline"), 9.5)
    assert not rule(short, 10.5)  # the step is predicted to be over
    patient = request("p", 10, 1, "online", ttft_slo_ms=5000)
    assert not rule(patient, 6.0)


def test_an_arrival_while_the_policy_decides_stops_the_step_before_it_computes():
    """A request that comes in after the step's ingest, while the policy is still deciding,
    is checked against the step's abort rule as soon as there is one: the step stops at its
    first check, and nothing of it is committed."""
    offline, online = workload()
    loop = make_loop("conserve", runner=SafepointHashRunner, ttft_slo_s=1e-6)
    for r in offline:
        loop.submit(r)
    loop.step()  # the offline prompts start
    inner = loop.policy.schedule
    arrivals = iter(online[:1])

    def schedule(view):
        decision = inner(view)
        for r in arrivals:  # once, mid-decision
            loop.submit(r)
        return decision

    loop.policy.schedule = schedule  # type: ignore[method-assign]
    before = {r.request_id: r.num_computed_tokens for r in offline}
    loop.step()
    assert loop.stats().num_safepoint_aborts == 1
    assert {r.request_id: r.num_computed_tokens for r in offline} == before
    assert loop.last_abort is not None
    loop.policy.schedule = inner  # type: ignore[method-assign]
    loop.run_until_idle()
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()


def test_a_safepoint_abort_commits_nothing_and_outputs_hold():
    offline, online = workload()
    loop = make_loop("conserve", runner=SafepointHashRunner, ttft_slo_s=1e-6)
    streams = {r.request_id: loop.submit(r) for r in offline}
    arrivals = iter(online)

    def arrive(so) -> None:
        assert so.abort is not None  # offline work only: preemptible
        r = next(arrivals)
        streams[r.request_id] = loop.submit(r)
        assert so.abort.is_set()

    runner = loop.runner
    assert isinstance(runner, SafepointHashRunner)
    runner.during_step += [lambda so: None] * 3 + [arrive]
    computed_before = None
    for _ in range(3):
        loop.step()
    computed_before = {r.request_id: r.num_computed_tokens for r in offline}
    loop.step()  # aborted
    assert loop.stats().num_safepoint_aborts == 1
    assert {r.request_id: r.num_computed_tokens for r in offline} == computed_before

    def arrive_when_preemptible(so) -> None:
        if so.abort is None:
            runner.during_step.append(arrive_when_preemptible)  # not this step: the next
        else:
            arrive(so)

    runner.during_step.append(arrive_when_preemptible)  # inside a later offline-only step
    loop.run_until_idle()
    assert loop.stats().num_safepoint_aborts >= 1
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()
    out = {rid: s.result(timeout=0).token_ids for rid, s in streams.items()}
    expected = reference()
    assert out == expected
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in offline)


# -- metrics ----------------------------------------------------------------------------------
class _Family:
    HISTOGRAM = COUNTER = GAUGE = "kind"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.series: dict[tuple[tuple[str, str], ...], list[float]] = {}

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None):
        return _Series(self.series.setdefault(tuple(sorted(labels.items())), []))


class _Series:
    def __init__(self, values: list[float]) -> None:
        self.values = values

    def increment(self, v: float) -> None:
        self.values.append(v)

    observe = set = increment


class _Pb:
    MetricFamily = _Family


def test_metrics_split_online_and_offline_and_count_what_conserve_does():
    from quanta.core.stream import RequestMetrics
    from quanta.frontends.triton.metrics import FinishedRecord, MetricsReporter

    offline, online = workload()
    loop = make_loop(
        "conserve", runner=SafepointHashRunner, ttft_slo_s=1e-6, checkpoint_threshold=1.0
    )
    runner = loop.runner
    assert isinstance(runner, SafepointHashRunner)
    arrivals = iter(online)
    runner.during_step += [lambda so: None] * 3 + [lambda so: loop.submit(next(arrivals))]
    run(loop, offline, [online[1]], after=4)
    reporter = MetricsReporter(_Pb, {"model": "m"}, stats=loop.stats)
    reporter.flush()
    fam = reporter._families
    assert sum(fam["quanta_safepoint_aborts_total"].series[(("model", "m"),)]) == 1
    copied = fam["quanta_checkpoint_blocks_copied_total"].series[(("model", "m"),)]
    assert sum(copied) == loop.stats().num_checkpoint_blocks_copied > 0
    kinds = {dict(k)["kind"] for k in fam["quanta_num_preemptions_total"].series}
    assert kinds == {"swap", "recompute", "checkpoint"}
    for cls, ttft in (("online", 0.2), ("offline", 3.0)):
        m = RequestMetrics(0.0, 0.1, ttft, ttft + 1, (ttft, ttft + 1), 10, 2, 0, 0, 0)
        reporter._apply_finished(FinishedRecord("t", cls, "length", False, m))
    by_class = fam["quanta_class_time_to_first_token_seconds"].series
    assert by_class[(("model", "m"), ("priority_class", "online"))] == [0.2]
    assert by_class[(("model", "m"), ("priority_class", "offline"))] == [3.0]
    tpot = fam["quanta_class_time_per_output_token_seconds"].series
    assert tpot[(("model", "m"), ("priority_class", "offline"))] == [1.0]


def test_conserve_stacks_under_an_ordering_and_keeps_online_first():
    from quanta.policies.fair import WSCOrder

    loop = make_loop("fair+conserve", safepoints=False)
    assert isinstance(loop.policy.ordering, WSCOrder)
    offline, online = workload()
    out = run(loop, offline, online)
    assert out == reference()
    with pytest.raises(ValueError, match=r"both supply the (packer|placement|lanes) stage"):
        make_policy("apt+conserve", SchedulerConfig())
