"""FCFS as vLLM does it: continuous batching, chunked prefill, preempt-the-newest.

Each step: running requests (oldest first) continue — a decode token or the next prefill
chunk — within the token budget; when the device pool cannot grow one, the newest running
request is preempted (swapped to host when the host tier has room, else dropped for
recompute). Then swapped requests come back oldest first, then waiting ones are admitted in
arrival order; the first that does not fit blocks the queue (strict FCFS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.output import RunnerOutput
from quanta.core.request import Request
from quanta.core.view import SchedulerView


@dataclass(slots=True)
class _Plan:
    """Mutable scratch state of one ``schedule`` call."""

    budget: int
    seqs: int
    free_device: int
    free_host: int
    run: list[tuple[str, int]] = field(default_factory=list)
    preempt: list[Preemption] = field(default_factory=list)
    swap_in: list[str] = field(default_factory=list)

    def decision(self) -> Decision:
        return Decision(tuple(self.run), tuple(self.preempt), tuple(self.swap_in))


class FCFSPolicy:
    """First come, first served; the baseline every other policy is measured against."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig, *, allow_swap: bool = True) -> None:
        self.config = config
        self.allow_swap = allow_swap

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        return None

    def schedule(self, view: SchedulerView) -> Decision:
        plan = _Plan(
            budget=self.config.max_num_batched_tokens,
            seqs=self.config.max_num_seqs,
            free_device=view.free_device_blocks,
            free_host=view.free_host_blocks,
        )
        self._continue_running(view, plan)
        if not plan.preempt:
            resumed_all = self._resume_swapped(view, plan)
            if resumed_all:
                self._admit_waiting(view, plan)
        return plan.decision()

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        return None

    def on_finish(self, request: Request) -> None:
        return None

    # -- phases ------------------------------------------------------------------------------
    def _continue_running(self, view: SchedulerView, plan: _Plan) -> None:
        queue = sorted(view.running, key=_order)
        while queue and plan.budget > 0 and plan.seqs > 0:
            req = queue.pop(0)
            n = min(req.num_uncomputed_tokens, plan.budget)
            need = view.blocks_to_grow(req, n)
            while need > plan.free_device and queue:
                self._preempt(view, plan, queue.pop())  # the newest running request
            if need > plan.free_device:
                self._preempt(view, plan, req)  # nothing left to take from: step aside
                return
            self._take(plan, req, n, need)

    def _resume_swapped(self, view: SchedulerView, plan: _Plan) -> bool:
        for req in sorted(view.swapped, key=_order):
            n = min(req.num_uncomputed_tokens, plan.budget)
            need = view.blocks_to_grow(req, n)
            if n == 0 or plan.seqs == 0 or need > plan.free_device:
                return False
            plan.swap_in.append(req.request_id)
            plan.free_host += view.num_blocks(req)
            self._take(plan, req, n, need)
        return True

    def _admit_waiting(self, view: SchedulerView, plan: _Plan) -> None:
        for req in sorted(view.waiting, key=_order):
            n = req.num_uncomputed_tokens
            if self.config.enable_chunked_prefill:
                n = min(n, plan.budget)
            elif n > plan.budget:
                return
            need = view.blocks_to_grow(req, n)
            if n == 0 or plan.seqs == 0 or need > plan.free_device:
                return
            self._take(plan, req, n, need)

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _take(plan: _Plan, req: Request, n: int, need: int) -> None:
        plan.run.append((req.request_id, n))
        plan.budget -= n
        plan.seqs -= 1
        plan.free_device -= need

    def _preempt(self, view: SchedulerView, plan: _Plan, req: Request) -> None:
        held = view.num_blocks(req)
        if self.allow_swap and held <= plan.free_host:
            plan.preempt.append(Preemption(req.request_id, PreemptMode.SWAP))
            plan.free_host -= held
        else:
            plan.preempt.append(Preemption(req.request_id, PreemptMode.RECOMPUTE))
        plan.free_device += held


def _order(req: Request) -> tuple[float, str]:
    return (req.arrival_time, req.request_id)
