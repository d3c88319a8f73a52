"""The offline API: ``quanta.LLM(model_dir).generate(prompts, SamplingParams(...))``.

It drives the same ``EngineLoop`` as the servers, synchronously, so batch jobs get the same
scheduling, preemption and outputs as online traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from quanta.config.models import offline_options
from quanta.core.config import CacheConfig, EngineConfig, SchedulerConfig
from quanta.core.errors import QuantaError
from quanta.core.output import TokenLogprob
from quanta.core.pooling import PoolingParams
from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.speculative import SpeculativeConfig
from quanta.core.stream import RequestMetrics, RequestStream
from quanta.frontends.engine import Engine, build_engine

Config = TypeVar("Config", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One prompt's outcome; ``error`` is set (and text partial) when it failed."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics | None
    error: QuantaError | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # per output token, with SamplingParams(logprobs=)
    # per prompt token after the first, with SamplingParams(prompt_logprobs=)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One prompt's embedding (vLLM's ``EmbeddingRequestOutput``); ``error`` is set (and
    ``embedding`` empty) when it failed."""

    prompt: str | list[int]
    embedding: list[float]
    num_prompt_tokens: int
    metrics: RequestMetrics | None
    error: QuantaError | None = None


class LLM:
    """A model replica for in-process batch generation."""

    def __init__(
        self,
        model: str,
        *,
        policy: str = "fcfs",
        policy_options: dict[str, Any] | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        cache: CacheConfig | dict[str, Any] | None = None,
        scheduler: SchedulerConfig | dict[str, Any] | None = None,
        enable_prefix_caching: bool = True,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        tensor_parallel_size: int | None = None,
        **options: Any,
    ) -> None:
        """``tensor_parallel_size``: ranks to split the model over (default: an engine
        directory's ``--tp_size``, else 1). ``options``: the engine, cache and scheduler
        options of the commands that size and run the engine, by name (``max_num_seqs=8``,
        ``kv_cache_memory="1GiB"``, ``attention_kernel="eager"``; the list:
        ``quanta.config.models.OFFLINE_OPTIONS``), checked by the same models; they go over
        ``cache=`` and ``scheduler=``."""
        engine, cache_args, scheduler_args = offline_options(options)
        config = EngineConfig(
            model=str(model),
            policy=policy,
            policy_options=policy_options or {},
            dtype=dtype,
            device=device,
            cache=_with(cache, CacheConfig, cache_args.runtime()),
            scheduler=_with(scheduler, SchedulerConfig, scheduler_args.runtime()),
            **engine.runtime(),
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=(
                SpeculativeConfig.model_validate(speculative_config)
                if isinstance(speculative_config, dict)
                else speculative_config
            ),
            **(
                {}
                if tensor_parallel_size is None
                else {"tensor_parallel_size": tensor_parallel_size}
            ),
        )
        self.engine: Engine = build_engine(config)

    def close(self) -> None:
        """Stop what the engine runs beside this process (tensor-parallel workers); they
        also stop when the engine is garbage-collected or the process exits."""
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        metadata: RequestMetadata | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (one text or one list of token ids is one prompt);
        invalid prompts raise before anything runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _broadcast(params or SamplingParams(), len(prompts))
        requests = [
            self.engine.make_request(p, sp, metadata=metadata)
            for p, sp in zip(prompts, params_list, strict=True)
        ]
        loop = self.engine.loop
        for r in requests:  # validate all before submitting any
            loop.validate(r)
        streams: list[RequestStream] = [loop.submit(r) for r in requests]  # type: ignore[misc]
        loop.run_until_idle()
        results = []
        for prompt, stream in zip(prompts, streams, strict=True):
            done = stream.result(timeout=0)
            results.append(
                GenerationResult(
                    prompt,
                    done.text,
                    list(done.token_ids),
                    done.finish_reason,
                    done.metrics,
                    done.error,
                    done.logprobs,
                    done.prompt_logprobs,
                )
            )
        return results


    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        pooling_params: PoolingParams | None = None,
        *,
        metadata: RequestMetadata | None = None,
    ) -> list[EmbeddingResult]:
        """Embed every prompt (vLLM's ``LLM.embed``): its final hidden states pooled as
        ``pooling_params`` says (default: the last token's, L2-normalized). Each prompt is a
        prefill-only request scheduled with the rest; invalid prompts raise before anything
        runs."""
        if isinstance(prompts, str):
            prompts = [prompts]
        pooling = pooling_params or PoolingParams()
        params = SamplingParams(max_tokens=1)  # NOTE: never sampled; reserves no more
        requests = [
            self.engine.make_request(p, params, metadata=metadata, pooling=pooling)
            for p in prompts
        ]
        loop = self.engine.loop
        for r in requests:
            loop.validate(r)
        streams: list[RequestStream] = [loop.submit(r) for r in requests]  # type: ignore[misc]
        loop.run_until_idle()
        results = []
        for prompt, r, stream in zip(prompts, requests, streams, strict=True):
            done = stream.result(timeout=0)
            results.append(
                EmbeddingResult(
                    prompt, list(done.embedding), r.num_prompt_tokens, done.metrics, done.error
                )
            )
        return results


def _with(
    given: BaseModel | dict[str, Any] | None, kind: type[Config], options: dict[str, Any]
) -> Config:
    """``cache=``/``scheduler=`` as given, with the options' fields over it."""
    base = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else given
    return kind.model_validate({**(base or {}), **options})


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)
