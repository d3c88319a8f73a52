"""Scheduling step N+1 while step N runs (async scheduling), on the hashing runner behind a
simulated device whose sampled ids reach the host only once its step has ended: every
scheduling system gives the same tokens with the overlap on and off, under preemption by swap
and recompute, greedy and seeded; a finished request wastes at most one row; the steps whose
next step needs the token on the host run the old way; a fault stays contained."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import MLFQ_ALWAYS, make_requests
from fakes import DeviceHashRunner, HashRunner, decode_chars
from hypothesis import given
from hypothesis import strategies as st
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.errors import EngineDeadError, EngineStepError
from quanta.core.faults import FaultPlan
from quanta.core.loop import EngineLoop
from quanta.core.output import LogitsProcessing, ScheduledSeq, SchedulerOutput
from quanta.core.overlap import PLACEHOLDER, fill, settle
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.policies import make_policy
from serving import wait_for

BLOCK = 4

SYSTEMS = [
    ("fcfs", {}),
    ("sj-mlfq", {"base_quantum": 1e-5, "starve_limit": 1e-3, **MLFQ_ALWAYS}),
    ("fair", {}),
    ("conserve", {"safepoints": False, "checkpoint_threshold": 1.0}),
    ("apt", {"cache": "kv"}),
    ("apt", {"cache": "kv", "allow_swap": True}),
    ("fair+conserve", {"safepoints": False}),
    ("sj-mlfq+affinity", dict(MLFQ_ALWAYS)),
]


def loop_for(
    policy: str = "fcfs",
    *,
    overlap: bool,
    device: int = 512,
    host: int = 0,
    runner: HashRunner | None = None,
    options: dict[str, object] | None = None,
    **sched: object,
) -> EngineLoop:
    sched.setdefault("max_num_batched_tokens", 16)
    return EngineLoop(
        runner=runner or DeviceHashRunner(device, host, BLOCK, step_seconds=0.001),
        policy=make_policy(policy, SchedulerConfig(**sched), **(options or {})),  # type: ignore[arg-type]
        blocks=BlockManager(BLOCK, device, host),
        clock=VirtualClock(),
        max_model_len=256,
        decode=decode_chars,
        async_scheduling=overlap,
    )


def workload(temperature: float) -> list[Request]:
    """Online and offline requests of mixed lengths (ConServe tells them apart)."""
    lens = [5, 8, 6, 9, 7, 4, 11, 3]
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[(7 * i + j) % 50 for j in range(n)],
            params=SamplingParams(max_tokens=12 + i, temperature=temperature),
            arrival_time=i * 1e-3,
            seed=100 + i,
            metadata=RequestMetadata(priority_class="offline" if i % 3 else "online"),
        )
        for i, n in enumerate(lens)
    ]


def run(loop: EngineLoop, requests: list[Request]) -> dict[str, tuple[int, ...]]:
    streams = [loop.submit(r) for r in requests]
    loop.run_until_idle()
    loop.stop()
    loop.blocks.check_integrity()
    assert loop.blocks.all_free(), "blocks leaked"
    outs = [s.result(timeout=0) for s in streams]  # type: ignore[union-attr]
    assert [o.error for o in outs] == [None] * len(outs)
    return {r.request_id: o.token_ids for r, o in zip(requests, outs, strict=True)}


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("host", [64, 0], ids=["swap", "recompute"])
@pytest.mark.parametrize(("policy", "options"), SYSTEMS, ids=[s for s, _ in SYSTEMS])
def test_every_system_gives_the_same_tokens_with_and_without_overlap(
    policy, options, host, temperature
):
    expected = run(loop_for(overlap=False, runner=HashRunner(512, 0, BLOCK)), workload(temperature))
    got = {}
    for overlap in (False, True):
        loop = loop_for(policy, overlap=overlap, device=14, host=host, options=options)
        got[overlap] = run(loop, workload(temperature))
        stats = loop.stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
        assert stats.async_scheduling is overlap
        device = loop.runner
        assert isinstance(device, DeviceHashRunner)
        if overlap:  # NOTE: the host scheduled rows whose tokens only the device knew
            assert stats.num_overlapped_steps > 0 and device.placeholder_rows.total() > 0
            assert device.num_launched_busy > 0  # ... while the device ran the step before
        else:
            assert stats.num_overlapped_steps == 0 and device.placeholder_rows.total() == 0
            assert device.num_launched_busy == 0
    assert got[False] == expected
    assert got[True] == expected


@given(
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=7),
    max_tokens=st.integers(1, 10),
    device=st.integers(12, 40),
    host=st.sampled_from([0, 16]),
    budget=st.integers(4, 32),
    late=st.integers(0, 6),
)
def test_any_workload_gives_the_same_tokens_overlapped(
    lens, max_tokens, device, host, budget, late
):
    """Arrivals part-way through and small pools: preemptions, chunked prefills, requests
    finishing while the next step is already scheduled."""

    def requests() -> list[Request]:
        return make_requests(len(lens), prompt_len=lens, max_tokens=max_tokens, temperature=0.7)

    expected = run(loop_for(overlap=False, runner=HashRunner(512, 0, BLOCK)), requests())
    loop = loop_for(overlap=True, device=device, host=host, max_num_batched_tokens=budget)
    reqs = requests()
    streams = [loop.submit(r) for r in reqs[: len(reqs) // 2]]
    for _ in range(late):
        loop.step()
    streams += [loop.submit(r) for r in reqs[len(reqs) // 2 :]]
    loop.run_until_idle()
    loop.stop()
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()
    got = {r.request_id: s.result(timeout=0).token_ids for r, s in zip(reqs, streams, strict=True)}  # type: ignore[union-attr]
    assert got == expected


def test_a_request_that_finished_wastes_at_most_one_row():
    """A stop token (EOS) only the device knows ends a request one step late on the host."""
    reqs = make_requests(4, prompt_len=[3, 6, 4, 5], max_tokens=30)
    plain = run(loop_for(overlap=False), make_requests(4, prompt_len=[3, 6, 4, 5], max_tokens=30))
    for r in reqs:  # each request stops on its 4th token, which no row of it knew before
        r.params = r.params.model_copy(update={"stop_token_ids": [plain[r.request_id][3]]})
    loop = loop_for(overlap=True)
    got = run(loop, reqs)
    assert all(got[rid] == plain[rid][:4] for rid in got)
    device = loop.runner
    assert isinstance(device, DeviceHashRunner)
    rows = Counter(s.request_id for so in device.steps for s in so.seqs if s.sample)
    assert all(rows[rid] in (4, 5) for rid in got) and any(rows[rid] == 5 for rid in got)


class _AnyToken:
    """A grammar that allows everything and counts what it was told."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    @property
    def terminated(self) -> bool:
        return False


