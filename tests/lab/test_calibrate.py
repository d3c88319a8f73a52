"""Fitting the cost model to recorded steps, and timing steps on a noisy machine."""

from __future__ import annotations

import math
import random

import pytest
from quanta.core.clock import VirtualClock
from quanta.core.output import RunnerOutput, ScheduledSeq, SchedulerOutput
from quanta.costmodel import PROFILES
from quanta.sim.driver import StepSample, time_runner
from quanta_lab.sim.calibrate import fit_steps, predict, report, rescale
from quanta_lab.sim.validate import spread

TRUTH = PROFILES["a100-opt13b"].model_copy(
    update={
        "step_overhead_s": 4e-4,
        "per_seq_s": 2e-5,
        "per_attention_call_s": 8e-5,
        "weights_read_s": 0.0,
        "compute_per_token_s": 5e-6,
        "kv_read_per_token_s": 3e-7,
        "attn_per_pair_s": 2e-8,
        "decode_pad_per_token_s": 4e-7,
        "swap_overlaps_compute": False,
    }
)


def random_steps(rng: random.Random, n: int) -> list[tuple[tuple[int, int], ...]]:
    steps = []
    for _ in range(n):
        decodes = tuple((1, rng.randrange(0, 400)) for _ in range(rng.randrange(0, 9)))
        prefills = tuple(
            (rng.randrange(2, 300), rng.choice((0, 0, 64))) for _ in range(rng.randrange(0, 3))
        )
        steps.append(decodes + prefills or ((1, 0),))
    return steps


def test_the_fit_recovers_a_known_profile_from_its_own_steps():
    rng = random.Random(0)
    samples = [
        StepSample(chunks, copies, predict(TRUTH, StepSample(chunks, copies, 0.0)))
        for chunks in random_steps(rng, 400)
        for copies in [rng.choice((0, 0, 0, 8))]
    ]
    start = TRUTH.model_copy(  # a poor first guess, as the sweep can be
        update={"step_overhead_s": 1e-4, "per_seq_s": 0.0, "compute_per_token_s": 1e-5}
    )
    fitted = fit_steps(start, samples)
    for field in ("step_overhead_s", "per_seq_s", "compute_per_token_s", "per_attention_call_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(TRUTH, field), rel=1e-3), field
    fit = report(fitted, samples)
    assert fit.steps == 400 and fit.median_error < 1e-6 and abs(fit.total_error) < 1e-6


def test_the_fit_never_returns_a_negative_coefficient():
    rng = random.Random(1)
    # Decode steps that get *cheaper* with more context: least squares would go negative.
    samples = [
        StepSample(((1, c),) * b, 0, 1e-3 + 1e-5 * b - 1e-8 * c * b)
        for b, c in ((rng.randrange(1, 9), rng.randrange(0, 300)) for _ in range(200))
    ]
    fitted = fit_steps(TRUTH, samples)
    assert all(
        getattr(fitted, f) >= 0
        for f in ("step_overhead_s", "per_seq_s", "kv_read_per_token_s", "decode_pad_per_token_s")
    )
    assert report(fitted, samples).median_error < 0.05


def test_copies_inside_the_step_are_predicted_only_when_they_do_not_overlap():
    sample = StepSample(((1, 100),), 8, 0.0)
    assert predict(TRUTH, sample) == pytest.approx(
        TRUTH.step_time(sample.chunks) + TRUTH.swap_time(8, 16)
    )
    overlapped = TRUTH.model_copy(update={"swap_overlaps_compute": True})
    assert predict(overlapped, sample) == pytest.approx(overlapped.step_time(sample.chunks))


class SlowThenFast:
    """A runner whose first run of every step is slow (interference) and the rest fast."""

    capabilities = None

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.runs = clock, 0

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.runs += 1
        self.clock[0] += 5.0 if self.runs % 3 == 1 else 1.0
        return RunnerOutput(tuple(s.request_id for s in so.seqs), (7,) * len(so.seqs))


def step(copies: int = 0) -> SchedulerOutput:
    seq = ScheduledSeq("a", (1,), 4, (0,), True, 0.0, 1.0, 0, 0, 0)
    return SchedulerOutput((seq,), swap_in=tuple((i, i) for i in range(copies)))


def test_repeated_steps_are_timed_by_their_fastest_run_and_recorded():
    now = [0.0]
    virtual, record = VirtualClock(), []
    inner = SlowThenFast(now)
    timed = time_runner(inner, virtual, lambda: now[0], record, repeats=3)
    out = timed.execute(step())
    assert out.sampled_token_ids == (7,) and inner.runs == 3
    assert virtual.now() == 1.0 and record == [StepSample(((1, 4),), 0, 1.0)]
    timed.execute(step(copies=2))  # copies are never run twice
    assert inner.runs == 4 and virtual.now() == 6.0 and record[-1].copies == 2


def test_a_repeated_step_that_samples_differently_is_refused():
    class Random(SlowThenFast):
        def execute(self, so: SchedulerOutput) -> RunnerOutput:
            self.runs += 1
            return RunnerOutput(("a",), (self.runs,))

    timed = time_runner(Random([0.0]), VirtualClock(), lambda: 0.0, repeats=2)
    with pytest.raises(RuntimeError, match="not greedy"):
        timed.execute(step())


def test_spread_of_repeated_runs():
    assert spread([1.0, 1.2, 0.9]) == pytest.approx(0.3)
    assert math.isnan(spread([1.0])) and math.isnan(spread([0.0, 0.0]))


def test_a_rescaled_profile_is_the_same_machine_slower():
    slow = rescale(TRUTH, 1.5)
    for chunks in random_steps(random.Random(2), 50):
        assert slow.step_time(chunks) == pytest.approx(1.5 * TRUTH.step_time(chunks))
    assert slow.swap_time(8, 16) == pytest.approx(1.5 * TRUTH.swap_time(8, 16))
    assert slow.num_blocks(16) == TRUTH.num_blocks(16)
