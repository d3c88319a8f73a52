"""The loop under faults, on the hashing runner: prompt logprobs with the prefix cache, one
request's fault contained to it, an uncontainable one failing everything in flight, and the
health a stalled or dead loop reports."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_requests
from fakes import HashRunner, decode_chars
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.errors import EngineDeadError, EngineStepError
from quanta.core.faults import FaultPlan
from quanta.core.loop import EngineLoop, LoopFatalError
from quanta.core.output import RunnerOutput, SchedulerOutput, TokenLogprob
from quanta.core.request import Request, SamplingParams
from quanta.core.watchdog import Watchdog
from quanta.policies import make_policy
from serving import wait_for

BLOCK = 4


def row_logprob(position: int, target: int) -> TokenLogprob:
    """What the fake reports for the row at ``position`` predicting ``target``: each value
    names its row, so a row reported twice, skipped or out of order shows."""
    return TokenLogprob(-(position * 1000 + target) / 1e4)


class LogprobRunner(HashRunner):
    """The hashing runner, plus the prompt logprobs each step asks for."""

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = super().execute(so)
        asked = [
            tuple(row_logprob(s.prompt_logprobs.first + k, t) for k, t in enumerate(targets))
            if s.prompt_logprobs is not None and (targets := s.prompt_logprobs.targets)
            else ()
            for s in so.seqs
        ]
        return dataclasses.replace(out, prompt_logprobs=tuple(asked) if any(asked) else ())


def loop_for(policy: str = "fcfs", *, caching: bool, device: int, host: int, **sched: object):
    return EngineLoop(
        runner=LogprobRunner(device, host, BLOCK, keep_sources=caching),
        policy=make_policy(policy, SchedulerConfig(**sched)),  # type: ignore[arg-type]
        blocks=BlockManager(BLOCK, device, host, prefix_caching=caching),
        clock=VirtualClock(),
        max_model_len=128,
        decode=decode_chars,
    )


def loglikelihood_requests() -> list[Request]:
    """lm-eval's loglikelihood pattern: contexts sharing prefixes longer than a block, each
    with several continuations, scored by echoed prompt logprobs; plain requests between."""
    contexts = [[(5 * j + c) % 41 + 3 for j in range(9 + 4 * c)] for c in range(3)]
    out = []
    for c, context in enumerate(contexts):
        for k in range(4):
            out.append(
                Request(
                    request_id=f"c{c}-{k}",
                    prompt_token_ids=context + [(13 * k + j) % 37 + 2 for j in range(1 + k)],
                    params=SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True),
                    arrival_time=len(out) * 1e-3,
                    seed=len(out),
                )
            )
        out.append(
            Request(
                request_id=f"p{c}",
                prompt_token_ids=[*context, 7, 8],
                params=SamplingParams(max_tokens=16, ignore_eos=True),
                arrival_time=len(out) * 1e-3,
                seed=len(out),
            )
        )
    return out


def run(loop: EngineLoop, requests: list[Request]) -> dict[str, object]:
    streams = {}
    for i, r in enumerate(requests):
        streams[r.request_id] = loop.submit(r)
        if i % 3 == 2:  # NOTE: in threes, so later ones find earlier prefixes cached
            loop.step()
            loop.blocks.check_integrity()
    loop.run_until_idle()
    loop.blocks.check_integrity()
    assert loop.blocks.all_free(), "blocks leaked"
    return {rid: s.result(timeout=0) for rid, s in streams.items()}  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", ["fcfs", "sj-mlfq", "fair"])
@pytest.mark.parametrize("host", [0, 24])
@pytest.mark.parametrize("chunk", [8, 64])
def test_prompt_logprobs_come_once_per_row_in_order_with_the_cache_under_preemption(
    policy, host, chunk
):
    """Requests asking for prompt logprobs share cached prefixes with earlier ones; a small
    pool forces recomputes (host 0) or swaps, and ``chunk`` tokens per step chunk the
    prompts or not. Every prompt logprob equals the run without the cache."""
    plain = run(
        loop_for(policy, caching=False, device=512, host=0, max_num_batched_tokens=64),
        loglikelihood_requests(),
    )
    loop = loop_for(
        policy, caching=True, device=10, host=host, max_num_batched_tokens=chunk, max_num_seqs=4
    )
    got = run(loop, loglikelihood_requests())
    for r in loglikelihood_requests():
        res = got[r.request_id]
        assert res.error is None, res.error
        assert res.token_ids == plain[r.request_id].token_ids
        if r.params.prompt_logprobs is not None:
            ids = r.prompt_token_ids
            expected = [row_logprob(q, ids[q + 1]) for q in range(len(ids) - 1)]
            assert list(res.prompt_logprobs) == expected
            assert list(plain[r.request_id].prompt_logprobs) == expected
    assert loop._applier.prefix_hits > 0  # the plain requests still share the cache
    assert loop.stats().num_preemptions_recompute + loop.stats().num_preemptions_swap > 0


def test_a_request_preempted_by_recompute_takes_back_the_prefix_it_reported():
    """Rows already reported may come from the cache: its own named blocks, after a
    recompute, are hits, and no row is reported twice."""
    loop = loop_for(caching=True, device=64, host=0, max_num_batched_tokens=8)
    r = loglikelihood_requests()[9]
    r.params = SamplingParams(max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    stream = loop.submit(r)
    while len(r.prompt_logprobs) < r.num_prompt_tokens - 1:
        loop.step()
    preempt = Decision(preempt=(Preemption(r.request_id, PreemptMode.RECOMPUTE),))
    loop._applier.apply(preempt, loop._live, 0.0)
    loop.run_until_idle()
    res = stream.result(timeout=0)  # type: ignore[union-attr]
    ids = r.prompt_token_ids
    assert list(res.prompt_logprobs) == [row_logprob(q, ids[q + 1]) for q in range(len(ids) - 1)]
    assert loop._applier.prefix_hits >= BLOCK


# -- containment ---------------------------------------------------------------------------
def fault_requests() -> list[Request]:
    reqs = make_requests(4, prompt_len=9, max_tokens=6)
    for i, r in enumerate(reqs):
        r.params = SamplingParams(max_tokens=6, seed=100 + i)
    return reqs


@pytest.mark.parametrize("site", ["apply", "runner", "commit", "detokenize"])
def test_a_fault_in_one_requests_handling_fails_only_that_request(site):
    expected = run(loop_for(caching=True, device=64, host=0), fault_requests())
    loop = loop_for(caching=True, device=64, host=0)
    loop.inject(FaultPlan.parse(f"{site}:101"))
    got = run(loop, fault_requests())
    assert isinstance(got["r1"].error, EngineStepError)
    assert "injected fault" in str(got["r1"].error)
    for rid in ("r0", "r2", "r3"):
        assert got[rid].error is None
        assert got[rid].token_ids == expected[rid].token_ids


def test_steps_that_fail_as_a_whole_again_and_again_are_fatal():
    loop = loop_for(caching=False, device=64, host=0, max_num_seqs=1)
    loop.inject(FaultPlan.parse("runner"))  # every row: the fault is no one request's
    streams = [loop.submit(r) for r in make_requests(8, prompt_len=5)]
    with pytest.raises(LoopFatalError, match="5 engine steps in a row failed"):
        for _ in range(50):
            loop.step()
    errors = [s.result(timeout=0).error for s in streams[:5]]  # type: ignore[union-attr]
    assert all(isinstance(e, EngineStepError) for e in errors)


def test_an_uncontainable_fault_fails_everything_in_flight_and_refuses_more():
    loop = loop_for(caching=False, device=64, host=0, max_num_seqs=2)
    loop.inject(FaultPlan.parse("step:102"))
    fatal: list[str] = []
    loop.on_fatal = fatal.append
    reqs = fault_requests()
    streams = [loop.submit(r) for r in reqs[:2]]
    loop.start()
    assert streams[0].result(timeout=30).error is None  # type: ignore[union-attr]
    late = loop.submit(reqs[2])  # seed 102: the loop dies on the step that sees it
    extra = loop.submit(reqs[3])
    for s in (late, extra):
        error = s.result(timeout=30).error  # type: ignore[union-attr]
        assert isinstance(error, EngineDeadError) and "injected fault" in str(error)
    wait_for(lambda: fatal, what="on_fatal")
    assert "injected fault at step" in fatal[0]
    health = loop.health(stall_timeout=60)
    assert not health.healthy and "injected fault" in health.reason
    with pytest.raises(EngineDeadError):
        loop.submit(make_requests(1)[0])
    loop.stop()


def test_a_stalled_loop_is_reported_unhealthy_and_its_queue_stays_counted():
    loop = loop_for(caching=False, device=64, host=0)
    loop.inject(FaultPlan.parse("stall:777"))
    seen = []
    dog = Watchdog(loop, stall_timeout=0.3, on_unhealthy=seen.append, interval=0.05)
    loop.start()
    dog.start()
    assert loop.submit(fault_requests()[0]).result(timeout=30).error is None  # type: ignore[union-attr]
    assert dog.latest().healthy
    stuck = fault_requests()[1]
    stuck.params = SamplingParams(max_tokens=4, seed=777)
    loop.submit(stuck)
    for r in fault_requests()[2:]:
        loop.submit(r)
    wait_for(lambda: seen, timeout=30, what="the watchdog")
    assert not seen[0].healthy and "no engine step completed" in seen[0].reason
    assert seen[0].num_unfinished == 3
    assert loop.stats().num_waiting + loop.stats().num_running >= 3
    dog.stop()
    loop.stop()  # releases the stalled step; every request ends
    assert not loop.has_unfinished()


def test_an_idle_loop_is_healthy_however_long_it_waited():
    loop = loop_for(caching=False, device=64, host=0)
    loop.start()
    loop._beat -= 3600  # NOTE: as if the last step ended an hour ago
    assert loop.health(stall_timeout=1).healthy
    assert loop.submit(make_requests(1)[0]).result(timeout=30).error is None  # type: ignore[union-attr]
    assert loop.health(stall_timeout=1).healthy
    loop.stop()


def test_a_fault_spec_names_known_sites_and_integer_seeds():
    plan = FaultPlan.parse("commit:1, stall")
    assert plan.sites == {"commit": frozenset({1}), "stall": frozenset({None})}
    with pytest.raises(ValueError, match="unknown site 'comit'"):
        FaultPlan.parse("comit:1")
    with pytest.raises(ValueError, match="not an integer"):
        FaultPlan.parse("commit:x")
