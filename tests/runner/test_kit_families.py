"""HF-exact checks of the families on the layer kit (Qwen2/2.5, Qwen3, Mistral, Phi-3,
Gemma 2): random-weight checkpoints written by transformers itself from each family's config,
greedy tokens equal to HF's in fp32, chunked and not, under swap and recompute preemption and
with a cached prefix; sliding windows of 8 tokens, which prompts and generations outgrow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from quanta.core.output import SchedulerOutput
from quanta.runner import ModelRunner
from runner_helpers import TINY_KIT_CONFIG, FakeRequest, ToyScheduler, hf_greedy, widen_weights

WINDOW = 8
COMMON = TINY_KIT_CONFIG
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", {}),
    "qwen2_yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
    ),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral": ("mistral", {"head_dim": 16, "sliding_window": WINDOW}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "phi3_partial": (
        "phi3",
        {
            "pad_token_id": 0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
    ),
    "gemma2": (
        "gemma2",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW},
    ),
}


def _hf_model(name: str, path: Path, seed: int) -> Any:
    """Save a tiny random fp32 model of ``name`` written by transformers from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = FAMILIES[name]
    config = AutoConfig.for_model(model_type, **COMMON, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    built = {}
    for i, name in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(name)
        built[name] = (path, _hf_model(name, path, seed=i))
    return built


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=gen).tolist()


def _runner(path: Path, block_size: int = 4, blocks: int = 96) -> ModelRunner:
    return ModelRunner(
        path, num_device_blocks=blocks, num_host_blocks=blocks, block_size=block_size
    )


def _requests(max_new: int = 12) -> list[FakeRequest]:
    shapes = [(3, None, 0), (17, 5, 0), (9, 5, 2), (30, None, 3)]
    return [
        FakeRequest(f"r{i}", _prompt(n, 100 + i), max_new, chunk_size=chunk, arrival_step=at)
        for i, (n, chunk, at) in enumerate(shapes)
    ]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_hf(checkpoints: dict[str, tuple[Path, Any]], name: str) -> None:
    path, hf_model = checkpoints[name]
    runner = _runner(path, block_size=16, blocks=32)
    for length in (1, 5, 17, 40):
        prompt = _prompt(length, seed=length)
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        for chunk_size in (None, 7):
            got = runner.forward_logits(prompt, chunk_size=chunk_size)
            diff = (got - expected).abs().max().item()
            assert diff < 1e-4, f"{name} len={length} chunk={chunk_size}: max diff {diff}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_hf(checkpoints: dict[str, tuple[Path, Any]], name: str) -> None:
    path, hf_model = checkpoints[name]
    requests = _requests()
    toy = ToyScheduler(_runner(path), requests, shuffle_seed=1)
    outputs = toy.run()
    assert toy.mixed_steps > 0
    for request in requests:
        expected = hf_greedy(hf_model, request.prompt, request.max_new_tokens)
        assert outputs[request.request_id] == expected, (name, request.request_id)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral", "phi3", "gemma2"])
def test_tokens_unchanged_by_swap_recompute_and_prefix_cache(
    checkpoints: dict[str, tuple[Path, Any]], name: str
) -> None:
    path, hf_model = checkpoints[name]
    baseline = ToyScheduler(_runner(path), _requests()).run()

    def poison(toy: ToyScheduler, output: SchedulerOutput) -> None:
        freed = [device for device, _ in output.swap_out]
        if freed:
            toy.runner.device_kv_cache[:, :, freed] = float("nan")

    swaps = {6: ("out", "r1"), 7: ("out", "r0"), 9: ("in", "r1"), 12: ("in", "r0")}
    swapped = ToyScheduler(_runner(path), _requests(), 7, swaps=swaps, on_step=poison).run()
    assert swapped == baseline

    requests = _requests()
    target = requests[3]
    dropped: list[int] = []

    def recompute(toy: ToyScheduler, _: SchedulerOutput) -> None:
        if len(target.output) == 5 and not dropped:
            toy.device_blocks.release(target.block_table)
            target.block_table, target.num_computed = [], 0
            dropped.append(1)

    assert ToyScheduler(_runner(path), requests, 3, on_step=recompute).run() == baseline
    assert dropped

    # A second request reuses the first one's three full prompt blocks (12 tokens) as cached.
    first = FakeRequest("a", _prompt(14, 5), 4)
    toy = ToyScheduler(_runner(path), [first])
    toy.run()
    second = FakeRequest("b", first.prompt[:12] + _prompt(6, 6), 12)
    second.block_table, second.num_computed = list(first.block_table[:3]), 12
    toy.requests.append(second)
    assert toy.run()["b"] == hf_greedy(hf_model, second.prompt, 12)
