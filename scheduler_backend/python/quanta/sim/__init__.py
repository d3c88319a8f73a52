"""The simulator: the real loop and policies on a virtual clock, step times from a cost model.

Pure Python like ``quanta.policies`` (no torch). Traces come from ``quanta.workloads``
(``make_workload``), the same requests a live benchmark sends. What is measured with it (the
papers' figures, its validation against the real engine, the profiler that fits a cost model)
is the lab's, ``quanta_lab.sim``.
"""

from __future__ import annotations

from quanta.sim.driver import SimResult, SimSetup, build_requests, drive, simulate
from quanta.sim.fairness import fairness
from quanta.sim.interactions import Replay
from quanta.sim.metrics import request_metrics, summarize
from quanta.sim.runner import SimRunner, SimStats

__all__ = [
    "Replay",
    "SimResult",
    "SimRunner",
    "SimSetup",
    "SimStats",
    "build_requests",
    "drive",
    "fairness",
    "request_metrics",
    "simulate",
    "summarize",
]
