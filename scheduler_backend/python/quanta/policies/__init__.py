"""Scheduling policies: pure Python stages composed into one policy per loop.

NOTE: nothing under ``quanta.policies`` may import torch (a test enforces it).
"""

from __future__ import annotations

from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.policy import Policy
from quanta.core.view import SchedulerView
from quanta.policies.registry import (
    PolicySpec,
    available_policies,
    make_policy,
    parse_policy,
    register_system,
)
from quanta.policies.stages import StagedPolicy

__all__ = [
    "Decision",
    "Policy",
    "PolicySpec",
    "PreemptMode",
    "Preemption",
    "SchedulerView",
    "StagedPolicy",
    "available_policies",
    "make_policy",
    "parse_policy",
    "register_system",
]
