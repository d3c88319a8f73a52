"""Command-line options more than one command takes (Typer annotations and their parsing)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer


def parse_speculative_config(text: str | None) -> dict[str, Any] | None:
    """``--speculative-config`` as vLLM takes it (JSON), checked here so a typo is a usage
    error naming the field rather than a model that fails to load."""
    if text is None:
        return None
    from pydantic import ValidationError

    from quanta.core.speculative import SpeculativeConfig

    try:
        config = SpeculativeConfig.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise typer.BadParameter(problems, param_hint="--speculative-config") from None
    return config.model_dump(exclude_none=True)


# vLLM's flag pair for automatic prefix caching (``EngineConfig.enable_prefix_caching``, on by
# default); ``quanta serve`` takes it from ``quanta.config.EngineArgs``.
_PREFIX_CACHING = "--enable-prefix-caching/--no-enable-prefix-caching"
_PREFIX_CACHING_HELP = (
    "share the KV of identical prompt prefixes between requests (vLLM's automatic prefix caching)"
)
PrefixCachingOpt = Annotated[bool, typer.Option(_PREFIX_CACHING, help=_PREFIX_CACHING_HELP)]

# vLLM's speculative decoding flag: a JSON object (``core/speculative.SpeculativeConfig``).
SpeculativeConfigOpt = Annotated[
    str | None,
    typer.Option(
        help='speculative decoding as JSON, vLLM\'s spelling: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(prompt lookup; default: off)",
        show_default=False,
    ),
]


def tensor_parallel_option(help: str, *more: str, **kwargs: Any) -> Any:
    """vLLM's tensor-parallel flag (``EngineConfig.tensor_parallel_size``) and its short
    spelling; ``more``: further names (trtllm-build's ``--tp_size``)."""
    return typer.Option("--tensor-parallel-size", "--tp-size", *more, min=1, help=help, **kwargs)


# Apt-Serve's SLO attainment (``quanta.slo``): the TBT limit and the named presets.
TbtSloOpt = Annotated[
    float | None,
    typer.Option(min=0.0, help="P99 time-between-tokens SLO (s) of SLO attainment"),
]
SloPresetOpt = Annotated[
    str | None,
    typer.Option(
        help="Apt-Serve's SLOs by dataset and model size: sharegpt-13b, humaneval-13b, "
        "longbench-13b, and -30b, -66b (explicit --ttft-slo/--tbt-slo override its parts)"
    ),
]


class RouterOpt(StrEnum):
    """How requests pick a replica: the gateway's router and the simulator's."""

    least_outstanding = "least-outstanding"
    round_robin = "round-robin"
    prefix_affinity = "prefix-affinity"


def batch_sizes(text: str) -> list[int]:
    """A ``--batch`` value, comma-separated sizes (``1,8,32``)."""
    return [int(b) for b in text.split(",") if b.strip()]


def check_state_policy(policy: str | None, options: dict[str, Any]) -> None:
    """``--state-url`` only means something to a policy that keeps fairness state: refused
    here, before a server starts, otherwise."""
    from quanta.policies import parse_policy

    if policy is None:
        raise typer.BadParameter("--state-url needs --policy (fair, wsc, vtc or rpm)")
    try:
        spec = parse_policy(policy, options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--state-url") from None
    if not spec.accepts("state_url"):
        raise typer.BadParameter(
            f"policy {policy!r} keeps no fairness state to share", param_hint="--state-url"
        )


def api_key_policies(keys: list[str] | None, key_file: Path | None) -> dict[str, Any]:
    """The gateway's keys (``auth.KeyPolicy`` by key), or a usage error naming the flag."""
    from quanta.frontends.openai.auth import KeysFileError, key_policies

    try:
        return key_policies(keys or (), key_file)
    except KeysFileError as exc:
        hint = "--api-key-file" if key_file is not None else "--api-key"
        raise typer.BadParameter(str(exc), param_hint=hint) from None


def with_key_weights(
    policy: str | None, options: dict[str, Any] | None, keys: dict[str, Any]
) -> dict[str, Any] | None:
    """``options`` with the keys' tenant weights, where the policy weighs tenants (vtc's
    ``weights``, fair and wsc's ``priorities``) and the options do not set them already."""
    weights = {p.tenant: p.weight for p in keys.values() if p.weight != 1.0}
    if policy is None or not weights:
        return options
    from quanta.policies import parse_policy

    try:
        spec = parse_policy(policy, options or {})
    except ValueError:
        return options  # the policy itself is refused later, with its own message
    added = {
        name: weights
        for name in ("weights", "priorities")
        if spec.accepts(name) and name not in (options or {})
    }
    return {**(options or {}), **added} if added else options
