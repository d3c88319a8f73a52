"""Which multi-call interactions are open, and the per-user service counters fairness
orders by.

An interaction is one user query served by several calls (agents). A call continues an
interaction when it says so (``interaction_stage > 0``) or when an earlier call with the same
``interaction_id`` was seen and the interaction has neither answered (its
``interaction_last`` call finished) nor gone idle for ``idle_timeout_s``. FairServe never
throttles such a call: the tokens already spent on the interaction would be wasted.
"""

from __future__ import annotations

from dataclasses import dataclass

from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.policies.stages import Observer


@dataclass(slots=True)
class _Open:
    user: str
    last_seen: float


class InteractionTracker(Observer):
    """Open interactions, learned from the calls that pass through admission."""

    def __init__(self, idle_timeout_s: float) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"interaction_timeout_s must be > 0, got {idle_timeout_s}")
        self.idle_timeout_s = idle_timeout_s
        self._open: dict[str, _Open] = {}

    def continues(self, request: Request, now: float) -> bool:
        """True when ``request`` is a later call of an interaction that is still open."""
        meta = request.metadata
        if meta.interaction_stage is not None and meta.interaction_stage > 0:
            return True
        entry = self._open.get(meta.interaction_id) if meta.interaction_id else None
        return entry is not None and now - entry.last_seen <= self.idle_timeout_s

    def on_admit(self, request: Request, view: SchedulerView) -> None:
        rid = request.metadata.interaction_id
        if rid is not None:
            self._open[rid] = _Open(request.metadata.tenant, view.now)
        self._expire(view.now)

    def on_finish(self, request: Request) -> None:
        """The last call answered, or any call failed: the interaction is over either way
        (a failed call leaves the user without an answer, so nothing follows it)."""
        rid = request.metadata.interaction_id
        if rid is None or rid not in self._open:
            return
        ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if request.metadata.interaction_last or not ok:
            del self._open[rid]
        elif request.finish_time is not None:
            self._open[rid].last_seen = request.finish_time

    def _expire(self, now: float) -> None:
        stale = [k for k, v in self._open.items() if now - v.last_seen > self.idle_timeout_s]
        for k in stale:
            del self._open[k]


class ServiceCounters:
    """Service received per user, with VTC's lift rule for users who (re)enter the queue.

    A user with no live request whose counter stayed low while away would otherwise be owed
    all of that absence when it comes back; the lift caps that credit at the least-served
    active user's counter (or, when nobody is active, the last user to leave).
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._live: dict[str, int] = {}  # user -> live requests
        self._last_exit: str | None = None

    def enter(self, user: str) -> None:
        """A request of ``user`` arrived; lift the counter when the user was not active."""
        if self._live.get(user, 0) == 0:
            active = [self.counters[u] for u, n in self._live.items() if n > 0]
            floor = min(active) if active else self.counters.get(self._last_exit or "", 0.0)
            self.counters[user] = max(self.counters.get(user, 0.0), floor)
        self._live[user] = self._live.get(user, 0) + 1

    def leave(self, user: str) -> None:
        left = self._live.get(user, 0) - 1
        if left <= 0:
            self._live.pop(user, None)
            self._last_exit = user
        else:
            self._live[user] = left

    def add(self, user: str, amount: float) -> None:
        self.counters[user] = self.counters.get(user, 0.0) + amount

    def of(self, user: str) -> float:
        return self.counters.get(user, 0.0)