def test_structured_output_rows_are_never_scheduled_on_a_placeholder():
    """The grammar advances on the committed token, so the step after a constrained row that
    samples waits for it; once that request is done, the others overlap again."""
    reqs = make_requests(3, prompt_len=[4, 5, 6], max_tokens=12)
    reqs[1].params = SamplingParams(max_tokens=4)
    grammar = _AnyToken()
    reqs[1].constraint = grammar
    loop = loop_for(overlap=True)
    got = run(loop, reqs)
    device = loop.runner
    assert isinstance(device, DeviceHashRunner)
    constrained = [s for so in device.steps for s in so.seqs if s.request_id == "r1"]
    assert grammar.accepted == list(got["r1"][:-1])  # NOTE: the last one ends it by length
    assert device.placeholder_rows["r1"] == 0 and device.placeholder_rows.total() > 0
    assert len(constrained) == len(got["r1"])  # NOTE: nor a wasted row at its end


def test_speculative_decoding_turns_the_overlap_off():
    from quanta.core.speculative import SpeculativeConfig

    loop = EngineLoop(
        runner=HashRunner(64, 0, BLOCK),
        policy=make_policy("fcfs", SchedulerConfig()),
        blocks=BlockManager(BLOCK, 64, 0),
        clock=VirtualClock(),
        max_model_len=256,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
        async_scheduling=True,
    )
    assert not loop.async_scheduling and not loop.stats().async_scheduling


