"""Latency SLOs by name, and the one rule every tool uses to turn its options into an ``SLO``.

Apt-Serve (Table 3) sets a TTFT and a P99 time-between-tokens SLO per dataset and model size,
loose TTFT for long-prompt summarisation, both relaxed for bigger models. The presets are
named ``<dataset>-<size>`` (``sharegpt-13b``, ``longbench-66b``, ...). An ``SLO`` also carries
a TPOT limit for DistServe's goodput; Apt-Serve has none, so a preset's TPOT limit is its TBT
limit (a request's mean gap is at most its largest one, so the goodput check is no stricter).

SLO attainment (``attainment``) is a fraction in [0, 1]: the share of *all* requests, failures
counted as misses, whose TTFT and own P99 time between tokens are within their limits
(``quanta.metrics.attains_slo`` decides each request, for the simulator and for live runs
alike). A request's own SLOs (``ttft_slo_ms``/``tpot_slo_ms`` of its workload row) override the
run's.

Pure Python: the simulator and the benchmarks both import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from quanta.metrics import SLO, RequestRecord, slo_attainment
from quanta.workloads.model import WorkloadRequest

# (TTFT s, P99 TBT s), Apt-Serve Table 3: OPT-13B on one A100-40GB, 30B on two, 66B on four.
APT_SERVE_SLOS: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "sharegpt-13b": (1.0, 1.0),
        "humaneval-13b": (0.5, 0.5),
        "longbench-13b": (4.0, 1.0),
        "sharegpt-30b": (1.5, 1.0),
        "humaneval-30b": (1.0, 0.5),
        "longbench-30b": (4.5, 1.0),
        "sharegpt-66b": (2.0, 1.0),
        "humaneval-66b": (1.5, 0.5),
        "longbench-66b": (5.0, 1.0),
    }
)


def slo_preset(name: str) -> SLO:
    """The named preset as an ``SLO`` (TPOT limit = TBT limit, see the module doc)."""
    try:
        ttft, tbt = APT_SERVE_SLOS[name]
    except KeyError:
        known = ", ".join(APT_SERVE_SLOS)
        raise ValueError(f"unknown SLO preset {name!r}; presets: {known}") from None
    return SLO(ttft_s=ttft, tpot_s=tbt, tbt_s=tbt)


def resolve_slo(
    *,
    ttft: float | None = None,
    tbt: float | None = None,
    tpot: float | None = None,
    preset: str | None = None,
) -> SLO | None:
    """The run's SLO from command-line options, or None when none is asked for.

    A preset gives all three limits and explicit seconds replace its parts. Without one,
    ``ttft`` is needed with ``tpot`` or ``tbt``, the missing one of the two taking the other's
    value; a limit alone is refused rather than completed by a guess.
    """
    if preset is not None:
        base = slo_preset(preset)
        return SLO(
            ttft_s=base.ttft_s if ttft is None else ttft,
            tpot_s=base.tpot_s if tpot is None else tpot,
            tbt_s=base.tbt_s if tbt is None else tbt,
        )
    if ttft is None and tbt is None and tpot is None:
        return None
    limit = tbt if tbt is not None else tpot
    if ttft is None or limit is None:
        raise ValueError(
            "an SLO needs a TTFT limit and a TPOT or TBT limit (or a preset: "
            f"{', '.join(APT_SERVE_SLOS)})"
        )
    return SLO(ttft_s=ttft, tpot_s=limit if tpot is None else tpot, tbt_s=limit)


def attainment(records: Sequence[RequestRecord], slo: SLO | None) -> float | None:
    """Apt-Serve's SLO attainment in [0, 1] against ``slo`` (each request's own SLOs first).

    Without ``slo`` it is still defined when every request carries both of its own limits;
    otherwise (or for no requests) it is None: there is nothing to attain.
    """
    if not records:
        return None
    if slo is None:
        own = [(r.ttft_slo_s, r.tpot_slo_s) for r in records]
        ttft, tpot = own[0]
        if ttft is None or tpot is None or any(None in pair for pair in own):
            return None
        # NOTE: every request overrides both limits, so this stand-in is never consulted.
        slo = SLO(ttft_s=ttft, tpot_s=tpot)
    return slo_attainment(records, slo)


def with_slo(rows: Sequence[WorkloadRequest], slo: SLO) -> list[WorkloadRequest]:
    """``rows`` with ``slo`` as the SLOs of those that have none of their own, so that a
    policy reading request SLOs aims at what the run is measured against (the TBT limit
    travels as ``tpot_slo_ms``, which ``SLO.for_request`` reads as the request's TBT limit)."""
    ttft_ms, tbt_ms = 1000 * slo.ttft_s, 1000 * (slo.tbt_s or slo.tpot_s)
    return [
        r
        if r.ttft_slo_ms is not None or r.tpot_slo_ms is not None
        else replace(r, ttft_slo_ms=ttft_ms, tpot_slo_ms=tbt_ms)
        for r in rows
    ]


def describe(slo: SLO) -> dict[str, float]:
    """The limits as JSON: TTFT, P99 TBT and TPOT, seconds."""
    return {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s or slo.tpot_s, "tpot_s": slo.tpot_s}
