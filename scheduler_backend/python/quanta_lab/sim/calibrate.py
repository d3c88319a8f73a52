"""Fit the cost model to steps the engine really ran, not only to hand-built ones.

Steps timed one shape at a time, over and over (``quanta profile``'s sweep), run faster than
the same shapes met inside a serving loop: there the scheduler's Python runs between steps,
every step has a new shape, sequences carry their own block tables and sampling settings. On
``opt-tiny`` the sweep's fit predicted loop steps about 20% short, and near saturation that
bias compounds into queueing errors of 50-90%. So the profile is refitted on a calibration
replay: a seeded trace (not the one a validation uses) served by the real loop for a short
while, every step recorded with its batch composition, and the coefficients refitted by least
squares over those steps plus the sweep (which alone covers long prefills and large batches).

The formula is the cost model's own (``CostModel.step_time``); its two maxima (weights vs
compute, KV read vs attention pairs) are fitted by fixing which side bounds each step under
the current coefficients, refitting, and repeating until the choice settles. Pure Python plus
numpy; the replay itself loads torch.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from quanta.core.config import SchedulerConfig
from quanta.costmodel import CostModel
from quanta.sim.driver import StepSample
from quanta.workloads import arrival_times

# Coefficients the fit sets, in column order.
COEFFICIENTS = (
    "step_overhead_s",
    "per_seq_s",
    "per_attention_call_s",
    "weights_read_s",
    "compute_per_token_s",
    "kv_read_per_token_s",
    "attn_per_pair_s",
    "decode_pad_per_token_s",
)
CALIBRATION_SEED = 9_001  # far from the seeds validations use, so no trace is fitted on itself


@dataclass(frozen=True)
class FitReport:
    """How well a profile predicts a set of measured steps."""

    steps: int
    median_error: float  # median of |predicted - measured| / measured, per step
    total_error: float  # (sum predicted - sum measured) / sum measured: what queueing feels

    def line(self, label: str) -> str:
        return (
            f"{label}: {self.steps} steps, median step error {100 * self.median_error:.0f}%, "
            f"total {100 * self.total_error:+.1f}%"
        )


def predict(cost: CostModel, sample: StepSample, block_size: int = 16) -> float:
    """The profile's time for a recorded step, copies included when they are in the step."""
    return cost.step_time(sample.chunks) + _copies(cost, sample, block_size)


def _copies(cost: CostModel, sample: StepSample, block_size: int) -> float:
    """The part of a recorded step its block copies took, by the profile."""
    return 0.0 if cost.swap_overlaps_compute else cost.swap_time(sample.copies, block_size)


def report(cost: CostModel, samples: Sequence[StepSample], block_size: int = 16) -> FitReport:
    steps = [s for s in samples if s.chunks and s.seconds > 0]
    if not steps:
        return FitReport(0, float("nan"), float("nan"))
    predicted = [predict(cost, s, block_size) for s in steps]
    errors = [abs(p - s.seconds) / s.seconds for p, s in zip(predicted, steps, strict=True)]
    measured = sum(s.seconds for s in steps)
    return FitReport(len(steps), statistics.median(errors), (sum(predicted) - measured) / measured)


def rescale(cost: CostModel, factor: float) -> CostModel:
    """``cost`` on a machine ``factor`` times slower: every time term scaled, memory kept."""
    update: dict[str, float] = {name: getattr(cost, name) * factor for name in COEFFICIENTS}
    update["swap_latency_s"] = cost.swap_latency_s * factor
    update["swap_bandwidth"] = cost.swap_bandwidth / factor
    return cost.model_copy(update=update)


def fit_steps(
    start: CostModel,
    samples: Sequence[StepSample],
    weights: Sequence[float] | None = None,
    *,
    block_size: int = 16,
    rounds: int = 6,
) -> CostModel:
    """``start`` with its step coefficients refitted to ``samples`` (weighted least squares,
    no negative coefficient); swap and memory fields are kept."""
    steps = [(s, w) for s, w in zip(samples, weights or [1.0] * len(samples), strict=True)]
    steps = [(s, w) for s, w in steps if s.chunks and s.seconds > 0]
    if not steps:
        return start
    target = [s.seconds - _copies(start, s, block_size) for s, _ in steps]  # copies are kept
    cost = start
    for _ in range(rounds):
        rows = [_columns(cost, s) for s, _ in steps]
        coef = _nonnegative_lstsq(rows, target, [w for _, w in steps])
        fitted = cost.model_copy(update=dict(zip(COEFFICIENTS, coef, strict=True)))
        if fitted == cost:
            break
        cost = fitted
    return cost


