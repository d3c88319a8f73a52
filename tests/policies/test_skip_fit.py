"""``skip-fit``: stacked under an ordering, a step starts the ranking's top calls that fit and
skips one that does not, where the default packer stops at it; nobody is evicted for it."""

from __future__ import annotations

from conftest import make_resident
from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager
from quanta.core.config import SchedulerConfig
from quanta.core.plan import PoolView
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.core.view import SchedulerView
from quanta.policies import make_policy


def call(rid: str, user: str, prompt: int, arrival: float) -> Request:
    meta = RequestMetadata(tenant=user)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(rid, [1 + j % 40 for j in range(prompt)], params, arrival, seed=1, metadata=meta)


def step(policy: str) -> tuple[tuple[str, int], ...]:
    """A 20-block pool, 12 blocks held by a running call; the call ranked first needs 10
    blocks, the one behind it 2."""
    bm = BlockManager(16, 20, 0)
    running = make_resident(bm, call("r0", "x", 16 * 12 - 1, 0.0))
    big, small = call("big", "a", 16 * 10 - 1, 1.0), call("small", "b", 31, 2.0)
    pol = make_policy(policy, SchedulerConfig(max_num_seqs=8))
    empty = SchedulerView(0.0, [], [], [], PoolView(bm))
    for r in (running, big, small):
        pol.admit(r, empty)
    view = SchedulerView(3.0, [big, small], [running], [], PoolView(bm))
    decision = pol.schedule(view)
    DecisionApplier(bm).validate(decision, {r.request_id: r for r in (running, big, small)})
    assert not decision.preempt  # nobody is evicted for a newcomer
    return decision.run


def test_a_call_that_does_not_fit_no_longer_holds_back_a_smaller_one():
    # Both users are unserved, so WSC ranks "big" first, by arrival.
    assert step("fair") == (("r0", 1),)  # the default packer stops at "big"
    assert step("fair+skip-fit") == (("r0", 1), ("small", 31))


def test_skip_fit_keeps_the_orderings_options():
    pol = make_policy("fair+skip-fit", SchedulerConfig(), reserve_fraction=0.1)
    assert pol.ordering.reserve_fraction == 0.1  # type: ignore[attr-defined]
    assert type(pol.packer).__name__ == "PriorityPacker"
