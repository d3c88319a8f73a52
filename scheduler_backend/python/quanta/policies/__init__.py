"""Scheduling policies: pure Python objects deciding, each iteration, what runs.

NOTE: nothing under ``quanta.policies`` may import torch (a test enforces it).
"""

from __future__ import annotations

from quanta.policies.base import Decision, Policy, Preemption, PreemptMode, SchedulerView
from quanta.policies.registry import available_policies, make_policy

__all__ = [
    "Decision",
    "Policy",
    "PreemptMode",
    "Preemption",
    "SchedulerView",
    "available_policies",
    "make_policy",
]
