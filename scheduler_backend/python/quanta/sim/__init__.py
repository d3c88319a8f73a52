"""The simulator: the real loop and policies on a virtual clock, step times from a cost model.

Pure Python like ``quanta.policies`` (no torch); only ``quanta.sim.profile`` and the real-engine
benchmarks in ``quanta.sim.bench`` load the PyTorch engine, inside their functions.
"""

from __future__ import annotations

from quanta.sim.driver import SimResult, SimSetup, build_requests, drive, simulate
from quanta.sim.metrics import request_metrics, summarize
from quanta.sim.runner import SimRunner, SimStats
from quanta.sim.workloads import DATASETS, TraceRequest, make_workload, with_io_ratio

__all__ = [
    "DATASETS",
    "SimResult",
    "SimRunner",
    "SimSetup",
    "SimStats",
    "TraceRequest",
    "build_requests",
    "drive",
    "make_workload",
    "request_metrics",
    "simulate",
    "summarize",
    "with_io_ratio",
]
