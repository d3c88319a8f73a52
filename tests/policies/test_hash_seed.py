"""A seeded workload gets the same decisions in every process, whatever the string hashing.

Python salts the hash of ``str`` (and ``bytes``) per process, so a set of request ids or
tenant names iterates in another order in the next process: a policy that walked one, or a
sort whose ties kept such an order, would decide differently on each run of the same seeded
simulation, and the simulator's figures in the docs could not be repeated. Here every
system's decisions over one workload are compared between two interpreters started with
different ``PYTHONHASHSEED`` values. The workload has what makes the systems choose among
equals: tenants (fair, vtc), both priority classes (conserve), prompts that share cached
prefixes, a pool too small for the queue (evictions, Apt-Serve's hidden caches) and many
arrivals at one instant (ties in arrival time).

Run as a script it prints the decisions of the systems it is given, as JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision
from quanta.core.loop import EngineLoop
from quanta.core.output import RunnerCapabilities, RunnerOutput, SchedulerOutput
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.core.view import SchedulerView
from quanta.policies import make_policy

SYSTEMS = ["fcfs", "sj-mlfq", "fair", "vtc", "conserve", "apt", "fair+apt", "fair+conserve"]


class _InstantRunner:
    """Samples token 5 for every row that samples; offers all an engine may offer."""

    capabilities = RunnerCapabilities(hidden_cache=True, layer_safepoints=True)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(
            tuple(s.request_id for s in so.seqs), tuple(5 if s.sample else None for s in so.seqs)
        )


def _ignore(_: object) -> None:
    """The outputs are not looked at: the decisions are."""


def _plain(now: float, d: Decision) -> list[object]:
    """The decision as JSON: ``hidden`` is a set, so it is sorted (the applier reads it by
    membership only); the abort rule is a function, so only whether there is one."""
    return [
        now,
        [list(run) for run in d.run],
        [[p.request_id, p.mode.value] for p in d.preempt],
        list(d.swap_in),
        sorted(d.hidden),
        list(d.checkpoint),
        d.abort_when is not None,
    ]


def decisions(system: str) -> list[list[object]]:
    """Every decision ``system`` makes over the seeded workload, with the time it was made."""
    rng = random.Random(11)
    clock = VirtualClock()
    policy = make_policy(system, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=160))
    made: list[list[object]] = []
    schedule = policy.schedule

    def recorded(view: SchedulerView) -> Decision:
        made.append(_plain(view.now, decision := schedule(view)))
        return decision

    policy.schedule = recorded  # type: ignore[method-assign]
    loop = EngineLoop(
        runner=_InstantRunner(),
        policy=policy,
        blocks=BlockManager(16, 32, 24, prefix_caching=True),
        clock=clock,
        max_model_len=512,
    )
    prefixes = [[rng.randrange(1, 50) for _ in range(48)] for _ in range(3)]
    for i in range(60):
        prompt = rng.choice(prefixes)[: rng.choice([0, 16, 32, 48])]
        prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))]
        meta = RequestMetadata(
            tenant=f"tenant-{rng.randrange(5)}",
            tenant_authenticated=rng.random() < 0.7,
            priority_class=rng.choice(["online", "offline"]),
        )
        params = SamplingParams(max_tokens=rng.randrange(1, 80), ignore_eos=True, temperature=0)
        loop.submit(Request(f"req-{i}", prompt, params, clock.now(), i, metadata=meta), _ignore)
        if i % 4 == 3:  # NOTE: arrivals in fours at one instant, a step between
            loop.step()
            clock.advance(rng.choice([0.0, 0.02, 0.2]))
    while loop.has_unfinished():
        loop.step()
        clock.advance(0.02)
    return made


def _in_process(hash_seed: str) -> dict[str, list[list[object]]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, __file__, *SYSTEMS], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_every_system_decides_alike_under_two_hash_seeds():
    first, second = _in_process("1"), _in_process("2")
    for system in SYSTEMS:
        assert first[system] == second[system], system
    apt = first["apt"]
    assert any(d[4] for d in apt) and any(d[2] for d in apt)  # hidden caches and evictions


if __name__ == "__main__":
    print(json.dumps({s: decisions(s) for s in sys.argv[1:]}))
