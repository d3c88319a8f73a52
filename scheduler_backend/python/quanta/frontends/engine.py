"""Builds one ready-to-run engine (runner + blocks + policy + loop) from an ``EngineConfig``.

Every frontend goes through here, so the offline API, Triton and the benchmarks run the same
code with the same defaults.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quanta.build.manifest import EngineManifestError, apply_manifest, check_files, read_manifest
from quanta.build.shape import model_shape
from quanta.core.blocks import BlockManager
from quanta.core.clock import Clock, WallClock
from quanta.core.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from quanta.core.errors import InvalidRequestError
from quanta.core.loop import EngineLoop
from quanta.core.pooling import PoolingParams
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.core.sizes import format_size
from quanta.core.window import kv_window
from quanta.policies import make_policy
from quanta.runner import ModelRunner, load_model_config
from quanta.runner.cpu import cpu_isa
from quanta.runner.devices import device_memory_bytes
from quanta.runner.layers.rotary import by_prompt_length
from quanta.runner.model_runner import resolve_dtype
from quanta.runner.models.config import ModelConfig
from quanta.structured import Grammars
from quanta.text.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Engine:
    """A loop plus what is needed to turn user input into ``Request`` objects."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    loop: EngineLoop
    clock: Clock
    grammars: Grammars
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def describe(self) -> dict[str, str]:
        """What this engine runs with, after an engine manifest's defaults: for the start-up
        log and the ``quanta_engine_info`` metric's labels."""
        c = self.config
        return {
            "model_dir": c.model,
            "policy": c.policy,
            "policy_options": json.dumps(c.policy_options, sort_keys=True),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "linear_kernel": self.runner.linear_kernel,
            "linear_tiles": self.runner.linear_tiles,
            "quantized_kernel": self.runner.quantized_kernel,
            "attention_kernel": self.runner.attention_kernel,
            "prefill_attention": self.runner.prefill_attention,
            "layer_path": self.runner.layer_path,
            **self.runner.decode_graph_info(),
            "cpu_isa": cpu_isa(),
            "max_num_seqs": str(c.scheduler.max_num_seqs),
            "max_num_batched_tokens": str(c.scheduler.max_num_batched_tokens),
            "max_seq_len": str(self.loop.max_model_len),
            "block_size": str(self.runner.block_size),
            "device_blocks": str(self.runner.num_device_blocks),
            "host_blocks": str(self.runner.num_host_blocks),
            "prefix_caching": str(c.enable_prefix_caching).lower(),
            "tensor_parallel_size": str(c.tensor_parallel_size),
            "async_scheduling": str(self.loop.async_scheduling).lower(),
            "speculative_config": (
                "none"
                if c.speculative_config is None
                else c.speculative_config.model_dump_json(exclude_none=True)
            ),
        }

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        metadata: RequestMetadata | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        bad_words: Sequence[str] = (),
        pooling: PoolingParams | None = None,
    ) -> Request:
        """Tokenize and stamp a request; the loop validates lengths on submit.

        ``bad_words`` are strings (TensorRT-LLM's ``bad_words``), each tokenized as it would
        appear mid-text and banned as a token sequence. A ``structured_output`` guide is
        compiled here, in the caller's thread, so a bad one is refused before it is queued.
        With ``pooling`` the request embeds its prompt instead of generating
        (``core/pooling.py``); its sampling settings are not used.
        """
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt) if prompt else [], prompt
        else:
            ids, text = list(prompt), None
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"input_ids must lie in [0, {vocab})")
        outside = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if outside:
            raise InvalidRequestError(
                f"logit_bias: token ids {outside} are not in the vocabulary [0, {vocab})"
            )
        if bad_words:
            extra = tuple(
                tuple(self.tokenizer.encode(w, add_special_tokens=False)) for w in bad_words
            )
            if not all(extra):
                raise InvalidRequestError("bad_words: an entry is empty")
            params = params.model_copy(update={"bad_words_ids": (*params.bad_words_ids, *extra)})
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        spec = params.structured_output
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            params=params,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            seed=seed,
            eos_token_ids=self.model_config.eos_token_ids,
            prompt=text,
            metadata=metadata or RequestMetadata(),
            constraint=None if spec is None else self.grammars(spec),
            pooling=pooling,
        )


