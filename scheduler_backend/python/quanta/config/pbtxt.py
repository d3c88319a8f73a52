"""A model's ``config.pbtxt`` parameters, read into the config models.

Every field marked ``Pbtxt`` in ``quanta.config.models`` is a parameter, under the marker's key
or the field's own name (``kv_cache_memory`` is ``device_bytes``); ``BackendArgs`` holds the
ones no command takes. Triton hands every parameter over as a string, which the field's own
type and validators read (through the marker's ``form`` first where the file spells it
otherwise: ``policy_options`` is one JSON object, not ``KEY=VALUE`` pairs). So the backend's
model load, ``quanta check-config``, ``quanta serve``'s generated models and the docs'
parameter table read one list, and a problem is named by its key as ``config.pbtxt`` spells it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from quanta.config.models import (
    BackendArgs,
    CacheArgs,
    EngineArgs,
    Pbtxt,
    SchedulerArgs,
    ServingArgs,
)


class ConfigParameterError(ValueError):
    """A ``config.pbtxt`` parameter is missing, unknown or has a bad value."""


@dataclass(frozen=True, slots=True)
class Parameter:
    """One ``config.pbtxt`` key and the model field it sets."""

    key: str
    model: type[BaseModel]
    field: str
    info: FieldInfo
    marker: Pbtxt

    @property
    def description(self) -> str:
        return self.marker.description or self.info.description or ""


class Parameters(NamedTuple):
    """A ``config.pbtxt``'s parameters as the models; a parameter not given is the field's
    default (``None`` for the shared options: the engine's manifest or the runtime config
    decides)."""

    backend: BackendArgs
    engine: EngineArgs
    cache: CacheArgs
    scheduler: SchedulerArgs
    serving: ServingArgs


MODELS: tuple[type[BaseModel], ...] = (
    BackendArgs,
    EngineArgs,
    CacheArgs,
    SchedulerArgs,
    ServingArgs,
)


@functools.cache
def parameters() -> dict[str, Parameter]:
    """Every ``config.pbtxt`` key, in the models' order (backend, engine, cache, scheduler,
    serving) and the fields' order within each."""
    out: dict[str, Parameter] = {}
    for model in MODELS:
        for name, info in model.model_fields.items():
            marker = next((m for m in info.metadata if isinstance(m, Pbtxt)), None)
            if marker is None:
                continue
            key = marker.key or name
            if key in out:
                raise TypeError(f"config.pbtxt parameter {key!r} is declared twice")
            out[key] = Parameter(key, model, name, info, marker)
    return out


def parse(params: dict[str, str]) -> Parameters:
    """``{key: string}`` as Triton passes them -> the models. An empty string is "not given";
    an unknown key (a typo) is an error, as is a bad value, each named by its key."""
    known = parameters()
    problems = [
        f"parameter {key!r}: Extra inputs are not permitted" for key in params if key not in known
    ]
    values: dict[type[BaseModel], dict[str, Any]] = {model: {} for model in MODELS}
    for key, raw in params.items():
        param = known.get(key)
        if param is None or raw == "":
            continue
        try:
            value = (
                raw if param.marker.form is None else _form(param.marker.form).validate_python(raw)
            )
        except ValidationError as exc:
            problems += _named(exc, {"": key})
            continue
        values[param.model][param.field] = value
    models: list[Any] = []
    for model in MODELS:
        keys = {p.field: p.key for p in known.values() if p.model is model}
        try:
            models.append(model.model_validate(values[model]))
        except ValidationError as exc:
            problems += _named(exc, keys)
    if problems:
        raise ConfigParameterError("; ".join(f"config.pbtxt {p}" for p in problems))
    return Parameters(*models)


@functools.cache
def _form(form: Any) -> TypeAdapter[Any]:
    return TypeAdapter(form)


def _named(exc: ValidationError, keys: dict[str, str]) -> list[str]:
    """Each error of ``exc`` named by the ``config.pbtxt`` key of its field, and within a
    JSON value by the path to it (``speculative_config.prompt_lookup_min``)."""
    out = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        key = ".".join([keys.get(field, keys.get("", field)), *map(str, err["loc"][1:])])
        out.append(f"parameter {key!r}: {err['msg']}" if key else f"parameters: {err['msg']}")
    return out
