"""Speculative decoding's proposals: n-gram prompt lookup, in the core, before each schedule.

A decoding request whose recent tokens already appeared earlier in its prompt or output (a
summary quoting its source, an edit copying most of a file, code repeating an identifier) is
likely to continue as it did there. Prompt lookup proposes those next tokens as drafts; the
runner verifies all of them in the request's one forward pass and keeps the longest prefix
the target model agrees with, plus one token of its own, so a step yields 1 to k+1 tokens for
the cost of a k+1-token chunk. The output is exactly the target model's (greedy: the same
tokens; sampled: the same distribution, by rejection sampling in the runner).

Proposals live on the request (``Request.draft_token_ids``) before the policy runs, and count
in ``num_uncomputed_tokens``, so every stage sees a drafted decode as the tokens it will
compute: the token budget, the block ledger and the cost model all pay for verification. A
policy that gives a drafted request fewer tokens verifies fewer drafts (one token: none).
Pure Python, like the rest of the core: the same proposals run in Triton, offline and in the
simulator.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quanta.core.request import Request, RequestStatus


class SpeculativeConfig(BaseModel):
    """vLLM's ``--speculative-config``, with its names.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}``: propose up to 4 tokens after the latest earlier occurrence of
    the request's last 4 (else 3, else 2) tokens. ``{"model": "engines/draft",
    "num_speculative_tokens": 3}`` (method ``draft_model``): a smaller model of the same
    vocabulary proposes 3 tokens greedily after each step. ``disable_by_batch_size``: no
    proposals in a step whose batch already holds more running requests than this (at large
    batches a step is compute-bound and verification costs what it saves)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram", "draft_model"] = "ngram"
    model: str | None = None  # the draft model's engine or checkpoint (draft_model)
    num_speculative_tokens: int = Field(4, ge=1, le=32)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    prompt_lookup_min: int = Field(2, ge=1, le=64)
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _known_method(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        if data.get("method") in ("eagle", "eagle3", "medusa", "mlp_speculator"):
            raise ValueError(
                f'speculative method {data["method"]!r} is not served; use "ngram" (prompt '
                'lookup) or "draft_model" with a "model"'
            )
        if data.get("model") is not None and "method" not in data:
            return {**data, "method": "draft_model"}  # vLLM: a model alone means a draft model
        return data

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                'method "draft_model" takes the draft\'s "model" (an engine or checkpoint '
                'directory); "ngram" takes none'
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``n_max`` down to ``n_min`` tokens, as if they came again; () when none
    occurs.

    The search runs in C: the ids as 4-byte words and ``bytes.rfind``, keeping only
    word-aligned hits, so a 4k-token context costs microseconds per step."""
    total = len(tokens)
    if k <= 0 or total < n_min + 1:
        return ()
    data = array("i", tokens).tobytes()
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = data[(total - n) * 4 :]
        end = (total - 1) * 4  # an occurrence must end before the suffix's last token
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                return _continuation(tokens, at // 4 + n, k)
            end = at + len(suffix) - 1
    return ()


def _continuation(tokens: Sequence[int], start: int, k: int) -> tuple[int, ...]:
    """``k`` tokens from ``start`` on, where a continuation that reaches the end goes on
    with its own first tokens (a repeat goes on repeating: ``4 4 4`` proposes ``4 4``)."""
    out = list(tokens[start : start + k])
    total = len(tokens)
    while len(out) < k:
        out.append(out[start + len(out) - total])
    return tuple(out)


def speculates(r: Request) -> bool:
    """Whether ``r`` may verify drafts this step: decoding, with nothing that makes a token's
    sampling depend on the tokens just before it inside the step (penalties over the history,
    bans until ``min_tokens``, bad words, a grammar's state, log-probabilities asked for), and
    no logit bias (the drafts' rows are verified unprocessed)."""
    p = r.params
    return (
        r.status is RequestStatus.RUNNING
        and r.decoding
        and r.constraint is None
        and not p.penalized
        and not p.logit_bias
        and p.logprobs is None
        and p.prompt_logprobs is None
        and r.pooling is None
        and r.num_output_tokens >= p.min_tokens
    )


class Proposer:
    """Sets every live request's drafts before the policy runs (the loop's one call)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, live: Iterable[Request], num_running: int) -> None:
        """Drafts for the requests that may speculate; () for every other one. With a draft
        model, the drafts are those the runner proposed after the request's latest step (cut
        to what may be verified now), and every speculating request reserves lookahead slots
        for the draft model's next proposals."""
        c = self.config
        enabled = c.disable_by_batch_size is None or num_running <= c.disable_by_batch_size
        for r in live:
            r.num_lookahead_tokens = 0
            if not (enabled and speculates(r)):
                r.draft_token_ids = ()
                continue
            if r.spec_skip:
                r.spec_skip -= 1
                r.draft_token_ids = ()
                continue
            # NOTE: never past max_tokens or the model's length: the last draft's slot is the
            # request's last position, so the blocks a request may ever hold do not grow.
            room = min(
                self._window(r),
                r.params.max_tokens - r.num_output_tokens - 1,
                self.max_model_len - r.num_tokens - 1,
            )
            if c.method == "draft_model":
                self._keep_proposals(r, room)
                continue
            drafts = propose_ngram(r.all_token_ids, room, c.prompt_lookup_min, c.prompt_lookup_max)
            r.draft_token_ids = drafts

    def _keep_proposals(self, r: Request, room: int) -> None:
        """The draft model's proposals, cut to ``room``, and lookahead slots for the next
        ones: as many as the window allows, ending no later than the request's last position
        and the model's length (so a request never holds more blocks than its longest
        output needs)."""
        r.draft_token_ids = r.draft_token_ids[:room]
        end = min(self.max_model_len, r.num_prompt_tokens + r.params.max_tokens)
        left = end - r.num_tokens - len(r.draft_token_ids)
        r.num_lookahead_tokens = max(0, min(self._window(r), left))

    def _window(self, r: Request) -> int:
        """The most drafts ``r`` may have now (``learn`` adapts it)."""
        k = self.config.num_speculative_tokens
        return k if r.spec_window is None else min(k, r.spec_window)


def learn(r: Request, drafted: int, accepted: int) -> None:
    """Adapt ``r``'s next proposals to how its drafts fared: after a partial acceptance,
    propose one more than was accepted; after a full one, one more than this time (capped by
    the configuration); after a total rejection, sit out 1, 2, 4 ... up to
    ``MAX_BACKOFF_STEPS`` steps, then try a single draft. So a request whose text does not
    repeat itself soon decodes plainly and pays for no verification it wastes, and one that
    copies its input drafts at full length."""
    if accepted == 0:
        r.spec_backoff = min(2 * r.spec_backoff or 1, MAX_BACKOFF_STEPS)
        r.spec_skip = r.spec_backoff
        r.spec_window = 1
        return
    r.spec_backoff = 0
    r.spec_window = accepted + 1


# Longest run of steps a request sits out after its drafts failed again and again.
MAX_BACKOFF_STEPS = 16


__all__ = [
    "MAX_BACKOFF_STEPS",
    "Proposer",
    "SpeculativeConfig",
    "learn",
    "propose_ngram",
    "speculates",
]
