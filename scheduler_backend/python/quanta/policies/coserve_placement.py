"""ConServe's placement: offline work yields to online work, at scheduling and mid-step.

- eviction: an online request that needs blocks evicts offline residents, those whose host
  checkpoint is complete first (freeing their blocks costs no copy, so they leave by swap
  whatever the mode set), then the rest;
- a step of offline work only is marked preemptible, with a rule (``MissesTTFT``) that stops
  it at the next layer safepoint when an arriving online request would miss its TTFT by
  waiting for the step to end (ConServe's Algorithm 2; the runner polls the loop's signal);
- incremental checkpointing: once free device memory falls below a threshold, the new KV of
  some offline residents is copied to the host after each step, more of them as pressure
  grows, so that preempting them later is a matter of freeing blocks;
- background prefetch: while offline work runs and no online request is live, swapped-out
  offline requests are brought back a bounded number of blocks per step, ahead of need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quanta.core.decision import PreemptMode
from quanta.core.output import RunnerCapabilities
from quanta.core.plan import StepPlan
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.common import is_online, on_device
from quanta.policies.stages import Placement, Ranking


def ttft_slo(req: Request, default: float) -> float:
    """The request's own TTFT SLO in seconds, else ``default``."""
    ms = req.metadata.ttft_slo_ms
    return default if ms is None else ms / 1000


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
        offline = [r for r in on_device(reversed(ranking.order), plan) if not is_online(r)]
        return sorted(offline, key=lambda r: not plan.is_checkpointed(r))  # stable

    def yield_mode(self, req: Request, plan: StepPlan) -> PreemptMode:
        """A checkpointed request leaves by swap (its copy is done); others by the mode set."""
        return PreemptMode.SWAP if plan.is_checkpointed(req) else self.evict_mode

    def after_batch(self, view: SchedulerView, plan: StepPlan, ranking: Ranking) -> None:
        order, pos = ranking.order, ranking.position()
        ran = [order[pos[rid]] for rid, _ in plan.run if rid in pos]
        offline_only = bool(ran) and not any(is_online(r) for r in ran)
        # NOTE: only while no online request is live: one arriving next step would evict what
        # was just brought back (measured: prefetch during ON phases doubled preemptions)
        if self.prefetch and ran and not any(is_online(r) for r in ranking.order):
            self._prefetch(plan, ranking)
        if self.safepoints and offline_only:
            chunks = [(n, order[pos[rid]].num_context_tokens) for rid, n in plan.run]
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
            for r in on_device(reversed(ranking.order), plan)
            if not is_online(r) and r.num_computed_tokens + ran.get(r.request_id, 0) > 0
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