def engine_config_for(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """``config`` as it will run: an engine directory's manifest supplies the defaults and
    refuses what it was not built for; ``max_seq_len`` may only shorten the context."""
    model_dir = Path(config.model)
    manifest = read_manifest(model_dir)
    if manifest is not None:
        check_files(manifest, model_dir, model_shape(model_config, model_dir))
        config = apply_manifest(config, manifest)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineManifestError(f"device {config.device} asked for, but CUDA is not available")
    if config.max_seq_len is not None and config.max_seq_len > model_config.max_model_len:
        raise ValueError(
            f"max_seq_len {config.max_seq_len} exceeds the model's context length "
            f"{model_config.max_model_len}"
        )
    return config


def _memory_utilization(config: EngineConfig) -> float | None:
    """The fraction of the CUDA device's memory the device KV tier is sized from, or None
    where the tier has a size of its own: a given ``num_device_blocks`` or ``device_bytes``
    (kv-cache-memory) wins, as vLLM's block override and ``kv_cache_memory_bytes`` win over
    its ``gpu_memory_utilization``. On the CPU the tier is sized as it always was: the
    fraction, meaningless there (the weights and the cache share the machine's RAM with
    everything else), is ignored with a warning rather than refused, so one config file
    serves CPU and GPU machines alike."""
    cache = config.cache
    given = cache.gpu_memory_utilization
    if not config.device.startswith("cuda"):
        if given is not None:
            log.warning(
                "gpu_memory_utilization %s ignored on %s: the device KV tier there is "
                "kv-cache-memory (default 1GiB) or num_device_blocks",
                given,
                config.device,
            )
        return None
    if cache.num_device_blocks is not None or "device_bytes" in cache.model_fields_set:
        if given is not None:
            log.info("gpu_memory_utilization %s: the device KV tier's given size wins", given)
        return None
    return given if given is not None else DEFAULT_GPU_MEMORY_UTILIZATION


def _check_memory(config: EngineConfig, device_kv: int, host_kv: int) -> None:
    """KV tiers this machine cannot hold fail here, with the numbers, rather than as an
    allocation failure (or the OOM killer) once the weights are loaded."""
    ram = device_memory_bytes("cpu")
    if config.device.startswith("cuda"):
        needs = [("device KV tier", device_kv, device_memory_bytes(config.device), "GPU")]
        needs.append(("host KV tier", host_kv, ram, "RAM"))
    else:  # both tiers live in RAM
        needs = [("device and host KV tiers", device_kv + host_kv, ram, "RAM")]
    for what, need, total, where in needs:
        if need > total:
            raise ValueError(
                f"the {what} need {format_size(need)}, more than this machine's "
                f"{format_size(total)} of {where}; lower kv-cache-memory / host-cache-memory "
                "(or num_device_blocks / num_host_blocks)"
            )


def build_engine(config: EngineConfig, clock: Clock | None = None) -> Engine:
    """Load the model, size both KV tiers and wire the loop."""
    model_dir = Path(config.model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json)")
    model_config = load_model_config(model_dir)
    # NOTE: before the manifest, whose sizes are defaults and not the user's
    utilization = _memory_utilization(config)
    config = engine_config_for(config, model_config)
    cache = config.cache
    dtype = resolve_dtype(config.dtype, torch.device(config.device))
    # NOTE: each rank holds its heads' share of a block, and a cache size is per rank (as
    # vLLM sizes each GPU's), so tensor parallelism fits that many times more blocks.
    per_block = ModelRunner.kv_bytes_per_block(model_config, cache.block_size, dtype)
    per_block //= config.tensor_parallel_size
    num_device, num_host = cache.resolve(per_block)
    device_kv = 0 if utilization is not None else num_device * per_block  # else sized later
    _check_memory(config, device_kv, num_host * per_block)
    sched = config.scheduler
    max_model_len = config.max_seq_len or model_config.max_model_len
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        raise ValueError(
            "without chunked prefill max_num_batched_tokens "
            f"({sched.max_num_batched_tokens}) must cover max_seq_len ({max_model_len})"
        )
    options: dict[str, Any] = {
        "num_host_blocks": num_host,
        "block_size": cache.block_size,
        "dtype": dtype,
        "device": config.device,
        "linear_kernel": config.linear_kernel,
        "attention_kernel": config.attention_kernel,
        "safepoint_interval": config.safepoint_interval,
        "draft_model": _draft_model(config),
        "tensor_parallel_size": config.tensor_parallel_size,
        "load_format": config.load_format,
        "enforce_eager": config.enforce_eager,
    }
    if utilization is None:
        runner = ModelRunner(
            model_dir, num_device_blocks=num_device, max_num_seqs=sched.max_num_seqs, **options
        )
    else:
        runner = ModelRunner.sized_by_memory(
            model_dir,
            utilization=utilization,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            **options,
        )
    tokenizer = load_tokenizer(model_dir)
    clock = clock or WallClock()
    loop = EngineLoop(
        runner=runner,
        policy=make_policy(config.policy, sched, **config.policy_options),
        blocks=BlockManager(
            cache.block_size,
            runner.num_device_blocks,
            num_host,
            # NOTE: under longrope a token's keys depend on its request's prompt length, not
            # only on the tokens, so blocks cannot be shared by content.
            prefix_caching=config.enable_prefix_caching and not by_prompt_length(model_config),
            sliding_window=_release_window(config, model_config),
        ),
        clock=clock,
        max_model_len=max_model_len,
        decode=tokenizer.decode,
        speculative=config.speculative_config,
        async_scheduling=(
            config.device.startswith("cuda")
            if config.async_scheduling is None
            else config.async_scheduling
        ),
    )
    grammars = Grammars(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
    return Engine(config, model_config, tokenizer, runner, loop, clock, grammars)


def _release_window(config: EngineConfig, model_config: ModelConfig) -> int:
    """The window behind which a request's blocks go back to the pool: only where every layer
    slides (``quanta.core.window``), and not with a draft model, whose own layers read the
    same block tables over the whole context."""
    if _draft_model(config) is not None:
        return 0
    return kv_window(model_config.sliding_windows)


def _draft_model(config: EngineConfig) -> Path | None:
    """The draft model's directory, when the speculative config names one; checked here so
    a wrong path is a load error naming the option."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return None
    path = Path(spec.model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"speculative_config model {spec.model!r} is not an engine or checkpoint "
            "directory (no config.json)"
        )
    return path
