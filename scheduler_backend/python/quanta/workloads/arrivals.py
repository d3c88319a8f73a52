"""When requests arrive: renewal processes (Poisson, or Gamma with a coefficient of variation)
and rates that change over time.

A Gamma renewal process with CV has shape k = 1/CV^2: k = 1 is Poisson, smaller is burstier.
A changing rate (``RateSchedule``: ON/OFF phases, ramps) is made by time rescaling: a
unit-rate process mapped through the inverse of the integrated rate.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from quanta.workloads.model import WorkloadError


def arrival_times(n: int, rate: float, rng: random.Random, cv: float = 1.0) -> list[float]:
    """Arrivals of a renewal process with mean rate ``rate``: Poisson for ``cv == 1``, else
    Gamma inter-arrivals with shape 1/CV^2 (smaller shape is burstier). ``inf``: all at 0."""
    if rate <= 0 or cv <= 0:
        raise WorkloadError(f"need rate > 0 and cv > 0, got rate={rate}, cv={cv}")
    if math.isinf(rate):
        return [0.0] * n
    shape = 1.0 / cv**2
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(t)
    return out


@dataclass(frozen=True, slots=True)
class RateSchedule:
    """A piecewise-constant arrival rate: ``steps`` are (start second, requests/s), the first
    starting at 0. The last rate holds forever, or the whole schedule repeats every
    ``period`` seconds (ON/OFF load)."""

    steps: tuple[tuple[float, float], ...]
    period: float | None = None

    def __post_init__(self) -> None:
        starts = [s for s, _ in self.steps]
        if not self.steps or starts[0] != 0 or starts != sorted(starts):
            raise WorkloadError("steps need increasing start times beginning at 0")
        if any(r < 0 or not math.isfinite(r) for _, r in self.steps):
            raise WorkloadError("rates must be finite and >= 0")
        if self.period is not None and (self.period <= starts[-1] or self._cycle_mass() <= 0):
            raise WorkloadError("period must exceed the last start and carry some arrivals")
        if self.period is None and self.steps[-1][1] <= 0:
            raise WorkloadError("the last rate holds forever, so it must be > 0")

    def _bounds(self) -> Iterator[tuple[float, float, float]]:
        """(start, end, rate) of each step within one period (end inf without a period)."""
        ends = [s for s, _ in self.steps[1:]] + [self.period or math.inf]
        for (start, rate), end in zip(self.steps, ends, strict=True):
            yield start, end, rate

    def _cycle_mass(self) -> float:
        return sum((e - s) * r for s, e, r in self._bounds() if math.isfinite(e))

    def time_at(self, mass: float) -> float:
        """The time by which ``mass`` arrivals are expected (the inverse of the integrated
        rate): mapping a unit-rate process through it gives this schedule's arrivals."""
        offset = 0.0
        if self.period is not None:
            cycles, mass = divmod(mass, self._cycle_mass())
            offset = cycles * self.period
        for start, end, rate in self._bounds():
            if rate > 0 and mass <= (end - start) * rate:
                return offset + start + mass / rate
            mass -= (end - start) * rate
        raise AssertionError("unreachable: the last step carries the remaining mass")

    def times(self, n: int, rng: random.Random, cv: float = 1.0) -> list[float]:
        """``n`` arrivals; within a phase, gaps are Gamma with this CV (1: Poisson)."""
        return [self.time_at(u) for u in arrival_times(n, 1.0, rng, cv)]


def on_off(on_rate: float, on_s: float, off_s: float, off_rate: float = 0.0) -> RateSchedule:
    """ON/OFF load (ConServe §6): ``on_rate`` for ``on_s`` seconds, then ``off_rate``."""
    return RateSchedule(((0.0, on_rate), (on_s, off_rate)), period=on_s + off_s)


def ramp(start_rate: float, end_rate: float, duration_s: float, steps: int = 10) -> RateSchedule:
    """A rate moving linearly from ``start_rate`` to ``end_rate`` in ``steps`` equal steps,
    then holding ``end_rate``."""
    if steps < 1 or duration_s <= 0:
        raise WorkloadError("need steps >= 1 and duration_s > 0")
    width = duration_s / steps
    rates = [start_rate + (end_rate - start_rate) * i / steps for i in range(steps + 1)]
    return RateSchedule(tuple((i * width, r) for i, r in enumerate(rates)))


Arrivals = float | RateSchedule


def arrival_stream(arrivals: Arrivals, rng: random.Random, cv: float) -> Iterator[float]:
    """Arrival times one by one, for generators that do not know in advance how many they
    need (interactions of several calls)."""
    if isinstance(arrivals, RateSchedule):
        for u in _unit_stream(rng, cv):
            yield arrivals.time_at(u)
        return
    if arrivals <= 0:
        raise WorkloadError(f"need a rate > 0, got {arrivals}")
    if math.isinf(arrivals):
        yield from itertools.repeat(0.0)
        return
    for u in _unit_stream(rng, cv):
        yield u / arrivals


def _unit_stream(rng: random.Random, cv: float) -> Iterator[float]:
    if cv <= 0:
        raise WorkloadError(f"need cv > 0, got {cv}")
    shape, t = 1.0 / cv**2, 0.0
    while True:
        t += rng.gammavariate(shape, 1.0 / shape)
        yield t
