"""The policy protocol: what a scheduler sees (``SchedulerView``) and says (``Decision``).

A policy never touches blocks or tensors. It reads the view, returns a ``Decision`` and the
loop's applier checks it against the block pools; an infeasible decision raises
``PolicyError`` (a policy bug), so policies must do their own block arithmetic with
``SchedulerView.blocks_to_grow``.
"""

from __future__ import annotations

from typing import Protocol

from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.output import RunnerOutput
from quanta.core.request import Request
from quanta.core.view import SchedulerView

__all__ = ["Decision", "Policy", "PreemptMode", "Preemption", "SchedulerView"]


class Policy(Protocol):
    """A scheduling policy; one instance per loop, called only from the loop thread."""

    name: str

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        """Accept a new request (None) or refuse it with a reason that reaches the client."""
        ...

    def schedule(self, view: SchedulerView) -> Decision:
        """Decide this iteration. Promises a decision feasible for the view's block pools."""
        ...

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        """Learn from a finished step (quanta, attained service, service counters)."""
        ...

    def on_finish(self, request: Request) -> None:
        """Forget a request that finished, failed or was cancelled."""
        ...
