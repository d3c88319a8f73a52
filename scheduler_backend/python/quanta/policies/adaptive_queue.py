"""Apt-Serve's queues kept from one step to the next: the waiting and swapped requests a
prefill step may start (``PrefillQueue``), and the residents a decode step continues or
evicts (``ResidentQueue``), grouped so that a step with a long queue works out only the items
its greedy reaches.

Why: the greedy takes items in the order of a bound on their value per block
(``knapsack.item_bounds``), and with 1,600 requests waiting, working out every request's
item and bound at every step was most of the step. Yet a waiting request's item changes
only when its prefix lookup does (the block manager names those: ``hit_changes``), when it
joins or leaves the queue, or when the step's token budget does; its value, its pending
time, grows with the clock alike for all. So requests whose items weigh the same (the same
blocks either way, the same SLO: a *group*) are kept together, each group in the order they
began to wait: within a group the bound only rises with the pending time (the value grows,
and the weight it is divided by can only shrink as hidden becomes worth its price). A step
then merges the groups' heads, lazily, and the walk reads the queue only as far as it goes.
A resident's item changes when it runs (its tokens, its pending time) or its drafts do; the
residents a decode step leaves out are evicted lowest value per block first, which is each
group's runs read from their ends, merged the same way.

A request past its SLO is worth a constant (fallback ``zero``) or a fraction of its pending
time (``decay``): as the clock passes a request's SLO it leaves its group's run of requests
within their SLO (the oldest leave first) for the group's run of late ones, which keeps its
own order (queue order for ``zero``, whose late requests are all worth the same).

Ties go as the list path breaks them, to the request earlier in the lane: this queue is used
only when the lane is ``arrival_order`` (swapped requests, then waiting ones, each by
arrival), so a request's place is its ``_Key``. Pending times that differ by less than a
division's rounding could in principle merge in another order than the list path's; the
tests compare both at every step of seeded workloads.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, ne

from quanta.core.blocks import PrefixHit
from quanta.core.plan import StepPlan
from quanta.core.request import CacheKind, Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.policies.common import arrival_key, total_pending
from quanta.policies.knapsack import NEAR_ZERO, Alone, Item, best_alone

# A request's place in the lane (``common.arrival_key``): its queue, its arrival, its id
_Key = tuple[int, float, str]
QueueKey = _Key
# What an item weighs, as ``AdaptivePacker._shape`` works it out: (tokens, KV blocks, hidden
# blocks, KV open, hidden open, tokens left, its lightest increment, TTFT SLO, TBT SLO)
Shape = tuple[int, int, int, bool, bool, float, int, float | None, float | None]
# A group: what every item of it weighs (KV blocks, hidden blocks, KV open, hidden open, the
# lightest increment, tokens left where they price the hidden option, else None), and the SLO
# its pending time is held to
_GroupKey = tuple[int, int, bool, bool, int, float | None, float | None]

ShapeOf = Callable[[Request, CacheKind | None, PrefixHit | None], Shape]
Progress = tuple[int, int, int, CacheKind | None]
AloneFn = Callable[[int, int | None, int | None], "Alone[_Key] | None"]

_rid = attrgetter("request_id")
_since = attrgetter("since")
_computed = attrgetter("num_computed_tokens")
_all_tokens = attrgetter("all_token_ids")
_drafts = attrgetter("draft_token_ids")


class _Last:
    """A place in reverse: one is less than another when it comes later in the queue, so
    a heap of these pops the latest place first (the list path's ties, ``-index``)."""

    __slots__ = ("key",)

    def __init__(self, key: _Key) -> None:
        self.key = key

    def __lt__(self, other: _Last) -> bool:
        return other.key < self.key


@dataclass(slots=True, eq=False)
class _Entry:
    """A request of the queue, with what its item was worked out from."""

    req: Request
    key: _Key
    since: float  # pending since: its last token, else its arrival
    shape: Shape
    tokens: int  # this step's tokens of it (0: none fit the budget; then in no group)
    progress: object = None  # what the queue compares to tell whether it changed
    group: _Group | None = None
    late: bool = False  # in its group's run of requests past their SLO


@dataclass(slots=True, eq=False)
class _Group:
    """The requests whose items weigh the same, in two runs each in the order of the bound:
    within their SLO by (pending since, place); past it by place (``zero``) or as the other."""

    key: _GroupKey
    on_time: list[tuple[float, _Key, _Entry]] = field(default_factory=list)
    late: list[tuple[float, _Key, _Entry]] = field(default_factory=list)

    def add(self, entry: _Entry, now: float, by_place: bool) -> None:
        slo = self.key[6]
        entry.group = self
        entry.late = slo is not None and max(0.0, now - entry.since) > slo
        if entry.late:
            insort(self.late, _late_key(entry, by_place))
        else:
            insort(self.on_time, (entry.since, entry.key, entry))

    def remove(self, entry: _Entry, by_place: bool) -> None:
        run, item = (
            (self.late, _late_key(entry, by_place))
            if entry.late
            else (self.on_time, (entry.since, entry.key, entry))
        )
        del run[bisect_left(run, item[:2])]
        entry.group = None

    def expire(self, now: float, by_place: bool) -> None:
        """Move the requests the clock took past their SLO to the late run: the oldest."""
        slo, run = self.key[6], self.on_time
        if slo is None:
            return
        gone = 0
        while gone < len(run) and max(0.0, now - run[gone][0]) > slo:
            gone += 1
        for _, _, entry in run[:gone]:
            entry.late = True
            insort(self.late, _late_key(entry, by_place))
        del run[:gone]


def _late_key(entry: _Entry, by_place: bool) -> tuple[float, _Key, _Entry]:
    """A late request's place in its run: by place alone when late ones are all worth the
    same (``zero``; the pending time then reads 0), else as on time."""
    return (0.0 if by_place else entry.since, entry.key, entry)


@dataclass(frozen=True, slots=True)
class Pricing:
    """What turns a request's pending time into its item this step (``AdaptivePacker``)."""

    factor: float  # (|W| + |R|) * rho
    mean: float | None  # the mean output of the requests finished so far
    zero: bool  # fallback ``zero`` (else ``decay``)
    decay: float

    def price(
        self, entry: _Entry, now: float, slo: float | None
    ) -> tuple[float, float, float, float]:
        """``entry``'s value at ``now`` (its SLO: ``slo``), the steps its hidden option is
        charged for, what it is worth at most and its bound (``knapsack.item_bounds``), as
        ``AdaptivePacker._items`` works them out (the tests compare both at every step)."""
        _, m, _, kv, hidden, own_steps, light, _, _ = entry.shape
        p = max(0.0, now - entry.since)
        value = p if slo is None or p <= slo else NEAR_ZERO if self.zero else self.decay * p
        steps = 1.0
        if kv and hidden:
            steps = self.mean if self.mean is not None else own_steps
        hidden_value = value - self.factor * m * steps
        most = max(value, hidden_value, NEAR_ZERO)
        if kv and hidden_value <= 0:  # NOTE: hidden is no option: KV is its one increment
            light = m
        return value, steps, most, -(most / light) if light > 0 else -math.inf


def _item(entry: _Entry, value: float, steps: float) -> Item:
    """``entry``'s knapsack item, worth ``value``, its hidden option charged ``steps``."""
    _, m, half, kv, hidden, _, _, _, _ = entry.shape
    return Item(value, m, half, kv, hidden, entry.tokens, steps)


class _KeptQueue:
    """Candidates of one kind of Apt-Serve step kept across steps, grouped by what their
    items weigh (module docstring); a subclass says who they are and when one changed.

    ``walk`` gives what ``knapsack.greedy_walk`` reads. Whatever the queue cannot follow
    (the budget or the pricing basis changed, its record of changes ran out) makes it start
    over."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._groups: dict[_GroupKey, _Group] = {}
        self._setting: tuple[object, ...] | None = None  # what the shapes were worked out with
        self._by_place = True
        self._own_steps = False

    def __len__(self) -> int:
        return len(self._entries)

    def total_pending(self, now: float) -> float:
        """The queue's pending time in all, as ``math.fsum`` adds it (in any order)."""
        return total_pending(list(map(_since, self._entries.values())), now)

    def request(self, key: _Key) -> Request:
        return self._entries[key[2]].req

    def sync(
        self,
        view: SchedulerView,
        plan: StepPlan,
        shape_of: ShapeOf,
        *,
        basis: tuple[object, ...],
        by_place: bool,
        own_steps: bool,
    ) -> None:
        """Follow the view: the requests that joined or left the queue, or changed, are
        worked out (``shape_of``) again; the others stand. ``basis`` is what every shape was
        worked out with (the step's token budget, whether chunks are taken): when it
        differs from the last step's, all are. ``by_place``: late requests are all worth
        the same (fallback ``zero``). ``own_steps``: a request's own tokens left price its
        hidden option (no request has finished yet)."""
        setting = (basis, by_place, own_steps)
        if setting != self._setting:
            self._forget()
        self._setting, self._by_place, self._own_steps = setting, by_place, own_steps
        self._follow(view, plan, shape_of)

    def _forget(self) -> None:
        self._entries.clear()
        self._groups.clear()

    def forget(self, request: Request) -> None:
        """``request`` ended: the queue keeps nothing of it (an idle server holds none of
        its requests), and the next ``sync`` reads it as one that left."""
        entry = self._entries.pop(request.request_id, None)
        if entry is not None:
            self._drop(entry)

    def _follow(self, view: SchedulerView, plan: StepPlan, shape_of: ShapeOf) -> None:
        """``sync`` of the queue's own requests, once the setting holds."""
        raise NotImplementedError

    def walk(
        self, now: float, pricing: Pricing, chunked: bool
    ) -> tuple[Iterator[tuple[float, _Key, Item]], int, float, AloneFn]:
        """What ``greedy_walk`` reads: the items in the order of (bound, place), lazily;
        the fewest tokens any asks; the most any is worth; and the option worth most
        alone."""
        by_place = self._by_place
        # NOTE: a run's next request, priced: (bound, place, run, index, value, steps); its
        # item is made only if the walk takes it
        heads: list[tuple[float, _Key, int, int, float, float]] = []
        runs: list[tuple[list[tuple[float, _Key, _Entry]], float | None]] = []
        most = 0.0
        for group in self._groups.values():
            slo, on_time = group.key[6], group.on_time
            if slo is not None and on_time and now - on_time[0][0] > slo:
                group.expire(now, by_place)  # NOTE: the call only where someone is late
            for run in (on_time, group.late):
                if run:
                    entry = run[0][2]
                    value, steps, worth, bound = pricing.price(entry, now, slo)
                    most = max(most, worth)
                    heads.append((bound, entry.key, len(runs), 0, value, steps))
                    runs.append((run, slo))
        firsts = [(key, runs[r][0][0][2], value, steps) for _, key, r, _, value, steps in heads]
        heapq.heapify(heads)
        # NOTE: every item asks a token at least, and chunked, that is all the walk's
        # stopping rule reads of the fewest (``knapsack._room_for_any``)
        least = 1 if chunked and heads else self._least()

        def items() -> Iterator[tuple[float, _Key, Item]]:
            while heads:
                bound, key, r, i, value, steps = heads[0]
                run, slo = runs[r]
                item = _item(run[i][2], value, steps)
                if i + 1 < len(run):
                    entry = run[i + 1][2]
                    v, s, _, b = pricing.price(entry, now, slo)
                    heapq.heapreplace(heads, (b, entry.key, r, i + 1, v, s))
                else:
                    heapq.heappop(heads)
                yield bound, key, item

        def alone(memory: int, seats: int | None, tokens: int | None) -> Alone[_Key] | None:
            # NOTE: a run's first request is worth the most of it, and first on ties of its
            # pending time; but options worth NEAR_ZERO tie across pending times, and then
            # the first in place among all of them is taken: read them all
            factor = pricing.factor
            tops = sorted((key, _item(e, value, steps)) for key, e, value, steps in firsts)
            best = best_alone(tops, factor, memory, seats, tokens, chunked)
            if best is None or best[0] > NEAR_ZERO:
                return best
            every = sorted(
                (e.key, _item(e, *pricing.price(e, now, e.group.key[6])[:2]))
                for e in self._entries.values()
                if e.group is not None
            )
            return best_alone(every, factor, memory, seats, tokens, chunked)

        return items(), least, most, alone

    # -- helpers -------------------------------------------------------------------------
    def _least(self) -> int:
        """The fewest tokens an item of the queue asks (0: there is none)."""
        return min((e.tokens for e in self._entries.values() if e.group is not None), default=0)

    @staticmethod
    def _shape_now(req: Request, plan: StepPlan, shape_of: ShapeOf) -> Shape:
        """``shape_of`` the request, from what it holds and its prefix hit now."""
        rid = req.request_id
        held = plan.pool.kind_of(rid)
        waiting = req.status is RequestStatus.WAITING
        return shape_of(req, held, plan.pool.prefix_hit(rid) if held is None and waiting else None)

    def _enter(
        self, req: Request, key: _Key, shape: Shape, now: float, progress: object = None
    ) -> None:
        since = req.last_token_time if req.last_token_time is not None else req.arrival_time
        entry = self._entries[req.request_id] = _Entry(req, key, since, shape, shape[0], progress)
        self._place(entry, now)

    def _reshape(self, entry: _Entry, shape: Shape, now: float) -> None:
        """``entry``'s item weighs ``shape`` now; its place in the queue is as it was."""
        self._drop(entry)
        entry.shape, entry.tokens = shape, shape[0]
        self._place(entry, now)

    def _place(self, entry: _Entry, now: float) -> None:
        """Put ``entry`` in the group its shape and SLO make (none: no tokens this step)."""
        n, m, half, kv, hidden, own, light, ttft, tbt = entry.shape
        if n == 0:
            return
        slo = ttft if entry.req.last_token_time is None else tbt
        steps = own if kv and hidden and self._own_steps else None
        gkey = (m, half, kv, hidden, light, steps, slo)
        group = self._groups.get(gkey)
        if group is None:
            group = self._groups[gkey] = _Group(gkey)
        group.add(entry, now, self._by_place)

    def _drop(self, entry: _Entry) -> None:
        group = entry.group
        if group is None:
            return
        group.remove(entry, self._by_place)
        if not group.on_time and not group.late:
            del self._groups[group.key]


class PrefillQueue(_KeptQueue):
    """The waiting and swapped requests Apt-Serve's prefill steps may start.

    A request's item changes only when its prefix lookup does (``PoolView.hit_changes``
    names those), or when it joins, leaves or moves within the queue."""

    def __init__(self) -> None:
        super().__init__()
        # the requests of the entries, as objects: which joined or left is found by set
        # operations on the objects themselves, in C, without reading each one's id
        self._queued: set[Request] = set()
        self._swapped: set[str] = set()  # the entries of swapped requests
        self._version = -1  # of the lookups it has read (``PoolView.hit_changes``)

    def _forget(self) -> None:
        super()._forget()
        self._queued = set()
        self._swapped.clear()

    def _follow(self, view: SchedulerView, plan: StepPlan, shape_of: ShapeOf) -> None:
        """Requests that joined or left, moved between the swapped and the waiting, or
        whose lookup changed (every one, when the record of lookups ran out)."""
        version, changed = plan.pool.hit_changes(self._version)
        self._version = version
        if changed is None:  # NOTE: too long ago to tell what changed: start over
            self._forget()
            changed = []
        entries, swapped, now = self._entries, self._swapped, view.now
        swapped_now = set(view.swapped)
        queued = set(view.waiting) | swapped_now
        for req in self._queued - queued:
            self._drop(entries.pop(req.request_id))
        joined = queued - self._queued
        self._queued = queued
        # NOTE: swapped, then dropped to waiting (or the other way): its place changed
        swapped_ids = set(map(_rid, swapped_now))
        moved = {r for r in swapped if r not in swapped_ids} | {
            r.request_id for r in swapped_now if r not in joined and r.request_id not in swapped
        }
        for rid in moved:
            req = entries[rid].req
            self._drop(entries.pop(rid))
            self._add(req, self._shape_now(req, plan, shape_of), now)
        for rid in dict.fromkeys(changed):
            entry = entries.get(rid)
            if entry is None or rid in moved:
                continue
            shape = self._shape_now(entry.req, plan, shape_of)
            if shape != entry.shape:
                self._reshape(entry, shape, now)
        for req in joined:
            self._add(req, self._shape_now(req, plan, shape_of), now)

    def _add(self, req: Request, shape: Shape, now: float, progress: object = None) -> None:
        waiting = req.status is RequestStatus.WAITING
        if not waiting:
            self._swapped.add(req.request_id)
        self._enter(req, arrival_key(req), shape, now)

    def _drop(self, entry: _Entry) -> None:
        self._swapped.discard(entry.req.request_id)
        super()._drop(entry)

    def forget(self, request: Request) -> None:
        super().forget(request)
        self._queued.discard(request)


class ResidentQueue(_KeptQueue):
    """The residents Apt-Serve's decode steps continue or evict: the running requests.

    A resident's item changes when it runs (its tokens and pending time), and, with
    speculation, when its drafts do: what each has computed, holds and proposes is compared
    with the step before, in one pass read in C when nobody joined or left."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: list[str] = []  # the residents of the last step, in the view's order
        # and what each had computed, held and proposed, and the kind of cache it held: a
        # resident switched to hidden and restarted may come back with as many tokens
        # computed, between two steps that walked the residents
        self._progress: list[Progress] = []

    def _forget(self) -> None:
        super()._forget()
        self._ids, self._progress = [], []

    def _follow(self, view: SchedulerView, plan: StepPlan, shape_of: ShapeOf) -> None:
        """Residents that joined or left, or whose progress or cache changed."""
        running, entries, now = view.running, self._entries, view.now
        ids = list(map(_rid, running))
        kinds = list(map(plan.pool.kind_of, ids))
        progress = list(
            zip(
                map(_computed, running),
                map(len, map(_all_tokens, running)),
                map(len, map(_drafts, running)),
                kinds,
                strict=True,
            )
        )
        if ids == self._ids:
            changed = compress(range(len(ids)), map(ne, progress, self._progress))
            redo = [(running[i], progress[i]) for i in changed]
        else:
            for rid in entries.keys() - set(ids):
                self._drop(entries.pop(rid))
            redo = [
                (r, p)
                for r, p in zip(running, progress, strict=True)
                if (e := entries.get(r.request_id)) is None or e.progress != p
            ]
        self._ids, self._progress = ids, progress
        for req, p in redo:
            old = entries.pop(req.request_id, None)
            if old is not None:
                self._drop(old)
            self._add(req, self._shape_now(req, plan, shape_of), now, p)

    def _add(self, req: Request, shape: Shape, now: float, progress: object = None) -> None:
        self._enter(req, arrival_key(req), shape, now, progress)

    def left_out(self, now: float, pricing: Pricing, chosen: Container[_Key]) -> Iterator[_Key]:
        """The residents not ``chosen``, lowest value per KV block first, the later in the
        queue first on ties (``AdaptivePacker._decode``'s eviction order), lazily: each
        run of a group read from its end."""
        heads: list[tuple[float, _Last, int, int]] = []
        runs: list[tuple[list[tuple[float, _Key, _Entry]], float | None]] = []
        for group in self._groups.values():
            slo = group.key[6]
            for run in (group.on_time, group.late):
                if run:
                    entry = run[-1][2]
                    ratio = pricing.price(entry, now, slo)[0] / group.key[0]
                    heads.append((ratio, _Last(entry.key), len(runs), len(run) - 1))
                    runs.append((run, slo))
        heapq.heapify(heads)
        while heads:
            _, last, r, i = heads[0]
            if i:
                run, slo = runs[r]
                entry = run[i - 1][2]
                ratio = pricing.price(entry, now, slo)[0] / entry.shape[1]
                heapq.heapreplace(heads, (ratio, _Last(entry.key), r, i - 1))
            else:
                heapq.heappop(heads)
            if last.key not in chosen:
                yield last.key
