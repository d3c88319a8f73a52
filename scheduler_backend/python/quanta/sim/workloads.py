"""The simulator's workloads are ``quanta.bench.workloads``: one file format and one set of
generators for ``quanta bench``, ``quanta simulate`` and Locust.

``make_workload(name_or_path, ...)`` takes a dataset name (``sharegpt``, ``alpaca``,
``humaneval``, ``longbench``: seeded approximations of the published length statistics) or a
workload file (JSONL, or a BurstGPT CSV). A file's rows keep their request ids and scheduling
metadata (tenant, app, interaction, online/offline class, SLOs), and the simulator hands them to
the policies exactly as a live server would.
"""

from __future__ import annotations

from quanta.bench.workloads import (
    DATASETS,
    LengthDist,
    TraceRequest,
    WorkloadError,
    WorkloadRequest,
    arrival_times,
    load_workload,
    make_workload,
    save_workload,
    with_io_ratio,
)

__all__ = [
    "DATASETS",
    "LengthDist",
    "TraceRequest",
    "WorkloadError",
    "WorkloadRequest",
    "arrival_times",
    "load_workload",
    "make_workload",
    "save_workload",
    "with_io_ratio",
]
