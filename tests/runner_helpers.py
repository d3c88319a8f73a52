"""Helpers for the runner parity tests: tiny HF checkpoints and a toy scheduler.

The toy scheduler hands out blocks from a counter and builds ``SchedulerOutput``s by hand, so
these tests exercise the runner's contract without depending on Quanta's real scheduler.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.runner import ModelRunner

# Prompts of every length class (a word, a phrase, a long sentence) that engine tests share.
PROMPTS = [
    "Hello, my name is",
    "The capital of France",
    "a",
    "Once upon a time, in a land far away, there lived a small dragon who",
]

VOCAB = 300
# The sizes every tiny kit-family checkpoint shares (transformers writes it from its config):
# big enough for grouped-query heads and two layers, small enough to run in milliseconds.
TINY_KIT_CONFIG: dict[str, int] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


def build_hf_checkpoint(
    family: str,
    path: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Any:
    """Save a tiny random fp32 HF model of ``family`` ("opt" or "llama") to ``path``.

    Weights are redrawn with a larger spread than HF's init (and non-trivial norm weights and
    biases) so logits have real margins and every parameter matters to the output.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
    }
    torch.manual_seed(seed)
    if family == "opt":
        model = OPTForCausalLM(OPTConfig(**{**common, "ffn_dim": 128, **overrides}))
    else:
        settings = {**common, "num_key_value_heads": 2, "intermediate_size": 128, **overrides}
        model = LlamaForCausalLM(LlamaConfig(**settings))
    # OPT ties its head to the embedding, so small layers leave it repeating its input.
    widen_weights(model, *((0.1, 0.3) if family == "opt" else (0.2, 0.12)))
    shard: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **shard)
    return model


def widen_weights(model: Any, embed_std: float = 0.2, weight_std: float = 0.12) -> None:
    """Draw ``model``'s weights wider than HF's init (norms in [0.5, 1.5]), so a tiny random
    model's logits have real margins and greedy choices are not ties; then eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, embed_std if "embed" in name else weight_std)
    model.eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of one unpadded prompt (stops early only at EOS)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@dataclass
class FakeRequest:
    """One request as the toy scheduler tracks it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    chunk_size: int | None = None  # None: whole prompt in one step
    arrival_step: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    host_blocks: list[int] | None = None  # set while swapped out

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class BlockCounter:
    """Hands out block ids first-in-first-out, optionally in a shuffled order, so freed
    blocks are not handed straight back and tables are non-contiguous."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        ids = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
        self.free: deque[int] = deque(ids)

    def allocate(self) -> int:
        return self.free.popleft()

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids)


@dataclass
class ToyScheduler:
    """Drives ``ModelRunner.execute`` step by step; ``swaps`` maps a step number to
    ("out" | "in", request_id)."""

    runner: ModelRunner
    requests: list[FakeRequest]
    shuffle_seed: int | None = None
    swaps: dict[int, tuple[str, str]] = field(default_factory=dict)
    on_step: Callable[[ToyScheduler, SchedulerOutput], None] | None = None
    mixed_steps: int = 0  # steps holding both a multi-token chunk and a decode

    def __post_init__(self) -> None:
        self.device_blocks = BlockCounter(self.runner.num_device_blocks, self.shuffle_seed)
        self.host_blocks = BlockCounter(self.runner.num_host_blocks, self.shuffle_seed)

    def run(self, max_steps: int = 500) -> dict[str, list[int]]:
        for step in range(max_steps):
            if all(r.done for r in self.requests):
                return {r.request_id: r.output for r in self.requests}
            self.step(step)
        raise AssertionError("toy scheduler did not finish")

    def step(self, step: int) -> None:
        swap_out, swap_in = self._plan_swaps(step)
        active = [
            r
            for r in self.requests
            if r.arrival_step <= step and not r.done and r.host_blocks is None
        ]
        seqs = tuple(self._schedule(r) for r in active)
        output = SchedulerOutput(seqs=seqs, swap_out=swap_out, swap_in=swap_in)
        sizes = {len(s.token_ids) for s in seqs}
        self.mixed_steps += int(1 in sizes and len(sizes) > 1)
        result = self.runner.execute(output)
        assert result.request_ids == tuple(r.request_id for r in active)
        for request, seq, token in zip(active, seqs, result.sampled_token_ids, strict=True):
            request.num_computed += len(seq.token_ids)
            assert (token is not None) == seq.sample
            if token is not None:
                request.output.append(token)
        if self.on_step is not None:
            self.on_step(self, output)

    def _schedule(self, r: FakeRequest) -> ScheduledSeq:
        tokens = r.prompt + r.output
        pending = tokens[r.num_computed :]
        if r.num_computed < len(r.prompt) and r.chunk_size is not None:
            pending = pending[: r.chunk_size]
        end = r.num_computed + len(pending)
        block_size = self.runner.block_size
        while len(r.block_table) * block_size < end:
            r.block_table.append(self.device_blocks.allocate())
        return ScheduledSeq(
            request_id=r.request_id,
            token_ids=tuple(pending),
            start_pos=r.num_computed,
            block_table=tuple(r.block_table),
            sample=end == len(tokens),
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=r.seed,
            output_index=len(r.output),
        )

    def _plan_swaps(
        self, step: int
    ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        if step not in self.swaps:
            return (), ()
        direction, request_id = self.swaps[step]
        request = next(r for r in self.requests if r.request_id == request_id)
        if direction == "out":
            host = [self.host_blocks.allocate() for _ in request.block_table]
            pairs = tuple(zip(request.block_table, host, strict=True))
            self.device_blocks.release(request.block_table)
            request.block_table, request.host_blocks = [], host
            return pairs, ()
        assert request.host_blocks is not None
        device = [self.device_blocks.allocate() for _ in request.host_blocks]
        pairs = tuple(zip(request.host_blocks, device, strict=True))
        self.host_blocks.release(request.host_blocks)
        request.block_table, request.host_blocks = device, None
        return (), pairs


def interpreted_triton_attention() -> Any:
    """``quanta.runner.triton_attention`` built for Triton's CPU interpreter, or the calling
    test module skipped. Triton reads ``TRITON_INTERPRET`` when it is first imported and when
    it decorates or later loads a kernel, so it is set for the rest of the process: only where
    no GPU is (a GPU run compares the compiled kernels in test_cuda.py) and only before
    anything imported triton."""
    if torch.cuda.is_available():
        pytest.skip("interpreter checks run without a GPU", allow_module_level=True)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set; run this file in a "
            "process of its own",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton", reason="triton is not installed")
    return importlib.import_module("quanta.runner.triton_attention")
