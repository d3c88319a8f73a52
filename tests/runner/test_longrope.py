"""Phi-3's longrope served HF-exact: a random-weight checkpoint transformers writes with an
original context of 32 tokens (of 128), distinct long and short factors, fp32.

HF rotates with the long factors a forward call that reaches past the original context: with
its KV cache, a prompt of ``L`` tokens once as a whole, then each generated token at position
``p`` on its own. The engine must rotate that token long iff ``max(L, p + 1) > 32``, whether
its prompt came in chunks, shared a step with others, or was swapped out or recomputed (with
its generated tokens, but not as a longer prompt). Phi-3's ``generate`` also drops the cache
when a sequence first grows past the original context and runs it again; the engine does not
(``quanta.runner.layers.rotary``), so the reference is HF's forward with its cache, and it is
``generate``'s own for every request that does not cross.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import quanta
import torch
from quanta.build.tokenizer import special_token_ids, write_tokenizer
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.core.request import SamplingParams
from quanta.families.phi3 import parse_config
from quanta.runner import ModelRunner
from quanta.runner.attention import with_prompt_lens
from quanta.runner.layers.rotary import RotaryTable
from runner_helpers import FakeRequest, ToyScheduler, hf_greedy, widen_weights

ORIGINAL = 32
HALF = 8  # head_dim 16
ROPE = {
    "rope_type": "longrope",
    "long_factor": [1.0 + 0.7 * i for i in range(HALF)],
    "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
    "rope_theta": 10000.0,
}
CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
    "original_max_position_embeddings": ORIGINAL,
    "rope_parameters": ROPE,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(directory, HF model) of a tiny fp32 Phi-3 with longrope and a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("phi3-longrope")
    tokenizer = write_tokenizer("phi3", path, CONFIG["max_position_embeddings"])
    ids = special_token_ids("phi3")
    config = AutoConfig.for_model(
        "phi3",
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=0,
        **CONFIG,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (length,), generator=gen).tolist()


def hf_cached_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy tokens through its forward with a KV cache: the prompt in one call, then
    one call per token (``generate``'s steps, without Phi-3's recompute on crossing)."""
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            out.append(int(result.logits[0, -1].argmax()))
            result = model(torch.tensor([[out[-1]]]), cache=result.past_key_values, use_cache=True)
    return out


def _expected(model: Any, requests: list[FakeRequest]) -> dict[str, list[int]]:
    """HF's tokens of each request; ``generate``'s own where the request does not grow from
    inside the original context to past it."""
    expected = {}
    for r in requests:
        expected[r.request_id] = hf_cached_greedy(model, r.prompt, r.max_new_tokens)
        if len(r.prompt) > ORIGINAL or len(r.prompt) + r.max_new_tokens <= ORIGINAL:
            assert expected[r.request_id] == hf_greedy(model, r.prompt, r.max_new_tokens)
    return expected


def _runner(path: Path, blocks: int = 96) -> ModelRunner:
    return ModelRunner(
        path, num_device_blocks=blocks, num_host_blocks=blocks, block_size=4, dtype="float32"
    )


class PromptScheduler(ToyScheduler):
    """The toy scheduler giving each chunk its request's prompt length, as the core does."""

    def _schedule(self, r: FakeRequest) -> ScheduledSeq:
        return replace(super()._schedule(r), num_prompt_tokens=len(r.prompt))


def _requests() -> list[FakeRequest]:
    # (prompt length, chunk, arrival step, new tokens): short prompts generating past the
    # original context, one exactly at it, long ones whole and in chunks shorter than it
    shapes = [
        (20, 8, 0, 24),
        (32, None, 1, 6),
        (40, 7, 0, 8),
        (50, 16, 2, 6),
        (5, None, 3, 30),
        (10, None, 0, 12),
    ]
    return [
        FakeRequest(f"r{i}", _prompt(n, 100 + i), new, chunk_size=chunk, arrival_step=at)
        for i, (n, chunk, at, new) in enumerate(shapes)
    ]


