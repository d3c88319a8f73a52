"""A runner with no tensors: each step advances a virtual clock by the cost model's time.

Block copies run on one host link, in order (swap-outs first, as the real runner does), and
overlap compute; a step's forward pass waits only for the copies of blocks it touches. So a
swap-in issued for a job that runs in the same step (reactive) sits on the critical path,
while one issued a step ahead (proactive) hides behind the other jobs' iteration, and a
swapped-out block is reused only once its copy has left: FastServe's Fig. 9 as a timeline.
A profile whose copies do not overlap compute (``swap_overlaps_compute=False``, the CPU
engine, which copies inside ``execute`` before the forward pass) puts every copy of a step on
its critical path instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from quanta.core.clock import VirtualClock
from quanta.core.output import RunnerCapabilities, RunnerOutput, SchedulerOutput
from quanta.costmodel import CostModel


@dataclass(slots=True)
class SimStats:
    """Cumulative counters of a simulated engine."""

    steps: int = 0
    compute_s: float = 0.0
    stall_s: float = 0.0  # steps waiting for their blocks' copies
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    copy_busy_s: float = 0.0
    stall_by_request: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class SimRunner:
    """Implements the ``Runner`` protocol from a ``CostModel`` and a ``VirtualClock``."""

    capabilities = RunnerCapabilities(hidden_cache=True, async_swap=True)

    def __init__(
        self, cost: CostModel, clock: VirtualClock, block_size: int, token_id: int = 1
    ) -> None:
        self.cost, self.clock, self.block_size = cost, clock, block_size
        self.token_id = token_id  # NOTE: requests stop by length (ignore_eos), never by token
        self.stats = SimStats()
        self._ready_at: dict[int, float] = {}  # device block -> when its pending copy ends
        self._link_free_at = 0.0

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        so = scheduler_output
        start = self.clock.now()
        if not self.cost.swap_overlaps_compute:
            self._link_free_at = start  # the copies start with the step, nothing queued ahead
        self._copy(start, so)
        wait_until = start
        for seq in so.seqs:
            for block in seq.block_table:
                wait_until = max(wait_until, self._ready_at.get(block, start))
        compute = self.cost.step_time((s.num_new_tokens, s.start_pos) for s in so.seqs)
        hidden_context = sum(s.start_pos for s in so.seqs if s.hidden)
        if hidden_context:  # K and V of hidden-cache requests' past tokens, recomputed
            compute += self.cost.hidden_time(hidden_context)
        if not self.cost.swap_overlaps_compute:
            wait_until = max(start, self._link_free_at)  # every copy, touched or not
        end = wait_until + compute if so.seqs else max(start, self._link_free_at)
        self._account(so, wait_until - start, compute)
        self.clock.set(end)
        self._ready_at = {b: t for b, t in self._ready_at.items() if t > end}
        return RunnerOutput(
            tuple(s.request_id for s in so.seqs),
            tuple(self.token_id if s.sample else None for s in so.seqs),
        )

    def _copy(self, now: float, so: SchedulerOutput) -> None:
        """Queue this step's copies on the host link; mark the device blocks they touch."""
        t = max(now, self._link_free_at)
        if so.swap_out:
            t += self.cost.swap_time(len(so.swap_out), self.block_size)
            for device_block, _ in so.swap_out:
                self._ready_at[device_block] = t  # not to be overwritten before it has left
        if so.swap_in:
            t += self.cost.swap_time(len(so.swap_in), self.block_size)
            for _, device_block in so.swap_in:
                self._ready_at[device_block] = t
        if so.swap_out or so.swap_in:
            self.stats.copy_busy_s += t - max(now, self._link_free_at)
            self._link_free_at = t

    def _account(self, so: SchedulerOutput, stall: float, compute: float) -> None:
        st = self.stats
        st.steps += 1
        st.compute_s += compute
        st.stall_s += stall
        st.swap_out_blocks += len(so.swap_out)
        st.swap_in_blocks += len(so.swap_in)
        if stall > 0:
            for seq in so.seqs:
                st.stall_by_request[seq.request_id] += stall
