"""Seeded workloads: who sends what, when — and the one JSONL file format that stores them.

A workload is a list of ``WorkloadRequest``: an arrival offset, a prompt (length, optionally
text), an output length, and the scheduling metadata the policies read (tenant, app,
interaction, online/offline class, SLOs). ``quanta bench``, ``quanta simulate`` and Locust all
read the same file (``save_workload`` / ``load_workload``), so a simulated run and a live run
can be fed exactly the same requests.

Length distributions are *approximations* of published statistics (the datasets cannot be
downloaded here): independent log-normal input and output lengths with the quoted means.

=========  ============  =============  =====================================================
name       mean in/out   sigma in/out   source of the means / shape
=========  ============  =============  =====================================================
sharegpt   161 / 338     1.0 / 0.9      vLLM paper (OPT tokenizer); heavy tail, our sigma
alpaca     19 / 58       0.6 / 0.8      vLLM paper (8.4x shorter inputs, 5.8x shorter outputs)
humaneval  150 / 70      0.35 / 0.45    164 problems, signature+docstring prompts; Apt-Serve
                                        §6.2: shorter outputs, low variance in both (our means)
longbench  1500 / 300    0.35 / 0.6     LongBench summarisation clipped to OPT's 2048 tokens
                                        (Apt-Serve §6.1 fn. 5): inputs ~10x ShareGPT, outputs
                                        comparable to ShareGPT (Apt-Serve §6.2; our means)
=========  ============  =============  =====================================================

Samples are redrawn until prompt + output fits ``max_len``, so for ``longbench`` the realised
means sit below the table's. Arrivals are Poisson, Gamma renewal with a coefficient of
variation (shape k = 1/CV^2: k = 1 is Poisson, smaller is burstier), or a rate that changes
over time (``RateSchedule``: ON/OFF phases, ramps) through time rescaling. Tenants send a
weighted share of the interactions (an abusive tenant has a large weight); an interaction is
one or more consecutive calls of one user in one app, sharing an ``interaction_id``.

File format (JSONL, one request per line; written by ``save_workload``)::

    {"request_id": "r0", "arrival_time": 0.31, "prompt_tokens": 96, "output_tokens": 48,
     "tenant": "t1", "app": "chat", "interaction_id": "t1-i0", "priority_class": "online",
     "ttft_slo_ms": 1000, "tpot_slo_ms": 100, "prompt": "optional text"}

Only ``output_tokens`` and one of ``prompt_tokens`` / ``prompt`` are required. ``arrival_time``
is an offset in seconds from the start of the run and is kept as is; ``timestamp`` is a trace's
own clock and is rebased so the first request arrives at 0. Accepted aliases: ``input_len`` /
``input_tokens`` (prompt_tokens), ``output_len`` / ``max_tokens`` (output_tokens), ``user``
(tenant). BurstGPT CSV traces (``Timestamp, Model, Request tokens, Response tokens, Total
tokens, Log Type``) are read too: ``Model`` becomes the app, ``Log Type`` the tenant, rows with
0 request or response tokens (failed requests in BurstGPT) are skipped. A bad row stops loading
with ``path:line: problem``.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

PriorityClass = Literal["online", "offline"]
CLASSES: tuple[PriorityClass, ...] = ("online", "offline")


class WorkloadError(ValueError):
    """A workload file or spec is malformed; the message names the line and the problem."""


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request. Field names are the file's keys; ``input_len``/``output_len`` mirror the
    simulator's former ``TraceRequest`` so its driver reads either."""

    arrival_time: float  # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int
    request_id: str = ""
    prompt: str | None = None  # text to send; None: ``prompt_tokens`` synthetic token ids
    tenant: str = "default"
    app: str = "default"
    interaction_id: str | None = None
    priority_class: PriorityClass = "online"
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    @property
    def input_len(self) -> int:
        return self.prompt_tokens

    @property
    def output_len(self) -> int:
        return self.output_tokens

    def metadata(self) -> dict[str, Any]:
        """Keyword arguments of ``quanta.core.request.RequestMetadata``."""
        return {
            "tenant": self.tenant,
            "app": self.app,
            "interaction_id": self.interaction_id,
            "priority_class": self.priority_class,
            "ttft_slo_ms": self.ttft_slo_ms,
            "tpot_slo_ms": self.tpot_slo_ms,
        }

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object: required keys always, optional ones when not default (an
        empty ``request_id`` is left out: loading names it ``r<index>``)."""
        out: dict[str, Any] = {"request_id": self.request_id} if self.request_id else {}
        out |= {
            "arrival_time": self.arrival_time,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        for key, default in _OPTIONAL_DEFAULTS.items():
            value = getattr(self, key)
            if value != default:
                out[key] = value
        return out


_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "tenant": "default",
    "app": "default",
    "interaction_id": None,
    "priority_class": "online",
    "ttft_slo_ms": None,
    "tpot_slo_ms": None,
    "prompt": None,
}

# The simulator's former name; same positional fields (arrival, input, output).
TraceRequest = WorkloadRequest


# -- lengths -------------------------------------------------------------------------------
class LengthSampler(Protocol):
    """Draws (prompt tokens, output tokens) that fit ``max_len`` together."""

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Independent log-normal input and output lengths with the given means."""

    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]:
        mu_in = math.log(self.mean_input) - self.sigma_input**2 / 2
        mu_out = math.log(self.mean_output) - self.sigma_output**2 / 2
        while True:
            n_in = max(1, round(rng.lognormvariate(mu_in, self.sigma_input)))
            n_out = max(1, round(rng.lognormvariate(mu_out, self.sigma_output)))
            if n_in + n_out <= max_len:
                return n_in, n_out


