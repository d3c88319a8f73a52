"""Agent workloads (FairServe §3): users of a few apps send *interactions* — one user query
served by a chain of dependent LLM calls — and a few abusers start interactions far more often
than anyone else.

The shapes are approximations of FairServe's Fig. 4-5 and Table 2 (its trace is not public),
scaled to fit a 2k-token model:

- 4-6 apps per seed (``app0``...). Calls per interaction are uniform in a range per app:
  ``(1, 1)``, ``(2, 6)``, ``(4, 20)``, ``(1, 1)``, ``(2, 10)``, ``(1, 4)`` in that order, so
  every catalogue has single-call apps and an agent app reaching 20 calls (Fig. 4a: over 20).
- System prompt: a seeded mean per app and per stage (a base log-uniform in [40, 400] tokens
  times a stage factor log-uniform in [0.5, 2]), each call log-normal around it (sigma 0.25):
  it varies across apps and, within an app, across stages and calls (Fig. 5a).
- Input (the user's or the previous agent's text): log-normal, per-app mean log-uniform in
  [30, 400], sigma 0.8. Output: log-normal with a per-app median log-uniform in [180, 320] and
  sigma 1.0, a heavy tail: about a fifth of calls exceed 500 output tokens (Fig. 5b: 20% of the
  users of four apps generate over 500). A call that does not fit ``max_len`` is redrawn.
- Each user uses one app (seeded). Benign users start interactions as renewal processes (CV
  ``cv``) at one rate; each abuser at ``abuse_factor`` times it. ``rate`` is the whole
  workload's mean calls per second, which sets the benign per-user rate.
- A follow-up call waits a think time uniform in [0.5, 2] s after the previous call finished.
  Its ``arrival_time`` is a lower bound: when it would be sent if every call took no time.
- Calls of one app share the app's system prompt: ``prefix_group`` is the app and
  ``prefix_tokens`` its ``system_tokens``, so two calls share the app's prompt up to the
  shorter of their two system prompts (``quanta.workloads.prompts``). A call's input is the
  user's or the previous agent's text, not the interaction's history, so no longer prefix
  is shared within an interaction.

Every user has its own seeded streams, so the same seed gives every user the same
interactions at any rate and number of abusers (their times scale with the rate).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

from quanta.workloads.arrivals import arrival_stream
from quanta.workloads.model import WorkloadError, WorkloadRequest

AGENTS = "agents"  # the workload's name beside the length DATASETS (``make_workload``)
CALL_RANGES: tuple[tuple[int, int], ...] = ((1, 1), (2, 6), (4, 20), (1, 1), (2, 10), (1, 4))
THINK_TIME_S = (0.5, 2.0)
_TRIES = 20  # redraws of a call that does not fit max_len before it is shrunk to fit


@dataclass(frozen=True, slots=True)
class AgentApp:
    """What one app's interactions look like (see the module doc for the distributions)."""

    name: str
    calls: tuple[int, int]  # calls per interaction, uniform in [lo, hi]
    system_tokens: tuple[float, ...]  # mean system prompt of each stage (the last repeats)
    input_tokens: float  # mean input per call
    output_tokens: float  # median output per call

    @property
    def mean_calls(self) -> float:
        return sum(self.calls) / 2

    def system_mean(self, stage: int) -> float:
        return self.system_tokens[min(stage, len(self.system_tokens) - 1)]


def agent_apps(seed: int = 0) -> list[AgentApp]:
    """The seeded catalogue of 4-6 apps."""
    rng = random.Random(f"{seed}-apps")
    apps = []
    for k in range(rng.randint(4, 6)):
        calls = CALL_RANGES[k]
        base = _log_uniform(rng, 40, 400)
        system = tuple(base * _log_uniform(rng, 0.5, 2.0) for _ in range(calls[1]))
        apps.append(
            AgentApp(
                f"app{k}",
                calls,
                system,
                input_tokens=_log_uniform(rng, 30, 400),
                output_tokens=_log_uniform(rng, 180, 320),
            )
        )
    return apps


