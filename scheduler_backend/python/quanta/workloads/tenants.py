"""Who sends what: tenants with weighted shares, the apps they use, multi-call interactions,
and offline batches.

Tenants send a weighted share of the interactions (an abusive tenant has a large weight); an
interaction is one or more consecutive calls of one user in one app, sharing an
``interaction_id``. A tenant is one the operator declared (an API key's) unless
``authenticated`` is false: then its name is the client's own choice. A tenant with
``rotate_names`` (never authenticated) sends each interaction under a name never used
before (``<name>-<k>``): the Sybil attack on fair scheduling, where every fresh name would
be one more tenant owed a share.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from quanta.workloads.arrivals import Arrivals, arrival_stream
from quanta.workloads.lengths import LengthSampler, length_sampler
from quanta.workloads.model import CLASSES, PriorityClass, WorkloadError, WorkloadRequest


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
    """A user: ``weight`` is its share of interactions (an abusive tenant's is large);
    ``rotate_names``: each interaction under a fresh name (``name_for``), which no key
    can vouch for; ``authenticated``: the name is a declared tenant's (module doc)."""

    name: str
    weight: float = 1.0
    apps: tuple[str, ...] = ("default",)
    priority_class: PriorityClass = "online"
    rotate_names: bool = False
    authenticated: bool = True

    def name_for(self, k: int) -> str:
        """The tenant name of its ``k``-th interaction (of the whole workload)."""
        return f"{self.name}-{k}" if self.rotate_names else self.name

    def __post_init__(self) -> None:
        if self.weight <= 0 or not self.apps or self.priority_class not in CLASSES:
            raise WorkloadError(f"tenant {self.name!r}: need weight > 0, apps, a known class")
        if self.rotate_names and self.authenticated:
            raise WorkloadError(f"tenant {self.name!r}: a key names one tenant, not many")


def tenant_mix(spec: str, *, apps: tuple[str, ...] = ("default",)) -> list[Tenant]:
    """``"gold:1,silver:2,abuser:20"`` -> weighted tenants (the Locust option's syntax). A
    name ending in ``?`` is not authenticated (a name the client chose); one ending in ``*``
    (``"victim:1,sybil*:8"``) sends each request under a fresh name, never authenticated."""
    tenants = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        rotate, anonymous = name.endswith("*"), name.endswith("?")
        name = name.removesuffix("*").removesuffix("?")
        try:
            if not name:
                raise ValueError(name)
            tenant = Tenant(
                name,
                float(weight or 1),
                apps,
                rotate_names=rotate,
                authenticated=not (rotate or anonymous),
            )
        except ValueError:
            raise WorkloadError(f"bad tenant mix {spec!r}; e.g. gold:1,silver:2,sybil*:8") from None
        tenants.append(tenant)
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
    starts = arrival_stream(arrivals, random.Random(f"{seed}-arrivals"), cv)
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
        user = tenant.name_for(k)
        iid = f"{user}-i{k}" if n_calls > 1 else None
        t = t0
        for j in range(n_calls):
            if j:
                t += rng_mix.expovariate(1 / app.call_gap_s) if app.call_gap_s else 0.0
            n_in, n_out = samplers[app.name].sample(rng_len, max_len)
            req = WorkloadRequest(
                t,
                n_in,
                n_out,
                tenant=user,
                tenant_authenticated=tenant.authenticated,
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


def with_tenants(
    rows: Sequence[WorkloadRequest], tenants: Sequence[Tenant], *, seed: int = 0
) -> list[WorkloadRequest]:
    """``rows`` with each request's tenant drawn by weight (a seeded stream of its own, so
    arrivals and lengths stay those of the seed); a rotating tenant's requests each get a
    fresh name. Apps and classes are left as they are."""
    if not tenants:
        raise WorkloadError("no tenants to draw from")
    rng = random.Random(f"{seed}-tenants")
    weights = [t.weight for t in tenants]
    drawn = [rng.choices(tenants, weights)[0] for _ in rows]
    return [
        replace(r, tenant=t.name_for(k), tenant_authenticated=t.authenticated)
        for k, (r, t) in enumerate(zip(rows, drawn, strict=True))
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
