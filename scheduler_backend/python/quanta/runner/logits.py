"""Logits processing before sampling: logit bias, penalties, banned tokens, and raw
log-probabilities.

Only rows whose ``ScheduledSeq.processing`` is set are touched, so a batch of plain requests
pays nothing. Every processor is a function of the row's own history and parameters, never of
its batch neighbours, so a preempted and recomputed request sees exactly the same logits.
The order is HF ``generate``'s (and vLLM's): the logit bias (HF's sequence bias), then the
repetition penalty, then the bans (min-tokens EOS, bad words); OpenAI's presence/frequency
penalties sit with the repetition penalty. Temperature, top-k, top-p and min-p follow in the
sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quanta.core.output import LogitsProcessing, ScheduledSeq, TokenLogprob


def process_logits(logits: torch.Tensor, rows: Sequence[ScheduledSeq]) -> dict[int, torch.Tensor]:
    """Apply each row's processing to ``logits`` ``[N, vocab]`` (fp32) in place.

    Returns the raw log-softmax of every row that asked for logprobs, taken before any
    processing (as vLLM's default reports them), keyed by row index.
    """
    raw: dict[int, torch.Tensor] = {}
    for i, row in enumerate(rows):
        proc = row.processing
        if proc is None:
            continue
        if proc.logprobs is not None:
            raw[i] = torch.log_softmax(logits[i], dim=-1)
        _apply(logits[i], proc)
    return raw


def token_logprob(raw: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The sampled token's raw log-probability and the ``top`` most likely tokens'."""
    return token_logprobs(raw[None], [token], top)[0]


def token_logprobs(raw: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``token_logprob`` for every row of ``raw`` ``[N, vocab]`` at once (prompt logprobs:
    hundreds of rows, where per-row calls would cost more than the LM head)."""
    index = torch.tensor(tokens, dtype=torch.long, device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, index).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(v) for v in chosen]
    values, ids = torch.topk(raw, min(top, raw.shape[-1]), dim=-1)
    return [
        TokenLogprob(v, tuple(zip(row_ids, row_values, strict=True)))
        for v, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]


def _apply(row: torch.Tensor, proc: LogitsProcessing) -> None:
    vocab = row.shape[-1]
    bias = [(t, b) for t, b in proc.logit_bias if t < vocab]
    if bias:
        ids, values = zip(*bias, strict=True)
        index = torch.tensor(ids, dtype=torch.long, device=row.device)
        row.index_add_(0, index, torch.tensor(values, dtype=row.dtype, device=row.device))
    if proc.history and proc.repetition_penalty != 1.0:
        ids = torch.tensor(
            sorted({t for t in proc.history if t < vocab}), dtype=torch.long, device=row.device
        )
        scores = row.index_select(0, ids)
        penalty = proc.repetition_penalty
        row.index_copy_(0, ids, torch.where(scores < 0, scores * penalty, scores / penalty))
    if proc.presence_penalty or proc.frequency_penalty:
        output = [t for t in proc.history[proc.num_prompt_tokens :] if t < vocab]
        if output:
            counts = torch.bincount(
                torch.tensor(output, dtype=torch.long, device=row.device), minlength=vocab
            )
            row -= proc.frequency_penalty * counts.to(row.dtype)
            row -= proc.presence_penalty * (counts > 0).to(row.dtype)
    banned = [t for t in proc.suppress if t < vocab]
    for words in proc.bad_words_ids:
        prefix = words[:-1]
        if not prefix or tuple(proc.history[len(proc.history) - len(prefix) :]) == prefix:
            banned.append(words[-1])
    banned = [t for t in banned if t < vocab]
    if banned:
        row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
