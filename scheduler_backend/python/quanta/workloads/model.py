"""The workload data model: one request of a workload, the error every reader raises, and the
checks that make a file's field a valid count or number.

Kept apart from the generators and readers so that everything else in ``quanta.workloads``
(and the simulator, the benchmarks and Locust) shares one definition of a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

PriorityClass = Literal["online", "offline"]
CLASSES: tuple[PriorityClass, ...] = ("online", "offline")


class WorkloadError(ValueError):
    """A workload file or spec is malformed; the message names the line and the problem."""


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request. Field names are the file's keys; ``input_len``/``output_len`` are the
    simulator's names for the two lengths, so its driver reads either.

    A call of a multi-call interaction (agents) has ``interaction_stage`` (0 first) and
    ``interaction_last`` on the call that answers the user; ``system_tokens`` of its prompt
    are system prompt. ``think_time_s`` is how long its sender waits after the previous call
    of the interaction finished, so for ``interaction_stage > 0`` ``arrival_time`` is only a
    lower bound: a dependency-aware replay (the simulator) sends it at
    max(arrival_time, previous finish + think_time_s).

    Requests of one ``prefix_group`` share their first ``prefix_tokens`` prompt tokens: the
    system prompt of an app, or a conversation so far (``quanta.workloads.prompts`` turns a
    row into token ids that share exactly that). ``prompt_token_ids`` are a trace's own ids,
    sent as they are instead of synthetic ones."""

    arrival_time: float  # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int
    request_id: str = ""
    prompt: str | None = None  # text to send; None: ``prompt_tokens`` synthetic token ids
    tenant: str = "default"
    app: str = "default"
    interaction_id: str | None = None
    priority_class: PriorityClass = "online"
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    interaction_stage: int | None = None
    interaction_last: bool = False
    system_tokens: int = 0  # leading prompt tokens that are system prompt (<= prompt_tokens)
    think_time_s: float = 0.0  # not metadata: when to send, not how to schedule
    prefix_group: str | None = None  # requests that share a prompt prefix (not metadata)
    prefix_tokens: int = 0  # leading prompt tokens shared within the group (<= prompt_tokens)
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt's ids; None: synthetic
    # NOTE: a workload's tenants are the operator's declared ones (an API key's) unless a
    # row says the name is the client's own choice, as the fairness figures assume
    tenant_authenticated: bool = True

    def __post_init__(self) -> None:
        # NOTE: checked here, not only in the reader, because every generator and transform
        # builds rows too and a wrong length would silently send another prompt.
        ids = self.prompt_token_ids
        if ids is not None:
            if not isinstance(ids, tuple):  # a list from a caller: the row stays hashable
                object.__setattr__(self, "prompt_token_ids", ids := tuple(ids))
            if len(ids) != self.prompt_tokens:
                raise WorkloadError(
                    f"prompt_token_ids has {len(ids)} ids but prompt_tokens is {self.prompt_tokens}"
                )
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise WorkloadError(
                f"prefix_tokens ({self.prefix_tokens}) must be in [0, prompt_tokens "
                f"({self.prompt_tokens})]"
            )
        if self.prefix_tokens and self.prefix_group is None:
            raise WorkloadError("prefix_tokens needs a prefix_group")

    @property
    def input_len(self) -> int:
        return self.prompt_tokens

    @property
    def output_len(self) -> int:
        return self.output_tokens

    def metadata(self) -> dict[str, Any]:
        """Keyword arguments of ``quanta.core.request.RequestMetadata``."""
        return {
            "tenant": self.tenant,
            "tenant_authenticated": self.tenant_authenticated,
            "app": self.app,
            "interaction_id": self.interaction_id,
            "interaction_stage": self.interaction_stage,
            "interaction_last": self.interaction_last,
            "system_tokens": self.system_tokens,
            "priority_class": self.priority_class,
            "ttft_slo_ms": self.ttft_slo_ms,
            "tpot_slo_ms": self.tpot_slo_ms,
        }

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object: required keys always, optional ones when not default (an
        empty ``request_id`` is left out: loading names it ``r<index>``)."""
        out: dict[str, Any] = {"request_id": self.request_id} if self.request_id else {}
        out |= {
            "arrival_time": self.arrival_time,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        for key, default in OPTIONAL_DEFAULTS.items():
            value = getattr(self, key)
            if value != default:
                out[key] = value
        return out


# The optional keys of a file's object and the values a writer leaves out.
OPTIONAL_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "tenant": "default",
        "app": "default",
        "interaction_id": None,
        "priority_class": "online",
        "ttft_slo_ms": None,
        "tpot_slo_ms": None,
        "prompt": None,
        "interaction_stage": None,
        "interaction_last": False,
        "system_tokens": 0,
        "think_time_s": 0.0,
        "prefix_group": None,
        "prefix_tokens": 0,
        "prompt_token_ids": None,
        "tenant_authenticated": True,
    }
)


class FileRow(NamedTuple):
    """A request as a reader found it, before the file's rows are put on one clock."""

    line: int  # 1-based line of the file, for error messages
    request: WorkloadRequest  # its ``arrival_time`` is not set yet
    time: float | None  # the row's time, None when the file gives none
    clock: bool  # True: ``time`` is a trace's own clock, rebased so the first arrives at 0


def parse_count(value: Any, name: str, *, minimum: int = 1) -> int:
    """An integer token count (``"12"`` and ``12.0`` are accepted, ``12.5`` is not)."""
    try:
        number = float(value) if isinstance(value, str | int | float) else math.nan
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not number.is_integer() or number < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(number)


def parse_number(value: Any, name: str, *, minimum: float, strict: bool = False) -> float:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    try:
        number = float(value) if isinstance(value, str | int | float) else math.nan
    except ValueError:
        number = math.nan
    bad = number <= minimum if strict else number < minimum
    if isinstance(value, bool) or not math.isfinite(number) or bad:
        op = ">" if strict else ">="
        raise WorkloadError(f"{name} must be a number {op} {minimum:g}, got {value!r}")
    return number
