"""``quanta bench schedule-step``: what a loop step costs before the runner is called, with
many requests waiting.

``quanta bench scheduler`` times a policy's ``schedule()`` alone. A step does more before
the forward pass: with prefix caching the loop looks up every waiting request's cached
prefix again each step (what is cached changes as blocks are named and evicted), then the
policy decides and the applier checks and applies the decision. Here the real loop runs with
a runner that answers at once and notes when it was called, so a step's scheduling time is
the time from the start of ``step()`` to that call: everything the engine does per step that
is not the model. It is the thread's CPU time, so other processes on a shared machine stay
out of it (but not what they do to the caches).

The steps timed are those with a full batch (``max_num_seqs`` requests decoding) and the
rest waiting, which is when the waiting queue is longest and every request in it is looked up
to no avail. With ``warm`` every waiting prompt was served once before (one token), so its
whole prompt is cached and each lookup walks its longest chain: the worst case for the
lookups. Prompts come as lists of ids, so the same measurement runs on any version of the
loop (``time_steps`` needs only what the loop had before prefix caching).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.loop import EngineLoop
from quanta.core.output import RunnerCapabilities, RunnerOutput, SchedulerOutput
from quanta.core.request import Request, RequestStatus, SamplingParams
from quanta.core.safepoint import StepAborted
from quanta.policies import make_policy


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Scheduling time per step of one configuration."""

    policy: str
    prefix_caching: bool
    num_waiting: int  # waiting requests during the timed steps (at least)
    num_running: int
    steps: int
    median_ms: float
    p90_ms: float
    min_ms: float  # the step least disturbed by whatever else shared the machine
    cached_tokens: int  # tokens the waiting requests' lookups found, at the last timed step


class _StampRunner:
    """Samples a fixed token for every row that samples and notes when it was called: what
    the loop did before that call is the step's scheduling.

    It offers what the model runner offers for a multi-head model, so every system can be
    timed: a hidden cache (it keeps no cache of either kind, so both read alike) and layer
    safepoints (its one "layer" ends at a safepoint that honours the step's abort signal)."""

    capabilities = RunnerCapabilities(hidden_cache=True, layer_safepoints=True)

    def __init__(self) -> None:
        self.called = 0.0

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.called = time.thread_time()
        if so.abort is not None and so.abort.is_set():
            raise StepAborted(layer=0)
        return RunnerOutput(
            tuple(s.request_id for s in so.seqs), tuple(5 if s.sample else None for s in so.seqs)
        )


def time_steps(
    prompts: Sequence[Sequence[int]],
    policy: str,
    *,
    prefix_caching: bool,
    warm: bool = False,
    max_num_seqs: int = 32,
    steps: int = 60,
    block_size: int = 16,
) -> StepTiming:
    """Scheduling time of ``steps`` steps in which the first ``max_num_seqs`` prompts decode
    and every prompt waits behind them once more (so ``len(prompts)`` requests wait); with
    ``warm`` and ``prefix_caching``, each prompt was served once before (see the module doc)."""
    batch, waiting = list(prompts[:max_num_seqs]), list(prompts)
    longest = max(len(p) for p in prompts)
    gen = 4 * steps + 256  # NOTE: nobody finishes while the steps are timed
    per_request = -(-(longest + gen) // block_size)
    distinct = sum(-(-len(p) // block_size) for p in prompts)  # room to keep every prompt cached
    device = per_request * max_num_seqs + (distinct if prefix_caching else 0) + 16
    runner = _StampRunner()
    clock = VirtualClock()
    kwargs = {"prefix_caching": True} if prefix_caching else {}  # NOTE: older loops had no cache
    loop = EngineLoop(
        runner=runner,
        policy=make_policy(policy, SchedulerConfig(max_num_seqs=max_num_seqs)),
        blocks=BlockManager(block_size, device, 0, **kwargs),
        clock=clock,
        max_model_len=longest + gen,
    )
    if warm and prefix_caching:
        _serve(loop, clock, "warm", waiting, 1)
    _submit(loop, clock, "run", batch, gen)
    queued = _submit(loop, clock, "wait", waiting, gen)
    while loop.stats().num_running < len(batch):  # NOTE: the batch's prefills, untimed
        _step(loop, clock)
    times = []
    for _ in range(steps):
        started = time.thread_time()
        _step(loop, clock)
        times.append(runner.called - started)
    stats = loop.stats()
    cached = sum(
        getattr(r, "num_cached_tokens", 0) for r in queued if r.status is RequestStatus.WAITING
    )
    return StepTiming(
        policy,
        prefix_caching,
        stats.num_waiting,
        stats.num_running,
        steps,
        1e3 * statistics.median(times),
        1e3 * sorted(times)[int(0.9 * (len(times) - 1))],
        1e3 * min(times),
        cached,
    )


def _submit(
    loop: EngineLoop, clock: VirtualClock, tag: str, prompts: Sequence[Sequence[int]], n: int
) -> list[Request]:
    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    requests = [Request(f"{tag}{i}", list(ids), params, clock.now(), i) for i, ids in
                enumerate(prompts)]  # fmt: skip
    for r in requests:
        loop.submit(r, lambda _: None)
    return requests


def _serve(
    loop: EngineLoop, clock: VirtualClock, tag: str, prompts: Sequence[Sequence[int]], n: int
) -> None:
    _submit(loop, clock, tag, prompts, n)
    while loop.has_unfinished():
        _step(loop, clock)


def _step(loop: EngineLoop, clock: VirtualClock) -> None:
    if not loop.step():
        raise RuntimeError("the loop had nothing to do: no step to time")
    clock.advance(0.01)


def workload_prompts(
    workload: str, n: int, *, seed: int = 0, max_len: int = 2048
) -> list[list[int]]:
    """The prompt ids of ``n`` rows of a named workload (``chat``: turns that repeat their
    conversation so far; ``sharegpt``: unrelated prompts), as the simulator makes them."""
    from quanta.workloads import make_workload
    from quanta.workloads.prompts import PromptIds

    ids = PromptIds(seed=seed)
    rows = make_workload(workload, n, 1.0, seed=seed, max_len=max_len)
    return [ids.of(row, i) for i, row in enumerate(rows)]


def bench_schedule_step(
    policies: Sequence[str],
    prompts: Sequence[Sequence[int]],
    *,
    warm: bool = False,
    max_num_seqs: int = 32,
    steps: int = 60,
    echo: Callable[[str], object] = print,
) -> list[StepTiming]:
    """Each policy with prefix caching off, then on; the ratio of their medians."""
    out = []
    for name in policies:
        off = time_steps(prompts, name, prefix_caching=False, warm=warm,
                         max_num_seqs=max_num_seqs, steps=steps)  # fmt: skip
        on = time_steps(prompts, name, prefix_caching=True, warm=warm,
                        max_num_seqs=max_num_seqs, steps=steps)  # fmt: skip
        out += [off, on]
        for t in (off, on):
            echo(
                f"{name:>10} prefix caching {'on ' if t.prefix_caching else 'off'}: "
                f"{t.median_ms:7.2f} ms per step (min {t.min_ms:.2f}, p90 {t.p90_ms:.2f}), "
                f"{t.num_waiting} waiting, "
                f"{t.num_running} running, {t.cached_tokens} tokens of theirs cached"
            )
        echo(f"{name:>10} on / off: {on.median_ms / off.median_ms:.2f}x")
    return out
