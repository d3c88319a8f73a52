"""The policy protocol: what the loop asks of a scheduler, and what a scheduler asks of the
runner.

A policy never touches blocks or tensors. It reads a ``SchedulerView`` and returns a
``Decision``; the loop's applier replays it on the block ledger (``core/plan.py``) and an
infeasible one raises ``PolicyError`` (a policy bug). A policy that needs something of the
engine (a hidden cache, layer safepoints, asynchronous copies) says so in ``requires`` and the
loop refuses to start on a runner that lacks it, rather than silently doing less.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Protocol

from quanta.core.decision import Decision
from quanta.core.errors import CapabilityError
from quanta.core.output import RunnerCapabilities, RunnerOutput
from quanta.core.request import Request
from quanta.core.view import SchedulerView


class Policy(Protocol):
    """A scheduling policy; one instance per loop, called only from the loop thread."""

    name: str
    requires: RunnerCapabilities

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        """Accept a new request (None) or refuse it with a reason that reaches the client."""
        ...

    def schedule(self, view: SchedulerView) -> Decision:
        """Decide this iteration. Promises a decision feasible for the view's block pools."""
        ...

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        """Learn from a finished step; called before ``on_finish`` of the requests it ended,
        whose ``num_computed_tokens`` already include the step."""
        ...

    def on_finish(self, request: Request) -> None:
        """Forget a request that finished, failed or was cancelled (the loop calls it once
        per request, whatever way it ended)."""
        ...

    def on_abort(self, decision: Decision) -> None:
        """A preemptible step was stopped at a layer safepoint: none of ``decision``'s runs
        happened (its preemptions and swap-ins did). Called only for steps the policy marked
        preemptible (``Decision.abort_when``)."""
        ...


def missing_capabilities(required: RunnerCapabilities, offered: RunnerCapabilities) -> list[str]:
    """The capability names ``required`` asks for and ``offered`` lacks."""
    return [
        f.name
        for f in fields(required)
        if getattr(required, f.name) and not getattr(offered, f.name)
    ]


def check_capabilities(policy: Policy, offered: RunnerCapabilities, runner_name: str) -> None:
    """Raise ``CapabilityError`` when ``policy`` needs more than the runner offers."""
    missing = missing_capabilities(policy.requires, offered)
    if missing:
        hint = _HINTS.get(missing[0], "") if len(missing) == 1 else ""
        raise CapabilityError(
            f"policy {policy.name!r} needs {', '.join(missing)}, which the {runner_name} "
            f"runner does not offer{hint}"
        )


_HINTS = {
    "hidden_cache": (
        " (the hidden cache halves memory only with multi-head attention, so grouped-query "
        "models are not offered it; policy option cache=kv schedules without it)"
    ),
}
