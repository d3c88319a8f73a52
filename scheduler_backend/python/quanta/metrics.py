"""Latency, throughput, SLO and fairness metrics of a run — pure Python, shared by live
benchmarks (``quanta.bench``) and the simulator (``quanta.sim``), which is why it sits beside
both rather than in either: the simulator must not import the benchmarks.

Every figure is computed from ``RequestRecord`` s: when a request arrived (was sent), when each
streamed chunk carrying tokens came, when it ended, how many tokens it got. Adapters build
them from the client's ``ClientResult`` (``from_client_results``) and from the loop's
``Request`` (``from_requests``), so a live run and a simulated one are measured by the same
code. Conventions (shared/design/REFERENCE_FACTS.md):

- TTFT = first token - arrival; E2E = end - arrival; TPOT = (E2E - TTFT) / (output tokens - 1)
  (undefined for one-token outputs); ITL = every gap between streamed chunks; normalized
  latency = E2E / output tokens (FastServe's per-token latency).
- Percentiles interpolate linearly between order statistics (numpy's default).
- Throughput: finished requests and their output tokens over the span from the first arrival
  to the last end of finished requests.
- Goodput (DistServe): requests/s, over the same span, of requests with TTFT <= SLO and
  TPOT <= SLO. ``max_rate_meeting`` gives DistServe's other reading — the highest arrival rate
  whose attainment reaches a goal.
- SLO attainment (Apt-Serve §6.1): the share of *all* requests (failures count as misses) with
  TTFT <= SLO and the request's own P99 time-between-tokens <= SLO.
- Service per tenant: VTC's weighted tokens (input x 1 + output x 2 by default); Jain's index
  (sum x)^2 / (n sum x^2) is 1 when every tenant got the same and 1/n when one got all.

A request's own SLOs (from its workload row) override the run's ``SLO``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STATS = ("mean", "p50", "p95", "p99")
METRICS = ("ttft", "tpot", "itl", "e2e", "normalized_latency")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did, in seconds on one clock."""

    request_id: str
    arrival: float
    token_times: tuple[float, ...]  # each streamed chunk that carried >= 1 token
    end: float  # NaN if it never ended
    num_output_tokens: int
    num_prompt_tokens: int | None = None
    tenant: str = "default"
    app: str = "default"
    priority_class: str = "online"
    error: str | None = None
    ttft_slo_s: float | None = None  # the request's own SLOs, if its workload row has them
    tpot_slo_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.end)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.arrival

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for outputs of fewer than two tokens."""
        ttft = self.ttft
        if ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.num_output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Every gap between consecutive streamed chunks."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def normalized_latency(self) -> float | None:
        return self.e2e / self.num_output_tokens if self.num_output_tokens else None

    @property
    def p99_tbt(self) -> float | None:
        """This request's P99 time between tokens (Apt-Serve); None with < 2 chunks."""
        gaps = self.itl
        return percentile(gaps, 99) if gaps else None


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets in seconds. Goodput checks TTFT and TPOT (DistServe); attainment
    checks TTFT and the request's P99 time-between-tokens against ``tbt_s`` (Apt-Serve),
    which defaults to ``tpot_s``."""

    ttft_s: float
    tpot_s: float
    tbt_s: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or (self.tbt_s is not None and self.tbt_s <= 0):
            raise ValueError(f"SLOs must be > 0: {self}")

    def for_request(self, r: RequestRecord) -> tuple[float, float, float]:
        """(ttft, tpot, tbt) limits for ``r``: its own SLOs first."""
        ttft = r.ttft_slo_s if r.ttft_slo_s is not None else self.ttft_s
        tpot = r.tpot_slo_s if r.tpot_slo_s is not None else self.tpot_s
        tbt = r.tpot_slo_s if r.tpot_slo_s is not None else (self.tbt_s or self.tpot_s)
        return ttft, tpot, tbt


# -- statistics ----------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def stats(values: Iterable[float | None]) -> dict[str, float]:
    """Mean, P50, P95, P99 of the values that are not None (NaN when none are)."""
    xs = [v for v in values if v is not None]
    return {
        "mean": mean(xs),
        "p50": percentile(xs, 50),
        "p95": percentile(xs, 95),
        "p99": percentile(xs, 99),
    }


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """Per-request values of one of ``METRICS`` over finished requests (ITL: every gap)."""
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl]
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    values = (getattr(r, metric) for r in ok)
    return [v for v in values if v is not None]


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index; NaN for no values or all zeros."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares > 0 else math.nan


# -- throughput and SLOs -------------------------------------------------------------------
def span(records: Sequence[RequestRecord]) -> float:
    """First arrival to last end over finished requests (NaN when none finished)."""
    ok = [r for r in records if r.ok]
    if not ok:
        return math.nan
    return max(r.end for r in ok) - min(r.arrival for r in ok)


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def throughput(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """(requests/s, output tokens/s) of finished requests."""
    ok = [r for r in records if r.ok]
    seconds = span(records)
    return _per_second(len(ok), seconds), _per_second(sum(r.num_output_tokens for r in ok), seconds)


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """DistServe: finished with TTFT and TPOT within limits (one-token outputs: TTFT only)."""
    ttft_max, tpot_max, _ = slo.for_request(r)
    ttft, tpot = r.ttft, r.tpot
    return r.ok and ttft is not None and ttft <= ttft_max and (tpot is None or tpot <= tpot_max)


def attains_slo(r: RequestRecord, slo: SLO) -> bool:
    """Apt-Serve: finished with TTFT and its own P99 time-between-tokens within limits."""
    ttft_max, _, tbt_max = slo.for_request(r)
    ttft, tbt = r.ttft, r.p99_tbt
    return r.ok and ttft is not None and ttft <= ttft_max and (tbt is None or tbt <= tbt_max)


def goodput(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Requests/s meeting ``slo`` (DistServe), over the run's span."""
    return _per_second(sum(meets_slo(r, slo) for r in records), span(records))


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Share of all requests attaining ``slo`` (Apt-Serve); NaN for no requests."""
    return sum(attains_slo(r, slo) for r in records) / len(records) if records else math.nan


def max_rate_meeting(
    points: Iterable[tuple[float, float]], goal: float = 0.9, *, interpolate: bool = False
) -> float | None:
    """The highest tested arrival rate up to which every tested rate reaches ``goal``
    (attainment in [0, 1]); None if the lowest misses it. ``interpolate`` moves linearly
    towards the first failing rate to where attainment crosses ``goal`` (an estimate)."""
    best: tuple[float, float] | None = None
    for rate, value in sorted(points):
        if value >= goal:
            best = (rate, value)
            continue
        if best is not None and interpolate and best[1] > value:
            r0, v0 = best
            return r0 + (rate - r0) * (v0 - goal) / (v0 - value)
        break
    return None if best is None else best[0]


# -- fairness and groups -------------------------------------------------------------------
def service(r: RequestRecord, input_weight: float = 1.0, output_weight: float = 2.0) -> float:
    """VTC's weighted tokens this request received: its prompt once it produced a token,
    plus every output token that reached the client (also for requests that later failed)."""
    prompt = (r.num_prompt_tokens or 0) if r.token_times else 0
    return input_weight * prompt + output_weight * r.num_output_tokens


def _group(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str]):
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    return dict(sorted(groups.items()))


def per_tenant(
    records: Sequence[RequestRecord],
    slo: SLO | None = None,
    *,
    input_weight: float = 1.0,
    output_weight: float = 2.0,
) -> dict[str, Any]:
    """Per tenant: counts, service and its share, latency; Jain's index over the tenants'
    service and over their mean normalized latency."""
    groups = _group(records, lambda r: r.tenant)
    served = {
        t: sum(service(r, input_weight, output_weight) for r in rs) for t, rs in groups.items()
    }
    total = sum(served.values())
    tenants = {}
    for t, rs in groups.items():
        tenants[t] = {
            **_counts(rs),
            "service": served[t],
            "service_share": served[t] / total if total else math.nan,
            "ttft_s": stats(metric_values(rs, "ttft")),
            "normalized_latency_s": stats(metric_values(rs, "normalized_latency")),
            **(_slo_figures(rs, slo) if slo is not None else {}),
        }
    latencies = [v["normalized_latency_s"]["mean"] for v in tenants.values()]
    return {
        "tenants": tenants,
        "jain_service": jain_index(list(served.values())),
        "jain_normalized_latency": jain_index([x for x in latencies if math.isfinite(x)]),
    }


def per_class(records: Sequence[RequestRecord], slo: SLO | None = None) -> dict[str, Any]:
    """``summarize`` of each priority class (online, offline) on its own."""
    return {
        c: summarize(rs, slo, groups=False)
        for c, rs in _group(records, lambda r: r.priority_class).items()
    }


# -- summaries -----------------------------------------------------------------------------
def _counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    ok = sum(r.ok for r in records)
    return {"num_requests": len(records), "num_finished": ok, "num_errors": len(records) - ok}


def _slo_figures(records: Sequence[RequestRecord], slo: SLO) -> dict[str, float]:
    return {
        "goodput_rps": goodput(records, slo),
        "slo_attainment": slo_attainment(records, slo),
        "frac_meeting_slo": (
            sum(meets_slo(r, slo) for r in records) / len(records) if records else math.nan
        ),
    }


def summarize(
    records: Sequence[RequestRecord], slo: SLO | None = None, *, groups: bool = True
) -> dict[str, Any]:
    """Counts, throughput, mean/P50/P95/P99 of every metric, SLO figures when ``slo`` is
    given, and (``groups``) the per-tenant and per-class breakdowns.

    Keys are a superset of ``quanta.bench.client.summarize``'s (``ttft_s``: {mean, p50, ...}).
    """
    rps, tps = throughput(records)
    out: dict[str, Any] = {
        **_counts(records),
        "duration_s": span(records),
        "request_throughput": rps,
        "output_token_throughput": tps,
    }
    for metric in METRICS:
        out[f"{metric}_s"] = stats(metric_values(records, metric))
    if slo is not None:
        out["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "tbt_s": slo.tbt_s or slo.tpot_s}
        out.update(_slo_figures(records, slo))
    if groups:
        out["by_tenant"] = per_tenant(records, slo)
        out["by_class"] = per_class(records, slo)
    return out


def flat_metrics(records: Sequence[RequestRecord]) -> dict[str, float]:
    """The simulator's flat keys (``mean_ttft``, ``p95_normalized_latency``, ...,
    ``throughput_rps``, ``throughput_tokens_s``) for every metric and statistic."""
    counts = _counts(records)
    rps, tps = throughput(records)
    out: dict[str, float] = {
        "num_requests": counts["num_requests"],
        "num_finished": counts["num_finished"],
    }
    for metric in METRICS:
        for stat, value in stats(metric_values(records, metric)).items():
            out[f"{stat}_{metric}"] = value
    out["throughput_rps"], out["throughput_tokens_s"] = rps, tps
    return out


def json_safe(obj: Any) -> Any:
    """NaN/inf become None and tuples lists, so the output is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


