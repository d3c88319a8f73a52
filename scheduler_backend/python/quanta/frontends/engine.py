"""Builds one ready-to-run engine (runner + blocks + policy + loop) from an ``EngineConfig``.

Every frontend goes through here, so the offline API, Triton and the benchmarks run the same
code with the same defaults.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quanta.core.blocks import BlockManager
from quanta.core.clock import Clock, WallClock
from quanta.core.config import EngineConfig
from quanta.core.errors import InvalidRequestError
from quanta.core.loop import EngineLoop
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.frontends.tokenizer import Tokenizer, load_tokenizer
from quanta.policies import make_policy
from quanta.runner import ModelRunner, load_model_config
from quanta.runner.model_runner import resolve_dtype
from quanta.runner.models.config import ModelConfig


@dataclass
class Engine:
    """A loop plus what is needed to turn user input into ``Request`` objects."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    loop: EngineLoop
    clock: Clock
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        metadata: RequestMetadata | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Tokenize and stamp a request; the loop validates lengths on submit."""
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt) if prompt else [], prompt
        else:
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"input_ids must lie in [0, {vocab})")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            params=params,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            seed=seed,
            eos_token_ids=self.model_config.eos_token_ids,
            prompt=text,
            metadata=metadata or RequestMetadata(),
        )


def build_engine(config: EngineConfig, clock: Clock | None = None) -> Engine:
    """Load the model, size both KV tiers and wire the loop."""
    model_dir = Path(config.model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json)")
    model_config = load_model_config(model_dir)
    cache = config.cache
    dtype = resolve_dtype(config.dtype, torch.device(config.device))
    per_block = ModelRunner.kv_bytes_per_block(model_config, cache.block_size, dtype)
    num_device, num_host = cache.resolve(per_block)
    sched = config.scheduler
    if (
        not sched.enable_chunked_prefill
        and sched.max_num_batched_tokens < model_config.max_model_len
    ):
        raise ValueError(
            "without chunked prefill max_num_batched_tokens "
            f"({sched.max_num_batched_tokens}) must cover max_model_len "
            f"({model_config.max_model_len})"
        )
    runner = ModelRunner(
        model_dir,
        num_device_blocks=num_device,
        num_host_blocks=num_host,
        block_size=cache.block_size,
        dtype=dtype,
        device=config.device,
    )
    tokenizer = load_tokenizer(model_dir)
    clock = clock or WallClock()
    loop = EngineLoop(
        runner=runner,
        policy=make_policy(config.policy, sched, **config.policy_options),
        blocks=BlockManager(cache.block_size, num_device, num_host),
        clock=clock,
        max_model_len=model_config.max_model_len,
        decode=tokenizer.decode,
    )
    return Engine(config, model_config, tokenizer, runner, loop, clock)
