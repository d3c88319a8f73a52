"""Which multi-call interactions are open, and the per-user service counters fairness
orders by.

An interaction is one user query served by several calls (agents). A call continues an
interaction when it says so (``interaction_stage > 0``) or when an earlier call with the same
``interaction_id`` was seen and the interaction has neither answered (its
``interaction_last`` call finished) nor gone idle for ``idle_timeout_s``. FairServe never
throttles such a call: the tokens already spent on the interaction would be wasted.
"""

from __future__ import annotations

from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.policies.fair_state import (
    LocalInteractions,
    OpenInteractions,
    ServiceCounters,  # NOTE: re-exported: it lived here before state could be shared
)
from quanta.policies.stages import Observer

__all__ = ["InteractionTracker", "ServiceCounters"]


class InteractionTracker(Observer):
    """Open interactions, learned from the calls that pass through admission; kept in
    ``store`` (this tracker's own unless a shared one is given, ``fair_state.py``)."""

    def __init__(self, idle_timeout_s: float, store: OpenInteractions | None = None) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"interaction_timeout_s must be > 0, got {idle_timeout_s}")
        self.idle_timeout_s = idle_timeout_s
        self.store = store if store is not None else LocalInteractions(idle_timeout_s)

    def continues(self, request: Request, now: float) -> bool:
        """True when ``request`` is a later call of an interaction that is still open."""
        meta = request.metadata
        if meta.interaction_stage is not None and meta.interaction_stage > 0:
            return True
        return meta.interaction_id is not None and self.store.is_open(meta.interaction_id, now)

    def on_admit(self, request: Request, view: SchedulerView) -> None:
        iid = request.metadata.interaction_id
        if iid is not None:
            self.store.open(iid, request.metadata.tenant, view.now)
        self.store.expire(view.now)

    def on_finish(self, request: Request) -> None:
        """The last call answered, or any call failed: the interaction is over either way
        (a failed call leaves the user without an answer, so nothing follows it)."""
        iid = request.metadata.interaction_id
        if iid is None:
            return
        ok = request.status.completed
        if request.metadata.interaction_last or not ok:
            self.store.close(iid)
        elif request.finish_time is not None:
            self.store.seen(iid, request.finish_time)
