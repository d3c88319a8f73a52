"""Helpers more than one system's stages use, kept in one place so they cannot drift apart:
vLLM's queue order, the priority classes, which residents a packer may still evict, and the
bisection the step-time limits search with.
"""

from __future__ import annotations

from collections.abc import Callable

from quanta.core.plan import StepPlan
from quanta.core.request import Request, RequestStatus

ONLINE, OFFLINE = "online", "offline"
"""The priority classes (``RequestMetadata.priority_class``) and the lanes named after them."""

QUEUE_RANK = {RequestStatus.RUNNING: 0, RequestStatus.SWAPPED: 1, RequestStatus.WAITING: 2}
"""vLLM's queues in the order they are served: running, then swapped, then waiting."""


def is_online(req: Request) -> bool:
    """Latency-critical work; only requests marked offline are batch work."""
    return req.metadata.priority_class != OFFLINE


def arrival_key(req: Request) -> tuple[int, float, str]:
    """vLLM's order: by queue, then by arrival (the id breaks ties, so the order is total)."""
    return (QUEUE_RANK[req.status], req.arrival_time, req.request_id)


def evictable(req: Request, plan: StepPlan) -> bool:
    """On the device and not chosen to run this step: a packer may still evict it."""
    return plan.is_resident(req) and req.request_id not in plan.chosen


def residents(order: list[Request], plan: StepPlan) -> list[Request]:
    """``order``'s requests that a packer may continue or evict, order kept."""
    return [r for r in order if evictable(r, plan)]


def largest(hi: int, fits: Callable[[int], bool]) -> int:
    """The largest ``x`` in ``[0, hi]`` with ``fits(x)`` (0 when none above it does), for a
    ``fits`` that holds up to some point and not beyond: a step's predicted time grows with
    the tokens it computes, so the chunk that keeps it within a limit is found by bisection."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