def test_placeholders_take_the_previous_steps_tokens_in_inputs_and_history():
    def seq(rid: str, tokens: tuple[int, ...], history: tuple[int, ...] = ()) -> ScheduledSeq:
        processing = LogitsProcessing(history=history, repetition_penalty=1.2) if history else None
        return ScheduledSeq(rid, tokens, 6, (0, 1), True, 0.0, 1.0, 0, 0, 2, processing)

    so = SchedulerOutput((seq("a", (PLACEHOLDER,), (1, 2, 3, PLACEHOLDER)), seq("b", (5, 6))))
    filled = fill(so, {"a": 9, "b": 4})
    assert filled.seqs[0].token_ids == (9,)
    assert filled.seqs[0].processing is not None
    assert filled.seqs[0].processing.history == (1, 2, 3, 9)
    assert filled.seqs[1] is so.seqs[1]
    plain = SchedulerOutput((seq("b", (5, 6)),))
    assert fill(plain, {}) is plain
    with pytest.raises(RuntimeError, match="no sampled token"):
        fill(so, {"b": 4})
    # once the step before is committed, the request's own token at that position
    (r,) = make_requests(1, prompt_len=6)
    r.append_token(7, 0.0)
    rerun = settle(SchedulerOutput((seq("r0", (PLACEHOLDER,)), seq("gone", (1,)))), {"r0": r})
    assert [s.token_ids for s in rerun.seqs] == [(7,)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_runner_fault_stays_with_its_request_while_steps_overlap(overlap):
    """Step N's collection raises; step N+1, launched on it, ran nothing and runs again
    once N's rows went through one by one."""

    def requests() -> list[Request]:
        reqs = make_requests(4, prompt_len=9, max_tokens=6)
        for i, r in enumerate(reqs):
            r.params = SamplingParams(max_tokens=6, seed=100 + i)
        return reqs

    expected = run(loop_for(overlap=False, runner=HashRunner(64, 0, BLOCK)), requests())
    loop = loop_for(overlap=overlap, runner=HashRunner(64, 0, BLOCK))
    loop.inject(FaultPlan.parse("runner:101"))
    reqs = requests()
    streams = [loop.submit(r) for r in reqs]
    loop.run_until_idle()
    loop.stop()
    assert loop.blocks.all_free()
    got = {r.request_id: s.result(timeout=0) for r, s in zip(reqs, streams, strict=True)}  # type: ignore[union-attr]
    assert isinstance(got["r1"].error, EngineStepError)
    for rid in ("r0", "r2", "r3"):
        assert got[rid].error is None and got[rid].token_ids == expected[rid]
    assert loop.stats().num_overlapped_steps > 0 if overlap else True


def test_a_loop_whose_overlapped_steps_keep_failing_dies_and_says_so():
    """Every row raises: the steps fail as a whole, the loop gives up, and its health and
    every request say it died, with a step launched on the failing one in flight."""
    loop = loop_for(overlap=True, runner=HashRunner(64, 0, BLOCK), max_num_seqs=1)
    loop.max_step_failures = 2
    loop.inject(FaultPlan.parse("runner"))
    fatal: list[str] = []
    loop.on_fatal = fatal.append
    streams = [loop.submit(r) for r in make_requests(6, prompt_len=5)]
    loop.start()
    errors = [s.result(timeout=30).error for s in streams]  # type: ignore[union-attr]
    assert all(isinstance(e, EngineStepError | EngineDeadError) for e in errors)
    assert any(isinstance(e, EngineDeadError) for e in errors)
    wait_for(lambda: fatal, what="on_fatal")
    assert "engine steps in a row failed" in fatal[0]
    assert not loop.health(stall_timeout=60).healthy
    with pytest.raises(EngineDeadError):
        loop.submit(make_requests(1)[0])
    loop.stop()
