"""``config.pbtxt`` parameters -> ``EngineConfig`` plus the backend's own settings.

Triton hands every parameter over as a string. They are parsed here (and only here) into the
pydantic configs, so a bad value stops the model load with a message that names the parameter
as it is written in ``config.pbtxt``, and an unknown parameter (a typo) is an error too rather
than a silently ignored setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Json, ValidationError

from quanta.core.config import (
    AttentionKernel,
    CacheConfig,
    EngineConfig,
    LinearKernel,
    SchedulerConfig,
)
from quanta.runner.devices import device_memory_bytes


class ConfigParameterError(ValueError):
    """A ``config.pbtxt`` parameter is missing, unknown or has a bad value."""


class BackendSettings(BaseModel):
    """Settings of the Triton backend that are not part of the engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str | None = None  # build this tiny checkpoint into model_dir when it is missing
    preset_seed: int = Field(0, ge=0)
    torch_threads: int | None = Field(None, ge=1)
    metrics_interval_ms: float = Field(500.0, gt=0)
    max_tenant_labels: int = Field(32, ge=0)
    cancel_check_interval_ms: float = Field(20.0, gt=0)
    # the watchdog: no engine step for this long while requests wait or run is a stall
    stall_timeout_s: float = Field(120.0, gt=0)
    # once unhealthy (stalled or dead), tritonserver is ended this many seconds later so its
    # supervisor restarts it; negative: never (only health checks and metrics say so)
    unhealthy_exit_s: float = 5.0
    fault_injection: str = ""  # tests only: faults to inject (quanta.core.faults)
    # quanta: scalars are [1]; tensorrt_llm: TensorRT-LLM's configs, with a batch dimension
    # (clients send [1, 1] for a scalar) and responses shaped [1, ...]
    io_layout: Literal["quanta", "tensorrt_llm"] = "quanta"


class _Parameters(BaseModel):
    """The flat parameter namespace of ``config.pbtxt``; field names are parameter keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str
    preset: str | None = None
    preset_seed: int = 0
    policy: str = "fcfs"
    policy_options: Json[dict[str, Any]] = Field(default_factory=dict)
    dtype: str | None = None
    quantization: Literal["none", "int8", "int4", "mixed"] | None = None
    device: str = "cpu"
    linear_kernel: LinearKernel = "auto"
    attention_kernel: AttentionKernel = "auto"
    safepoint_interval: int = 8
    max_seq_len: int | None = None
    enable_prefix_caching: bool = True
    speculative_config: Json[dict[str, Any]] | None = None
    tensor_parallel_size: int = 1
    block_size: int | None = None
    num_device_blocks: int | None = None
    device_bytes: int | None = None
    device_memory_fraction: float | None = Field(None, gt=0, le=1)
    num_host_blocks: int | None = None
    host_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool | None = None
    torch_threads: int | None = None
    metrics_interval_ms: float = 500.0
    max_tenant_labels: int = 32
    cancel_check_interval_ms: float = 20.0
    stall_timeout_s: float = 120.0
    unhealthy_exit_s: float = 5.0
    fault_injection: str = ""
    io_layout: Literal["quanta", "tensorrt_llm"] = "quanta"


_CACHE_KEYS = ("block_size", "num_device_blocks", "device_bytes", "num_host_blocks", "host_bytes")
_ONE_OF = {
    "device": ("num_device_blocks", "device_bytes", "device_memory_fraction"),
    "host": ("num_host_blocks", "host_bytes"),
}
_SCHED_KEYS = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")


def _given(p: BaseModel, field: str) -> bool:
    return field in p.model_fields_set


def parameters_from_model_config(model_config: dict[str, Any]) -> dict[str, str]:
    """``{key: string_value}`` from a model config as Triton passes it (JSON, parsed)."""
    raw = model_config.get("parameters") or {}
    return {key: value.get("string_value", "") for key, value in raw.items()}


def parse_parameters(
    params: dict[str, str], *, cwd: Path | None = None
) -> tuple[EngineConfig, BackendSettings]:
    """Validate ``params``; relative ``model_dir`` paths are resolved against ``cwd``."""
    try:
        p = _Parameters(**{k: v for k, v in params.items() if v != ""})
    except ValidationError as exc:
        raise _parameter_error(exc) from None
    cache = {k: getattr(p, k) for k in _CACHE_KEYS if getattr(p, k) is not None}
    for tier, keys in _ONE_OF.items():
        given = [k for k in keys if getattr(p, k) is not None]
        if len(given) > 1:
            raise ConfigParameterError(
                f"config.pbtxt parameters {' and '.join(repr(k) for k in given)}: the {tier} "
                f"tier is sized by one of {', '.join(keys)}, not several"
            )
    if p.device_memory_fraction is not None:
        cache["device_bytes"] = int(p.device_memory_fraction * device_memory_bytes(p.device))
    sched = {k: getattr(p, k) for k in _SCHED_KEYS if getattr(p, k) is not None}
    model_dir = Path(p.model_dir)
    if not model_dir.is_absolute():
        model_dir = (cwd or Path.cwd()) / model_dir
    try:
        engine = EngineConfig(
            model=str(model_dir),
            policy=p.policy,
            policy_options=p.policy_options,
            dtype=p.dtype,
            quantization=p.quantization,
            device=p.device,
            linear_kernel=p.linear_kernel,
            attention_kernel=p.attention_kernel,
            safepoint_interval=p.safepoint_interval,
            max_seq_len=p.max_seq_len,
            enable_prefix_caching=p.enable_prefix_caching,
            speculative_config=p.speculative_config,
            # NOTE: only when given, so an engine's manifest supplies the default
            **(
                {"tensor_parallel_size": p.tensor_parallel_size}
                if _given(p, "tensor_parallel_size")
                else {}
            ),
            cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**sched),
        )
        settings = BackendSettings(
            preset=p.preset,
            preset_seed=p.preset_seed,
            torch_threads=p.torch_threads,
            metrics_interval_ms=p.metrics_interval_ms,
            max_tenant_labels=p.max_tenant_labels,
            cancel_check_interval_ms=p.cancel_check_interval_ms,
            stall_timeout_s=p.stall_timeout_s,
            unhealthy_exit_s=p.unhealthy_exit_s,
            fault_injection=p.fault_injection,
            io_layout=p.io_layout,
        )
    except ValidationError as exc:
        raise _parameter_error(exc) from None
    _check_policy(engine)
    return engine, settings


def _check_policy(engine: EngineConfig) -> None:
    """An unknown policy name or option fails at load, naming the parameter."""
    from quanta.policies import parse_policy

    try:
        parse_policy(engine.policy, engine.policy_options)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigParameterError(
            f"config.pbtxt parameter 'policy'/'policy_options': {exc}"
        ) from None


def _parameter_error(exc: ValidationError) -> ConfigParameterError:
    """Name each problem by its ``config.pbtxt`` key (nested ``cache.block_size`` is flat)."""
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if p not in ("cache", "scheduler")]
        name = {"model": "model_dir"}.get(".".join(loc), ".".join(loc))
        where = f"parameter '{name}'" if name else "parameters"
        parts.append(f"config.pbtxt {where}: {err['msg']}")
    return ConfigParameterError("; ".join(parts))


def load_model_config(args: dict[str, Any]) -> dict[str, Any]:
    """The model config dict from the ``args`` of ``TritonPythonModel.initialize``."""
    return json.loads(args["model_config"])
