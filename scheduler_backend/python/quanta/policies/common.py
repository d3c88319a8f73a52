"""Helpers more than one system's stages use, kept in one place so they cannot drift apart:
vLLM's queue order, the priority classes, which residents a packer may still evict, and the
bisection the step-time limits search with.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from operator import attrgetter, sub

from quanta.core.plan import StepPlan
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView

ONLINE, OFFLINE = "online", "offline"
"""The priority classes (``RequestMetadata.priority_class``) and the lanes named after them."""

_WAITING = RequestStatus.WAITING

QUEUE_RANK = {RequestStatus.RUNNING: 0, RequestStatus.SWAPPED: 1, RequestStatus.WAITING: 2}
"""vLLM's queues in the order they are served: running, then swapped, then waiting."""


def is_online(req: Request) -> bool:
    """Latency-critical work; only requests marked offline are batch work."""
    return req.metadata.priority_class != OFFLINE


def by_class(order: Iterable[Request]) -> tuple[list[Request], list[Request]]:
    """``order`` split into its online and its offline requests, order kept (``is_online``
    read inline: with a long queue a call per request and class was much of the step)."""
    order = list(order)
    return (
        [r for r in order if r.metadata.priority_class != OFFLINE],
        [r for r in order if r.metadata.priority_class == OFFLINE],
    )


def arrival_key(req: Request) -> tuple[int, float, str]:
    """vLLM's order: by queue, then by arrival (the id breaks ties, so the order is total)."""
    return (QUEUE_RANK[req.status], req.arrival_time, req.request_id)


_by_arrival = attrgetter("arrival_time", "request_id")


def arrival_order(view: SchedulerView) -> list[Request]:
    """The view's candidates in ``arrival_key`` order: the view keeps its queues apart, so
    each is sorted alone (by a key read in C, once per request per step)."""
    return [
        *sorted(view.running, key=_by_arrival),
        *sorted(view.swapped, key=_by_arrival),
        *sorted(view.waiting, key=_by_arrival),
    ]


class ArrivalQueues:
    """``arrival_order`` kept from one step to the next, for an ordering that ranks every
    step: each of the view's queues stays sorted, and a step only takes out the requests
    that left it and puts in those that joined (or sorts it anew, when many moved at once).

    Why: with 1,600 requests waiting, sorting the queues again by (arrival, id) at every step
    was a sixth of Apt-Serve's step, and from one step to the next only the few requests
    that started, finished or were preempted move. Which ones is read in C (sets of the
    requests themselves, compared by identity). A request's arrival and id never change
    while it is live, so a sorted queue less the requests that left is still sorted."""

    # NOTE: past this many joining or leaving at once, one sort of the whole queue is cheaper
    # (each one moves the queue's tail in memory)
    _MOVES = 32

    def __init__(self) -> None:
        self._sorted: list[list[Request]] = [[], [], []]
        self._members: list[set[Request]] = [set(), set(), set()]

    def order(self, view: SchedulerView) -> list[Request]:
        """``arrival_order(view)``, as a new list (the kept queues stay this object's own)."""
        return [
            *self._follow(0, view.running),
            *self._follow(1, view.swapped),
            *self._follow(2, view.waiting),
        ]

    def forget(self, request: Request) -> None:
        """``request`` ended: no queue keeps it (an idle server holds none of its requests)."""
        for members, kept in zip(self._members, self._sorted, strict=True):
            if request in members:
                members.discard(request)
                del kept[bisect_left(kept, _by_arrival(request), key=_by_arrival)]

    def _follow(self, i: int, queue: list[Request]) -> list[Request]:
        """Queue ``i`` kept sorted, brought up to ``queue`` (the view's, in any order)."""
        now, was = set(queue), self._members[i]
        joined = now - was
        left = len(was) - (len(now) - len(joined))
        if len(joined) > self._MOVES or left > self._MOVES:
            kept = self._sorted[i] = sorted(queue, key=_by_arrival)
        else:
            kept = self._sorted[i]
            if left:  # NOTE: each found by bisection
                for req in was - now:
                    del kept[bisect_left(kept, _by_arrival(req), key=_by_arrival)]
            for req in joined:
                insort(kept, req, key=_by_arrival)
        self._members[i] = now
        return kept


_last_token = attrgetter("last_token_time")
_arrival = attrgetter("arrival_time")


def pending_since(requests: list[Request]) -> list[float]:
    """When each request began to wait (``Request.pending_time``: its last token, else its
    arrival), read in C where every one has a token."""
    since = list(map(_last_token, requests))
    if None in since:
        since = [a if s is None else s for s, a in zip(since, map(_arrival, requests), strict=True)]
    return since


def total_pending(since: list[float], now: float) -> float:
    """The pending times at ``now`` of requests waiting ``since`` (``pending_since``), in all,
    as ``math.fsum`` adds them: the same total in whatever order they are read.

    Why not a call of ``pending_time`` per request: Apt-Serve weighs its queues' totals at
    every step, and with 1,600 live requests those calls were a tenth of the step."""
    if since and max(since) > now:  # NOTE: as ``pending_time``, none is negative
        return math.fsum(max(0.0, now - s) for s in since)
    return math.fsum(map(sub, repeat(now, len(since)), since))


def evictable(req: Request, plan: StepPlan) -> bool:
    """On the device and not chosen to run this step: a packer may still evict it."""
    return plan.is_resident(req) and req.request_id not in plan.chosen


def on_device(order: Iterable[Request], plan: StepPlan) -> list[Request]:
    """``order``'s requests that are resident after the plan's moves, order kept.

    NOTE: a waiting request is never resident (it holds no blocks until it runs), and with a
    long queue almost every request is waiting: its status is read before any call."""
    return [r for r in order if r.status is not _WAITING and plan.is_resident(r)]


def residents(order: list[Request], plan: StepPlan) -> list[Request]:
    """``order``'s requests that a packer may continue or evict, order kept."""
    chosen = plan.chosen
    return [r for r in on_device(order, plan) if r.request_id not in chosen]


def outside(order: list[Request], plan: StepPlan) -> Iterator[Request]:
    """``order``'s requests that are neither resident nor moved this step (they may start
    or resume), order kept; lazily, since a packer mostly stops at the first that does not
    fit. The plan's moves between two reads must not change who is resident."""
    for r in order:
        if (r.status is _WAITING or not plan.is_resident(r)) and r.request_id not in plan.moved:
            yield r


def largest(hi: int, fits: Callable[[int], bool], guess: int | None = None) -> int:
    """The largest ``x`` in ``[0, hi]`` with ``fits(x)`` (0 when none above it does), for a
    ``fits`` that holds up to some point and not beyond: a step's predicted time grows with
    the tokens it computes, so the chunk that keeps it within a limit is found by bisection.

    ``guess`` (say, the answer of the step before, which the next one mostly repeats) is
    tried first: when it fits and the one above it does not, two calls of ``fits`` answer;
    else it halves the range the bisection searches. Either way the answer is the same."""
    lo = 0
    if guess is not None and 0 <= guess <= hi:
        if fits(guess):
            if guess == hi or not fits(guess + 1):
                return guess
            lo = guess + 1
        else:
            hi = guess - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
