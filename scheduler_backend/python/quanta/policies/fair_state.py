"""Where fairness state lives: service counters, throttling windows and open interactions.

One server ranks tenants by the service it gave them. Several replicas behind one router
each rank by their own counters. A tenant spread over every replica then gets its fair share
on each, which adds up to more than its share of the cluster, while a tenant that only
reaches some replicas gets less. No anchor system keeps fair shares across replicas; the
VTC paper leaves it as future work. Here the fair policies (``fair``, ``wsc``, ``vtc``,
``rpm``) take ``state_url``:

- none (the default): the policy's own counters, in this process, as before;
- ``memory://NAME``: one state shared by every policy of this process that names it (the
  simulator's replicas on one clock);
- ``redis://HOST:PORT/DB``: a Redis server shared by every replica (``fair_redis.py``),
  updated atomically by Lua scripts.

This module holds what every store shares (the protocols, the local state) and the URL check;
``fair_stores.py`` picks the store a URL names, so the Redis store can build on the local one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

Lift = Literal["min", "max"]
"""Where a user who (re)enters the queue starts: the least-served active user's counter
(VTC's rule) or the most-served's (a name nobody vouches for; ``ServiceCounters``)."""
# Counters of users with no live request are swept once this many are held, and again each
# time the table has doubled since (only those a lift would raise anyway: nothing a ranking
# reads is lost); amortized, a sweep costs O(1) per entry.
SWEEP_SLACK = 1024


class Counters(Protocol):
    """Service received per user, with VTC's lift rule (``ServiceCounters``)."""

    def enter(self, user: str, lift: Lift = "min") -> None: ...
    def leave(self, user: str) -> None: ...
    def add(self, user: str, amount: float) -> None: ...
    def of(self, user: str) -> float: ...
    def sync(self) -> None:
        """Make ``of`` current (a shared store reads once a step, not once a request)."""
        ...


class Windows(Protocol):
    """Arrivals per key over a sliding window of ``window_s``."""

    window_s: float

    def note(self, key: str, now: float) -> int:
        """Record an arrival; the count in the window, this one included."""
        ...


class OpenInteractions(Protocol):
    """Interactions that have begun and not yet answered, with when each was last seen."""

    def open(self, interaction: str, user: str, now: float) -> None: ...
    def seen(self, interaction: str, now: float) -> None: ...
    def close(self, interaction: str) -> None: ...
    def is_open(self, interaction: str, now: float) -> bool: ...
    def expire(self, now: float) -> None: ...


class ServiceCounters:
    """Service received per user, with VTC's lift rule for users who (re)enter the queue.

    A user with no live request whose counter stayed low while away would otherwise be owed
    all of that absence when it comes back; the lift caps that credit at the least-served
    active user's counter (or, when nobody is active, the last user to leave).

    That cap trusts names. A name never seen before (or swept, below) starts at the same
    floor, level with the least-served tenant already waiting, so a client that sends each
    request under a fresh name is always first in line: each name is one more tenant owed
    a share. ``lift="max"`` starts such a user at the most-served active user's counter:
    it cannot rank ahead of anyone waiting when it arrives. That is still not enough where
    service is counted as it is computed (WSC): a waiting newcomer's counter stands still
    while the tenants being served pass it, so each fresh name soon ranks ahead of them
    again and still claims a tenant's share; in the simulator a steady tenant fares worse
    than under FCFS either way (``docs/results/fairserve.md``). It also costs an honest newcomer
    up to the spread of the active counters. So the fair policies, by default, count every
    unauthenticated request as one tenant (``fair.POOL``) and lift only real tenants.

    Counters of users with no live request that are at or below the least-served active
    user's are swept as the table grows (``SWEEP_SLACK``): any lift raises them to that
    floor again, so forgetting them changes no ranking and a stream of fresh names does not
    grow the table without bound.
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._live: dict[str, int] = {}  # user -> live requests
        self._last_exit: str | None = None
        self._sweep_at = SWEEP_SLACK

    def enter(self, user: str, lift: Lift = "min") -> None:
        """A request of ``user`` arrived; lift the counter when the user was not active."""
        if self._live.get(user, 0) == 0:
            active = [self.counters[u] for u, n in self._live.items() if n > 0]
            if active:
                floor = max(active) if lift == "max" else min(active)
            else:
                floor = self.counters.get(self._last_exit or "", 0.0)
            self.counters[user] = max(self.counters.get(user, 0.0), floor)
        self._live[user] = self._live.get(user, 0) + 1
        if len(self.counters) > self._sweep_at:
            self._sweep()
            self._sweep_at = max(SWEEP_SLACK, 2 * len(self.counters))

    def _sweep(self) -> None:
        """Forget the inactive users a lift would raise to the active floor anyway."""
        active = [self.counters[u] for u, n in self._live.items() if n > 0]
        if not active:
            return
        floor = min(active)
        stale = [
            u
            for u, c in self.counters.items()
            if c <= floor and self._live.get(u, 0) == 0 and u != self._last_exit
        ]
        for u in stale:
            del self.counters[u]

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

    def sync(self) -> None:
        """Nothing to fetch: this object is the state."""


class SlidingWindows:
    """Arrival times per key over a sliding window."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._times: dict[str, deque[float]] = {}

    def count(self, key: str, now: float) -> int:
        times = self._times.setdefault(key, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return len(times)

    def note(self, key: str, now: float) -> int:
        n = self.count(key, now) + 1
        self._times[key].append(now)
        return n


@dataclass(slots=True)
class _Open:
    user: str
    last_seen: float


class LocalInteractions:
    """Open interactions in this process; one goes idle after ``idle_timeout_s``."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._open: dict[str, _Open] = {}

    def open(self, interaction: str, user: str, now: float) -> None:
        self._open[interaction] = _Open(user, now)

    def seen(self, interaction: str, now: float) -> None:
        if interaction in self._open:
            self._open[interaction].last_seen = now

    def close(self, interaction: str) -> None:
        self._open.pop(interaction, None)

    def is_open(self, interaction: str, now: float) -> bool:
        entry = self._open.get(interaction)
        return entry is not None and now - entry.last_seen <= self.idle_timeout_s

    def expire(self, now: float) -> None:
        stale = [k for k, v in self._open.items() if now - v.last_seen > self.idle_timeout_s]
        for k in stale:
            del self._open[k]


class FairnessState(Protocol):
    """What the fair policies keep, wherever it is kept; ``errors`` counts the operations a
    shared store could not do (they fell back to this process's view)."""

    errors: int

    @property
    def service(self) -> Counters: ...
    def windows(self, name: str, window_s: float) -> Windows: ...
    def interactions(self, idle_timeout_s: float) -> OpenInteractions: ...


@dataclass
class LocalState:
    """State in this process: a policy's own (no URL) or shared in it (``memory://``)."""

    service: ServiceCounters = field(default_factory=ServiceCounters)
    errors: int = 0  # NOTE: nothing here can fail
    _windows: dict[tuple[str, float], SlidingWindows] = field(default_factory=dict)
    _interactions: dict[float, LocalInteractions] = field(default_factory=dict)

    def windows(self, name: str, window_s: float) -> SlidingWindows:
        return self._windows.setdefault((name, window_s), SlidingWindows(window_s))

    def interactions(self, idle_timeout_s: float) -> LocalInteractions:
        return self._interactions.setdefault(idle_timeout_s, LocalInteractions(idle_timeout_s))


def check_state_url(url: str | None) -> str | None:
    """A pydantic validator's body: the URL's scheme is one ``fair_stores.py`` serves."""
    if url is not None and not url.startswith(("memory://", "redis://", "rediss://", "unix://")):
        raise ValueError(f"state_url must be memory://NAME or redis://HOST:PORT/DB, got {url!r}")
    return url
