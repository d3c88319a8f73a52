"""Layer safepoints: how an engine step of preemptible work is stopped half-way.

ConServe stops a running offline batch between layers when an online request arrives that
would miss its TTFT by waiting for the step to end. The policy marks such a step with an
``AbortRule`` (the decision's ``abort_when``); the loop asks that rule about every request that
arrives while the step runs and raises the step's ``AbortSignal``; a runner that offers
safepoints polls the signal every few layers and raises ``StepAborted``. Nothing of the step is
committed: computed-token counts do not advance, and the KV it wrote past them is overwritten
when the tokens are computed again, so outputs are unchanged.

Pure Python (threading only): the signal is raised on a client's thread and read on the
loop's.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from quanta.core.request import Request


class AbortRule(Protocol):
    """Whether a request arriving at ``now`` should stop the running step.

    Called on the submitting thread while the step runs: it must only read what it captured
    when the decision was made (a predicted end time, a cost model, default SLOs)."""

    def __call__(self, request: Request, now: float) -> bool: ...


class AbortSignal:
    """Raised (any thread) to stop the current step at its next safepoint."""

    __slots__ = ("_event", "raised_at")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.raised_at: float | None = None  # the loop clock's time when it was raised

    def raise_at(self, now: float) -> None:
        if not self._event.is_set():
            self.raised_at = now
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self._event.clear()
        self.raised_at = None


class StepAborted(Exception):
    """A runner stopped a preemptible step at a safepoint; nothing of it may be committed."""

    def __init__(self, layer: int, elapsed_s: float | None = None) -> None:
        super().__init__(f"step aborted at the safepoint before layer {layer}")
        self.layer = layer  # layers that ran before the stop
        self.elapsed_s = elapsed_s  # seconds the step ran before it stopped, when known
