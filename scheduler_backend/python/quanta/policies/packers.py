"""Packers: fill one step from a lane's ranking within the token budget, seats and blocks.

- ``InOrderPacker`` (vLLM's FCFS shape): residents continue in rank order, evicting the
  lowest-ranked residents when the pool cannot grow one, and stepping aside themselves when
  nothing is left to take from; then requests that are not resident start or resume in rank
  order, and the first that does not fit blocks the rest (strict order). Nothing new starts in
  a step that had to evict.
- ``PriorityPacker`` (FastServe's Algorithm 1): the top jobs of the ranking that fit; a job
  that does not fit is skipped and the ones behind it may still run. Residents may evict
  lower-ranked residents to grow. With ``evict_to_start`` (the paper's reading) a job that is
  not resident may evict too; without it (the default) it starts or resumes only in free
  blocks above ``headroom``, so a paused resident is never thrown out for a newcomer: pausing
  a resident costs nothing, swapping it costs two copies and recomputing it a prefill.
"""

from __future__ import annotations

import sys

from quanta.core.config import SchedulerConfig
from quanta.core.plan import StepPlan
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.policies.common import evictable, outside, residents
from quanta.policies.stages import Lane, Packer, Placement, Ranking


def chunk(req: Request, budget: int, chunked: bool) -> int:
    """A decode token (with as many of its drafts as fit), or the next prefill chunk (all of
    it when chunking is off)."""
    n = req.num_uncomputed_tokens
    if n <= budget:
        return n
    return budget if chunked or n - req.num_draft_tokens <= budget else 0


def tokens_left(lane: Lane, plan: StepPlan) -> int:
    """The tokens ``lane`` may still add to ``plan`` (``Lane.tokens_left``; no limit at all
    reads as ``sys.maxsize``)."""
    left = lane.tokens_left(plan)
    return sys.maxsize if left is None else left


class InOrderPacker(Packer):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        queue = residents(lane.order, plan)
        if not self._continue(queue, plan, lane, placement):
            return
        # NOTE: read after the residents continued, which moved nobody (they would have
        # returned above), so the requests outside are those there were before
        for req in outside(lane.order, plan):
            n = chunk(req, tokens_left(lane, plan), self.config.enable_chunked_prefill)
            if n == 0 or not plan.take_if_fits(req, n):
                return

    @staticmethod
    def _continue(queue: list[Request], plan: StepPlan, lane: Lane, placement: Placement) -> bool:
        """Residents continue; False when someone had to be evicted (start nothing new)."""
        evicted = False
        while queue and tokens_left(lane, plan) > 0 and plan.has_room():
            req = queue.pop(0)
            n = min(req.num_uncomputed_tokens, tokens_left(lane, plan))
            need = plan.blocks_to_grow(req, n)
            while need > plan.free_device and queue:
                victim = queue.pop()  # the lowest-ranked resident
                plan.evict(victim, placement.yield_mode(victim, plan))
                evicted = True
            if need > plan.free_device:
                plan.evict(req, placement.yield_mode(req, plan))  # nothing left to take from
                return False
            plan.run_req(req, n)
        return not evicted


class PriorityPacker(Packer):
    """See the module docstring.

    With ``decode_first`` a step's seats are still claimed in rank order, but its token budget
    is spent on the claimed decodes (one token each) before the claimed prefills share what is
    left, in rank order: a started job is never pushed out of a step by a newcomer's chunk.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        evict_to_start: bool = False,
        headroom: float = 0.0,
        decode_first: bool = False,
    ) -> None:
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.config = config
        self.evict_to_start = evict_to_start
        self.headroom = headroom
        self.decode_first = decode_first

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        pos = ranking.position()
        victims = placement.victims(ranking, plan)
        # NOTE: headroom is for residents to grow; with none, a job may use the whole pool
        # (else one larger than the pool less the headroom could never start).
        in_use = view.total_device_blocks > plan.free_device
        keep = int(self.headroom * view.total_device_blocks) if in_use else 0
        seats = plan.seats if plan.seats is not None else len(lane.order)
        # NOTE: blocks held by evictable residents ranked below the walk's position.
        below = sum(plan.frees(r) for r in residents(lane.order, plan))
        prefills: list[Request] = []
        for req in lane.order:
            if evictable(req, plan):
                below -= plan.frees(req)
            if seats <= 0 or tokens_left(lane, plan) == 0:
                break
            if req.request_id in plan.chosen or (
                req.request_id in plan.moved and not plan.is_resident(req)
            ):
                continue
            n = chunk(req, tokens_left(lane, plan), self.config.enable_chunked_prefill)
            if n > 1 and self.decode_first:
                if self._could_fit(req, n, plan, keep, below):
                    prefills.append(req)  # claims its seat now, its tokens after the decodes
                    seats -= 1
            elif n and self._could_fit(req, n, plan, keep, below):
                below -= self._evict_for(req, n, pos, victims, plan, placement)
                if plan.take_if_fits(req, n):
                    seats -= 1
        for req in prefills:
            n = chunk(req, tokens_left(lane, plan), self.config.enable_chunked_prefill)
            i = pos[req.request_id]
            room = sum(
                plan.frees(v) for v in victims if pos[v.request_id] > i and evictable(v, plan)
            )
            if n and plan.has_room(n) and self._could_fit(req, n, plan, keep, room):
                self._evict_for(req, n, pos, victims, plan, placement)
                plan.take_if_fits(req, n)

    def _could_fit(self, req: Request, n: int, plan: StepPlan, keep: int, room: int) -> bool:
        """``n`` tokens of ``req`` fit in free blocks, or (when it may evict) in free blocks
        plus the ``room`` lower-ranked residents hold."""
        need = plan.blocks_to_grow(req, n)
        if not plan.is_resident(req) and not self.evict_to_start:
            return need + keep <= plan.free_device
        return need <= plan.free_device + room

    @staticmethod
    def _evict_for(
        req: Request,
        n: int,
        pos: dict[str, int],
        victims: list[Request],
        plan: StepPlan,
        placement: Placement,
    ) -> int:
        """Evict lower-ranked residents, in the placement's order, until ``req`` fits; the
        blocks taken from them. NOTE: the room a packer counts on is an estimate once blocks
        are shared (a victim may share blocks with another, or with ``req``'s cached prefix),
        so the need is asked again after each eviction and the caller checks before running."""
        i, freed = pos[req.request_id], 0
        for victim in victims:
            if plan.blocks_to_grow(req, n) <= plan.free_device:
                break
            if pos[victim.request_id] > i and evictable(victim, plan):
                freed += plan.evict(victim, placement.yield_mode(victim, plan))
        return freed
