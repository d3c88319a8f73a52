"""Fair orderings: FairServe's weighted service counter (WSC) and its baseline VTC.

Both keep a service counter per user (tenant) and rank the requests that are not running by
the least-served user first; running requests continue in arrival order, as in vLLM's FCFS,
so fairness decides who gets in, not who is thrown out.

- ``VTCOrder`` (Sheng et al., OSDI'24, as its public code counts): a user's counter grows by
  ``input_weight / w`` per prompt token when its request is admitted and ``output_weight / w``
  per generated token, ``w`` the tenant's weight.
- ``WSCOrder`` (FairServe Eq. 2-3): a call of app ``a`` at interaction stage ``j`` adds
  ``E_user * (alpha * input + beta * system + gamma * output) / w_aj`` as its tokens are
  computed, where ``w_aj = alpha * N_I + beta * N_S + gamma * N_O`` are the expected token
  counts of that app and stage, learned from finished calls (a prior, or seeded weights, until
  there is history). Calls that continue an open interaction go first, least-served user
  first; then the earliest call of the least-served user.

Who counts as a tenant (``unauthenticated_tenants``): a tenant the request authenticates
(``RequestMetadata.tenant_authenticated``, set by the gateway from an API key) is its own,
lifted as VTC lifts a user who (re)enters the queue. The names of all other requests are
the client's choice, so by default (``"pool"``) they share one tenant, ``POOL``, ranked by
arrival among themselves (WSC: continuing calls first, as for any tenant): sending under
fresh names buys no share, and a tenant with a key gets its fair share against all
unauthenticated traffic together.
``"max"`` keeps each name its own tenant but starts a name that (re)enters at the
most-served active tenant's counter, ``"min"`` at the least-served's (VTC's lift, which
trusts names: a client sending each request under a new name is always first in line).
``fair_state.ServiceCounters`` says why the lift alone is not enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from operator import attrgetter, itemgetter
from typing import Any, Literal

from pydantic import Field

from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision
from quanta.core.output import RunnerOutput
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.policies.fair_state import Counters, Lift
from quanta.policies.fair_stores import fairness_state
from quanta.policies.interactions import InteractionTracker
from quanta.policies.memory_share import hold_back
from quanta.policies.stages import Ordering, Ranking, Turns
from quanta.policies.systems import SharedStateOptions, Stages, System
from quanta.policies.throttle import OITAdmission

Unauthenticated = Literal["pool", "max", "min"]
POOL = "(unauthenticated)"  # the tenant every unauthenticated request counts as, with "pool"


_arrival_time = attrgetter("arrival_time")
_last = itemgetter(-1)


class _Served(dict[str, float]):
    """Users' counters as read during one ranking: each user's once, however many of its
    requests wait (the counters do not change while a ranking sorts)."""

    def __init__(self, service: Counters) -> None:
        super().__init__()
        self._service = service

    def __missing__(self, user: str) -> float:
        self[user] = served = self._service.of(user)
        return served


class _CounterOrder(Ordering):
    """Residents by arrival, then everyone else by their ``_keys``."""

    def __init__(
        self,
        config: SchedulerConfig,
        service: Counters | None = None,
        unauthenticated: Unauthenticated = "pool",
    ) -> None:
        self.config = config
        self.service = service if service is not None else fairness_state(None).service
        self.unauthenticated = unauthenticated
        self._live: dict[str, Request] = {}

    def user(self, r: Request) -> str:
        """Whose counter ``r`` is charged to and ranked by (the module doc)."""
        meta = r.metadata
        if meta.tenant_authenticated or self.unauthenticated != "pool":
            return meta.tenant
        return POOL

    def _lift(self, r: Request) -> Lift:
        if r.metadata.tenant_authenticated or self.unauthenticated == "pool":
            return "min"
        return self.unauthenticated

    def on_admit(self, request: Request, view: SchedulerView) -> None:
        self._live[request.request_id] = request
        self.service.enter(self.user(request), self._lift(request))

    def on_finish(self, request: Request) -> None:
        if self._live.pop(request.request_id, None) is not None:
            self.service.leave(self.user(request))

    def rank(self, view: SchedulerView) -> Ranking:
        """Running requests by arrival, then the swapped, then the waiting, each by their
        ``_keys`` and arrival (a stable sort: ties keep the view's order)."""
        self.service.sync()  # NOTE: a shared store's counters, read once for the whole sort
        order = sorted(view.running, key=_arrival_time)
        for queue in (view.swapped, view.waiting):
            # NOTE: decorated, so the sort compares in C; the index keeps it stable
            keys = zip(self._keys(queue, view.now), map(_arrival_time, queue), count(), queue)
            order += map(_last, sorted(keys))
        return Ranking(order, Turns(order, self.config.max_num_seqs))

    def _keys(self, queue: Sequence[Request], now: float) -> list[Any]:
        """Each request's rank within its queue, least served first: its user's counter."""
        served = _Served(self.service)
        return list(map(served.__getitem__, map(self.user, queue)))


class VTCOrder(_CounterOrder):
    """Virtual token counter; see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        weights: Mapping[str, float] | None = None,
        service: Counters | None = None,
        unauthenticated: Unauthenticated = "pool",
    ) -> None:
        super().__init__(config, service, unauthenticated)
        self.input_weight, self.output_weight = input_weight, output_weight
        self.weights = dict(weights or {})

    def on_admit(self, request: Request, view: SchedulerView) -> None:
        super().on_admit(request, view)
        user = self.user(request)
        # NOTE: the prompt tokens the engine will compute: a prefix cached at arrival is free
        uncached = request.num_prompt_tokens - request.num_cached_tokens
        self.service.add(user, self.input_weight * uncached / self._w(user))

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        for rid, token in zip(output.request_ids, output.sampled_token_ids, strict=True):
            r = self._live.get(rid)
            if r is not None and token is not None:
                user = self.user(r)
                self.service.add(user, self.output_weight / self._w(user))

    def _w(self, user: str) -> float:
        return self.weights.get(user, 1.0)


@dataclass(slots=True)
class _Mean:
    n: int = 0
    input: float = 0.0
    system: float = 0.0
    output: float = 0.0

    def add(self, input: float, system: float, output: float) -> None:
        self.n += 1
        k = 1.0 / self.n
        self.input += (input - self.input) * k
        self.system += (system - self.system) * k
        self.output += (output - self.output) * k


class WSCOrder(_CounterOrder):
    """FairServe's weighted service counter; see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        tracker: InteractionTracker,
        *,
        alpha: float = 1.0,
        beta: float = 2.0,
        gamma: float = 1.0,
        priorities: Mapping[str, float] | None = None,
        prior_weight: float = 1000.0,
        stage_weights: Mapping[str, list[float]] | None = None,
        service: Counters | None = None,
        reserve_fraction: float = 0.0,
        unauthenticated: Unauthenticated = "pool",
    ) -> None:
        super().__init__(config, service, unauthenticated)
        if not 0 <= reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
        self.reserve_fraction = reserve_fraction
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.tracker = tracker
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.priorities = dict(priorities or {})
        self.prior_weight = prior_weight
        self.seeded = {app: list(ws) for app, ws in (stage_weights or {}).items()}
        self._means: dict[tuple[str, int], _Mean] = {}
        self._weights: dict[tuple[str, int], float] = {}  # NOTE: cleared when _means changes
        self._charged: dict[str, int] = {}  # prompt positions already charged, per request

    def rank(self, view: SchedulerView) -> Ranking:
        ranking = super().rank(view)
        if self.reserve_fraction <= 0:
            return ranking
        order = hold_back(ranking.order, view.pool, self.reserve_fraction)
        return Ranking(order, {r.request_id: ranking.next_turn[r.request_id] for r in order})

    # -- weights (Eq. 2) -------------------------------------------------------------------
    def weight(self, app: str, stage: int) -> float:
        """w_aj: learned from finished calls of (app, stage), else of the app, else seeded,
        else of every app, else the prior. Cached: it is read for every computed token."""
        key = (app, stage)
        if key not in self._weights:
            self._weights[key] = self._weight(app, stage)
        return self._weights[key]

    def _weight(self, app: str, stage: int) -> float:
        mean = self._means.get((app, stage))
        if mean is None:
            seeded = self.seeded.get(app)
            if seeded:
                return seeded[min(stage, len(seeded) - 1)]
            same_app = [m for (a, _), m in self._means.items() if a == app]
            mean = _pooled(same_app) or _pooled(list(self._means.values()))
        if mean is None:
            return self.prior_weight
        w = self.alpha * mean.input + self.beta * mean.system + self.gamma * mean.output
        return w if w > 0 else self.prior_weight

    # -- service (Eq. 3), as tokens are computed -----------------------------------------
    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        sampled = dict(zip(output.request_ids, output.sampled_token_ids, strict=True))
        for rid, n in decision.run:
            r = self._live.get(rid)
            if r is None:
                continue
            meta = r.metadata
            done = min(r.num_computed_tokens, r.num_prompt_tokens)
            # NOTE: only what this step computed: a prefix found cached costs nothing
            start = max(self._charged.get(rid, 0), min(r.num_computed_tokens - n, done))
            system = max(0, min(done, meta.system_tokens) - min(start, meta.system_tokens))
            tokens = self.alpha * (max(0, done - start) - system) + self.beta * system
            if sampled.get(rid) is not None:
                tokens += self.gamma
            self._charged[rid] = max(start, done)
            user = self.user(r)
            e = self.priorities.get(user, 1.0)
            self.service.add(user, e * tokens / self.weight(meta.app, _stage(r)))

    def on_finish(self, request: Request) -> None:
        super().on_finish(request)
        self._charged.pop(request.request_id, None)
        if request.status.completed:
            meta = request.metadata
            system = min(meta.system_tokens, request.num_prompt_tokens)
            key = (meta.app, _stage(request))
            self._means.setdefault(key, _Mean()).add(
                request.num_prompt_tokens - system, system, request.num_output_tokens
            )
            self._weights.clear()

    # -- ordering --------------------------------------------------------------------------
    def _keys(self, queue: Sequence[Request], now: float) -> list[Any]:
        """Calls that continue an open interaction first, then the least-served user's."""
        served, continues = _Served(self.service), self.tracker.continues
        return [
            (0 if continues(r, now) else 1, served[user])
            for r, user in zip(queue, map(self.user, queue), strict=True)
        ]


