"""Batch formation shared by the preemptive priority policies (MLFQ, fixed priority, SRPT).

FastServe's Algorithm 1 (lines 22-25): each iteration the top MaxBatchSize ready jobs by
priority run. Jobs that lose their place keep their KV where it is (token-granularity
preemption costs nothing by itself); only when the chosen jobs need device blocks are
lower-priority device residents evicted, largest ENST first (swap to host, or drop for
recompute when the host tier is full or the policy recomputes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView


@dataclass(slots=True)
class BatchPlan:
    """Mutable scratch state of one ``schedule`` call; its arithmetic mirrors the applier's."""

    budget: int
    seqs: int
    free_device: int
    free_host: int
    run: list[tuple[str, int]] = field(default_factory=list)
    preempt: list[Preemption] = field(default_factory=list)
    swap_in: list[str] = field(default_factory=list)
    chosen: set[str] = field(default_factory=set)  # runs this step
    moved: set[str] = field(default_factory=set)  # preempted or swapped in this step

    def decision(self) -> Decision:
        return Decision(tuple(self.run), tuple(self.preempt), tuple(self.swap_in))

    def take(self, view: SchedulerView, req: Request, n: int, need: int) -> None:
        """Run ``n`` tokens of ``req``, swapping it in first when its KV is on the host."""
        if req.status is RequestStatus.SWAPPED:
            # NOTE: the host blocks it frees are not credited: the applier swaps out (all
            # preemptions) before it swaps in, so they cannot take this step's evictions.
            self.swap_in.append(req.request_id)
            self.moved.add(req.request_id)
        self.run.append((req.request_id, n))
        self.chosen.add(req.request_id)
        self.budget -= n
        self.seqs -= 1
        self.free_device -= need

    def evict(self, view: SchedulerView, req: Request, mode: PreemptMode) -> int:
        """Take ``req``'s device blocks back; swap falls back to recompute when the host is
        full, so eviction always succeeds. Returns the blocks freed."""
        held = view.num_blocks(req)
        if mode is PreemptMode.SWAP and held > self.free_host:
            mode = PreemptMode.RECOMPUTE
        if mode is PreemptMode.SWAP:
            self.free_host -= held
        self.preempt.append(Preemption(req.request_id, mode))
        self.moved.add(req.request_id)
        self.free_device += held
        return held

    def prefetch(self, view: SchedulerView, req: Request) -> None:
        """Swap ``req`` in without running it (proactive swap-in)."""
        self.swap_in.append(req.request_id)
        self.moved.add(req.request_id)
        self.free_device -= view.num_blocks(req)


class BatchBuilder:
    """Picks the top jobs of a priority order that fit the step's token, seat and block limits."""

    def __init__(self, config: SchedulerConfig, evict_mode: PreemptMode) -> None:
        self.config = config
        self.evict_mode = evict_mode

    def new_plan(self, view: SchedulerView) -> BatchPlan:
        return BatchPlan(
            budget=self.config.max_num_batched_tokens,
            seqs=self.config.max_num_seqs,
            free_device=view.free_device_blocks,
            free_host=view.free_host_blocks,
        )

    def build(
        self, view: SchedulerView, order: Sequence[Request], enst: Mapping[str, float]
    ) -> BatchPlan:
        """Walk ``order`` (highest priority first) and take every job that fits.

        A job that does not fit even after evicting every lower-priority resident is skipped,
        and smaller jobs behind it may still run: the device is never left idle by one big job.
        """
        plan = self.new_plan(view)
        pos = {r.request_id: i for i, r in enumerate(order)}
        residents = [
            r for r in order if r.status is RequestStatus.RUNNING and view.num_blocks(r) > 0
        ]
        # NOTE: eviction order is largest ENST first, lower priority breaking ties.
        victims = sorted(residents, key=lambda r: (-enst[r.request_id], -pos[r.request_id]))
        evictable = sum(view.num_blocks(r) for r in residents)  # held below position i
        for i, req in enumerate(order):
            if req.status is RequestStatus.RUNNING and req.request_id not in plan.moved:
                evictable -= view.num_blocks(req)
            if plan.seqs == 0 or plan.budget == 0:
                break
            if req.request_id in plan.moved:
                continue
            n = self._num_tokens(req, plan.budget)
            if n == 0:
                continue
            need = view.blocks_to_grow(req, n)
            if need > plan.free_device + evictable:
                continue
            while need > plan.free_device:
                victim = self._next_victim(victims, pos, i, plan)
                evictable -= plan.evict(view, victim, self.evict_mode)
            plan.take(view, req, n, need)
        return plan

    def _num_tokens(self, req: Request, budget: int) -> int:
        """A decode token, or the next prefill chunk (whole when chunking is off)."""
        n = req.num_uncomputed_tokens
        if n <= budget:
            return n
        return budget if self.config.enable_chunked_prefill else 0

    @staticmethod
    def _next_victim(
        victims: list[Request], pos: Mapping[str, int], i: int, plan: BatchPlan
    ) -> Request:
        """The largest-ENST resident below position ``i`` not yet chosen or moved."""
        for k, v in enumerate(victims):
            rid = v.request_id
            if pos[rid] > i and rid not in plan.moved and rid not in plan.chosen:
                del victims[k]
                return v
        raise AssertionError("evictable block count out of sync with the victim list")
