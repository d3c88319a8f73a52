"""Typer options derived from the config models, and ``--config FILE.yaml``.

``options_from`` turns the fields of ``EngineArgs``, ``CacheArgs``, ``SchedulerArgs`` and
``ServingArgs`` into a command's options, so every command that takes an option declares it
once, with the meaning its field's description gives. Where a value comes from, highest first:

1. the command line;
2. the environment: a field's own variable where it has one (``QUANTA_HTTP_PORT``), else
   ``QUANTA_<COMMAND>_<OPTION>`` (``QUANTA_SERVE_MAX_NUM_SEQS=8``); the command's name is part
   of it so the runner's own variables (``QUANTA_ATTENTION_KERNEL``) never set a flag;
3. the ``--config`` file: keys are the long option names without dashes
   (``max-num-seqs: 8``), as vLLM's ``--config`` takes them;
4. the default.

This is click's own order (command line, ``envvar``, ``default_map``, default): the file is
loaded into the context's ``default_map`` before any other option is read.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_origin, get_type_hints

import typer
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from quanta.config.models import Flag

ENV_PREFIX = "QUANTA"
_UNSET = inspect.Parameter.empty
F = TypeVar("F", bound=Callable[..., Any])


def flag_name(field: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field.replace("_", "-")


def field_flags(name: str, info: FieldInfo) -> tuple[str, ...]:
    """Every spelling of a field's option, its own first; a switch has its ``--no-`` form
    (``--enable-prefix-caching/--no-enable-prefix-caching``)."""
    flag = next((m for m in info.metadata if isinstance(m, Flag)), Flag())
    own = flag_name(name)
    if bool in (info.annotation, *get_args(info.annotation)):
        own = f"{own}/--no-{own[2:]}"
    return (own, *flag.aliases)


def field_envvar(info: FieldInfo) -> str | None:
    return next((m.envvar for m in info.metadata if isinstance(m, Flag)), None)


def _cli_type(annotation: Any) -> Any:
    """The type Typer parses a field as: a nested model or a mapping is JSON text."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    inner = args[0] if get_origin(annotation) is not None and len(args) == 1 else annotation
    if (isinstance(inner, type) and issubclass(inner, BaseModel)) or get_origin(inner) is dict:
        return str | None
    return annotation


def split_default(description: str) -> tuple[str, str | None]:
    """``"tokens per step (default: 2048)"`` -> ``("tokens per step", "2048")``: what an
    option that is unset by default says applies then, apart from what it means."""
    found = _SAYS_DEFAULT.search(description)
    if found is None:
        return description, None
    rest = description[: found.start()] + (")" if found.group(1) == "; " else "")
    return rest.rstrip(), found.group(2)


_SAYS_DEFAULT = re.compile(r"(\(|; )default: ([^()]*)\)$")


def _bounds(info: FieldInfo) -> dict[str, Any]:
    """``ge``/``le`` of a field as click's range, so a bad number is a usage error; typer's
    options have no open bound, so a ``gt`` is left to the model's own validation."""
    out: dict[str, Any] = {}
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            out["min"] = m.ge
        if getattr(m, "le", None) is not None:
            out["max"] = m.le
    return out


def option_parameter(
    name: str, info: FieldInfo, panel: str, default: Any = _UNSET
) -> inspect.Parameter:
    """One field as a keyword parameter ``Annotated[type, typer.Option(...)]``."""
    description = info.description or ""
    if default is not _UNSET and default is not None:
        description = split_default(description)[0]  # the command's own default shows
    option = typer.Option(
        *field_flags(name, info),
        help=description,
        envvar=field_envvar(info),
        rich_help_panel=panel,
        **_bounds(info),
    )
    if default is _UNSET:
        default = info.get_default(call_default_factory=True)
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        annotation=Annotated[_cli_type(info.annotation), option],
        default=default,
    )


