"""Sliding-window release on the real engine: a Mistral checkpoint written by transformers with
a 16-token window, prompts and generations far longer, blocks of 4. Blocks behind the window go
back to the pool and are filled with NaN after every step; greedy tokens stay HF's, and those
of the same run without release, under chunked prefill, preemption by swap and by recompute,
and a cached prefix; in bf16 too, with prefill chunks attending on the AMX kernel after their
first blocks were released. Gemma 2 (global layers between the sliding ones) releases
nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import decode_chars
from quanta.core.block_pool import Tier
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.loop import EngineLoop
from quanta.core.request import Request, SamplingParams
from quanta.core.window import RELEASED, kv_window
from quanta.policies import make_policy
from quanta.runner import ModelRunner
from runner_helpers import TINY_KIT_CONFIG, hf_greedy, widen_weights

pytestmark = pytest.mark.engine

WINDOW, BLOCK = 16, 4
COMMON = {**TINY_KIT_CONFIG, "head_dim": 16, "sliding_window": WINDOW}


def _checkpoint(model_type: str, path: Path, **extra: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **(COMMON | extra))
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("mistral")
    return path, _checkpoint("mistral", path)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (24,), generator=gen).tolist()
    tails = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (17, 30, 9)]
    return [shared + tail for tail in tails]


def _serve(
    path: Path,
    *,
    release: bool,
    device: int = 96,
    host: int = 96,
    prefix_caching: bool = False,
    max_tokens: int = 40,
    block: int = BLOCK,
    dtype: str = "float32",
) -> tuple[dict[str, list[int]], EngineLoop, int]:
    """Greedy tokens of ``_prompts()``; free device blocks are NaN after every step, so a read
    of a released (or any stale) block shows. Also the most blocks one request held."""
    runner = ModelRunner(
        path, num_device_blocks=device, num_host_blocks=host, block_size=block, dtype=dtype
    )
    if dtype == "bfloat16" and runner.prefill_attention != "amx":
        pytest.skip("no AMX prefill kernel here")
    window = kv_window(runner.model_config.sliding_windows) if release else 0
    loop = EngineLoop(
        runner=runner,
        policy=make_policy("fcfs", SchedulerConfig(max_num_batched_tokens=16)),
        blocks=BlockManager(
            block, device, host, prefix_caching=prefix_caching, sliding_window=window
        ),
        clock=VirtualClock(),
        max_model_len=256,
        decode=decode_chars,
    )
    requests = [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            arrival_time=i * 1e-3,
            seed=i,
        )
        for i, prompt in enumerate(_prompts())
    ]
    for r in requests:
        loop.submit(r)
    most = 0
    pool = loop.blocks.pools[Tier.DEVICE]
    while loop.has_unfinished():
        loop.step()
        loop.blocks.check_integrity()
        most = max([most, *(loop.blocks.num_blocks(r.request_id) for r in requests)])
        stale = [b for b in pool.free_ids() if b not in pool.name_of]
        if stale:
            runner.device_kv_cache[:, :, stale] = float("nan")
    assert loop.blocks.all_free()
    return {r.request_id: list(r.output_token_ids) for r in requests}, loop, most


def test_released_blocks_are_never_read_and_tokens_are_hfs(mistral: tuple[Path, Any]) -> None:
    path, hf_model = mistral
    got, _, most = _serve(path, release=True)
    for i, prompt in enumerate(_prompts()):
        expected = hf_greedy(hf_model, prompt, 40)
        assert got[f"r{i}"][: len(expected)] == expected, f"r{i}"
    # after each step: the window's blocks and the one it ends in, of up to 24 per request
    assert most <= WINDOW // BLOCK + 1
    kept, _, most_kept = _serve(path, release=False)
    assert got == kept and most_kept > most


@pytest.mark.parametrize(("device", "host", "mode"), [(16, 96, "swap"), (16, 0, "recompute")])
def test_tokens_hold_under_preemption(
    mistral: tuple[Path, Any], device: int, host: int, mode: str
) -> None:
    path, _ = mistral
    expected, _, _ = _serve(path, release=False)
    got, loop, _ = _serve(path, release=True, device=device, host=host)
    stats = loop.stats()
    preempted = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
    assert preempted > 0 and got == expected


def test_tokens_hold_with_a_cached_prefix(mistral: tuple[Path, Any]) -> None:
    path, _ = mistral
    expected, _, _ = _serve(path, release=False)
    got, loop, _ = _serve(path, release=True, prefix_caching=True)
    assert loop.stats().prefix_cache_hits > 0 and got == expected


def test_bf16_prefill_chunks_attend_natively_after_a_release(tmp_path: Path) -> None:
    """Heads of 32 columns and blocks of 16 keys, as the AMX prefill kernel serves them, a
    32-token window: chunks of 16 tokens start after the window released their first blocks
    (which hold NaN), and the tokens are those of the same run without release."""
    _checkpoint("mistral", tmp_path, head_dim=32, sliding_window=32)
    serve = {"block": 16, "dtype": "bfloat16", "device": 64, "host": 0}
    got, _, most = _serve(tmp_path, release=True, **serve)
    kept, _, most_kept = _serve(tmp_path, release=False, **serve)
    assert got == kept and most < most_kept


def test_gemma2_releases_nothing(tmp_path: Path) -> None:
    _checkpoint(
        "gemma2",
        tmp_path,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    runner = ModelRunner(tmp_path, num_device_blocks=32, num_host_blocks=0, block_size=BLOCK)
    windows = runner.model_config.sliding_windows
    assert windows == (WINDOW, 0) and kv_window(windows) == 0
    blocks = BlockManager(BLOCK, 32, 0, sliding_window=kv_window(windows))
    assert blocks.allocate_slots("r", 60) is not None
    assert blocks.release_behind_window("r", 60) == 0
    assert RELEASED not in blocks.block_table("r")
    blocks.free("r")
