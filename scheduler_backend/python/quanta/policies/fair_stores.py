"""The fairness state a ``state_url`` names, one per URL in this process.

Apart from ``fair_state.py`` because it knows every kind of store, the Redis one included,
which itself builds on the local pieces there. Pure Python: the Redis client is imported only
when a Redis URL is named.
"""

from __future__ import annotations

from quanta.policies.fair_state import FairnessState, LocalState, check_state_url

_SHARED: dict[str, FairnessState] = {}


def fairness_state(url: str | None) -> FairnessState:
    """The state ``url`` names: a fresh local one for None, else the one this process holds
    for the URL (created on first use)."""
    if url is None:
        return LocalState()
    if url not in _SHARED:
        check_state_url(url)
        if url.startswith("memory://"):
            _SHARED[url] = LocalState()
        else:
            from quanta.policies.fair_redis import RedisState

            _SHARED[url] = RedisState(url)
    return _SHARED[url]


def state_errors() -> int:
    """Operations of this process's shared states that failed open (Redis unreachable)."""
    return sum(s.errors for s in _SHARED.values())


def forget_state(url: str) -> None:
    """Drop this process's handle on ``url`` (a simulated run's memory state, once done)."""
    _SHARED.pop(url, None)
