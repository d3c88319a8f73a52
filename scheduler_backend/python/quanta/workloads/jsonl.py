"""The JSONL workload format: one request per line, the keys of ``WorkloadRequest``.

::

    {"request_id": "r0", "arrival_time": 0.31, "prompt_tokens": 96, "output_tokens": 48,
     "tenant": "t1", "app": "chat", "interaction_id": "t1-i0", "priority_class": "online",
     "ttft_slo_ms": 1000, "tpot_slo_ms": 100, "prompt": "optional text",
     "interaction_stage": 1, "interaction_last": true, "system_tokens": 40, "think_time_s": 1.5,
     "prefix_group": "chat/c7", "prefix_tokens": 96}

Only ``output_tokens`` and one of ``prompt_tokens`` / ``prompt`` / ``prompt_token_ids`` are
required. ``arrival_time`` is an offset in seconds from the start of the run and is kept as
is; ``timestamp`` is a trace's own clock and is rebased so the first request arrives at 0.
Accepted aliases: ``input_len`` / ``input_tokens`` (prompt_tokens), ``output_len`` /
``max_tokens`` (output_tokens), ``user`` (tenant). Unknown keys are errors, so a typo cannot
silently drop a field.

The interaction keys describe one call of a multi-call interaction (agents):
``interaction_stage`` (its index, 0 first; needs ``interaction_id``), ``interaction_last``
(true on the call that answers the user), ``system_tokens`` (how many of the prompt's tokens
are system prompt, at most ``prompt_tokens``) and ``think_time_s`` (seconds its sender waits
after the previous call finished; only for ``interaction_stage`` > 0).
``tenant_authenticated`` (default true) says the tenant is one the operator declared (an
API key's); false: a name the client chose, which the fair policies do not trust (a live
replay's requests are authenticated only by the API key they are sent with).

The prefix keys say which prompts share a beginning, so that a trace without text still
exercises a prefix cache: requests with one ``prefix_group`` (a string) share their first
``prefix_tokens`` tokens (at most ``prompt_tokens``; needs the group), as
``quanta.workloads.prompts`` generates them (its doc has the scheme). ``prompt_token_ids``
(a list of token ids >= 0, not with ``prompt``) is the prompt itself, sent as given; its
length is ``prompt_tokens``, which may then be left out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from quanta.workloads.model import (
    CLASSES,
    OPTIONAL_DEFAULTS,
    FileRow,
    WorkloadError,
    WorkloadRequest,
    parse_count,
    parse_number,
)

_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "timestamp": "timestamp",
        "arrival_time": "arrival_time",
        "prompt_tokens": "prompt_tokens",
        "input_len": "prompt_tokens",
        "input_tokens": "prompt_tokens",
        "output_tokens": "output_tokens",
        "output_len": "output_tokens",
        "max_tokens": "output_tokens",
        "user": "tenant",
        **{k: k for k in ("request_id", *OPTIONAL_DEFAULTS)},
    }
)


def write_jsonl(path: Path, requests: Sequence[WorkloadRequest]) -> None:
    """One JSON object per request, in the given order (``WorkloadRequest.to_dict``)."""
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")


def read_jsonl(path: Path, count_tokens: Callable[[str], int]) -> list[FileRow]:
    """The file's requests in file order; blank lines are skipped, a bad line raises
    ``path:line: problem``."""
    rows: list[FileRow] = []
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{line}: not JSON ({exc.msg})") from None
            try:
                req, when, clock = _parse_object(obj, len(rows), count_tokens)
            except WorkloadError as exc:
                raise WorkloadError(f"{path}:{line}: {exc}") from None
            rows.append(FileRow(line, req, when, clock))
    return rows


def estimate_tokens(text: str) -> int:
    """About 4 characters per token: an estimate (the server counts the real tokens)."""
    return max(1, round(len(text) / 4))


def _parse_object(
    obj: Any, index: int, count_tokens: Callable[[str], int]
) -> tuple[WorkloadRequest, float | None, bool]:
    if not isinstance(obj, dict):
        raise WorkloadError(f"expected a JSON object, got {type(obj).__name__}")
    fields: dict[str, Any] = {}
    for key, value in obj.items():
        name = _ALIASES.get(key)
        if name is None:
            raise WorkloadError(f"unknown field {key!r} (known: {', '.join(sorted(_ALIASES))})")
        if name in fields:
            raise WorkloadError(f"field {name!r} given twice (through an alias)")
        fields[name] = value
    if "timestamp" in fields and "arrival_time" in fields:
        raise WorkloadError("give arrival_time or timestamp, not both")
    clock = "timestamp" in fields
    when = fields.pop("timestamp", fields.pop("arrival_time", None))
    if when is not None:
        when = parse_number(when, "arrival_time" if not clock else "timestamp", minimum=0.0)
    prompt = fields.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise WorkloadError("prompt must be a non-empty string")
    ids = _parse_token_ids(fields)
    if ids is not None and prompt is not None:
        raise WorkloadError("give prompt or prompt_token_ids, not both")
    if "prompt_tokens" in fields:
        fields["prompt_tokens"] = parse_count(fields["prompt_tokens"], "prompt_tokens")
    elif prompt is not None:
        fields["prompt_tokens"] = max(1, count_tokens(prompt))
    elif ids is not None:
        fields["prompt_tokens"] = len(ids)
    else:
        raise WorkloadError("needs prompt_tokens or prompt (or prompt_token_ids)")
    if "output_tokens" not in fields:
        raise WorkloadError("needs output_tokens")
    fields["output_tokens"] = parse_count(fields["output_tokens"], "output_tokens")
    for key in ("tenant", "app", "interaction_id", "request_id"):
        if key in fields and fields[key] is not None and not isinstance(fields[key], str):
            raise WorkloadError(f"{key} must be a string")
    if fields.get("priority_class", "online") not in CLASSES:
        got = fields["priority_class"]
        raise WorkloadError(f"priority_class must be online or offline, got {got!r}")
    for key in ("ttft_slo_ms", "tpot_slo_ms"):
        if fields.get(key) is not None:
            fields[key] = parse_number(fields[key], key, minimum=0.0, strict=True)
    _parse_interaction(fields)
    _parse_prefix(fields)
    if not fields.get("request_id"):
        fields["request_id"] = f"r{index}"
    return WorkloadRequest(arrival_time=0.0, **fields), when, clock


def _parse_interaction(fields: dict[str, Any]) -> None:
    """Check and normalise the interaction keys in place (after the lengths are known)."""
    stage = fields.get("interaction_stage")
    if stage is not None:
        stage = fields["interaction_stage"] = parse_count(stage, "interaction_stage", minimum=0)
        if fields.get("interaction_id") is None:
            raise WorkloadError("interaction_stage needs an interaction_id")
    for key in ("interaction_last", "tenant_authenticated"):
        if not isinstance(fields.get(key, False), bool):
            raise WorkloadError(f"{key} must be true or false, got {fields[key]!r}")
    if "system_tokens" in fields:
        system = fields["system_tokens"] = parse_count(
            fields["system_tokens"], "system_tokens", minimum=0
        )
        if system > fields["prompt_tokens"]:
            raise WorkloadError(
                f"system_tokens ({system}) must be <= prompt_tokens ({fields['prompt_tokens']})"
            )
    if "think_time_s" in fields:
        think = fields["think_time_s"] = parse_number(
            fields["think_time_s"], "think_time_s", minimum=0.0
        )
        if think and not stage:
            raise WorkloadError("think_time_s applies only to calls with interaction_stage > 0")


def _parse_token_ids(fields: dict[str, Any]) -> tuple[int, ...] | None:
    """The ``prompt_token_ids`` key as a tuple (in ``fields`` too), or None when absent."""
    ids = fields.get("prompt_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids:
        raise WorkloadError(f"prompt_token_ids must be a non-empty list of token ids, got {ids!r}")
    for k, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise WorkloadError(f"prompt_token_ids[{k}] must be an integer >= 0, got {token!r}")
    fields["prompt_token_ids"] = tuple(ids)
    return fields["prompt_token_ids"]


def _parse_prefix(fields: dict[str, Any]) -> None:
    """Check and normalise the prefix keys in place; how they fit the prompt and each other
    ``WorkloadRequest`` checks, for files and generators alike."""
    group = fields.get("prefix_group")
    if group is not None and (not isinstance(group, str) or not group):
        raise WorkloadError(f"prefix_group must be a non-empty string, got {group!r}")
    if "prefix_tokens" in fields:
        fields["prefix_tokens"] = parse_count(fields["prefix_tokens"], "prefix_tokens", minimum=0)