def _columns(cost: CostModel, sample: StepSample) -> list[float]:
    """The step's value for each coefficient, with each maximum resolved to the side that
    bounds it under ``cost``."""
    tokens = sum(new for new, _ in sample.chunks)
    weights_bound = cost.weights_read_s > cost.compute_per_token_s * tokens
    kv = pairs = 0.0
    prefills = decodes = longest = 0
    for new, start in sample.chunks:
        context = start + new
        causal_pairs = new * (start + (new + 1) / 2)
        if cost.attn_per_pair_s > 0:
            by_pairs = cost.attn_per_pair_s * causal_pairs > cost.kv_read_per_token_s * context
        else:  # a dropped term gets its natural chunks back, and another chance each round
            by_pairs = new > 1
        if by_pairs:
            pairs += causal_pairs
        else:
            kv += context
        if new > 1:
            prefills += 1
        else:
            decodes += 1
            longest = max(longest, start + 1)
    return [
        1.0,
        float(len(sample.chunks)),
        float(prefills + (decodes > 0)),
        1.0 if weights_bound else 0.0,
        0.0 if weights_bound else float(tokens),
        kv,
        pairs,
        float(decodes * longest),
    ]


def _nonnegative_lstsq(
    rows: list[list[float]], target: list[float], weights: list[float]
) -> list[float]:
    """Least squares with coefficients >= 0: drop the most negative column and refit until
    none is negative (Lawson-Hanson's outer loop, enough for eight columns)."""
    a = np.array(rows, dtype=float) * np.sqrt(np.array(weights))[:, None]
    b = np.array(target, dtype=float) * np.sqrt(np.array(weights))
    active = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    coef = np.zeros(a.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if solution.min() >= 0:
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return [float(c) for c in coef]


def calibration_steps(
    model: Path,
    cost: CostModel,
    *,
    seconds: float,
    timer: Callable[[], float],
    max_num_seqs: int = 8,
    dtype: str | None = None,
    device: str = "cpu",
    scale: float = 0.25,
    step_repeats: int = 1,
    block_size: int = 16,
) -> list[StepSample]:
    """Steps of a real FCFS replay lasting about ``seconds`` of engine time: ShareGPT-like
    lengths (x ``scale``) arriving at about the capacity ``cost`` estimates, so batches range
    from one sequence to full and prefills mix with decodes."""
    from quanta_lab.sim.engine_replay import bench_trace, pressure_cache, replay
    from quanta_lab.sim.repro import batched_capacity

    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    probe = bench_trace(200, cost.max_model_len, CALIBRATION_SEED, scale)
    capacity = batched_capacity(probe, cost, sched)
    count = int(min(400, max(16, 0.9 * capacity * seconds)))
    trace = bench_trace(count, cost.max_model_len, CALIBRATION_SEED, scale)
    times = arrival_times(count, 0.9 * capacity, random.Random(CALIBRATION_SEED))
    trace = [replace(r, arrival_time=t) for r, t in zip(trace, times, strict=True)]
    cache = pressure_cache(trace, max_num_seqs, cost.max_model_len, block_size)
    samples: list[StepSample] = []
    replay(
        model,
        "fcfs",
        trace,
        sched,
        cache,
        CALIBRATION_SEED,
        cost=cost,
        timer=timer,
        dtype=dtype,
        device=device,
        record=samples,
        step_repeats=step_repeats,
    )
    return samples


def refit(
    start: CostModel,
    sweep: Sequence[StepSample],
    loop: Sequence[StepSample],
    block_size: int = 16,
) -> CostModel:
    """Fit to the loop's steps, with the sweep's points weighted to count about as much as
    one loop step each (so a 2048-token prefill shapes the fit without dominating it)."""
    typical = statistics.median([s.seconds for s in loop if s.chunks]) if loop else 1.0
    weights = [1.0] * len(loop) + [(typical / s.seconds) ** 2 for s in sweep]
    return fit_steps(start, [*loop, *sweep], weights, block_size=block_size)
