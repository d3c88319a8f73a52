"""Requests, their sampling settings and their lifecycle.

A ``Request`` is owned by the loop thread; everyone else sees it through the read-only
``SchedulerView`` or through the ``RequestOutput`` deltas the loop emits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quanta.core.errors import EmptyPromptError, PromptTooLongError
from quanta.core.output import TokenLogprob
from quanta.core.pooling import PoolingParams
from quanta.core.structured import StructuredOutput, TokenConstraint


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop; invalid values raise ``pydantic.ValidationError``.

    ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` switch those filters off;
    ``temperature == 0`` is greedy.
    With a ``seed`` the random stream of token *i* depends only on ``(seed, i)``, so a request
    that is preempted and resumed samples exactly what it would have sampled uninterrupted.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    # Tokens less likely than ``min_p`` times the most likely one are never sampled (0 = off),
    # after temperature, as HF's MinPLogitsWarper and vLLM's min_p.
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # HF's repetition penalty over prompt and output (1 = off); OpenAI's presence and
    # frequency penalties over the output (0 = off).
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # EOS and stop_token_ids cannot end the output before this many tokens.
    min_tokens: int = Field(0, ge=0)
    # Token sequences never generated (HF's bad_words_ids: the last token of a sequence is
    # banned when the output so far ends with the rest of it).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # OpenAI's logit_bias: added to these token ids' logits before any other processing, so
    # greedy decoding and every filter see it (-100 all but bans a token, 100 all but forces
    # it). The ids are checked against the model's vocabulary when the request is made.
    logit_bias: dict[int, float] | None = None
    # Log-probabilities of each sampled token and of the ``logprobs`` most likely ones (None:
    # none returned; 0: the sampled token's only), from the model's raw distribution.
    logprobs: int | None = Field(None, ge=0, le=20)
    # The same for every prompt token after the first (what the model made of the prompt),
    # returned with the first output token.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # The output must match this JSON schema, regex, choice or grammar (``core/structured``).
    structured_output: StructuredOutput | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value: object) -> object:
        if isinstance(value, str):
            return (value,)
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative")
        return value

    @field_validator("bad_words_ids")
    @classmethod
    def _bad_words_non_empty(
        cls, value: tuple[tuple[int, ...], ...]
    ) -> tuple[tuple[int, ...], ...]:
        if any(not words or any(t < 0 for t in words) for words in value):
            raise ValueError("bad_words_ids must be non-empty sequences of token ids")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if not value:
            return None  # an empty bias is no bias
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} of token {token} must lie in [-100, 100]")
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sequence(self, index: int) -> SamplingParams:
        """Sequence ``index`` of several sampled for one prompt (``n``, TensorRT-LLM's
        ``num_return_sequences``): its own random stream, seed + index, when seeded (an
        unseeded request gets a random seed of its own anyway)."""
        if index == 0 or self.seed is None:
            return self
        return self.model_copy(update={"seed": (self.seed + index) % 2**63})

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs the request's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.bad_words_ids)
        )


class RequestMetadata(BaseModel):
    """Who sent a request and what it promises; policies read it, engines never do."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    tenant: str = "default"
    # NOTE: set by the server, never by a client: True when ``tenant`` was taken from a
    # credential the operator declared (an API key mapped to a tenant), False when it is a
    # name the client chose. The fair policies give only authenticated tenants a service
    # counter of their own; by default every other request counts as one pooled tenant
    # (``policies/fair.py``), so fresh names buy no share.
    tenant_authenticated: bool = False
    app: str = "default"
    interaction_id: str | None = None
    # NOTE: an interaction is one user query served by several calls (agents). Its calls
    # share ``interaction_id``; ``interaction_stage`` is the call's index in it (0 first) and
    # ``interaction_last`` marks the call after which the user has an answer.
    interaction_stage: int | None = Field(None, ge=0)
    interaction_last: bool = False
    system_tokens: int = Field(0, ge=0, description="leading prompt tokens that are system prompt")
    priority_class: Literal["online", "offline"] = "online"
    ttft_slo_ms: float | None = Field(None, gt=0)
    tpot_slo_ms: float | None = Field(None, gt=0)