def test_config_reads_hf_longrope(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    config = _runner(path).model_config
    scaling = config.rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert scaling.original_max_position_embeddings == ORIGINAL
    assert scaling.factor == 4.0  # max_position_embeddings / original, as HF sets it
    rotary = RotaryTable(config)
    assert rotary.scale == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(ORIGINAL)))
    assert rotary.scale == hf_model.model.rotary_emb.attention_scaling
    assert torch.equal(rotary.inv_freq, hf_model.model.rotary_emb.original_inv_freq)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_model.config, "cpu", seq_len=ORIGINAL + 1)
    assert rotary.long_inv_freq is not None and torch.equal(rotary.long_inv_freq, long)


def test_phi3_config_names() -> None:
    """Phi3Config's older names for longrope and its default original context."""
    common = {"vocab_size": 64, "hidden_size": 64, "num_layers": 1, "num_heads": 4}
    raw = CONFIG | {"num_attention_heads": 4, "intermediate_size": 128}
    raw.pop("original_max_position_embeddings")
    raw["rope_parameters"] = {**ROPE, "rope_type": "su"}
    scaling = parse_config(raw, common | {"max_position_embeddings": 128}).rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert scaling.original_max_position_embeddings == 4096
    bad = raw | {"rope_parameters": {**ROPE, "long_factor": [1.0]}}
    with pytest.raises(ValueError, match="long_factor needs 8 values"):
        parse_config(bad, common | {"max_position_embeddings": 128})


def test_rows_pick_their_set_by_position_and_prompt_length(
    checkpoint: tuple[Path, Any],
) -> None:
    rotary = RotaryTable(_runner(checkpoint[0]).model_config)
    assert rotary.long_inv_freq is not None
    positions = torch.tensor([5, 5, 31, 31, 32])
    cos, _ = rotary(positions, torch.float32, torch.tensor([10, 40, 32, 33, 10]))
    for row, long in enumerate([False, True, False, True, True]):  # 32: past it, any prompt
        angles = positions[row].float() * (rotary.long_inv_freq if long else rotary.inv_freq)
        want = torch.cat((angles, angles)).cos() * rotary.scale
        assert torch.equal(cos[row], want), row
    with pytest.raises(ValueError, match="prompt length"):
        rotary(positions, torch.float32)


def test_hidden_sequences_cached_tokens_get_their_prompt_length() -> None:
    """Past tokens of hidden-cache sequences are rotated again every step: with their own
    request's prompt length, sequence after sequence in step order."""
    from quanta.runner.attention import AttentionMetadata, HiddenBatch

    empty = torch.zeros(0, dtype=torch.long)
    hidden = HiddenBatch(empty, empty, empty, empty, empty, (), None)
    meta = AttentionMetadata(empty, (), None, hidden=hidden)
    seqs = [
        ScheduledSeq(
            "a", (1,), 3, (0,), True, 0.0, 1.0, 0, 0, 0, hidden=True, num_prompt_tokens=40
        ),
        ScheduledSeq("b", (1, 2), 0, (1,), True, 0.0, 1.0, 0, 0, 0, num_prompt_tokens=2),
        ScheduledSeq("c", (1,), 2, (2,), True, 0.0, 1.0, 0, 0, 0, hidden=True),
    ]
    out = with_prompt_lens(meta, seqs, torch.device("cpu"))
    assert out.prompt_lens is not None and out.prompt_lens.tolist() == [40, 2, 2, 3]
    assert out.hidden is not None and out.hidden.past_prompt_lens is not None
    assert out.hidden.past_prompt_lens.tolist() == [40, 40, 40, 3, 3]


def test_logits_match_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    runner = _runner(path, blocks=40)
    for length in (5, 31, 32, 33, 60, 128):
        prompt = _prompt(length, seed=length)
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        for chunk_size in (None, 7, 32):
            got = runner.forward_logits(prompt, chunk_size=chunk_size)
            diff = (got - expected).abs().max().item()
            assert diff < 1e-4, f"len={length} chunk={chunk_size}: max diff {diff}"


def test_greedy_generation_matches_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    requests = _requests()
    toy = PromptScheduler(_runner(path), requests, shuffle_seed=1)
    outputs = toy.run()
    assert toy.mixed_steps > 0
    assert outputs == _expected(hf_model, requests)