def agents(
    num_requests: int,
    rate: float,
    *,
    num_users: int = 20,
    abusers: int = 0,
    abuse_factor: float = 15.0,
    seed: int = 0,
    cv: float = 1.0,
    max_len: int = 2048,
    id_prefix: str = "r",
) -> list[WorkloadRequest]:
    """``num_requests`` calls of interactions of ``num_users`` benign users (``u0``...) and
    ``abusers`` abusers (``abuser0``...), ordered by ``arrival_time``.

    Interactions are taken in order of their start until the calls add up to
    ``num_requests``; the last one taken is cut short to fit (it still ends with a call marked
    ``interaction_last``). Interaction ids are ``<user>-i<k>``.
    """
    if num_requests < 0 or num_users < 0 or abusers < 0 or num_users + abusers == 0:
        raise WorkloadError("need num_requests >= 0 and num_users, abusers >= 0, not both 0")
    if not (math.isfinite(rate) and rate > 0) or abuse_factor < 1:
        raise WorkloadError(f"need a finite rate > 0 and abuse_factor >= 1, got {rate}")
    if max_len < 2:
        raise WorkloadError(f"max_len must be >= 2, got {max_len}")
    apps = agent_apps(seed)
    pick = random.Random(f"{seed}-users")
    names = [f"u{i}" for i in range(num_users)] + [f"abuser{i}" for i in range(abusers)]
    weights = [1.0] * num_users + [abuse_factor] * abusers
    users = [(name, pick.choice(apps), w) for name, w in zip(names, weights, strict=True)]
    per_weight = rate / sum(w * app.mean_calls for _, app, w in users)
    heap = []
    for i, (name, app, weight) in enumerate(users):
        starts = arrival_stream(per_weight * weight, random.Random(f"{seed}-{name}-starts"), cv)
        draws = _interactions(name, app, random.Random(f"{seed}-{name}-calls"), max_len)
        heap.append((next(starts), i, starts, draws))
    heapq.heapify(heap)
    calls: list[WorkloadRequest] = []
    while heap and len(calls) < num_requests:
        t0, i, starts, draws = heapq.heappop(heap)
        chain = next(draws)[: num_requests - len(calls)]
        chain[-1] = replace(chain[-1], interaction_last=True)
        calls += [replace(c, arrival_time=t0 + c.arrival_time) for c in chain]
        heapq.heappush(heap, (next(starts), i, starts, draws))
    calls.sort(key=lambda c: c.arrival_time)  # NOTE: stable: ties keep the drawing order
    return [replace(c, request_id=f"{id_prefix}{k}") for k, c in enumerate(calls)]


def _interactions(
    user: str, app: AgentApp, rng: random.Random, max_len: int
) -> Iterator[list[WorkloadRequest]]:
    """The user's interactions one by one; times relative to the interaction's start, no
    call marked last (the caller marks the one that ends it)."""
    for k in itertools.count():
        offset = 0.0
        chain = []
        for stage in range(rng.randint(*app.calls)):
            think = rng.uniform(*THINK_TIME_S) if stage else 0.0
            offset += think
            system, n_in, n_out = _lengths(app, stage, rng, max_len)
            chain.append(
                WorkloadRequest(
                    offset,
                    system + n_in,
                    n_out,
                    tenant=user,
                    app=app.name,
                    interaction_id=f"{user}-i{k}",
                    interaction_stage=stage,
                    system_tokens=system,
                    think_time_s=think,
                    prefix_group=app.name,
                    prefix_tokens=system,
                )
            )
        yield chain


def _lengths(app: AgentApp, stage: int, rng: random.Random, max_len: int) -> tuple[int, int, int]:
    """(system, input, output) tokens of one call, fitting ``max_len`` together."""
    mu_sys = math.log(app.system_mean(stage)) - 0.25**2 / 2
    mu_in = math.log(app.input_tokens) - 0.8**2 / 2
    for _ in range(_TRIES):
        system = round(rng.lognormvariate(mu_sys, 0.25))
        n_in = max(1, round(rng.lognormvariate(mu_in, 0.8)))
        n_out = max(1, round(rng.lognormvariate(math.log(app.output_tokens), 1.0)))
        if system + n_in + n_out <= max_len:
            return system, n_in, n_out
    scale = (max_len - 2) / (system + n_in + n_out)  # NOTE: rare; only tiny max_len reach it
    return int(system * scale), max(1, int(n_in * scale)), max(1, int(n_out * scale))


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))