class RequestStatus(StrEnum):
    """Where a request is; ``Request.set_status`` is the one place transitions are checked."""

    WAITING = "waiting"  # no KV anywhere: new, or dropped for recompute
    RUNNING = "running"  # KV in the device tier
    SWAPPED = "swapped"  # KV in the host tier
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def completed(self) -> bool:
        """Ended by its length or a stop, not aborted or failed: its tokens are whole."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FINISHED = frozenset(_FINISH_REASONS)
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING}) | _FINISHED,
    RequestStatus.RUNNING: frozenset({RequestStatus.WAITING, RequestStatus.SWAPPED}) | _FINISHED,
    RequestStatus.SWAPPED: frozenset({RequestStatus.RUNNING, RequestStatus.WAITING}) | _FINISHED,
}


def validate_prompt(
    prompt_token_ids: list[int], params: SamplingParams, max_model_len: int
) -> None:
    """Reject prompts that can never be served, before they take a place in any queue."""
    if not prompt_token_ids:
        raise EmptyPromptError("prompt is empty: it must contain at least one token")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise PromptTooLongError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{total} exceeds the model's maximum length of {max_model_len} tokens"
        )


@dataclass(slots=True, eq=False)
class Request:
    """One generation job; mutable state that only the loop thread touches."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    metadata: RequestMetadata = field(default_factory=RequestMetadata)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefix tokens a waiting request that holds no blocks would find in the prefix cache,
    # as looked up before this step's schedule; 0 once it holds blocks. Attached when it runs,
    # so a policy counts only the rest as work to do.
    num_cached_tokens: int = 0
    # Names of its full blocks (``core/prefix.py``), extended as its tokens are computed.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    cumulative_logprob: float = 0.0  # of the sampled tokens, when logprobs were asked for
    # of prompt tokens 1.. in order, when asked for; kept across preemption so a recomputed
    # prompt is neither asked nor reported twice
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # An embedding request: pooled instead of sampled, it ends once its prompt is computed
    # (``core/pooling.py``); the sum of the rows pooled so far, kept across preemption.
    pooling: PoolingParams | None = None
    pooled_sum: list[float] = field(default_factory=list, repr=False)
    num_pooled_rows: int = 0
    error: str | None = None
    # Grammar state of a structured-output request, compiled by the frontend from
    # ``params.structured_output``; advanced only by committed tokens.
    constraint: TokenConstraint | None = field(default=None, repr=False)
    # Speculative decoding: tokens proposed to follow ``all_token_ids``, set before each
    # schedule (``core/speculative.py``) and verified by the step that runs them; never part
    # of the output until the runner accepts them.
    draft_token_ids: tuple[int, ...] = ()
    # How the request's drafts have fared (``speculative.learn``): the most the next proposal
    # may make (None: the configured number), steps to sit out after drafts that all failed,
    # and the length of the latest sit-out (doubled on each failure in a row).
    spec_window: int | None = None
    # Draft-model speculation: slots past the step's tokens that the runner writes the draft
    # model's proposals through (reserved with a run that reaches the newest token, returned
    # at commit); 0 otherwise.
    num_lookahead_tokens: int = 0
    spec_skip: int = 0
    spec_backoff: int = 0

    # Timestamps in the loop clock's seconds; None until the event happens.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    # Counters policies and metrics read.
    attained_service: float = 0.0  # seconds of engine steps this request took part in
    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_swapped_blocks: int = 0
    num_recomputed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens its first start found cached (usage)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens left to compute: neither computed nor found in the prefix cache, drafts to
        verify included (a step may run fewer of those: the rest is optional)."""
        return (
            self.num_tokens
            + len(self.draft_token_ids)
            - self.num_computed_tokens
            - self.num_cached_tokens
        )

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    def slots_for(self, n: int) -> int:
        """Token slots a run of ``n`` tokens holds: the lookahead too when the run reaches
        the newest token (the step samples and the draft model proposes after it)."""
        if self.num_context_tokens + n >= self.num_tokens:
            return n + self.num_lookahead_tokens
        return n

    def real_tokens(self, n: int) -> int:
        """Of ``n`` tokens a step computes for this request, those that are not drafts: the
        ones whose K/V is valid whatever the verification decides."""
        return min(n, self.num_tokens - self.num_context_tokens)

    @property
    def decoding(self) -> bool:
        """Only the newest token lacks KV: the next step samples (drafts aside)."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def num_context_tokens(self) -> int:
        """Position of the next token to compute: the tokens before it have KV, computed or
        about to be attached from the prefix cache."""
        return self.num_computed_tokens + self.num_cached_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def set_status(self, new: RequestStatus) -> None:
        """Move to ``new``; an illegal transition is a loop bug, so it raises."""
        if new not in _TRANSITIONS.get(self.status, frozenset()):
            raise RuntimeError(f"request {self.request_id}: illegal {self.status} -> {new}")
        self.status = new

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def pending_time(self, now: float) -> float:
        """Time since the request last made visible progress (arrival or last token)."""
        last = self.last_token_time if self.last_token_time is not None else self.arrival_time
        return max(0.0, now - last)


class CacheKind(StrEnum):
    """What a request's blocks hold (Apt-Serve's hybrid cache).

    A block is sized for ``block_size`` tokens of K and V over all layers. A hidden-cache
    request stores each layer's attention input instead, one vector per token where K and V
    are two, so for multi-head attention (K and V each as wide as the hidden state) the same
    block holds ``HIDDEN_TOKENS_PER_BLOCK * block_size`` tokens: half the blocks, exactly.
    """

    KV = "kv"
    HIDDEN = "hidden"


# Tokens of hidden states a block holds, per token of K+V (2 for multi-head attention; a
# model whose K+V is narrower than its hidden state offers no hidden cache).
HIDDEN_TOKENS_PER_BLOCK = 2


def blocks_for(num_tokens: int, block_size: int, kind: CacheKind = CacheKind.KV) -> int:
    """Blocks needed to hold ``num_tokens`` tokens of cache of ``kind``."""
    if num_tokens <= 0:
        return 0
    per_block = block_size * (HIDDEN_TOKENS_PER_BLOCK if kind is CacheKind.HIDDEN else 1)
    return math.ceil(num_tokens / per_block)
