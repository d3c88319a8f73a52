"""Policies by name, so the Triton config, the offline API and the simulator agree."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from quanta.core.config import SchedulerConfig
from quanta.policies.base import Policy
from quanta.policies.fcfs import FCFSPolicy
from quanta.policies.mlfq import SRPT, FixedPriority, NaiveMLFQ, SkipJoinMLFQ

_FACTORIES: dict[str, Callable[..., Policy]] = {
    "fcfs": FCFSPolicy,
    # FastServe (seed 000) and the baselines of its Fig. 14 / Fig. 15 ablations.
    "sj-mlfq": SkipJoinMLFQ,
    "sj-mlfq-reactive": partial(SkipJoinMLFQ, memory="reactive"),
    "sj-mlfq-recompute": partial(SkipJoinMLFQ, memory="recompute"),
    "mlfq": NaiveMLFQ,
    "fixed-priority": FixedPriority,
    "srpt": SRPT,
}


def available_policies() -> list[str]:
    return sorted(_FACTORIES)


def make_policy(name: str, config: SchedulerConfig, **options: Any) -> Policy:
    """Build a policy; an unknown name or option is a clear ``ValueError``."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
    try:
        return factory(config, **options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from exc
