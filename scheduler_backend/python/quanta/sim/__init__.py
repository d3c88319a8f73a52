"""The simulator: the real loop and policies on a virtual clock, step times from a cost model.

Pure Python like ``quanta.policies`` (no torch); only ``quanta.sim.profile`` and the real-engine
benchmarks in ``quanta.sim.bench`` load the PyTorch engine, inside their functions. Traces
come from ``quanta.workloads`` (``make_workload``), the same requests a live benchmark sends.
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