def options_from(
    *,
    only: dict[str, tuple[str, ...]] | None = None,
    defaults: dict[str, Any] | None = None,
    **groups: type[BaseModel],
) -> Callable[[F], F]:
    """Give a command the options of each model in ``groups`` plus ``--config``.

    The command function declares its own options as usual, and one keyword parameter per
    group (``engine: EngineArgs``); it receives that group's validated model. ``only`` names
    the fields a command takes of a group (default: all); ``defaults`` changes a field's
    default for this command (the simulator's batch limits).
    """
    only = only or {}
    defaults = defaults or {}

    def decorate(func: F) -> F:
        own = [p for p in inspect.signature(func).parameters.values() if p.name not in groups]
        hints = _own_hints(func, own)
        fields: dict[str, list[str]] = {}
        params = [p.replace(annotation=hints[p.name]) for p in own]
        params.append(_config_parameter())
        for group, model in groups.items():
            panel = model.__name__.removesuffix("Args") + " options"
            names = list(only.get(group, model.model_fields))
            fields[group] = names
            params += [
                option_parameter(n, model.model_fields[n], panel, defaults.get(n, _UNSET))
                for n in names
            ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            kwargs.pop("config")
            for group, model in groups.items():
                values = {n: kwargs.pop(n) for n in fields[group]}
                kwargs[group] = _validate(model, values)
            return func(**kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command  # type: ignore[return-value]

    return decorate


def _own_hints(func: Callable[..., Any], own: list[inspect.Parameter]) -> dict[str, Any]:
    """The command's own parameters' annotations, evaluated (the module may use
    ``from __future__ import annotations``)."""
    hints = get_type_hints(func, include_extras=True)
    return {p.name: hints.get(p.name, p.annotation) for p in own}


def _validate(model: type[BaseModel], values: dict[str, Any]) -> BaseModel:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        where = ".".join(str(p) for p in err["loc"][1:])
        said = err["msg"].removeprefix("Value error, ")  # a validator's own words
        message = f"{where}: {said}" if where else said
        raise typer.BadParameter(message, param_hint=flag_name(name) if name else None) from None


def _config_parameter() -> inspect.Parameter:
    option = typer.Option(
        "--config",
        help="YAML file of options: keys are the long option names without dashes "
        "(max-num-seqs: 8); the command line and the environment win over it",
        is_eager=True,
        callback=load_config_file,
        show_default=False,
    )
    return inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        annotation=Annotated[Path | None, option],
        default=None,
    )


def load_config_file(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> None:
    """Read ``--config`` into the context's ``default_map``, which click reads after the
    command line and the environment; an unknown key is a usage error that names it."""
    if value is None:
        return None
    try:
        data = yaml.safe_load(Path(value).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(str(exc), ctx, param) from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value}: expected a mapping of option names", ctx, param)
    by_key = config_keys(ctx.command)
    defaults: dict[str, Any] = {}
    for key, raw in data.items():
        target = by_key.get(str(key))
        if target is None or target.name == "config":
            near = difflib.get_close_matches(str(key), list(by_key), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise typer.BadParameter(f"{value}: unknown key {key!r}{hint}", ctx, param)
        defaults[target.name] = _file_value(target, raw)  # type: ignore[index]
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return None


def config_keys(command: Any) -> dict[str, Any]:
    """A ``--config`` file's keys (of a click command): each option's long names without
    dashes, and each argument's name (``model: engines/opt``)."""
    keys: dict[str, Any] = {}
    for param in command.params:
        if param.param_type_name == "option":
            for opt in param.opts:
                if opt.startswith("--"):
                    keys[opt[2:]] = param
        elif param.name:
            keys[param.name] = param
    return keys


def _file_value(param: Any, raw: Any) -> Any:
    """A YAML value as click reads a default: a list for a repeated option, JSON text for
    an option that takes JSON."""
    if param.multiple:
        return [str(v) for v in raw] if isinstance(raw, list) else [str(raw)]
    if isinstance(raw, dict | list):
        return json.dumps(raw)
    return raw


def env_prefix(command: str) -> dict[str, str]:
    """The context settings that give a command's options ``QUANTA_<COMMAND>_<OPTION>``."""
    return {"auto_envvar_prefix": f"{ENV_PREFIX}_{command.upper().replace('-', '_')}"}
