"""What ``quanta serve``'s supervisor knows about each tritonserver, for the rest of the process.

Why a shared object and not a health check: while tritonserver is down or reloading its model,
the OpenAI gateway in the same process would otherwise learn it one failed request at a time
(a refused connection, or Triton's own "unknown model" while it loads, which reads as a 404).
The supervisor already knows the server is down and when the next start is due, so it writes
that here and the gateway reads it: new requests get 503 with ``Retry-After`` at once, its
readiness fails, its ``/metrics`` shows the state, and its gRPC channel is opened afresh after
each restart (a channel that saw the server die backs off its reconnects for seconds).

States are keyed by the server's gRPC address as the gateway is given it (``host:port``); a
gateway in front of a server no supervisor in this process watches finds none and behaves as
before. No Quanta import: the gateway, the launcher and the supervisor all read it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["starting", "up", "down", "restarting", "stopped", "failed"]
PHASES: tuple[Phase, ...] = ("starting", "up", "down", "restarting", "stopped", "failed")
DEFAULT_STARTUP_S = 10.0  # until a first start has been timed
DEFAULT_RETRY_S = 5.0  # Retry-After where nothing better is known


@dataclass
class SupervisorState:
    """One supervised tritonserver: its phase, its restarts, when it is expected back.

    ``starting``: launched, not ready yet; ``up``: ready; ``down``: dead, waiting out the
    backoff; ``restarting``: relaunched, loading; ``stopped``: shut down on purpose;
    ``failed``: the supervisor gave up (``--max-restarts``). Thread-safe: the supervisor
    writes from its thread, the gateway reads from its event loop.
    """

    server: str  # its gRPC address, ``host:port``
    phase: Phase = "starting"
    restarts: int = 0  # restarts begun (each relaunch after a death)
    deaths: int = 0  # times it died (or a restart failed)
    deaths_in_a_row: int = 0  # since it last stayed up (the backoff's exponent)
    last_exit: str = ""  # how it last ended, in words
    startup_s: float = DEFAULT_STARTUP_S  # how long its last start took to become ready
    _next_start: float = 0.0  # monotonic time the next relaunch is due (``down``)
    _since: float = field(default_factory=time.monotonic)  # when the phase last changed
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    # -- the supervisor's side ------------------------------------------------------------
    def mark_up(self, startup_s: float | None = None) -> None:
        with self._lock:
            if startup_s is not None:
                self.startup_s = startup_s
            self._set("up")

    def mark_down(self, exit_status: str, delay_s: float, in_a_row: int) -> None:
        """It died; the next relaunch is ``delay_s`` away."""
        with self._lock:
            self.deaths += 1
            self.deaths_in_a_row = in_a_row
            self.last_exit = exit_status
            self._next_start = time.monotonic() + delay_s
            self._set("down")

    def mark_restarting(self) -> None:
        with self._lock:
            self.restarts += 1
            self._set("restarting")

    def mark_stopped(self) -> None:
        with self._lock:
            self._set("stopped")

    def mark_failed(self, exit_status: str) -> None:
        with self._lock:
            self.last_exit = exit_status
            self._set("failed")

    def _set(self, phase: Phase) -> None:
        self.phase = phase
        self._since = time.monotonic()

    # -- the readers' side ----------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether requests can be sent to it now (up; or launched and not known dead)."""
        return self.phase in ("up", "starting")

    def retry_after(self) -> float | None:
        """Seconds until it is expected to serve again: the rest of the backoff plus a start
        as long as the last one; None while it serves, or when it will not come back."""
        with self._lock:
            now = time.monotonic()
            if self.phase == "down":
                return max(0.0, self._next_start - now) + self.startup_s
            if self.phase == "restarting":
                return max(1.0, self.startup_s - (now - self._since))
            return None

    def describe(self) -> str:
        """The state in words, for the 503 a client gets."""
        if self.phase == "down":
            return (
                f"Triton at {self.server} is down ({self.last_exit}); restart "
                f"{self.restarts + 1} is scheduled"
            )
        if self.phase == "restarting":
            return f"Triton at {self.server} is restarting (restart {self.restarts})"
        if self.phase == "failed":
            return f"Triton at {self.server} is down for good ({self.last_exit})"
        if self.phase == "stopped":
            return f"Triton at {self.server} was shut down"
        return f"Triton at {self.server} is {self.phase}"


_STATES: dict[str, SupervisorState] = {}
_REGISTRY_LOCK = threading.Lock()


def register(state: SupervisorState) -> SupervisorState:
    """Make ``state`` the one readers find for its server (a later one replaces it)."""
    with _REGISTRY_LOCK:
        _STATES[state.server] = state
    return state


def unregister(state: SupervisorState) -> None:
    with _REGISTRY_LOCK:
        if _STATES.get(state.server) is state:
            del _STATES[state.server]


def state_for(server: str) -> SupervisorState | None:
    """The supervisor's state of the server at ``server`` (``host:port``, a scheme allowed),
    or None when no supervisor in this process watches it."""
    key = server.split("://", 1)[1] if "://" in server else server
    return _STATES.get(key)


def metrics_text() -> str:
    """Every registered server's state in Prometheus' text format (empty when none)."""
    with _REGISTRY_LOCK:
        states = sorted(_STATES.values(), key=lambda s: s.server)
    if not states:
        return ""
    lines = [
        "# HELP quanta_supervisor_restarts_total Times the supervisor relaunched tritonserver.",
        "# TYPE quanta_supervisor_restarts_total counter",
        *(f'quanta_supervisor_restarts_total{{server="{s.server}"}} {s.restarts}' for s in states),
        "# HELP quanta_supervisor_deaths_total Times tritonserver died or failed to restart.",
        "# TYPE quanta_supervisor_deaths_total counter",
        *(f'quanta_supervisor_deaths_total{{server="{s.server}"}} {s.deaths}' for s in states),
        "# HELP quanta_supervisor_up 1 while tritonserver is ready to serve.",
        "# TYPE quanta_supervisor_up gauge",
        *(f'quanta_supervisor_up{{server="{s.server}"}} {int(s.phase == "up")}' for s in states),
        "# HELP quanta_supervisor_state The supervisor's phase of tritonserver (1 for the "
        "current one).",
        "# TYPE quanta_supervisor_state gauge",
    ]
    for s in states:
        lines += [
            f'quanta_supervisor_state{{server="{s.server}",state="{p}"}} {int(s.phase == p)}'
            for p in PHASES
        ]
    return "\n".join(lines) + "\n"
