"""ConServe's packer: the online lane first, the offline lane in what is left.

Both lanes come with their limits (``ClassLanes`` sets them): the step's token budget while
online work is live, and for the offline lane the step time the online TPOT SLO allows. The
packer reads them from each lane and keeps nothing between lanes.
"""

from __future__ import annotations

from quanta.core.config import SchedulerConfig
from quanta.core.plan import StepPlan
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.common import ONLINE, evictable, largest, residents
from quanta.policies.packers import chunk
from quanta.policies.stages import Lane, Packer, Placement, Ranking


class CoservePacker(Packer):
    """Online lane first under its token budget, offline lane in what is left.

    Online: residents continue in rank order, then the others start or resume in order (the
    first that does not fit waits, and so do the ones behind it); blocks come from offline
    residents (``placement.victims``), then from the lowest-ranked online resident.
    Offline: residents continue, then new or preempted ones start, only in free blocks, never
    at an online request's expense, and each only as far as the step stays within the lane's
    ``max_step_time``.
    """

    def __init__(self, config: SchedulerConfig, cost: CostModel | None) -> None:
        self.config = config
        self.cost = cost  # None: no step-time limit (online-only needs none)

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        if lane.name == ONLINE:
            self._pack_online(lane, plan, ranking, placement)
        else:
            self._pack_offline(lane, plan, ranking, placement)

    def _chunk(self, req: Request, lane: Lane, plan: StepPlan) -> int:
        """``req``'s next run within what the lane may still add to the step."""
        left = lane.tokens_left(plan)
        budget = self.config.max_num_batched_tokens if left is None else left
        return chunk(req, budget, self.config.enable_chunked_prefill)

    def _pack_online(
        self, lane: Lane, plan: StepPlan, ranking: Ranking, placement: Placement
    ) -> None:
        victims = placement.victims(ranking, plan)
        queue = residents(lane.order, plan)
        for req in queue:
            if not evictable(req, plan):
                continue  # evicted for a higher-ranked one
            n = self._chunk(req, lane, plan)
            if n == 0 or not plan.has_room(n):
                break
            if not self._make_room(req, n, plan, victims, placement):
                lowest = [r for r in reversed(queue) if evictable(r, plan) and r is not req]
                while plan.blocks_to_grow(req, n) > plan.free_device and lowest:
                    victim = lowest.pop(0)
                    plan.evict(victim, placement.yield_mode(victim, plan))
                if plan.blocks_to_grow(req, n) > plan.free_device:
                    plan.evict(req, placement.yield_mode(req, plan))  # nothing left to take from
                    continue
            plan.run_req(req, n)
        for req in lane.order:
            if plan.is_resident(req) or req.request_id in plan.moved:
                continue
            n = self._chunk(req, lane, plan)
            if n == 0 or not plan.has_room(n):
                return
            if not self._make_room(req, n, plan, victims, placement):
                return  # strict order among online requests
            plan.take(req, n)

    def _pack_offline(
        self, lane: Lane, plan: StepPlan, ranking: Ranking, placement: Placement
    ) -> None:
        timed = _StepTime(self.cost, lane.max_step_time, ranking, plan)
        chunked = self.config.enable_chunked_prefill
        queue = residents(lane.order, plan)
        for i, req in enumerate(queue):
            if not evictable(req, plan):
                continue  # evicted for a higher-ranked one
            n = timed.fit(req, self._chunk(req, lane, plan), chunked)
            if n == 0 or not plan.has_room(n):
                return
            below = [r for r in reversed(queue[i + 1 :]) if evictable(r, plan)]
            while plan.blocks_to_grow(req, n) > plan.free_device and below:
                victim = below.pop(0)
                plan.evict(victim, placement.yield_mode(victim, plan))
            if plan.blocks_to_grow(req, n) > plan.free_device:
                plan.evict(req, placement.yield_mode(req, plan))
                return
            plan.run_req(req, n)
            timed.add(req, n)
        for req in lane.order:
            if plan.is_resident(req) or req.request_id in plan.moved:
                continue
            n = timed.fit(req, self._chunk(req, lane, plan), chunked)
            if n == 0 or not plan.take_if_fits(req, n):
                return  # in order: the next offline request waits too
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
        False (and nothing evicted) when all of them would not be enough. NOTE: with shared
        blocks what they free is an estimate, so the answer is the fit after the evictions."""
        need = plan.blocks_to_grow(req, n)
        if need <= plan.free_device:
            return True
        free = [v for v in victims if evictable(v, plan)]
        if need > plan.free_device + sum(plan.frees(v) for v in free):
            return False
        for victim in free:
            if plan.blocks_to_grow(req, n) <= plan.free_device:
                break
            plan.evict(victim, placement.yield_mode(victim, plan))
        return plan.blocks_to_grow(req, n) <= plan.free_device


class _StepTime:
    """The step's predicted time as offline work joins it: while online work is live, an
    offline run is taken only as far as the step stays within the online TPOT SLO. (The
    token budget alone does not keep it: an offline decode costs a sequence's overhead and
    its context's reads, which a token of a prefill chunk does not.)"""

    def __init__(
        self, cost: CostModel | None, limit: float | None, ranking: Ranking, plan: StepPlan
    ) -> None:
        self.cost, self.limit = cost, limit
        order, pos = ranking.order, ranking.position()
        self.chunks = [(n, order[pos[rid]].num_context_tokens) for rid, n in plan.run]

    def fit(self, req: Request, n: int, chunked: bool) -> int:
        """The most of ``n`` tokens of ``req`` the step can take (0: none)."""
        cost, limit = self.cost, self.limit
        if cost is None or limit is None or n == 0:
            return n
        start = req.num_context_tokens
        if cost.step_time([*self.chunks, (n, start)]) <= limit:
            return n
        if n == 1 or not chunked:
            return 0
        return largest(n - 1, lambda k: cost.step_time([*self.chunks, (k, start)]) <= limit)

    def add(self, req: Request, n: int) -> None:
        self.chunks.append((n, req.num_context_tokens))
