"""ConServe: online and offline work in one batch, the offline part always ready to yield.

Online requests (``priority_class="online"``: streaming, latency-critical) are packed first,
within a per-step token budget that the cost model says keeps their TPOT within its SLO; the
offline lane (batch work, measured by throughput) fills what is left, as far as the predicted
step time stays within that SLO. A step with no online work
ignores the budget ("offline batching mode"). Offline work yields to online work:

- at scheduling: an online request that needs blocks evicts offline residents, those whose
  host checkpoint is complete first (freeing their blocks costs no copy), then the rest;
- mid-step: a step of offline work only is marked preemptible, with a rule that stops it at
  the next layer safepoint when an arriving online request would miss its TTFT by waiting for
  the step to end (ConServe's Algorithm 2; the runner polls the loop's signal);
- incremental checkpointing: once free device memory falls below a threshold, the new KV of
  some offline residents is copied to the host after each step, more of them as pressure
  grows, so that preempting them later is a matter of freeing blocks;
- background prefetch: while offline work runs and no online request is live, swapped-out
  offline requests are brought back a bounded number of blocks per step, ahead of need.

The two baselines of the paper's experiments share the lanes:

- ``OnlineOnlyLanes``: offline requests are held back (not refused) while any online request
  is in flight: an engine that serves offline work only in online idle time;
- ``ClassOrder`` with FCFS's packer: online first in the queue, running offline work is never
  preempted for a newcomer (vLLM's priority scheduling, the paper's vLLM++).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.output import RunnerCapabilities
from quanta.core.plan import StepPlan
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.packers import chunk
from quanta.policies.stages import Lane, Lanes, Ordering, Packer, Placement, Ranking

ONLINE, OFFLINE = "online", "offline"

_GROUP = {RequestStatus.RUNNING: 0, RequestStatus.SWAPPED: 1, RequestStatus.WAITING: 2}


def is_online(req: Request) -> bool:
    return req.metadata.priority_class != OFFLINE


def ttft_slo(req: Request, default: float) -> float:
    """The request's own TTFT SLO in seconds, else ``default``."""
    ms = req.metadata.ttft_slo_ms
    return default if ms is None else ms / 1000


def tpot_slo(req: Request, default: float) -> float:
    ms = req.metadata.tpot_slo_ms
    return default if ms is None else ms / 1000


def slo_token_budget(
    cost: CostModel,
    decodes: Sequence[int],
    tpot_s: float,
    max_tokens: int,
    min_chunk: int = 1,
) -> int:
    """Tokens one step may hold so that its predicted time stays within ``tpot_s``: the
    ``decodes`` (contexts of the requests that decode in it) plus the largest prefill chunk
    that fits, found by bisection on the cost model (step time grows with the chunk).

    At least the decodes plus ``min_chunk`` (an online prompt always advances), at most
    ``max_tokens``. A cost model too slow for the SLO gets that floor: the SLO is then out of
    reach whatever the scheduler does, and online work still moves."""
    base = [(1, c) for c in decodes]
    floor = min(max_tokens, len(decodes) + min_chunk)
    lo, hi = 0, max(0, max_tokens - len(decodes))
    if cost.step_time(base) > tpot_s:
        return floor
    while lo < hi:  # the largest chunk whose step fits the SLO
        mid = (lo + hi + 1) // 2
        if cost.step_time([*base, (mid, 0)]) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return max(floor, len(decodes) + lo)


