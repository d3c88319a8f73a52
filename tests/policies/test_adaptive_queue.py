"""Apt-Serve's kept queues (``policies/adaptive_queue.py``) follow what changed between the
steps that read them: the seeded workloads in ``test_long_queue_paths.py`` compare every
decision with the lists'; here, the changes a workload seldom makes."""

from __future__ import annotations

import pytest
from conftest import make_requests
from quanta.core.blocks import BlockManager
from quanta.core.config import SchedulerConfig
from quanta.core.plan import PoolView
from quanta.core.request import CacheKind, Request, RequestStatus, SamplingParams
from quanta.core.view import SchedulerView
from quanta.costmodel import PROFILES
from quanta.policies.adaptive import AdaptivePacker
from quanta.policies.adaptive_queue import Pricing, ResidentQueue

BLOCK = 16


def _resident(bm: BlockManager, kind: CacheKind) -> Request:
    """A request decoding with 40 tokens computed, its cache of ``kind``."""
    req = Request("a", list(range(1, 41)), SamplingParams(max_tokens=8), 0.0, 0)
    req.status = RequestStatus.RUNNING
    req.all_token_ids = [*req.prompt_token_ids, 7]
    req.output_token_ids = [7]
    req.num_computed_tokens = 40
    assert bm.allocate_slots(req.request_id, 41, kind) is not None
    return req


def _walk(queue: ResidentQueue, packer: AdaptivePacker, bm: BlockManager, req: Request):  # type: ignore[no-untyped-def]
    """Sync ``queue`` to a view of ``req`` running, and the first item its walk gives."""
    view = SchedulerView(1.0, [], [req], [], PoolView(bm))
    plan = view.plan(64, 4)

    def shape(r, held, hit):  # type: ignore[no-untyped-def]
        return packer._shape(r, held, hit, 64, True, BLOCK, True)

    queue.sync(view, plan, shape, basis=(64, True), by_place=True, own_steps=False)
    source, _, _, _ = queue.walk(1.0, Pricing(0.0, 4.0, True, 0.4), True)
    return next(source)[2]


def test_a_resident_back_with_the_other_cache_and_the_same_tokens_is_worked_out_again():
    """Switched to hidden and restarted between two steps that walked the residents, a
    resident may come back with as many tokens computed as before: what it holds tells."""
    packer = AdaptivePacker(SchedulerConfig(max_num_seqs=4), PROFILES["a100-opt13b"])
    bm = BlockManager(BLOCK, 64, 0)
    queue = ResidentQueue()
    req = _resident(bm, CacheKind.KV)
    kv = _walk(queue, packer, bm, req)
    assert kv.kv and kv.hidden  # a KV resident may be offered hidden
    bm.free(req.request_id)
    assert bm.allocate_slots(req.request_id, 41, CacheKind.HIDDEN) is not None
    hidden = _walk(queue, packer, bm, req)
    assert not hidden.kv and hidden.hidden
    assert hidden.kv_blocks == kv.kv_blocks and hidden.tokens == kv.tokens


@pytest.mark.parametrize(
    ("policy", "options"),
    [("apt", {"cache": "kv"}), ("fcfs", {}), ("conserve", {"safepoints": False})],
)
def test_an_idle_server_keeps_none_of_its_requests(make_loop, policy, options):
    """The queues a policy keeps across steps let go of a request when it ends, finished or
    cancelled while it waited: once idle, the policy holds none of them."""
    loop = make_loop(policy=policy, policy_options=options, prefix_caching=True, max_num_seqs=4,
                     max_num_batched_tokens=32)  # fmt: skip
    reqs = make_requests(12, prompt_len=[6, 10, 14] * 4, max_tokens=5)
    for r in reqs:
        loop.submit(r)
    loop.step()
    loop.cancel(reqs[-1].request_id)  # NOTE: still waiting behind the first four
    loop.run_until_idle()
    assert reqs[-1].status is RequestStatus.FINISHED_ABORTED
    ordering = loop.policy.ordering
    assert not any(ordering._queues._members) and not any(ordering._queues._sorted)
    packer = loop.policy.packer
    if isinstance(packer, AdaptivePacker):
        assert not packer._queue._entries and not packer._queue._queued
        assert not packer._residents._entries
