"""``config.pbtxt`` parameters -> ``EngineConfig`` plus the backend's own settings.

Triton hands every parameter over as a string. ``quanta.config.pbtxt`` reads them into the
config models the commands share (the keys are fields of those models), and this module turns
those into the engine's config, so a bad value stops the model load with a message that names
the parameter as it is written in ``config.pbtxt``, and an unknown parameter (a typo) is an
error too rather than a silently ignored setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from quanta.config.models import BackendArgs
from quanta.config.pbtxt import ConfigParameterError, parse
from quanta.core.config import CacheConfig, EngineConfig, SchedulerConfig
from quanta.runner.devices import device_memory_bytes

_ONE_OF = {
    "device": ("num_device_blocks", "device_bytes", "device_memory_fraction"),
    "host": ("num_host_blocks", "host_bytes"),
}


class BackendSettings(BackendArgs):
    """What the Triton backend reads beyond the engine's config: ``BackendArgs``, and of the
    shared options the process's torch threads and the tensors' layout, resolved."""

    torch_threads: int | None = None
    # quanta: scalars are [1]; tensorrt_llm: TensorRT-LLM's configs, with a batch dimension
    # (clients send [1, 1] for a scalar) and responses shaped [1, ...]
    io_layout: Literal["quanta", "tensorrt_llm"] = "quanta"


def parameters_from_model_config(model_config: dict[str, Any]) -> dict[str, str]:
    """``{key: string_value}`` from a model config as Triton passes it (JSON, parsed)."""
    raw = model_config.get("parameters") or {}
    return {key: value.get("string_value", "") for key, value in raw.items()}


def parse_parameters(
    params: dict[str, str], *, cwd: Path | None = None
) -> tuple[EngineConfig, BackendSettings]:
    """Validate ``params``; relative ``model_dir`` paths are resolved against ``cwd``."""
    backend, engine, cache, scheduler, serving = parse(params)
    for tier, keys in _ONE_OF.items():
        given = [k for k in keys if params.get(k, "") != ""]
        if len(given) > 1:
            raise ConfigParameterError(
                f"config.pbtxt parameters {' and '.join(repr(k) for k in given)}: the {tier} "
                f"tier is sized by one of {', '.join(keys)}, not several"
            )
    sizes = cache.runtime()
    if backend.device_memory_fraction is not None:
        device = engine.device or "cpu"
        sizes["device_bytes"] = int(backend.device_memory_fraction * device_memory_bytes(device))
    limits: dict[str, Any] = scheduler.runtime()
    if backend.enable_chunked_prefill is not None:
        limits["enable_chunked_prefill"] = backend.enable_chunked_prefill
    model_dir = Path(backend.model_dir)
    if not model_dir.is_absolute():
        model_dir = (cwd or Path.cwd()) / model_dir
    try:
        config = EngineConfig(
            model=str(model_dir),
            # NOTE: only what was given, so an engine's manifest supplies the rest
            **engine.runtime(),
            **({"policy": scheduler.policy} if scheduler.policy is not None else {}),
            policy_options=scheduler.policy_options(),
            quantization=backend.quantization,
            cache=CacheConfig(**sizes),
            scheduler=SchedulerConfig(**limits),
        )
        settings = BackendSettings(
            **backend.model_dump(),
            torch_threads=engine.torch_threads,
            io_layout=serving.io_layout or "quanta",
        )
    except ValidationError as exc:
        raise _parameter_error(exc) from None
    _check_policy(config)
    return config, settings


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
