"""``LLM.embed`` on real tiny checkpoints: HF parity of the pooled hidden states, and the same
vector whatever runs beside it, however it is chunked and under preemption."""

from __future__ import annotations

import pytest
import quanta
import torch
from quanta import PoolingParams, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.engine

PROMPTS = [
    "Hello, my name is",
    "a",
    "Once upon a time, in a land far away, there lived a small dragon who loved",
]
POOLINGS = [
    PoolingParams(),
    PoolingParams(pooling_type="MEAN"),
    PoolingParams(pooling_type="LAST", normalize=False),
    PoolingParams(pooling_type="MEAN", normalize=False),
]


@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny"])
def model_dir(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def llm(model_dir):
    return quanta.LLM(str(model_dir), cache={"num_device_blocks": 64})


def _hf_embedding(model, ids: list[int], pooling: PoolingParams) -> torch.Tensor:
    """HF transformers' last hidden states (after the final norm), pooled the same way."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0]
    vector = hidden[-1] if pooling.pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: f"{p.pooling_type}-{p.normalize}")
def test_embeddings_match_hf(model_dir, llm, pooling):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    results = llm.embed(PROMPTS, pooling)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.error is None
        ids = llm.tokenizer.encode(prompt)
        assert result.num_prompt_tokens == len(ids)
        expected = _hf_embedding(model, ids, pooling)
        got = torch.tensor(result.embedding)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        if pooling.normalize:
            assert abs(float(got.norm()) - 1.0) < 1e-5


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_same_vector_beside_generation_chunked_and_preempted(model_dir, llm, pooling_type):
    """Embeddings computed alone in a roomy pool equal those computed in small chunks, next to
    generating requests, in a pool so small that requests are preempted (by recompute)."""
    pooling = PoolingParams(pooling_type=pooling_type)
    alone = [r.embedding for r in llm.embed(PROMPTS, pooling)]
    small = quanta.LLM(
        str(model_dir),
        cache={"num_device_blocks": 14, "num_host_blocks": 0, "block_size": 4},
        scheduler={"max_num_batched_tokens": 8},
    )
    engine, loop = small.engine, small.engine.loop
    busy = [
        engine.make_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        for p in ["The capital of France is", "Tell me a story about a very old", "x y"]
    ]
    embeds = [
        engine.make_request(p, SamplingParams(max_tokens=1), pooling=pooling) for p in PROMPTS
    ]
    streams = [loop.submit(r) for r in [busy[0], *embeds[:2], *busy[1:], embeds[2]]]
    loop.run_until_idle()
    done = [stream.result(timeout=0) for stream in streams]
    assert all(d.error is None for d in done)
    assert loop.stats().num_preemptions_recompute > 0, "the small pool never preempted"
    assert any(r.num_preemptions for r in embeds), "no embedding request was preempted"
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()
    for expected, got in zip(alone, done[1:3] + done[5:], strict=True):
        assert got.token_ids == ()
        torch.testing.assert_close(
            torch.tensor(got.embedding), torch.tensor(expected), atol=1e-5, rtol=1e-5
        )
