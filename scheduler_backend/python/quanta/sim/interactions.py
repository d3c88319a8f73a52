"""Dependency-aware replay: when each simulated request may be sent.

An agent's next call needs the previous call's answer, so a call with ``interaction_stage``
is sent only once the call before it in its interaction (the present call of the next lower
stage) has finished: at max(its ``arrival_time``, that finish + its think time), which becomes
its ``arrival_time``. If an earlier call failed, was throttled or was refused at submission,
the rest of the interaction is never sent (abandoned: the user got no answer to build on).
Requests without a stage are sent at their ``arrival_time``, in the order an open-loop replay
sends them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence

from quanta.core.errors import ThrottledError
from quanta.core.request import Request, RequestStatus
from quanta.core.stream import RequestOutput, Sink


class Replay:
    """The requests not sent yet: a queue of those due at a known time and, per request in
    flight, the call of its interaction waiting for it. Outcomes are recorded as requests
    finish: ``throttled`` (refused by the policy's admission) and ``abandoned`` (never sent).

    NOTE: the loop calls a request's sink on its thread; the simulator drives the loop on its
    own thread, so no lock is needed.
    """

    def __init__(
        self, requests: Sequence[Request], think_times: Mapping[str, float] | None = None
    ) -> None:
        self._think = dict(think_times or {})
        self._index = {id(r): i for i, r in enumerate(requests)}  # ties: the given order
        self._due: list[tuple[float, int, Request]] = []
        self._waiting: dict[str, Request] = {}  # request id -> the call that follows it
        self.throttled: set[str] = set()
        self.abandoned: list[Request] = []
        chains: dict[str, list[Request]] = defaultdict(list)
        for r in requests:
            meta = r.metadata
            if meta.interaction_id is not None and meta.interaction_stage is not None:
                chains[meta.interaction_id].append(r)
            else:
                self._push(r.arrival_time, r)
        for chain in chains.values():
            chain.sort(key=lambda r: r.metadata.interaction_stage or 0)  # stable: file order
            self._push(chain[0].arrival_time, chain[0])
            for before, after in itertools.pairwise(chain):
                self._waiting[before.request_id] = after

    @property
    def pending(self) -> bool:
        """Requests are due at a known time (those waiting on others are not counted)."""
        return bool(self._due)

    def next_time(self) -> float | None:
        return self._due[0][0] if self._due else None

    def due(self, now: float) -> list[Request]:
        """The requests to send by ``now``, in order."""
        out = []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due)[2])
        return out

    def peek(self, until: float) -> list[Request]:
        """The requests due before ``until``, in the order ``due`` will send them; none is
        removed (the simulator asks which arrivals fall inside a running step)."""
        found, stack = [], [0]
        while stack:  # NOTE: a heap: a node due at or after ``until`` hides its whole subtree
            i = stack.pop()
            if i < len(self._due) and self._due[i][0] < until:
                found.append(self._due[i])
                stack += (2 * i + 1, 2 * i + 2)
        return [entry[2] for entry in sorted(found, key=lambda e: e[:2])]

    def sink(self, request: Request) -> Sink:
        """The sink to submit ``request`` with: it learns when and how the request ends."""

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                self._finished(request, out)

        return on_output

    def refused(self, request: Request) -> None:
        """The engine refused ``request`` at submission: its interaction ends here."""
        self._abandon_after(request, "an earlier call was refused")

    def _finished(self, request: Request, out: RequestOutput) -> None:
        if out.error is not None:
            if isinstance(out.error, ThrottledError):
                self.throttled.add(request.request_id)
            self._abandon_after(request, f"an earlier call failed ({out.error})")
            return
        follower = self._waiting.pop(request.request_id, None)
        if follower is None:
            return
        assert request.finish_time is not None  # NOTE: set before the final delta is sent
        think = self._think.get(follower.request_id, 0.0)
        follower.arrival_time = max(follower.arrival_time, request.finish_time + think)
        self._push(follower.arrival_time, follower)

    def _abandon_after(self, request: Request, why: str) -> None:
        follower = self._waiting.pop(request.request_id, None)
        while follower is not None:
            follower.error = f"abandoned, never sent: {why}"
            follower.set_status(RequestStatus.FINISHED_ABORTED)
            self.abandoned.append(follower)
            follower = self._waiting.pop(follower.request_id, None)

    def _push(self, when: float, request: Request) -> None:
        heapq.heappush(self._due, (when, self._index[id(request)], request))
