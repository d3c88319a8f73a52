"""The replica tests' shared workload: two backlogged tenants, one wide and one sticky.

The simulator's replica tests and the Redis-shared fairness tests run the same case, one on
the simulator's replicas and one across processes sharing state in Redis.
"""

from __future__ import annotations

from quanta.sim.driver import build_requests
from quanta.sim.replicas import Router
from quanta.workloads import WorkloadRequest


def two_tenants(replicas: int) -> list[WorkloadRequest]:
    """Both tenants backlogged from the start: "wide" on every replica (no shared prefix),
    "narrow" on half of them (its calls share one of a few prefixes, which the sticky
    prefix-affinity router keeps on their replicas)."""
    router = Router("prefix-affinity", replicas, 16)

    def row(i: int, tenant: str, group: str | None) -> WorkloadRequest:
        return WorkloadRequest(
            i * 1e-3,
            256,
            64,
            request_id=f"{tenant}{i}",
            tenant=tenant,
            prefix_group=group,
            prefix_tokens=32 if group else 0,
        )

    homes: dict[int, str] = {}
    for g in range(64):
        homes.setdefault(router.home(build_requests([row(0, "narrow", f"g{g}")])[0]), f"g{g}")
    groups = [homes[k] for k in sorted(homes)][: replicas // 2]
    assert len(groups) == replicas // 2
    wide = [row(i, "wide", None) for i in range(1500)]
    narrow = [row(i, "narrow", groups[i % len(groups)]) for i in range(1500)]
    return sorted(wide + narrow, key=lambda r: r.arrival_time)
