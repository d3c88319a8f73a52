"""``quanta simulate --replicas N``: N engines behind one router, on one virtual time line.

Each replica is the simulator's usual engine: the real loop and policy on a ``SimRunner``,
with its own clock. The driver always moves whatever is earliest. An arrival due no later
than every busy replica's clock is routed and submitted. Otherwise the busy replica whose
clock is furthest behind runs one step. So a replica sees an arrival at most one of its own
steps late, as a real engine does when a request lands mid-step.

Routers, as production routers spell them:

- ``least-outstanding`` (default): the replica with the fewest requests sent and not finished;
- ``round-robin``;
- ``prefix-affinity``: the replica a request's first full block of tokens hashes to, so calls
  sharing a system prompt meet their cached prefix, unless that replica has more than
  ``AFFINITY_SLACK`` times the mean outstanding (plus a few), as SGLang's cache-aware router
  balances.

``shared_state`` gives every replica's fair policy one ``memory://`` state
(``policies/fair_state.py``): the counters a Redis deployment would share, updated as each step
ends. Without it each replica ranks tenants by its own service only.

Not modelled: safepoint aborts (a replica's step is not interrupted by arrivals routed
elsewhere, so ConServe's layer-level preemption is off here), network delay and router cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.errors import InvalidRequestError
from quanta.core.loop import EngineLoop, LoopStats
from quanta.core.request import Request
from quanta.core.stream import RequestOutput
from quanta.metrics import SLO
from quanta.policies import parse_policy
from quanta.policies.fair_stores import forget_state
from quanta.sim.driver import SimResult, SimSetup, build_requests, make_sim_policy, replay_of
from quanta.sim.interactions import Replay
from quanta.sim.metrics import summarize
from quanta.sim.runner import SimRunner, SimStats
from quanta.workloads import WorkloadRequest

ROUTERS = ("least-outstanding", "round-robin", "prefix-affinity")
AFFINITY_SLACK = 2.0  # prefix-affinity gives way above this many times the mean load


class Router:
    """Picks a replica for each request, by the policy ``name`` (module docstring)."""

    def __init__(
        self, name: str, replicas: int, block_size: int, affinity_slack: float = AFFINITY_SLACK
    ) -> None:
        if name not in ROUTERS:
            raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.name, self.replicas, self.block_size = name, replicas, block_size
        self.affinity_slack = affinity_slack  # inf: sticky, never balanced
        self._turn = itertools.cycle(range(replicas))

    def pick(self, request: Request, outstanding: Sequence[int]) -> int:
        least = min(range(self.replicas), key=lambda i: (outstanding[i], i))
        if self.name == "round-robin":
            return next(self._turn)
        if self.name == "least-outstanding":
            return least
        home = self.home(request)
        mean = sum(outstanding) / self.replicas
        return home if outstanding[home] <= self.affinity_slack * mean + 4 else least

    def home(self, request: Request) -> int:
        """The replica ``request``'s first full block of prompt tokens hashes to."""
        head = request.prompt_token_ids[: self.block_size]
        digest = hashlib.blake2b(repr(list(head)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.replicas


@dataclass
class ReplicaResult(SimResult):
    """A replicated run: the usual figures over every request, and per replica what it did."""

    per_replica: tuple[dict[str, Any], ...] = ()


def simulate_replicas(
    trace: Sequence[WorkloadRequest],
    setup: SimSetup,
    replicas: int,
    *,
    router: str = "least-outstanding",
    shared_state: bool = False,
    until: float | None = None,
    affinity_slack: float = AFFINITY_SLACK,
) -> ReplicaResult:
    """Serve ``trace`` on ``replicas`` copies of ``setup`` behind ``router``; deterministic."""
    route = Router(router, replicas, setup.block_size, affinity_slack)
    url = None
    if shared_state and parse_policy(setup.policy, setup.policy_options).accepts("state_url"):
        url = f"memory://sim-{uuid.uuid4().hex}"
        setup = dataclasses.replace(
            setup, policy_options={**setup.policy_options, "state_url": url}
        )
    try:
        return _run(trace, setup, route, until, shared=url is not None)
    finally:
        if url is not None:
            forget_state(url)


def summarize_replicas(
    trace: Sequence[WorkloadRequest],
    setup: SimSetup,
    replicas: int,
    *,
    router: str,
    shared_state: bool,
    delay_threshold_s: float,
    slo: SLO | None,
) -> dict[str, Any]:
    """``quanta simulate``'s JSON of a replicated run: ``summarize``'s figures over every
    request, and under ``replicas`` the router, the state and each replica's share."""
    run = simulate_replicas(trace, setup, replicas, router=router, shared_state=shared_state)
    result = summarize(run, delay_threshold_s=delay_threshold_s, slo=slo)
    result["replicas"] = {
        "count": replicas,
        "router": router,
        "shared_state": "on" if shared_state else "off",
        "per_replica": list(run.per_replica),
    }
    return result


def _run(
    trace: Sequence[WorkloadRequest],
    setup: SimSetup,
    route: Router,
    until: float | None,
    *,
    shared: bool,
) -> ReplicaResult:
    n = route.replicas
    clocks = [VirtualClock() for _ in range(n)]
    runners = [
        SimRunner(setup.profile, c, setup.block_size, safepoint_interval=setup.safepoint_interval)
        for c in clocks
    ]
    device, host = setup.pools()
    loops = [
        EngineLoop(
            runner=runners[i],
            policy=make_sim_policy(setup),
            blocks=BlockManager(
                setup.block_size,
                device,
                host,
                prefix_caching=setup.prefix_caching,
                sliding_window=setup.profile.sliding_window,
            ),
            clock=clocks[i],
            max_model_len=setup.profile.max_model_len,
        )
        for i in range(n)
    ]
    requests = build_requests(trace)
    plan = replay_of(trace, requests)
    outstanding = [0] * n
    routed = [0] * n
    rejected = _drive(loops, clocks, plan, route, outstanding, routed, until)
    cut_off = tuple(r.request_id for r in requests if not r.status.finished)
    for loop in loops:
        if loop.has_unfinished():
            loop.stop(f"the simulated run ended at {until} s")
        loop.blocks.check_integrity()
    abandoned = tuple(r.request_id for r in plan.abandoned)
    expected = plan.throttled | set(abandoned) | set(cut_off)
    failed = [r for r in requests if r.error is not None and r.request_id not in expected]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    per_replica = tuple(
        {
            "routed": routed[i],
            "steps": runners[i].stats.steps,
            "compute_s": runners[i].stats.compute_s,
            "clock_s": clocks[i].now(),
        }
        for i in range(n)
    )
    return ReplicaResult(
        setup,
        requests,
        rejected,
        _merged_stats([r.stats for r in runners]),
        _merged_loop_stats([loop.stats() for loop in loops]),
        frozenset(plan.throttled),
        abandoned,
        cut_off,
        per_replica=per_replica,
    )


def _drive(
    loops: list[EngineLoop],
    clocks: list[VirtualClock],
    plan: Replay,
    route: Router,
    outstanding: list[int],
    routed: list[int],
    until: float | None,
) -> list[tuple[Request, str]]:
    rejected: list[tuple[Request, str]] = []
    limit = float("inf") if until is None else until
    while True:
        busy = [i for i, loop in enumerate(loops) if loop.has_unfinished()]
        t_step = min((clocks[i].now() for i in busy), default=float("inf"))
        due = plan.next_time()
        t_arrival = float("inf") if due is None else due
        if min(t_step, t_arrival) >= limit or (not busy and due is None):
            return rejected
        if t_arrival <= t_step:
            for req in plan.due(t_arrival):
                i = route.pick(req, outstanding)
                clocks[i].set(max(clocks[i].now(), t_arrival))
                try:
                    loops[i].submit(req, _counting(plan.sink(req), outstanding, i))
                except InvalidRequestError as exc:
                    rejected.append((req, str(exc)))
                    plan.refused(req)
                    continue
                outstanding[i] += 1
                routed[i] += 1
            continue
        i = min(busy, key=lambda k: (clocks[k].now(), k))
        if not loops[i].step():
            # NOTE: nothing runnable there until another arrival (its queue is blocked)
            nxt = plan.next_time()
            if nxt is None:
                loops[i].run_until_idle()  # fails what the policy left stuck
            else:
                clocks[i].set(max(clocks[i].now(), nxt))


def _counting(sink: Any, outstanding: list[int], i: int) -> Any:
    def on_output(out: RequestOutput) -> None:
        if out.finished:
            outstanding[i] -= 1
        sink(out)

    return on_output


def _merged_stats(stats: Sequence[SimStats]) -> SimStats:
    out = SimStats()
    for s in stats:
        for f in dataclasses.fields(SimStats):
            if f.name == "stall_by_request":
                for rid, t in s.stall_by_request.items():
                    out.stall_by_request[rid] += t
            else:
                setattr(out, f.name, getattr(out, f.name) + getattr(s, f.name))
    return out


def _merged_loop_stats(stats: Sequence[LoopStats]) -> LoopStats:
    """Every counter summed over the replicas (gauges too: the cluster's totals)."""
    first = stats[0]
    summed = {}
    for f in dataclasses.fields(first):
        values = [getattr(s, f.name) for s in stats]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            summed[f.name] = sum(values)
    return dataclasses.replace(first, **summed)