@dataclass(frozen=True, slots=True)
class UniformLengths:
    """Uniform integer lengths in [lo, hi] (inclusive): easy to reason about in small runs."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def __post_init__(self) -> None:
        for lo, hi in (self.prompt, self.output):
            if not 1 <= lo <= hi:
                raise WorkloadError(f"need 1 <= lo <= hi, got {lo}:{hi}")

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]:
        if self.prompt[0] + self.output[0] > max_len:
            raise WorkloadError(f"{self} cannot fit max_len={max_len}")
        while True:
            n_in, n_out = rng.randint(*self.prompt), rng.randint(*self.output)
            if n_in + n_out <= max_len:
                return n_in, n_out


DATASETS: dict[str, LengthDist] = {
    "sharegpt": LengthDist(161, 338, sigma_input=1.0, sigma_output=0.9),
    "alpaca": LengthDist(19, 58, sigma_input=0.6, sigma_output=0.8),
    "humaneval": LengthDist(150, 70, sigma_input=0.35, sigma_output=0.45),
    "longbench": LengthDist(1500, 300, sigma_input=0.35, sigma_output=0.6),
}


def length_sampler(spec: str | LengthSampler) -> LengthSampler:
    """A dataset name, ``uniform:IN_LO-IN_HI:OUT_LO-OUT_HI``, or a sampler passed through."""
    if not isinstance(spec, str):
        return spec
    if spec in DATASETS:
        return DATASETS[spec]
    if spec.startswith("uniform:"):
        try:
            _, p, o = spec.split(":")
            (a, b), (c, d) = (tuple(int(x) for x in part.split("-")) for part in (p, o))
        except ValueError:
            raise WorkloadError(f"bad length spec {spec!r}; e.g. uniform:64-128:32-64") from None
        return UniformLengths((a, b), (c, d))
    known = ", ".join(sorted(DATASETS))
    raise WorkloadError(f"unknown lengths {spec!r}; datasets: {known}, or uniform:64-128:32-64")


# -- arrivals ------------------------------------------------------------------------------
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


def _arrival_stream(arrivals: Arrivals, rng: random.Random, cv: float) -> Iterator[float]:
    """Arrival times one by one (the number of interactions is not known in advance)."""
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


# -- tenants, apps, interactions -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class App:
    """What one application's calls look like. An interaction makes ``calls`` consecutive
    calls (uniform in [lo, hi]); each follow-up is sent an exponential gap with mean
    ``call_gap_s`` after the previous one was *sent* (open loop: a trace cannot wait for a
    response, so this approximates FairServe's multi-call interactions)."""

    name: str = "default"
    lengths: str | LengthSampler = "sharegpt"
    calls: tuple[int, int] = (1, 1)
    call_gap_s: float = 1.0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.calls[0] <= self.calls[1] or self.call_gap_s < 0:
            raise WorkloadError(f"app {self.name!r}: need 1 <= calls lo <= hi, call_gap_s >= 0")


@dataclass(frozen=True, slots=True)
class Tenant:
    """A user: ``weight`` is its share of interactions (an abusive tenant's is large)."""

    name: str
    weight: float = 1.0
    apps: tuple[str, ...] = ("default",)
    priority_class: PriorityClass = "online"

    def __post_init__(self) -> None:
        if self.weight <= 0 or not self.apps or self.priority_class not in CLASSES:
            raise WorkloadError(f"tenant {self.name!r}: need weight > 0, apps, a known class")


def tenant_mix(spec: str, *, apps: tuple[str, ...] = ("default",)) -> list[Tenant]:
    """``"gold:1,silver:2,abuser:20"`` -> weighted tenants (the Locust option's syntax)."""
    tenants = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        try:
            tenants.append(Tenant(name, float(weight or 1), apps))
        except ValueError:
            raise WorkloadError(f"bad tenant mix {spec!r}; e.g. gold:1,silver:2") from None
    if not tenants:
        raise WorkloadError("empty tenant mix")
    return tenants


def synthesize(
    num_requests: int,
    *,
    arrivals: Arrivals = 1.0,
    cv: float = 1.0,
    lengths: str | LengthSampler = "sharegpt",
    tenants: Sequence[Tenant] | None = None,
    apps: Sequence[App] | None = None,
    seed: int = 0,
    max_len: int = 2048,
    id_prefix: str = "r",
) -> list[WorkloadRequest]:
    """``num_requests`` requests: interactions start at the arrival process's times, each
    picks a tenant by weight, one of its apps, and a number of calls.

    Arrivals, lengths and the tenant/app draws use separate seeded streams, so the same seed
    gives the same lengths at every rate and the same arrival times at every length mix.
    ``lengths`` is the default app's; ``interaction_id`` is set on multi-call interactions.
    """
    if num_requests < 0:
        raise WorkloadError("num_requests must be >= 0")
    app_by_name = {a.name: a for a in apps or (App(lengths=lengths),)}
    tenants = list(tenants or [Tenant("default", apps=(next(iter(app_by_name)),))])
    for t in tenants:
        missing = [a for a in t.apps if a not in app_by_name]
        if missing:
            raise WorkloadError(f"tenant {t.name!r} uses unknown apps {missing}")
    samplers = {name: length_sampler(a.lengths) for name, a in app_by_name.items()}
    starts = _arrival_stream(arrivals, random.Random(f"{seed}-arrivals"), cv)
    rng_len, rng_mix = random.Random(f"{seed}-lengths"), random.Random(f"{seed}-mix")
    weights = [t.weight for t in tenants]
    calls: list[tuple[float, int, WorkloadRequest]] = []
    times: list[float] = []  # sorted arrival times, to know when no earlier call can come
    for k in itertools.count():
        t0 = next(starts)
        if len(times) >= num_requests and (num_requests == 0 or t0 >= times[num_requests - 1]):
            break
        tenant = rng_mix.choices(tenants, weights)[0]
        app = app_by_name[rng_mix.choice(tenant.apps)]
        n_calls = rng_mix.randint(*app.calls)
        iid = f"{tenant.name}-i{k}" if n_calls > 1 else None
        t = t0
        for j in range(n_calls):
            if j:
                t += rng_mix.expovariate(1 / app.call_gap_s) if app.call_gap_s else 0.0
            n_in, n_out = samplers[app.name].sample(rng_len, max_len)
            req = WorkloadRequest(
                t,
                n_in,
                n_out,
                tenant=tenant.name,
                app=app.name,
                interaction_id=iid,
                priority_class=tenant.priority_class,
                ttft_slo_ms=app.ttft_slo_ms,
                tpot_slo_ms=app.tpot_slo_ms,
            )
            calls.append((t, len(calls), req))
            bisect.insort(times, t)
    calls.sort(key=lambda c: (c[0], c[1]))
    return [
        replace(r, request_id=f"{id_prefix}{i}") for i, (_, _, r) in enumerate(calls[:num_requests])
    ]


def offline_batch(
    num_requests: int,
    *,
    lengths: str | LengthSampler = "longbench",
    at: float = 0.0,
    tenant: str = "batch",
    app: str = "batch",
    seed: int = 0,
    max_len: int = 2048,
    id_prefix: str = "b",
) -> list[WorkloadRequest]:
    """Offline (batch-API) requests all submitted at ``at`` (ConServe's offline jobs)."""
    rng, sampler = random.Random(f"{seed}-offline"), length_sampler(lengths)
    return [
        WorkloadRequest(
            at,
            *sampler.sample(rng, max_len),
            request_id=f"{id_prefix}{i}",
            tenant=tenant,
            app=app,
            priority_class="offline",
        )
        for i in range(num_requests)
    ]


def merge(*workloads: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """One workload ordered by arrival; request ids must not collide."""
    out = sorted(itertools.chain(*workloads), key=lambda r: r.arrival_time)
    ids = [r.request_id for r in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise WorkloadError(f"request id {dup!r} appears twice; use distinct id_prefix values")
    return out


# -- transformations -----------------------------------------------------------------------
def rebase(requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """Shift times so the first request arrives at 0."""
    t0 = min((r.arrival_time for r in requests), default=0.0)
    return [replace(r, arrival_time=r.arrival_time - t0) for r in requests]


def scale_to_rate(requests: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """Stretch or squeeze a trace's times so its mean rate is ``rate`` (bursts keep their
    shape): how ConServe replays BurstGPT at the rate a small testbed can serve."""
    out = rebase(requests)
    last = max((r.arrival_time for r in out), default=0.0)
    if len(out) < 2 or last <= 0 or rate <= 0:
        raise WorkloadError("need >= 2 requests spread over time and rate > 0")
    factor = (len(out) - 1) / rate / last
    return [replace(r, arrival_time=r.arrival_time * factor) for r in out]


def with_io_ratio(
    trace: Sequence[WorkloadRequest], ratio: float, max_len: int
) -> list[WorkloadRequest]:
    """FastServe Fig. 14: the same jobs with mean input / mean output = ``ratio``.

    Every input length is scaled by one factor and every output length by another, so each
    distribution keeps its shape while the mean total length is preserved; lengths are then
    clipped to [1, max_len - 1] and to the model.
    """
    if ratio <= 0 or not trace:
        raise WorkloadError("need ratio > 0 and a non-empty trace")
    mean_in = sum(r.prompt_tokens for r in trace) / len(trace)
    mean_out = sum(r.output_tokens for r in trace) / len(trace)
    total = mean_in + mean_out
    a, b = total * ratio / (1 + ratio) / mean_in, total / (1 + ratio) / mean_out
    out = []
    for r in trace:
        n_in = min(max_len - 1, max(1, round(r.prompt_tokens * a)))
        n_out = min(max_len - n_in, max(1, round(r.output_tokens * b)))
        out.append(replace(r, prompt_tokens=n_in, output_tokens=n_out))
    return out


def make_workload(
    name_or_path: str,
    num_requests: int,
    rate: float,
    *,
    seed: int = 0,
    cv: float = 1.0,
    max_len: int = 2048,
) -> list[WorkloadRequest]:
    """The simulator's entry point: a dataset name or a trace file (JSONL or BurstGPT CSV).

    A dataset draws all lengths, then Poisson/Gamma arrivals from one ``Random(seed)`` (the
    former ``quanta.sim.workloads`` order, so seeded simulations are unchanged). A file's
    first ``num_requests`` rows are used with times rebased to 0; a file without times gets
    arrivals from ``rate``/``cv``; rows longer than ``max_len`` are dropped.
    """
    if name_or_path in DATASETS:
        rng = random.Random(seed)
        dist = DATASETS[name_or_path]
        lengths = [dist.sample(rng, max_len) for _ in range(num_requests)]
        times = arrival_times(num_requests, rate, rng, cv)
        return [
            WorkloadRequest(t, i, o, request_id=f"r{k}")
            for k, (t, (i, o)) in enumerate(zip(times, lengths, strict=True))
        ]
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(DATASETS))
        raise WorkloadError(f"workload {name_or_path!r} is neither a dataset ({known}) nor a file")
    rows = rebase(load_workload(path, rate=rate, cv=cv, seed=seed)[:num_requests])
    return [r for r in rows if r.prompt_tokens + r.output_tokens <= max_len]


# -- files ---------------------------------------------------------------------------------
def save_workload(path: str | Path, requests: Sequence[WorkloadRequest]) -> Path:
    """Write the JSONL workload file (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
    return path


_ALIASES = {
    "timestamp": "timestamp",
    "arrival_time": "arrival_time",
    "prompt_tokens": "prompt_tokens",
    "input_len": "prompt_tokens",
    "input_tokens": "prompt_tokens",
    "output_tokens": "output_tokens",
    "output_len": "output_tokens",
    "max_tokens": "output_tokens",
    "user": "tenant",
    **{k: k for k in ("request_id", *_OPTIONAL_DEFAULTS)},
}


def load_workload(
    path: str | Path,
    *,
    rate: float | None = None,
    cv: float = 1.0,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> list[WorkloadRequest]:
    """Read a JSONL workload or a BurstGPT CSV, ordered by arrival.

    Rows without times get arrivals from ``rate``/``cv`` (seeded), which is then required.
    A ``prompt`` without ``prompt_tokens`` is measured with ``count_tokens`` (default: about
    4 characters per token, an estimate; the server counts the real tokens of sent text).
    """
    path = Path(path)
    if path.suffix.lower() == ".csv":
        rows = _read_burstgpt(path)
    else:
        rows = _read_jsonl(path, count_tokens or _estimate_tokens)
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    untimed = [line for line, _, t, _ in rows if t is None]
    if untimed and len(untimed) < len(rows):
        raise WorkloadError(f"{path}:{untimed[0]}: no arrival_time/timestamp, unlike other rows")
    if untimed:
        if rate is None:
            raise WorkloadError(f"{path}: no arrival times in the file; give a rate")
        times = arrival_times(len(rows), rate, random.Random(seed), cv)
        reqs = [replace(r, arrival_time=t) for (_, r, _, _), t in zip(rows, times, strict=True)]
    else:
        reqs = [replace(r, arrival_time=t) for _, r, t, _ in rows]  # type: ignore[arg-type]
        if any(clock for *_, clock in rows):
            reqs = rebase(reqs)
    seen: dict[str, int] = {}
    for (line, *_), r in zip(rows, reqs, strict=True):
        if r.request_id in seen:
            raise WorkloadError(
                f"{path}:{line}: request_id {r.request_id!r} already used on line "
                f"{seen[r.request_id]}"
            )
        seen[r.request_id] = line
    return sorted(reqs, key=lambda r: r.arrival_time)


# (line, request without its time, time or None, whether the time is a trace clock)
_Row = tuple[int, WorkloadRequest, float | None, bool]


def _read_jsonl(path: Path, count_tokens: Callable[[str], int]) -> list[_Row]:
    rows: list[_Row] = []
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{line}: not JSON ({exc.msg})") from None
            try:
                req, when, clock = _parse_object(obj, len(rows), count_tokens)
            except WorkloadError as exc:
                raise WorkloadError(f"{path}:{line}: {exc}") from None
            rows.append((line, req, when, clock))
    return rows


def _parse_object(
    obj: Any, index: int, count_tokens: Callable[[str], int]
) -> tuple[WorkloadRequest, float | None, bool]:
    if not isinstance(obj, dict):
        raise WorkloadError(f"expected a JSON object, got {type(obj).__name__}")
    fields: dict[str, Any] = {}
    for key, value in obj.items():
        name = _ALIASES.get(key)
        if name is None:
            raise WorkloadError(f"unknown field {key!r} (known: {', '.join(sorted(_ALIASES))})")
        if name in fields:
            raise WorkloadError(f"field {name!r} given twice (through an alias)")
        fields[name] = value
    if "timestamp" in fields and "arrival_time" in fields:
        raise WorkloadError("give arrival_time or timestamp, not both")
    clock = "timestamp" in fields
    when = fields.pop("timestamp", fields.pop("arrival_time", None))
    if when is not None:
        when = _number(when, "arrival_time" if not clock else "timestamp", minimum=0.0)
    prompt = fields.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise WorkloadError("prompt must be a non-empty string")
    if "prompt_tokens" in fields:
        fields["prompt_tokens"] = _count(fields["prompt_tokens"], "prompt_tokens")
    elif prompt is not None:
        fields["prompt_tokens"] = max(1, count_tokens(prompt))
    else:
        raise WorkloadError("needs prompt_tokens or prompt")
    if "output_tokens" not in fields:
        raise WorkloadError("needs output_tokens")
    fields["output_tokens"] = _count(fields["output_tokens"], "output_tokens")
    for key in ("tenant", "app", "interaction_id", "request_id"):
        if key in fields and fields[key] is not None and not isinstance(fields[key], str):
            raise WorkloadError(f"{key} must be a string")
    if fields.get("priority_class", "online") not in CLASSES:
        got = fields["priority_class"]
        raise WorkloadError(f"priority_class must be online or offline, got {got!r}")
    for key in ("ttft_slo_ms", "tpot_slo_ms"):
        if fields.get(key) is not None:
            fields[key] = _number(fields[key], key, minimum=0.0, strict=True)
    if not fields.get("request_id"):
        fields["request_id"] = f"r{index}"
    return WorkloadRequest(arrival_time=0.0, **fields), when, clock


def _read_burstgpt(path: Path) -> list[_Row]:
    need = ("Timestamp", "Request tokens", "Response tokens")
    rows: list[_Row] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise WorkloadError(f"{path}:1: BurstGPT header lacks {missing}; need {list(need)}")
        for row in reader:
            line = reader.line_num
            try:
                req = _parse_burstgpt(row, len(rows))
            except WorkloadError as exc:
                raise WorkloadError(f"{path}:{line}: {exc}") from None
            if req is not None:
                rows.append((line, req[0], req[1], True))
    return rows


def _parse_burstgpt(
    row: Mapping[str, str | None], index: int
) -> tuple[WorkloadRequest, float] | None:
    if None in row or any(v is None for v in row.values()):
        raise WorkloadError("wrong number of columns")
    when = _number(row["Timestamp"], "Timestamp", minimum=0.0)
    n_in = _count(row["Request tokens"], "Request tokens", minimum=0)
    n_out = _count(row["Response tokens"], "Response tokens", minimum=0)
    total = row.get("Total tokens")
    if total not in (None, "") and _count(total, "Total tokens", minimum=0) != n_in + n_out:
        raise WorkloadError(f"Total tokens {total} != Request tokens + Response tokens")
    if n_in == 0 or n_out == 0:  # BurstGPT logs failed requests with 0 tokens: not replayable
        return None
    req = WorkloadRequest(
        0.0,
        n_in,
        n_out,
        request_id=f"r{index}",
        app=(row.get("Model") or "default").strip() or "default",
        tenant=(row.get("Log Type") or "default").strip() or "default",
    )
    return req, when


def _count(value: Any, name: str, *, minimum: int = 1) -> int:
    """An integer token count (``"12"`` and ``12.0`` are accepted, ``12.5`` is not)."""
    try:
        number = float(value) if isinstance(value, str | int | float) else math.nan
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not number.is_integer() or number < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(number)


def _number(value: Any, name: str, *, minimum: float, strict: bool = False) -> float:
    try:
        number = float(value) if isinstance(value, str | int | float) else math.nan
    except ValueError:
        number = math.nan
    bad = number <= minimum if strict else number < minimum
    if isinstance(value, bool) or not math.isfinite(number) or bad:
        op = ">" if strict else ">="
        raise WorkloadError(f"{name} must be a number {op} {minimum:g}, got {value!r}")
    return number


def _estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / 4))


# -- to the client -------------------------------------------------------------------------
def to_client_requests(
    requests: Sequence[WorkloadRequest],
    *,
    ignore_eos: bool = True,
    priority: Callable[[WorkloadRequest], int] | None = None,
) -> list[Any]:
    """``quanta.bench.client.ClientRequest`` s for ``replay``: text when the request has it,
    else a token count the client turns into seeded token ids; all scheduling metadata, and
    ``priority(row)`` as vLLM's per-request priority when given."""
    from quanta.bench.client import ClientRequest

    return [
        ClientRequest(
            request_id=r.request_id,
            arrival_s=r.arrival_time,
            prompt=r.prompt if r.prompt is not None else r.prompt_tokens,
            max_tokens=r.output_tokens,
            tenant=r.tenant,
            priority_class=r.priority_class,
            ignore_eos=ignore_eos,
            app=r.app,
            interaction_id=r.interaction_id,
            ttft_slo_ms=r.ttft_slo_ms,
            tpot_slo_ms=r.tpot_slo_ms,
            priority=None if priority is None else priority(r),
        )
        for r in requests
    ]


__all__ = [
    "CLASSES",
    "DATASETS",
    "App",
    "Arrivals",
    "LengthDist",
    "LengthSampler",
    "RateSchedule",
    "Tenant",
    "TraceRequest",
    "UniformLengths",
    "WorkloadError",
    "WorkloadRequest",
    "arrival_times",
    "length_sampler",
    "load_workload",
    "make_workload",
    "merge",
    "offline_batch",
    "on_off",
    "ramp",
    "rebase",
    "save_workload",
    "scale_to_rate",
    "synthesize",
    "tenant_mix",
    "to_client_requests",
    "with_io_ratio",
]