def _stage(r: Request) -> int:
    return r.metadata.interaction_stage or 0


def _pooled(means: list[_Mean]) -> _Mean | None:
    """One mean over several, weighted by their counts."""
    total = sum(m.n for m in means)
    if total == 0:
        return None
    out = _Mean(total)
    for m in means:
        out.input += m.input * m.n / total
        out.system += m.system * m.n / total
        out.output += m.output * m.n / total
    return out


# -- the systems ---------------------------------------------------------------------------
class CounterOptions(SharedStateOptions):
    """What every service-counter ordering takes: who an unauthenticated request counts as."""

    unauthenticated_tenants: Unauthenticated = Field(
        "pool",
        description="requests whose tenant is not authenticated (no API key): pool, all one "
        "tenant, (unauthenticated), first come first served among them; max, each name its "
        "own tenant, starting at the most-served active tenant's counter; min, each name its "
        "own tenant lifted to the least-served's (VTC's rule: a client that sends under "
        "fresh names is always first)",
    )


class VTCOptions(CounterOptions):
    input_weight: float = Field(1.0, ge=0, description="counter per prompt token at admission")
    output_weight: float = Field(2.0, ge=0, description="counter per generated token")
    weights: dict[str, float] = Field(default_factory=dict, description="tenant -> weight w")


