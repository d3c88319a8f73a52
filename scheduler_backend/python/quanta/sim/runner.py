"""A runner with no tensors: each step advances a virtual clock by the cost model's time.

Block copies run on one host link, in order (swap-outs first, as the real runner does), and
overlap compute; a step's forward pass waits only for the copies of blocks it touches. So a
swap-in issued for a job that runs in the same step (reactive) sits on the critical path,
while one issued a step ahead (proactive) hides behind the other jobs' iteration, and a
swapped-out block is reused only once its copy has left: FastServe's Fig. 9 as a timeline.
A profile whose copies do not overlap compute (``swap_overlaps_compute=False``, the CPU
engine, which copies inside ``execute`` before the forward pass) puts every copy of a step on
its critical path instead.

Layer safepoints (ConServe): a step the loop marks preemptible (``abort`` set) runs
``safepoint_overhead`` slower and polls every ``safepoint_interval`` layers; the driver's
``interrupt`` hook says when, inside the step, an arrival raises the signal, and the step stops
at the next safepoint after it, raising ``StepAborted`` with nothing sampled. Checkpoint copies
follow the forward pass on the host link: behind the next steps when copies overlap compute,
at the end of this step when they do not.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from quanta.core.clock import VirtualClock
from quanta.core.output import RunnerCapabilities, RunnerOutput, SchedulerOutput
from quanta.core.safepoint import StepAborted
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
    checkpoint_blocks: int = 0  # blocks copied to the host after a step (incremental checkpoints)
    safepoint_aborts: int = 0
    aborted_compute_s: float = 0.0  # forward-pass time of aborted steps, thrown away
    abort_wait_s: float = 0.0  # from each aborting arrival to the safepoint that stopped the step
    abort_end_wait_s: float = 0.0  # ... and to the end the step would have had without it
    # (start, end, preemptible) of every step, a stopped one ending at its safepoint: what an
    # arrival inside it waited for before the loop could take it, and whether it could have
    # stopped the step (``quanta_lab.sim.safepoint_repro.head_of_line_waits``)
    spans: list[tuple[float, float, bool]] = field(default_factory=list)
    stall_by_request: dict[str, float] = field(default_factory=lambda: defaultdict(float))


# (step start, step end) -> when an arrival inside the step raises its abort signal, or None
Interrupt = Callable[[float, float], float | None]


class SimRunner:
    """Implements the ``Runner`` protocol from a ``CostModel`` and a ``VirtualClock``."""

    capabilities = RunnerCapabilities(hidden_cache=True, layer_safepoints=True, async_swap=True)

    def __init__(
        self,
        cost: CostModel,
        clock: VirtualClock,
        block_size: int,
        token_id: int = 1,
        *,
        safepoint_interval: int = 8,
    ) -> None:
        if safepoint_interval < 1:
            raise ValueError(f"safepoint_interval must be >= 1, got {safepoint_interval}")
        self.cost, self.clock, self.block_size = cost, clock, block_size
        self.token_id = token_id  # NOTE: requests stop by length (ignore_eos), never by token
        self.safepoint_interval = safepoint_interval
        self.interrupt: Interrupt | None = None  # set by the driver, which knows the arrivals
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
        if so.abort is not None:
            compute *= 1.0 + self.cost.safepoint_overhead
        if not self.cost.swap_overlaps_compute:
            wait_until = max(start, self._link_free_at)  # every copy, touched or not
        end = wait_until + compute if so.seqs else max(start, self._link_free_at)
        if so.abort is not None and so.seqs and self.interrupt is not None:
            raised = self.interrupt(start, end)
            if raised is not None:
                self._stop_at_safepoint(so, start, wait_until, compute, raised)
        end = self._checkpoint(so, end)
        self._account(so, wait_until - start, compute)
        self.stats.spans.append((start, end, so.abort is not None))
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
        self.stats.swap_out_blocks += len(so.swap_out)
        self.stats.swap_in_blocks += len(so.swap_in)
        if so.swap_out or so.swap_in:
            self.stats.copy_busy_s += t - max(now, self._link_free_at)
            self._link_free_at = t

    def _stop_at_safepoint(
        self, so: SchedulerOutput, start: float, begin: float, compute: float, raised: float
    ) -> None:
        """Raise ``StepAborted`` at the first safepoint at or after ``raised``; return (the
        step completes) when the forward pass ends before another safepoint comes.

        Safepoints follow layers k, 2k, ... (k = ``safepoint_interval``) of a forward pass
        that began at ``begin``, each layer ``compute / num_layers`` long. The copies issued
        before the pass stay queued; the checkpoint copies are never made."""
        layers, k = self.cost.num_layers, self.safepoint_interval
        per_layer = compute / layers
        if per_layer <= 0:
            return
        done = max(k, k * math.ceil((raised - begin) / per_layer / k - 1e-9))
        if done >= layers:
            return  # the pass ends before the next poll
        stop = begin + done * per_layer
        assert so.abort is not None  # NOTE: checked by the caller
        so.abort.raise_at(raised)  # as the submitting thread would have
        st = self.stats
        st.safepoint_aborts += 1
        st.aborted_compute_s += stop - begin
        st.abort_wait_s += stop - raised
        st.abort_end_wait_s += begin + compute - raised
        st.stall_s += begin - start
        st.spans.append((start, stop, True))
        self.clock.set(stop)
        self._ready_at = {b: t for b, t in self._ready_at.items() if t > stop}
        raise StepAborted(done, stop - start)

    def _checkpoint(self, so: SchedulerOutput, end: float) -> float:
        """Queue the checkpoint copies after the forward pass; the step's end (later than
        ``end`` only when copies do not overlap compute).

        NOTE: the owner keeps using a block being checkpointed (the copy only reads it), so
        no block waits for these copies."""
        if not so.checkpoint:
            return end
        t0 = max(end, self._link_free_at)
        self._link_free_at = t0 + self.cost.swap_time(len(so.checkpoint), self.block_size)
        self.stats.copy_busy_s += self._link_free_at - t0
        self.stats.checkpoint_blocks += len(so.checkpoint)
        return end if self.cost.swap_overlaps_compute else self._link_free_at

    def _account(self, so: SchedulerOutput, stall: float, compute: float) -> None:
        st = self.stats
        st.steps += 1
        st.compute_s += compute
        st.stall_s += stall
        if stall > 0:
            for seq in so.seqs:
                st.stall_by_request[seq.request_id] += stall