class ClassOrder(Ordering):
    """Online before offline; within a class running, swapped, then waiting, each by arrival
    (vLLM's priority scheduling: the waiting queue sorted by priority)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def rank(self, view: SchedulerView) -> Ranking:
        order = sorted(
            view.candidates,
            key=lambda r: (not is_online(r), _GROUP[r.status], r.arrival_time, r.request_id),
        )
        seats = self.config.max_num_seqs
        return Ranking(order, {r.request_id: float(i // seats) for i, r in enumerate(order)})


class ClassLanes(Lanes):
    """The ranking split by class, order kept: the online lane, then the offline lane."""

    def split(self, ranking: Ranking, view: SchedulerView) -> list[Lane]:
        online = [r for r in ranking.order if is_online(r)]
        offline = [r for r in ranking.order if not is_online(r)]
        return [Lane(ONLINE, online), Lane(OFFLINE, self.hold(online, offline))]

    def hold(self, online: list[Request], offline: list[Request]) -> list[Request]:
        """The offline requests that may run this step."""
        return offline


class OnlineOnlyLanes(ClassLanes):
    """No offline work while any online request is in flight (held back, not refused)."""

    def hold(self, online: list[Request], offline: list[Request]) -> list[Request]:
        return [] if online else offline


class CoservePlacement(Placement):
    """Evicts offline residents for online work (checkpointed ones first, for free), and
    around the batch: the preemptible-step rule, incremental checkpoints and prefetch."""

    def __init__(
        self,
        cost: CostModel | None,
        *,
        evict_mode: PreemptMode = PreemptMode.SWAP,
        ttft_slo_s: float = 1.5,
        safepoints: bool = False,
        checkpoint: bool = False,
        checkpoint_threshold: float = 0.5,
        prefetch: bool = False,
        prefetch_blocks: int | None = None,
    ) -> None:
        if safepoints and cost is None:
            raise ValueError("the safepoint abort rule predicts step times: it needs a cost model")
        self.cost = cost
        self.evict_mode = evict_mode
        self.ttft_slo_s = ttft_slo_s
        self.safepoints = safepoints
        self.checkpoint = checkpoint
        self.checkpoint_threshold = checkpoint_threshold
        self.prefetch = prefetch
        self.prefetch_blocks = prefetch_blocks
        self.requires = RunnerCapabilities(layer_safepoints=safepoints)

    def victims(self, ranking: Ranking, plan: StepPlan) -> list[Request]:
        """Offline residents only: checkpointed ones first, then lowest-ranked first."""
        offline = [r for r in reversed(ranking.order) if not is_online(r) and plan.is_resident(r)]
        return sorted(offline, key=lambda r: not plan.is_checkpointed(r))  # stable

    def yield_mode(self, req: Request, plan: StepPlan) -> PreemptMode:
        """A checkpointed request leaves by swap (its copy is done); others by the mode set."""
        return PreemptMode.SWAP if plan.is_checkpointed(req) else self.evict_mode

    def after_batch(self, view: SchedulerView, plan: StepPlan, ranking: Ranking) -> None:
        by_id = {r.request_id: r for r in ranking.order}
        ran = [by_id[rid] for rid, _ in plan.run if rid in by_id]
        offline_only = bool(ran) and not any(is_online(r) for r in ran)
        # NOTE: only while no online request is live: one arriving next step would evict what
        # was just brought back (measured: prefetch during ON phases doubled preemptions)
        if self.prefetch and ran and not any(is_online(r) for r in ranking.order):
            self._prefetch(plan, ranking)
        if self.safepoints and offline_only:
            chunks = [(n, by_id[rid].num_computed_tokens) for rid, n in plan.run]
            assert self.cost is not None  # NOTE: checked at construction
            plan.abort_when = MissesTTFT(view.now + self.cost.step_time(chunks), self)
        if self.checkpoint:
            self._checkpoint(view, plan, ranking)

    def _checkpoint(self, view: SchedulerView, plan: StepPlan, ranking: Ranking) -> None:
        """Mirror the new KV of some offline residents: none while free device memory is
        above the threshold, then a share growing linearly to all of them when the pool is
        full; lowest-ranked first (the likeliest to be preempted)."""
        total = view.total_device_blocks
        free = plan.free_device / total if total else 1.0
        if free >= self.checkpoint_threshold:
            return
        pressure = (self.checkpoint_threshold - free) / self.checkpoint_threshold
        ran = dict(plan.run)
        residents = [
            r
            for r in reversed(ranking.order)
            if not is_online(r)
            and plan.is_resident(r)
            and r.num_computed_tokens + ran.get(r.request_id, 0) > 0
        ]
        for req in residents[: math.ceil(len(residents) * pressure)]:
            upto = req.num_computed_tokens + ran.get(req.request_id, 0)
            if plan.pool.checkpointed_tokens(req.request_id) >= upto:
                continue  # nothing new since its last checkpoint
            if plan.pool.checkpoint_need(req.request_id, upto) <= plan.free_host:
                plan.checkpoint_req(req)

    def _prefetch(self, plan: StepPlan, ranking: Ranking) -> None:
        """Swap preempted offline requests back in, highest-ranked first, at most
        ``prefetch_blocks`` a step (a request larger than that goes alone in a step of its
        own), into blocks the step leaves free."""
        limit = self.prefetch_blocks or max(1, plan.pool.total_device // 8)
        budget = limit
        for req in ranking.order:
            if req.status is not RequestStatus.SWAPPED or req.request_id in plan.moved:
                continue
            n = plan.held(req)
            if n > plan.free_device or (n > budget and budget < limit):
                return  # in rank order: the next one waits for the next step
            plan.swap_in_req(req)
            budget -= n
            if budget <= 0:
                return


@dataclass(frozen=True)
class MissesTTFT:
    """The abort rule of a preemptible step: an online request arriving at ``now`` would wait
    until the step's predicted ``end``, then for its own prefill; stop the step when that
    passes its TTFT SLO. Reads only what it captured (called on a client's thread)."""

    end: float
    placement: CoservePlacement

    def __call__(self, request: Request, now: float) -> bool:
        if not is_online(request) or self.end <= now:
            return False
        cost = self.placement.cost
        assert cost is not None  # NOTE: a placement with safepoints has one
        own = cost.prefill_time(request.num_prompt_tokens)
        return (self.end - now) + own > ttft_slo(request, self.placement.ttft_slo_s)


class CoservePacker(Packer):
    """Online lane first under the SLO token budget, offline lane in what is left.

    Online: residents continue in rank order, then the others start or resume in order (the
    first that does not fit waits, and so do the ones behind it); blocks come from offline
    residents (``placement.victims``), then from the lowest-ranked online resident.
    Offline: residents continue, then new or preempted ones start, only in free blocks, never
    at an online request's expense.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost: CostModel | None,
        *,
        tpot_slo_s: float = 0.11,
    ) -> None:
        self.config = config
        self.cost = cost  # None: no SLO budget (online-only needs none)
        self.tpot_slo_s = tpot_slo_s
        self._cap: int | None = None  # this step's token budget, set by the online lane
        self._tpot: float | None = None  # this step's time budget while online work is live

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        if lane.name == ONLINE:
            self._cap = self._budget(lane.order, plan) if lane.order else None
            self._tpot = None
            if lane.order and self.cost is not None:
                self._tpot = min(tpot_slo(r, self.tpot_slo_s) for r in lane.order)
            self._pack_online(lane.order, plan, ranking, placement)
        else:
            self._pack_offline(lane.order, plan, ranking, placement)

    def _budget(self, online: list[Request], plan: StepPlan) -> int | None:
        """The step's token budget while online work is live (None: the configured one)."""
        if self.cost is None:
            return None
        running = [r for r in plan_residents(online, plan) if r.num_uncomputed_tokens == 1]
        tpot = min((tpot_slo(r, self.tpot_slo_s) for r in online), default=self.tpot_slo_s)
        decodes = [r.num_computed_tokens for r in running]
        return slo_token_budget(
            self.cost,
            decodes,
            tpot,
            self.config.max_num_batched_tokens,
            min_chunk=plan.pool.block_size,
        )

    def _left(self, plan: StepPlan) -> int:
        budget = plan.budget if plan.budget is not None else self.config.max_num_batched_tokens
        if self._cap is None:
            return budget
        used = sum(n for _, n in plan.run)
        return max(0, min(budget, self._cap - used))

    def _pack_online(
        self, order: list[Request], plan: StepPlan, ranking: Ranking, placement: Placement
    ) -> None:
        victims = placement.victims(ranking, plan)
        residents = plan_residents(order, plan)
        for req in residents:
            if not _evictable(req, plan):
                continue  # evicted for a higher-ranked one
            n = chunk(req, self._left(plan), self.config.enable_chunked_prefill)
            if n == 0 or not plan.has_room(n):
                break
            if not self._make_room(req, n, plan, victims, placement):
                lowest = [r for r in reversed(residents) if _evictable(r, plan) and r is not req]
                while plan.blocks_to_grow(req, n) > plan.free_device and lowest:
                    plan.evict(lowest.pop(0), placement.evict_mode)
                if plan.blocks_to_grow(req, n) > plan.free_device:
                    plan.evict(req, placement.evict_mode)  # nothing left to take from
                    continue
            plan.run_req(req, n)
        for req in order:
            if plan.is_resident(req) or req.request_id in plan.moved:
                continue
            n = chunk(req, self._left(plan), self.config.enable_chunked_prefill)
            if n == 0 or not plan.has_room(n):
                return
            if not self._make_room(req, n, plan, victims, placement):
                return  # strict order among online requests
            plan.take(req, n)

    def _pack_offline(
        self, order: list[Request], plan: StepPlan, ranking: Ranking, placement: Placement
    ) -> None:
        timed = _StepTime(self.cost, self._tpot, ranking, plan)
        residents = plan_residents(order, plan)
        for i, req in enumerate(residents):
            if not _evictable(req, plan):
                continue  # evicted for a higher-ranked one
            n = chunk(req, self._left(plan), self.config.enable_chunked_prefill)
            n = timed.fit(req, n, self.config.enable_chunked_prefill)
            if n == 0 or not plan.has_room(n):
                return
            below = [r for r in reversed(residents[i + 1 :]) if _evictable(r, plan)]
            while plan.blocks_to_grow(req, n) > plan.free_device and below:
                victim = below.pop(0)
                plan.evict(victim, _yield(placement, victim, plan))
            if plan.blocks_to_grow(req, n) > plan.free_device:
                plan.evict(req, _yield(placement, req, plan))
                return
            plan.run_req(req, n)
            timed.add(req, n)
        for req in order:
            if plan.is_resident(req) or req.request_id in plan.moved:
                continue
            n = chunk(req, self._left(plan), self.config.enable_chunked_prefill)
            n = timed.fit(req, n, self.config.enable_chunked_prefill)
            if n == 0 or not plan.has_room(n):
                return
            if plan.blocks_to_grow(req, n) > plan.free_device:
                return  # in order: the next offline request waits too
            plan.take(req, n)
            timed.add(req, n)

    @staticmethod
    def _make_room(
        req: Request,
        n: int,
        plan: StepPlan,
        victims: list[Request],
        placement: Placement,
    ) -> bool:
        """Evict offline residents (in ``victims`` order) until ``n`` tokens of ``req`` fit;
        False (and nothing evicted) when all of them would not be enough."""
        need = plan.blocks_to_grow(req, n)
        if need <= plan.free_device:
            return True
        free = [v for v in victims if _evictable(v, plan)]
        if need > plan.free_device + sum(plan.held(v) for v in free):
            return False
        for victim in free:
            if plan.blocks_to_grow(req, n) <= plan.free_device:
                break
            plan.evict(victim, _yield(placement, victim, plan))
        return True


class _StepTime:
    """The step's predicted time as offline work joins it: while online work is live, an
    offline run is taken only as far as the step stays within the online TPOT SLO. (The
    token budget alone does not keep it: an offline decode costs a sequence's overhead and
    its context's reads, which a token of a prefill chunk does not.)"""

    def __init__(
        self, cost: CostModel | None, limit: float | None, ranking: Ranking, plan: StepPlan
    ) -> None:
        self.cost, self.limit = cost, limit
        by_id = {r.request_id: r for r in ranking.order}
        self.chunks = [(n, by_id[rid].num_computed_tokens) for rid, n in plan.run]

    def fit(self, req: Request, n: int, chunked: bool) -> int:
        """The most of ``n`` tokens of ``req`` the step can take (0: none)."""
        if self.cost is None or self.limit is None or n == 0:
            return n
        start = req.num_computed_tokens
        if self.cost.step_time([*self.chunks, (n, start)]) <= self.limit:
            return n
        if n == 1 or not chunked:
            return 0
        lo, hi = 0, n - 1
        while lo < hi:  # the largest chunk that fits
            mid = (lo + hi + 1) // 2
            if self.cost.step_time([*self.chunks, (mid, start)]) <= self.limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, req: Request, n: int) -> None:
        self.chunks.append((n, req.num_computed_tokens))


def plan_residents(order: list[Request], plan: StepPlan) -> list[Request]:
    """``order``'s requests whose KV is on the device and that do not run yet this step."""
    return [r for r in order if plan.is_resident(r) and r.request_id not in plan.chosen]


def _evictable(req: Request, plan: StepPlan) -> bool:
    return plan.is_resident(req) and req.request_id not in plan.chosen


def _yield(placement: Placement, req: Request, plan: StepPlan) -> PreemptMode:
    if isinstance(placement, CoservePlacement):
        return placement.yield_mode(req, plan)
    return placement.evict_mode
