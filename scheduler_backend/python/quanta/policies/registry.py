"""Policies by name, so the Triton config, the offline API and the simulator agree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quanta.core.config import SchedulerConfig
from quanta.policies.base import Policy
from quanta.policies.fcfs import FCFSPolicy

_FACTORIES: dict[str, Callable[..., Policy]] = {
    "fcfs": FCFSPolicy,
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
