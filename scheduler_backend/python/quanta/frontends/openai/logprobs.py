"""Triton's log-probability outputs as the gateway's per-token (text, logprob, alternatives).

Triton answers with ids and flat arrays (``top_log_probs`` N per token); OpenAI's formats name
tokens by their text, so every id goes through the tokenizer's ``token_text``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quanta.frontends.openai.protocol import TokenLogprobs
from quanta.frontends.triton.client import output_ids, output_list

TokenText = Callable[[int], str]


def output_logprobs(event: dict[str, Any], top: int, text: TokenText) -> TokenLogprobs:
    """The generated tokens of one Triton response with their logprobs."""
    return _with_text(
        output_ids(event),
        output_list(event, "output_log_probs"),
        output_list(event, "top_log_prob_ids"),
        output_list(event, "top_log_probs"),
        top,
        text,
    )


def prompt_logprobs(event: dict[str, Any], top: int, text: TokenText) -> TokenLogprobs:
    """The prompt's tokens with their logprobs (echo), from the response that carries them
    (else none); the first token has none: nothing predicts it."""
    ids = output_list(event, "prompt_ids")
    if not ids:
        return []
    rest = _with_text(
        ids[1:],
        output_list(event, "prompt_log_probs"),
        output_list(event, "prompt_top_log_prob_ids"),
        output_list(event, "prompt_top_log_probs"),
        top,
        text,
    )
    return [(text(ids[0]), None, None), *rest]


def _with_text(
    ids: list[int],
    values: list[float],
    alt_ids: list[int],
    alt_values: list[float],
    top: int,
    text: TokenText,
) -> TokenLogprobs:
    out: TokenLogprobs = []
    for i, (token, logprob) in enumerate(zip(ids, values, strict=True)):
        window = slice(i * top, (i + 1) * top)
        alts = zip(alt_ids[window], alt_values[window], strict=True)
        out.append((text(token), logprob, [(text(a), v) for a, v in alts]))
    return out
