"""Cache affinity: waiting requests with the longest cached prefix go first, as SGLang's
longest-prefix-match scheduling does, on top of whichever system ranks.

A request whose prefix is cached costs only its uncached tokens to start, and starting it
now, while its prefix is still cached, keeps a hit that a later start might lose to eviction.
So among the waiting requests (and only those: running and swapped requests keep the places
the ordering gave them) the longest cached prefix goes first, the ordering's rank breaking
ties. The waiting requests take the ordering's positions for waiting requests, so the
ranking's shape (who runs before whom across queues) is the system's. Past ``max_waiting``
waiting requests it keeps the ordering as it is (SGLang falls back to FCFS there too): a
long queue is where the system's own order, fairness included, matters most.
"""

from __future__ import annotations

from pydantic import Field

from quanta.core.config import SchedulerConfig
from quanta.core.request import RequestStatus
from quanta.core.view import SchedulerView
from quanta.policies.stages import Ranking, Reorder
from quanta.policies.systems import Stages, System, SystemOptions


class CacheAffinity(Reorder):
    def __init__(self, max_waiting: int, min_cached_tokens: int) -> None:
        self.max_waiting = max_waiting
        self.min_cached_tokens = min_cached_tokens

    def reorder(self, ranking: Ranking, view: SchedulerView) -> Ranking:
        slots = [i for i, r in enumerate(ranking.order) if r.status is RequestStatus.WAITING]
        if not 1 < len(slots) <= self.max_waiting:
            return ranking
        waiting = [ranking.order[i] for i in slots]
        hits = {
            r.request_id: r.num_cached_tokens
            for r in waiting
            if r.num_cached_tokens >= self.min_cached_tokens
        }
        if not hits:
            return ranking
        rank = {r.request_id: i for i, r in enumerate(waiting)}
        ahead = sorted(waiting, key=lambda r: (-hits.get(r.request_id, 0), rank[r.request_id]))
        order = list(ranking.order)
        turns = dict(ranking.next_turn)
        for i, r in zip(slots, ahead, strict=True):
            # NOTE: a request takes the slot's next turn with the slot
            turns[r.request_id] = ranking.next_turn[ranking.order[i].request_id]
            order[i] = r
        return Ranking(order, turns)


class AffinityOptions(SystemOptions):
    max_waiting: int = Field(
        128, ge=1, description="reorder only while at most this many requests wait"
    )
    min_cached_tokens: int = Field(
        1, ge=1, description="a hit shorter than this counts as none (ties by rank)"
    )


def affinity_stages(config: SchedulerConfig, o: AffinityOptions) -> Stages:
    return Stages(reorder=CacheAffinity(o.max_waiting, o.min_cached_tokens))


SYSTEMS = [
    System(
        "affinity",
        AffinityOptions,
        affinity_stages,
        doc="SGLang's longest-prefix-match order for waiting requests; stacks with any system",
    )
]
