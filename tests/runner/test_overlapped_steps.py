"""Async scheduling on the real runner (a tiny LLaMA on the CPU): each step scheduled while
the one before it runs on the step thread gives every request the tokens of the engine that
waits, under preemption by swap and recompute, greedy, seeded and with penalties (whose
history holds the placeholder the runner fills)."""

from __future__ import annotations

import pytest
import quanta
from conftest import MLFQ_ALWAYS
from runner_helpers import PROMPTS

pytestmark = pytest.mark.engine


def params() -> list[quanta.SamplingParams]:
    greedy = quanta.SamplingParams(max_tokens=20, temperature=0)
    seeded = quanta.SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7)
    penalized = quanta.SamplingParams(
        max_tokens=20, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5
    )
    return [greedy] * len(PROMPTS) + [seeded] * 2 + [penalized] * 2


def generate(model_dir, *, overlap: bool | None, host: int, policy: str = "fcfs", **options):
    llm = quanta.LLM(
        str(model_dir),
        policy=policy,
        policy_options=options,
        cache={"num_device_blocks": 20, "num_host_blocks": host, "block_size": 4},
        scheduler={"max_num_batched_tokens": 16},
        async_scheduling=overlap,
    )
    prompts = PROMPTS + PROMPTS[:2] + PROMPTS[2:]
    out = llm.generate(prompts, params())
    loop = llm.engine.loop
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()
    return [r.token_ids for r in out], loop.stats(), llm.engine.describe()


@pytest.mark.parametrize("host", [64, 0], ids=["swap", "recompute"])
@pytest.mark.parametrize(
    ("policy", "options"), [("fcfs", {}), ("sj-mlfq", MLFQ_ALWAYS)], ids=["fcfs", "sj-mlfq"]
)
def test_overlapped_steps_give_the_same_tokens(llama_tiny, host, policy, options):
    expected, plain, info = generate(llama_tiny, overlap=None, host=host, policy=policy, **options)
    assert not plain.async_scheduling and info["async_scheduling"] == "false"  # the CPU's default
    got, stats, info = generate(llama_tiny, overlap=True, host=host, policy=policy, **options)
    assert stats.async_scheduling and info["async_scheduling"] == "true"
    assert stats.num_overlapped_steps > 0
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert got == expected


def test_structured_output_beside_plain_requests_gives_the_same_tokens(llama_tiny):
    """A guided row's next step waits for its committed token (its grammar advances on it);
    the plain requests beside it get the same tokens either way."""
    guided = quanta.SamplingParams(
        max_tokens=12,
        temperature=0.8,
        seed=3,
        structured_output=quanta.StructuredOutput(regex="[ab]+c"),
    )
    plain = quanta.SamplingParams(max_tokens=24, temperature=0)
    outs = {}
    for overlap in (False, True):
        llm = quanta.LLM(str(llama_tiny), async_scheduling=overlap, cache={"num_device_blocks": 64})
        res = llm.generate(PROMPTS, [guided, plain, plain, guided])
        outs[overlap] = [r.token_ids for r in res]
        assert llm.engine.loop.blocks.all_free()
        assert llm.engine.loop.stats().num_overlapped_steps > 0 or not overlap
    assert outs[True] == outs[False]
