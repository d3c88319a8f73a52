"""A thread that watches a threaded ``EngineLoop`` and says when it stops serving.

Why a thread of its own: a loop stuck inside a step (a hung kernel, a deadlock) cannot report
itself, and a loop thread that died reports nothing either. The watchdog reads
``EngineLoop.health`` every ``interval`` seconds and calls ``on_unhealthy`` once, on the first
reading that is not healthy; the latest reading is there for metrics and health checks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from quanta.core.loop import EngineLoop, LoopHealth

log = logging.getLogger(__name__)

# No step for this long while requests wait or run is a stall. Generous on purpose: the first
# step of a compiled kernel, or a long prefill chunk on a slow CPU, takes seconds to a minute,
# and a false alarm ends the server. vLLM's engine iteration timeout is 60 s.
DEFAULT_STALL_TIMEOUT_S = 120.0


class Watchdog:
    """See the module docstring; ``start`` it after the loop started."""

    def __init__(
        self,
        loop: EngineLoop,
        *,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        on_unhealthy: Callable[[LoopHealth], None] | None = None,
        interval: float = 1.0,
    ) -> None:
        if stall_timeout <= 0:
            raise ValueError(f"stall timeout must be > 0 s, got {stall_timeout}")
        self.loop = loop
        self.stall_timeout = stall_timeout
        self._on_unhealthy = on_unhealthy
        self._interval = min(interval, stall_timeout / 4)
        self._latest = LoopHealth(True)
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quanta-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def health(self) -> LoopHealth:
        """A fresh reading (cheap: a lock and a clock read); it also fires the callback."""
        return self._check()

    def latest(self) -> LoopHealth:
        return self._latest

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._check()

    def _check(self) -> LoopHealth:
        health = self.loop.health(self.stall_timeout)
        self._latest = health
        if not health.healthy and not self._fired:
            self._fired = True  # NOTE: a race fires twice at worst; the callback is idempotent
            log.error("the engine is unhealthy: %s", health.reason)
            if self._on_unhealthy is not None:
                try:
                    self._on_unhealthy(health)
                except Exception:
                    log.exception("handling an unhealthy engine failed")
        return health