class WSCOptions(CounterOptions):
    alpha: float = Field(1.0, ge=0, description="weight of input tokens")
    beta: float = Field(2.0, ge=0, description="weight of system-prompt tokens")
    gamma: float = Field(1.0, ge=0, description="weight of output tokens")
    priorities: dict[str, float] = Field(
        default_factory=dict, description="tenant -> priority factor E (default 1)"
    )
    prior_weight: float = Field(1000.0, gt=0, description="w_aj before any call finished")
    stage_weights: dict[str, list[float]] = Field(
        default_factory=dict, description="app -> w_aj per stage, used until history exists"
    )
    interaction_timeout_s: float = Field(
        30.0, gt=0, description="an interaction with no last call ends after this idle time"
    )


class FairOptions(WSCOptions):
    user_limit: int = Field(20, ge=1, description="requests per user per window, in overload")
    app_limit: int = Field(200, ge=1, description="requests per app per window, in overload")
    window_s: float = Field(60.0, gt=0)
    overload_watermark: float = Field(
        0.9, gt=0, le=1, description="device pool fraction in use that, with a queue, is overload"
    )
    reserve_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="device pool fraction a user over its equal share of the pool may not "
        "start calls into (0: none, the paper's FairServe)",
    )


def _tracker(o: WSCOptions) -> InteractionTracker:
    store = fairness_state(o.state_url).interactions(o.interaction_timeout_s)
    return InteractionTracker(o.interaction_timeout_s, store)


def _wsc_order(
    config: SchedulerConfig, o: WSCOptions, tracker: InteractionTracker, reserve: float = 0.0
) -> WSCOrder:
    return WSCOrder(
        config,
        tracker,
        alpha=o.alpha,
        beta=o.beta,
        gamma=o.gamma,
        priorities=o.priorities,
        prior_weight=o.prior_weight,
        stage_weights=o.stage_weights,
        service=fairness_state(o.state_url).service,
        reserve_fraction=reserve,
        unauthenticated=o.unauthenticated_tenants,
    )


def _wsc(config: SchedulerConfig, o: WSCOptions) -> Stages:
    tracker = _tracker(o)
    return Stages(ordering=_wsc_order(config, o, tracker), observers=(tracker,))


def _fair(config: SchedulerConfig, o: FairOptions) -> Stages:
    tracker = _tracker(o)
    state = fairness_state(o.state_url)
    admission = OITAdmission(
        tracker,
        users=state.windows("users", o.window_s),
        apps=state.windows("apps", o.window_s),
        user_limit=o.user_limit,
        app_limit=o.app_limit,
        window_s=o.window_s,
        watermark=o.overload_watermark,
    )
    order = _wsc_order(config, o, tracker, o.reserve_fraction)
    return Stages(admission, order, observers=(tracker,))


def _vtc(config: SchedulerConfig, o: VTCOptions) -> Stages:
    order = VTCOrder(
        config,
        input_weight=o.input_weight,
        output_weight=o.output_weight,
        weights=o.weights,
        service=fairness_state(o.state_url).service,
        unauthenticated=o.unauthenticated_tenants,
    )
    return Stages(ordering=order)


SYSTEMS = [
    System("fair", FairOptions, _fair, doc="FairServe: WSC ordering and OIT throttling"),
    System("wsc", WSCOptions, _wsc, doc="FairServe without throttling (the paper's FS (W))"),
    System("vtc", VTCOptions, _vtc, doc="virtual token counter"),
]
