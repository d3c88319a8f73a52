"""Command-line options more than one command takes (Typer annotations and their parsing)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

import typer

PolicyOpt = Annotated[
    list[str] | None,
    typer.Option("--policy-option", help="KEY=VALUE passed to the policy (JSON values)"),
]


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["starve_limit=2", "memory=reactive"]`` -> ``{"starve_limit": 2, ...}``."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


class LinearKernelOpt(StrEnum):
    """How the engine runs its projections (``EngineConfig.linear_kernel``)."""

    auto = "auto"
    onednn = "onednn"
    torch = "torch"


class AttentionKernelOpt(StrEnum):
    """How the engine runs decode attention (``EngineConfig.attention_kernel``)."""

    auto = "auto"
    compiled = "compiled"
    eager = "eager"