def test_tokens_match_hf_under_swap_and_recompute(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    expected = _expected(hf_model, _requests())

    def poison(toy: ToyScheduler, output: SchedulerOutput) -> None:
        freed = [device for device, _ in output.swap_out]
        if freed:
            toy.runner.device_kv_cache[:, :, freed] = float("nan")

    swaps = {6: ("out", "r0"), 7: ("out", "r2"), 10: ("in", "r0"), 13: ("in", "r2")}
    swapped = PromptScheduler(_runner(path), _requests(), 7, swaps=swaps, on_step=poison).run()
    assert swapped == expected

    # r0 (a 20-token prompt in 8-token chunks) is recomputed at 36 tokens: its prompt stays
    # short-rotated and its generated tokens past the original context long, as before.
    requests = _requests()
    target = requests[0]
    dropped: list[int] = []

    def recompute(toy: ToyScheduler, _: SchedulerOutput) -> None:
        if len(target.output) == 16 and not dropped:
            toy.device_blocks.release(target.block_table)
            target.block_table, target.num_computed = [], 0
            dropped.append(1)

    assert PromptScheduler(_runner(path), requests, 3, on_step=recompute).run() == expected
    assert dropped


@pytest.mark.parametrize("host_blocks", [64, 0], ids=["swap", "recompute"])
def test_engine_matches_hf_under_preemption(checkpoint: tuple[Path, Any], host_blocks: int) -> None:
    """Through the whole engine: the scheduler's chunks (16 tokens a step) carry each
    request's prompt length, kept across a recompute."""
    path, hf_model = checkpoint
    shapes = [(20, 24), (40, 8), (28, 14), (36, 10)]
    requests = [FakeRequest(f"e{i}", _prompt(n, 200 + i), new) for i, (n, new) in enumerate(shapes)]
    params = [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True) for _, new in shapes]
    llm = quanta.LLM(
        str(path),
        dtype="float32",
        cache={"num_device_blocks": 20, "num_host_blocks": host_blocks, "block_size": 4},
        scheduler={"max_num_batched_tokens": 16},
    )
    try:
        results = llm.generate([r.prompt for r in requests], params)
    finally:
        llm.close()
    stats = llm.engine.loop.stats()
    preempted = stats.num_preemptions_swap if host_blocks else stats.num_preemptions_recompute
    assert preempted > 0
    assert not llm.engine.loop.blocks.prefix_caching  # keys depend on the prompt's length
    expected = _expected(hf_model, requests)
    assert [r.token_ids for r in results] == [expected[r.request_id] for r in requests]


def test_two_ranks_rotate_as_one(checkpoint: tuple[Path, Any]) -> None:
    """Tensor-parallel workers get each chunk's prompt length too: a long prompt in chunks
    shorter than the original context, and a short one generating past it."""
    path, hf_model = checkpoint
    requests = [FakeRequest("a", _prompt(40, 1), 6), FakeRequest("b", _prompt(28, 2), 10)]
    params = [
        SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)
        for r in requests
    ]
    with quanta.LLM(
        str(path),
        dtype="float32",
        tensor_parallel_size=2,
        scheduler={"max_num_batched_tokens": 16},
    ) as llm:
        got = llm.generate([r.prompt for r in requests], params)
    expected = _expected(hf_model, requests)
    assert [g.token_ids for g in got] == [expected[r.request_id] for r in requests]


def test_hidden_cache_requests_match_hf(checkpoint: tuple[Path, Any]) -> None:
    """Hidden-cache requests (Phi-3 has as many KV heads as query heads) rotate their cached
    tokens again every step, each by its request's prompt length."""
    path, hf_model = checkpoint
    runner = _runner(path)
    assert runner.capabilities.hidden_cache
    requests = _requests()

    class HiddenScheduler(PromptScheduler):
        def _schedule(self, r: FakeRequest) -> ScheduledSeq:
            return replace(super()._schedule(r), hidden=r.request_id in {"r0", "r2", "r4"})

    assert HiddenScheduler(runner, requests, 2).run() == _expected(hf_model, requests)
