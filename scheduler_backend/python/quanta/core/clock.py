"""Injected clocks: the loop never reads time itself, so the simulator can run it virtually."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Source of time for the loop; seconds as float."""

    def now(self) -> float:
        """Current time in seconds (monotonic within one clock)."""
        ...


class WallClock:
    """Real time; ``time.time()`` so timestamps can be reported to clients as epoch ns."""

    def now(self) -> float:
        return time.time()


class VirtualClock:
    """Time that only moves when told to, for the simulator and deterministic tests."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward; negative steps would break every latency metric."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        with self._lock:
            self._now += seconds

    def set(self, t: float) -> None:
        """Jump to ``t`` (an arrival in the future); never backwards."""
        with self._lock:
            if t < self._now:
                raise ValueError(f"cannot move a clock back from {self._now} to {t}")
            self._now = t
