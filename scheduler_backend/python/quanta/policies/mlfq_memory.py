"""FastServe's KV-cache management (§4.2): where preempted jobs' KV lives, and when it moves.

Three strategies, one per ``memory`` setting of the priority policies:

- ``proactive`` (FastServe): the host tier is a second home. A reserve of free device blocks,
  sized from recent arrivals, is kept for new jobs; when the device falls below it, idle jobs
  with the largest ENST are swapped out, and when there is room above it, host-resident jobs
  with the smallest ENST are swapped in *before* they are scheduled, so the copy overlaps the
  current iteration instead of stalling the next one.
- ``reactive``: swap out only when the batch needs blocks, swap in only when a job runs.
- ``recompute``: drop the KV of evicted jobs; they prefill prompt + output again.

Every strategy falls back to recompute when the host tier is full (``StepPlan.evict``), so no
decision ever waits on host space: the top job always fits once everything below it is gone.

Moves weigh their cost: a proactive swap-out or an exchange happens only when the job that
leaves is not expected back (by ENST) before both copies could be made, so the same jobs do
not ping-pong between tiers step after step, and all proactive traffic of one step fits in
what the host link copies during the shortest iteration.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Protocol

from quanta.core.decision import PreemptMode
from quanta.core.plan import StepPlan
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.common import on_device
from quanta.policies.stages import Placement, Ranking, Turns

MEMORY_MODES = ("proactive", "reactive", "recompute")


def mlfq_enst(
    levels: Mapping[str, int],
    t_promote: Mapping[str, float],
    quanta: Sequence[float],
    batch_size: int,
) -> dict[str, float]:
    """Estimated next scheduled time of every job (FastServe §4.2).

    ENST(i) = min(T_promote(i), T_execute(i)) with T_promote the time left until starvation
    promotion and T_execute(i) = (1/B) * sum over higher-priority jobs j of
    sum_{i.prio < k <= j.prio} q_k: each j is assumed to use every quantum from its own queue
    down to i's before i runs (``execute_times``).
    """
    t_exec = execute_times(levels.values(), quanta, batch_size)
    return {rid: min(t_promote[rid], t_exec[level]) for rid, level in levels.items()}


def execute_times(levels: Iterable[int], quanta: Sequence[float], batch_size: int) -> list[float]:
    """T_execute of a job in each queue, given every job's queue (``mlfq_enst``): per level
    with prefix sums, O(jobs + levels)."""
    counted = Counter(levels)  # NOTE: counted in C: one entry per waiting job
    counts = [counted.get(level, 0) for level in range(len(quanta))]
    prefix = [0.0]  # prefix[L] = q_0 + ... + q_{L-1}
    for q in quanta:
        prefix.append(prefix[-1] + q)
    t_exec: list[float] = []
    above = 0  # jobs in queues above L
    above_prefix = 0.0  # sum over those jobs of prefix[their level]
    for level in range(len(quanta)):
        t_exec.append((prefix[level] * above - above_prefix) / batch_size)
        above += counts[level]
        above_prefix += counts[level] * prefix[level]
    return t_exec


class EnstJob(Protocol):
    """What ``Enst`` reads of a job: its queue and when it last ran."""

    request: Request
    level: int
    last_run: float


class Enst(Mapping[str, float]):
    """``mlfq_enst`` of a ranking's jobs, each worked out when read: a step reads the ENST
    of its residents and of the few jobs its proactive moves consider, and ``first`` finds
    the idle jobs due next without reading the rest of a long queue.

    ``jobs`` are the ranking's jobs in order, and ``of`` finds a request's job (the
    ordering's own mapping, read as it stands: nothing is copied per step); ``by_queue``
    says the ranking goes queue by queue (else the jobs' levels are read to tell). T_promote
    of a job is ``max(next_check, limit - (now - last_run))``."""

    __slots__ = ("_floor", "_jobs", "_limit", "_next_check", "_now", "_of", "_sorted", "_t_exec")

    def __init__(
        self,
        jobs: Sequence[EnstJob],
        of: Mapping[str, EnstJob],
        t_exec: Sequence[float],
        *,
        next_check: float,
        limit: float,
        now: float,
        by_queue: bool = False,
    ) -> None:
        self._jobs, self._of = jobs, of
        self._t_exec, self._next_check, self._limit, self._now = t_exec, next_check, limit, now
        # the least T_execute of a queue or any below it
        self._floor = [min(t_exec[level:]) for level in range(len(t_exec))]
        if by_queue:
            self._sorted = True
        else:
            levels = list(map(_level, jobs))
            self._sorted = levels == sorted(levels)

    def __getitem__(self, request_id: str) -> float:
        job = self._of[request_id]
        t_promote = max(self._next_check, self._limit - (self._now - job.last_run))
        return min(t_promote, self._t_exec[job.level])

    def __iter__(self) -> Iterator[str]:
        return map(_job_id, self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def first(self, idle: Sequence[Request], k: int, pos: Mapping[str, int]) -> list[Request]:
        """The ``k`` requests of ``idle`` (in ranking order) of smallest (ENST, position),
        in that order.

        NOTE: a job's ENST is at least ``min(next_check, T_execute of its queue)``, and with
        the ranking by queue every job further on is in that queue or one below; so once
        ``min(next_check, the least T_execute from its queue down)`` reaches the k-th
        smallest ENST read so far, no job further on can be among the first k (one with the
        same ENST comes later in the ranking)."""
        if k <= 0:
            return []
        if not self._sorted:
            ids = list(map(_request_id, idle))
            keys = zip(map(self.__getitem__, ids), map(pos.__getitem__, ids), idle, strict=True)
            return [r for _, _, r in heapq.nsmallest(k, keys)]
        kept: list[tuple[float, int, int]] = []  # the k smallest so far, negated: a max-heap
        for j, req in enumerate(idle):
            rid = req.request_id
            bound = min(self._next_check, self._floor[self._of[rid].level])
            if len(kept) == k and bound >= -kept[0][0]:
                break
            key = (-self[rid], -pos[rid], j)
            if len(kept) < k:
                heapq.heappush(kept, key)
            elif key > kept[0]:
                heapq.heapreplace(kept, key)
        return [idle[j] for _, _, j in sorted(kept, reverse=True)]


_request_id = attrgetter("request_id")
_job_id = attrgetter("request.request_id")
_level = attrgetter("level")


class _Rank(Mapping[str, tuple[float, int]]):
    """(ENST, position) of a request of the ranking, read on demand: proactive moves ask
    for the few requests they consider, not for the whole queue."""

    __slots__ = ("_enst", "_pos")

    def __init__(self, enst: Mapping[str, float], pos: Mapping[str, int]) -> None:
        self._enst, self._pos = enst, pos

    def __getitem__(self, request_id: str) -> tuple[float, int]:
        return self._enst[request_id], self._pos[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pos)

    def __len__(self) -> int:
        return len(self._pos)


class ReactiveSwap(Placement):
    """Swap only when forced: eviction to host, swap-in when the job is chosen."""

    name = "reactive"
    evict_mode = PreemptMode.SWAP

    def victims(self, ranking: Ranking, plan: StepPlan) -> list[Request]:
        """Residents, largest ENST first, lower priority breaking ties."""
        pos = ranking.position()
        residents = on_device(ranking.order, plan)
        return sorted(
            residents, key=lambda r: (-ranking.next_turn[r.request_id], -pos[r.request_id])
        )


class Recompute(ReactiveSwap):
    """Evicted jobs lose their KV and prefill again when they next run."""

    name = "recompute"
    evict_mode = PreemptMode.RECOMPUTE


class ProactiveSwap(ReactiveSwap):
    """Keeps a reserve of free device blocks and moves KV ahead of need, in ENST order.

    After the batch is chosen: (1) below the reserve, idle residents leave for the host,
    largest ENST first; (2) the host-resident jobs among the next MaxBatchSize in priority
    order (the public code's swap quota) come back, smallest ENST first, into room above the
    reserve or in exchange for idle residents with a larger ENST. Both are limited to what the
    host link copies during one iteration, so they hide behind compute, and a job moves only
    when it is not expected to run before its copies there and back would be done.
    """

    name = "proactive"

    def __init__(
        self,
        *,
        max_batch_size: int,
        cost: CostModel,
        reserve_window: float,
        min_reserve_blocks: int | None,
        max_reserve_fraction: float,
    ) -> None:
        if reserve_window < 0 or not 0 <= max_reserve_fraction <= 1:
            raise ValueError("need reserve_window >= 0 and 0 <= max_reserve_fraction <= 1")
        self.max_batch_size = max_batch_size
        self.cost = cost
        self.reserve_window = reserve_window
        # Public FastServe code keeps max(max_batch_size, a minimum) blocks free.
        self.min_reserve_blocks = (
            max_batch_size if min_reserve_blocks is None else min_reserve_blocks
        )
        self.max_reserve_fraction = max_reserve_fraction
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, prompt blocks)
        self._recent_blocks = 0

    def on_admit(self, request: Request, view: SchedulerView) -> None:
        blocks = view.pool.blocks_for(request.num_prompt_tokens)
        self._arrivals.append((view.now, blocks))
        self._recent_blocks += blocks

    def reserve(self, view: SchedulerView) -> int:
        """Blocks to keep free: what arrived over the last window is what a burst may bring
        in the next one, at least the minimum, at most a fraction of the pool."""
        while self._arrivals and self._arrivals[0][0] < view.now - self.reserve_window:
            self._recent_blocks -= self._arrivals.popleft()[1]
        wanted = max(self.min_reserve_blocks, self._recent_blocks)
        return min(wanted, int(view.total_device_blocks * self.max_reserve_fraction))

    def after_batch(self, view: SchedulerView, plan: StepPlan, ranking: Ranking) -> None:
        reserve = self.reserve(view)
        enst, pos = ranking.next_turn, ranking.position()
        rank = _Rank(enst, pos)
        chosen = plan.chosen
        idle = [r for r in ranking.order if r.request_id not in chosen]
        # NOTE: the first MaxBatchSize of the idle by (ENST, position): with turns by
        # position the idle are in that order already, else the keys are read in C (with a
        # long queue, a key call per request was much of the step)
        if isinstance(enst, Turns):
            upcoming = idle[: self.max_batch_size]
        elif isinstance(enst, Enst):
            upcoming = enst.first(idle, self.max_batch_size, pos)
        else:
            ids = list(map(_request_id, idle))
            keys = zip(map(enst.__getitem__, ids), map(pos.__getitem__, ids), idle, strict=True)
            upcoming = [r for _, _, r in heapq.nsmallest(self.max_batch_size, keys)]
        keep = {r.request_id for r in upcoming}
        victims = [  # idle residents, largest (ENST, position) first
            r
            for r in on_device(ranking.order, plan)
            if r.request_id not in chosen
            and r.request_id not in plan.moved
            and r.request_id not in keep
            and plan.held(r) > 0
        ]
        victims.sort(key=lambda r: rank[r.request_id], reverse=True)
        budget = self._link_budget(view)
        for victim in list(victims):
            if plan.free_device >= reserve:
                break
            held = plan.held(victim)
            if held > budget or not self._worth_moving(view, enst[victim.request_id], held):
                break
            if self._swap_out(plan, victim):  # NOTE: never recompute ahead of need
                victims.remove(victim)
                budget -= held
        if plan.free_device >= reserve:
            self._prefetch(view, plan, upcoming, victims, rank, reserve, budget)

    def _link_budget(self, view: SchedulerView) -> int:
        """Blocks the host link moves during the shortest iteration: the copies it hides."""
        return int(self.cost.min_iteration_time / self.cost.swap_time(1, view.block_size))

    def _worth_moving(self, view: SchedulerView, gap: float, blocks: int) -> bool:
        """A job whose next turn is ``gap`` away is worth moving out only if both copies of
        its ``blocks`` could be done by then: otherwise it comes back before it has left."""
        return gap > 2 * self.cost.swap_time(blocks, view.block_size)

    def _prefetch(
        self,
        view: SchedulerView,
        plan: StepPlan,
        upcoming: Sequence[Request],
        victims: list[Request],
        rank: Mapping[str, tuple[float, int]],
        reserve: int,
        budget: int,
    ) -> None:
        wanted = [r for r in upcoming if r.status is RequestStatus.SWAPPED]
        for req in sorted(wanted, key=lambda r: rank[r.request_id]):
            held = plan.held(req)
            while plan.free_device - held < reserve and victims:
                victim = victims[0]
                moved = plan.held(victim)
                gap = rank[victim.request_id][0] - rank[req.request_id][0]
                if rank[victim.request_id] < rank[req.request_id] or held + moved > budget:
                    return
                if not self._worth_moving(view, gap, moved) or not self._swap_out(
                    plan, victims.pop(0)
                ):
                    return
                budget -= moved
            if plan.free_device - held < reserve or held > budget:
                return
            plan.swap_in_req(req)
            budget -= held

    @staticmethod
    def _swap_out(plan: StepPlan, req: Request) -> bool:
        if plan.swap_out_need(req) > plan.free_host:
            return False
        plan.evict(req, PreemptMode.SWAP)
        return True