# -- adapters ------------------------------------------------------------------------------
def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)


def from_client_results(
    results: Iterable[Any], workload: Iterable[Any] | None = None
) -> list[RequestRecord]:
    """Records from ``ClientResult`` s (or their ``to_dict()``); times from the send.

    ``workload`` (``WorkloadRequest`` s) fills what the client does not carry: app, the
    request's SLOs, and the prompt length when the server did not report it.
    """
    rows = {_get(w, "request_id"): w for w in workload or ()}
    out = []
    for res in results:
        rid = _get(res, "request_id")
        row = rows.get(rid)
        slo_ms = [_get(row, k) if row is not None else None for k in ("ttft_slo_ms", "tpot_slo_ms")]
        prompt = _get(res, "num_prompt_tokens")
        if prompt is None and row is not None:
            prompt = _get(row, "prompt_tokens")
        out.append(
            RequestRecord(
                request_id=rid,
                arrival=_get(res, "send_s"),
                token_times=tuple(_get(res, "chunk_s") or ()),
                end=_get(res, "end_s", math.nan),
                num_output_tokens=_get(res, "num_output_tokens", 0),
                num_prompt_tokens=prompt,
                tenant=_get(res, "tenant") or "default",
                app=_get(row, "app", "default") if row is not None else "default",
                priority_class=_get(res, "priority_class") or "online",
                error=_get(res, "error"),
                ttft_slo_s=None if slo_ms[0] is None else slo_ms[0] / 1000,
                tpot_slo_s=None if slo_ms[1] is None else slo_ms[1] / 1000,
            )
        )
    return out


def from_requests(requests: Iterable[Any]) -> list[RequestRecord]:
    """Records from the loop's ``quanta.core.request.Request`` s (the simulator's clock);
    every token is its own chunk. A request that never finished is an error."""
    out = []
    for r in requests:
        meta = r.metadata
        error = r.error
        if error is None and r.finish_time is None:
            error = "not finished"
        out.append(
            RequestRecord(
                request_id=r.request_id,
                arrival=r.arrival_time,
                token_times=tuple(r.token_times),
                end=math.nan if r.finish_time is None else r.finish_time,
                num_output_tokens=r.num_output_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
                tenant=meta.tenant,
                app=meta.app,
                priority_class=meta.priority_class,
                error=error,
                ttft_slo_s=None if meta.ttft_slo_ms is None else meta.ttft_slo_ms / 1000,
                tpot_slo_s=None if meta.tpot_slo_ms is None else meta.tpot_slo_ms / 1000,
            )
        )
    return out
