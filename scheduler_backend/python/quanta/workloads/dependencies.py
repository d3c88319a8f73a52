"""Which call of a live replay may be sent when: the dependency of multi-call interactions.

An agent's next call needs the previous call's answer, so a call with an ``interaction_stage``
may be sent only once the call before it in its interaction (the one of the next lower stage)
has finished: at max(its arrival time, that finish + its think time). If a call failed or was
throttled, the rest of its interaction is never sent (abandoned: the user got no answer to
build on). Calls without a stage are free: sent at their arrival time, exactly as before.

Why its own module: the same rule drives ``quanta bench serve``'s asyncio client and Locust's
gevent users, which own their clocks and their waiting; this object only answers "who is
released, and when" as calls end, so it is pure bookkeeping with no clock or I/O. It mirrors
``quanta.sim.interactions.Replay``, which works on the simulator's core ``Request`` objects.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

ABANDONED = "abandoned, never sent"  # the start of an abandoned call's error


class Call(NamedTuple):
    """What the dependency needs of one call of a workload."""

    request_id: str
    arrival_s: float
    interaction_id: str | None = None
    interaction_stage: int | None = None
    think_time_s: float = 0.0


class Interactions:
    """The calls waiting for another: per call, the call of its interaction that follows it.

    ``finished`` releases the follower of a call that succeeded, or abandons the rest of the
    interaction of a call that failed; each call is decided once.
    """

    def __init__(self, calls: Iterable[Call]) -> None:
        chains: dict[str, list[Call]] = defaultdict(list)
        self._calls = list(calls)
        for call in self._calls:
            if call.interaction_id is not None and call.interaction_stage is not None:
                chains[call.interaction_id].append(call)
        self._next: dict[str, Call] = {}  # request id -> the call that waits for it
        for chain in chains.values():
            chain.sort(key=lambda c: c.interaction_stage or 0)  # stable: the given order
            for before, after in itertools.pairwise(chain):
                self._next[before.request_id] = after
        self._waiting = {c.request_id for c in self._next.values()}
        self.abandoned: list[str] = []

    def waits(self, request_id: str) -> bool:
        """``request_id`` may be sent only once ``finished`` releases it."""
        return request_id in self._waiting

    def free(self) -> list[Call]:
        """The calls waiting for nobody, in the given order: send them at ``arrival_s``."""
        return [c for c in self._calls if c.request_id not in self._waiting]

    @property
    def pending(self) -> int:
        """Calls still waiting for an earlier call (neither released nor abandoned)."""
        return len(self._waiting)

    def finished(self, request_id: str, end_s: float, ok: bool) -> dict[str, float | None]:
        """``request_id`` ended at ``end_s``: the calls this decides, each with its send time
        (released) or None (abandoned, because ``ok`` is False); empty for a call that has
        no follower."""
        follower = self._next.pop(request_id, None)
        if follower is None:
            return {}
        if ok:
            self._waiting.discard(follower.request_id)
            return {follower.request_id: max(follower.arrival_s, end_s + follower.think_time_s)}
        decided: dict[str, float | None] = {}
        while follower is not None:
            self._waiting.discard(follower.request_id)
            self.abandoned.append(follower.request_id)
            decided[follower.request_id] = None
            follower = self._next.pop(follower.request_id, None)
        return decided
