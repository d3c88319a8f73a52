"""FairServe's reserve of KV blocks: a user over its equal share of the device pool starts a
call only while the free blocks after it stay above the reserve; users within their share,
and running calls, are never held back."""

from __future__ import annotations

import pytest
from conftest import make_resident
from quanta.core.blocks import BlockManager
from quanta.core.config import SchedulerConfig
from quanta.core.plan import PoolView
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.core.view import SchedulerView
from quanta.policies import make_policy
from quanta.policies.memory_share import hold_back


def call(rid: str, user: str, prompt: int) -> Request:
    meta = RequestMetadata(tenant=user)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(rid, [1 + j % 40 for j in range(prompt)], params, 0.0, seed=1, metadata=meta)


def pool_with(blocks: int, residents: dict[str, tuple[str, int]]) -> tuple[PoolView, list]:
    """A pool of ``blocks`` 16-token blocks holding each resident's prompt."""
    bm = BlockManager(16, blocks, 0)
    running = [make_resident(bm, call(rid, user, n)) for rid, (user, n) in residents.items()]
    return PoolView(bm), running


def test_a_user_over_its_share_does_not_start_into_the_reserve():
    """20 blocks, two users: a share is 10. The abuser holds 12 (over it); 8 are free and
    the reserve is 4. Its next call (2 blocks) would leave 6: it starts; a second one of 4
    blocks would leave 2: held back. The benign user's 4-block call, ranked after both,
    still starts into the reserve: it holds nothing."""
    pool, running = pool_with(20, {"a0": ("abuser", 16 * 12)})
    a1, a2 = call("a1", "abuser", 32), call("a2", "abuser", 64)
    b1 = call("b1", "benign", 64)
    order = [*running, a1, a2, b1]
    assert [r.request_id for r in hold_back(order, pool, 0.2)] == ["a0", "a1", "b1"]
    assert hold_back(order, pool, 0.0) == order  # no reserve: the paper's FairServe


def test_within_its_share_a_user_may_use_the_reserve_and_running_calls_stay():
    pool, running = pool_with(20, {"a0": ("abuser", 16 * 8), "b0": ("benign", 16 * 8)})
    b1 = call("b1", "benign", 64)  # both hold 8 of a share of 10; 4 free, reserve 4
    a1 = call("a1", "abuser", 16)
    kept = hold_back([*running, b1, a1], pool, 0.2)
    assert [r.request_id for r in kept] == ["a0", "b0", "b1", "a1"]


def test_two_calls_of_one_user_cannot_pass_on_the_same_free_blocks():
    """Each call let through is counted: the first takes the abuser over its share, the
    second would then start into the reserve."""
    pool, running = pool_with(20, {"b0": ("benign", 16 * 2)})
    a1, a2 = call("a1", "abuser", 16 * 11), call("a2", "abuser", 16 * 5)
    kept = hold_back([*running, a1, a2], pool, 0.2)
    assert [r.request_id for r in kept] == ["b0", "a1"]


def test_fair_takes_the_option_and_holds_back_through_its_ranking():
    pool, running = pool_with(20, {"a0": ("abuser", 16 * 12)})
    a1, b1 = call("a1", "abuser", 96), call("b1", "benign", 64)
    view = SchedulerView(0.0, [a1, b1], running, [], pool)
    ranked = make_policy("fair", SchedulerConfig(), reserve_fraction=0.2)
    plain = make_policy("fair", SchedulerConfig())
    order = ranked.ordering.rank(view).order
    assert "a1" not in [r.request_id for r in order] and "b1" in [r.request_id for r in order]
    assert "a1" in [r.request_id for r in plain.ordering.rank(view).order]
    with pytest.raises(ValueError, match="reserve_fraction"):
        make_policy("fair", SchedulerConfig(), reserve_fraction=1.0)


def test_on_a_flood_the_reserve_shortens_the_benign_waits_at_no_cost_in_time():
    """An abuser sends 300 calls in 10 s into a 400-block pool, a benign user one every 2 s
    (throttling off, so only the order and the reserve differ). Without the reserve the
    benign calls wait for the abuser's running calls to free blocks; with 20% held back from
    the abuser they find room, and the flood still ends when it did."""
    from quanta.costmodel import PROFILES
    from quanta.sim import SimSetup, simulate
    from quanta.workloads import WorkloadRequest

    abuser = [WorkloadRequest(i / 30, 400, 200, f"a{i}", tenant="abuser") for i in range(300)]
    benign = [WorkloadRequest(2.0 * i, 400, 200, f"b{i}", tenant="benign") for i in range(10)]
    trace = sorted(abuser + benign, key=lambda r: r.arrival_time)

    def run(reserve: float) -> tuple[float, float]:
        options = {"reserve_fraction": reserve, "user_limit": 1000, "app_limit": 100_000}
        setup = SimSetup(
            "fair",
            PROFILES["a100-opt13b"],
            SchedulerConfig(max_num_seqs=256),
            num_device_blocks=400,
            policy_options=options,
        )
        done = simulate(trace, setup).requests
        benign_calls = [r for r in done if r.metadata.tenant == "benign"]
        waits = [r.first_scheduled_time - r.arrival_time for r in benign_calls]  # type: ignore[operator]
        return sum(waits) / len(waits), max(r.finish_time for r in done)  # type: ignore[type-var]

    plain_wait, plain_end = run(0.0)
    wait, end = run(0.2)
    assert wait < 0.5 * plain_wait and plain_wait > 1.0
    assert end <= 1.02 * plain_end
