"""Logits processing before sampling: logit bias, penalties, banned tokens, and raw
log-probabilities.

Only rows whose ``ScheduledSeq.processing`` is set are touched, so a batch of plain requests
pays nothing. Every processor is a function of the row's own history and parameters, never of
its batch neighbours, so a preempted and recomputed request sees exactly the same logits.
The order is HF ``generate``'s (and vLLM's): the logit bias (HF's sequence bias), then the
repetition penalty, then the bans (min-tokens EOS, bad words); OpenAI's presence/frequency
penalties sit with the repetition penalty. Temperature, top-k, top-p and min-p follow in the
sampler.

Each processor runs once for the whole step, over the (row, token) pairs every row names, on
the logits' device: the host only reads the rows' histories to list the pairs, and sends them
without waiting for the device (``runner/transfer.py``). The arithmetic per touched logit is
the one a per-row dense pass does, and an untouched logit is left as it is, so the result is
the same bit for bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quanta.core.output import LogitsProcessing, ScheduledSeq, TokenLogprob
from quanta.runner.transfer import to_device


@dataclass(frozen=True, slots=True)
class RawLogprobs:
    """The raw log-softmax of the rows that asked for logprobs, taken before any processing
    (as vLLM's default reports them)."""

    rows: tuple[int, ...]  # positions among the step's sampled rows
    tops: tuple[int, ...]  # most likely tokens each row asks for besides the sampled one
    values: torch.Tensor  # [len(rows), vocab] fp32, on the logits' device

    def pick(self, tokens: torch.Tensor) -> LogprobPicks:
        """The sampled tokens' log-probabilities (``tokens``: every sampled row's id, on the
        device) and each row's most likely tokens, still on the device."""
        index = to_device(self.rows, torch.long, tokens.device)
        chosen = self.values.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1)
        groups: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = []
        for top in sorted({t for t in self.tops if t > 0}):
            # NOTE: one topk per distinct count, as a row alone would run it: with ties, a
            # wider topk may order the tied ids differently.
            members = tuple(j for j, t in enumerate(self.tops) if t == top)
            part = self.values
            if len(members) < len(self.rows):
                part = part.index_select(0, to_device(members, torch.long, part.device))
            values, ids = torch.topk(part, min(top, part.shape[-1]), dim=-1)
            groups.append((members, ids, values))
        return LogprobPicks(self.rows, chosen, tuple(groups))


@dataclass(frozen=True, slots=True)
class LogprobPicks:
    """``RawLogprobs.pick``'s tensors, to be copied to the host with the sampled ids."""

    rows: tuple[int, ...]
    chosen: torch.Tensor  # [len(rows)]
    groups: tuple[tuple[tuple[int, ...], torch.Tensor, torch.Tensor], ...]  # members, ids, values

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, *(t for _, ids, values in self.groups for t in (ids, values))]

    def on_host(self, host: Sequence[torch.Tensor]) -> dict[int, TokenLogprob]:
        """Each row's ``TokenLogprob`` from host copies of ``tensors()``, by row position."""
        chosen = host[0].tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(self.rows)
        for g, (members, _, _) in enumerate(self.groups):
            ids, values = host[1 + 2 * g].tolist(), host[2 + 2 * g].tolist()
            for j, row_ids, row_values in zip(members, ids, values, strict=True):
                tops[j] = tuple(zip(row_ids, row_values, strict=True))
        return {
            row: TokenLogprob(value, top)
            for row, value, top in zip(self.rows, chosen, tops, strict=True)
        }


def process_logits(logits: torch.Tensor, rows: Sequence[ScheduledSeq]) -> RawLogprobs | None:
    """Apply each row's processing to ``logits`` ``[N, vocab]`` (fp32) in place.

    Returns the raw log-softmax of the rows that asked for logprobs, or None if none did.
    """
    processed = [(i, row.processing) for i, row in enumerate(rows) if row.processing is not None]
    if not processed:
        return None
    edits = _Edits(logits.shape[-1])
    asked: list[tuple[int, int]] = []
    for i, proc in processed:
        if proc.logprobs is not None:
            asked.append((i, proc.logprobs))
        edits.add(i, proc)
    raw = None
    if asked:
        index = to_device([i for i, _ in asked], torch.long, logits.device)
        raw = RawLogprobs(
            tuple(i for i, _ in asked),
            tuple(top for _, top in asked),
            torch.log_softmax(logits.index_select(0, index), dim=-1),
        )
    edits.apply(logits)
    return raw


def token_logprobs(raw: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The raw log-probability of ``tokens[i]`` in row ``i`` of ``raw`` ``[N, vocab]``, and
    the ``top`` most likely tokens', for every row at once (prompt logprobs: hundreds of rows,
    where per-row calls would cost more than the LM head)."""
    index = torch.tensor(tokens, dtype=torch.long, device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, index).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(v) for v in chosen]
    values, ids = torch.topk(raw, min(top, raw.shape[-1]), dim=-1)
    return [
        TokenLogprob(v, tuple(zip(row_ids, row_values, strict=True)))
        for v, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]


class _Pairs:
    """(row, token) pairs, each with one value per column."""

    __slots__ = ("rows", "tokens", "values")

    def __init__(self, columns: int) -> None:
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.values: list[list[float]] = [[] for _ in range(columns)]

    def add(self, row: int, token: int, *values: float) -> None:
        self.rows.append(row)
        self.tokens.append(token)
        for column, value in zip(self.values, values, strict=True):
            column.append(value)

    def at(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs as an index of ``[N, vocab]`` logits (one copy for both halves)."""
        flat = to_device(self.rows + self.tokens, torch.long, device)
        return flat[: len(self.rows)], flat[len(self.rows) :]

    def column(self, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return to_device(self.values[k], dtype, device)


class _Edits:
    """What each processor changes over a step's rows, listed on the host."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.bias = _Pairs(1)  # value added
        self.repeat = _Pairs(1)  # repetition penalty
        self.seen = _Pairs(3)  # count in the output, frequency and presence penalties
        self.banned = _Pairs(0)

    def add(self, i: int, proc: LogitsProcessing) -> None:
        vocab = self.vocab
        for t, b in proc.logit_bias:
            if t < vocab:
                self.bias.add(i, t, b)
        if proc.history and proc.repetition_penalty != 1.0:
            for t in sorted({t for t in proc.history if t < vocab}):
                self.repeat.add(i, t, proc.repetition_penalty)
        if proc.presence_penalty or proc.frequency_penalty:
            counts = Counter(t for t in proc.history[proc.num_prompt_tokens :] if t < vocab)
            for t, n in counts.items():
                self.seen.add(i, t, n, proc.frequency_penalty, proc.presence_penalty)
        banned = list(proc.suppress)
        for words in proc.bad_words_ids:
            prefix = words[:-1]
            if not prefix or tuple(proc.history[len(proc.history) - len(prefix) :]) == prefix:
                banned.append(words[-1])
        for t in banned:
            if t < vocab:
                self.banned.add(i, t)

    def apply(self, logits: torch.Tensor) -> None:
        """Each processor in turn over all its pairs, so each row sees them in the order a
        pass over that row alone would apply them."""
        device, dtype = logits.device, logits.dtype
        if self.bias.rows:
            at = self.bias.at(device)
            logits.index_put_(at, logits[at] + self.bias.column(0, dtype, device))
        if self.repeat.rows:
            at = self.repeat.at(device)
            scores, penalty = logits[at], self.repeat.column(0, dtype, device)
            logits.index_put_(at, torch.where(scores < 0, scores * penalty, scores / penalty))
        if self.seen.rows:
            at = self.seen.at(device)
            counts, frequency, presence = (self.seen.column(k, dtype, device) for k in range(3))
            # as a dense pass: minus frequency * count, then minus presence * (count > 0)
            logits.index_put_(at, logits[at] - frequency * counts - presence)
        if self.banned.rows:
            at = self.banned.at(device)
            logits.index_put_(at, logits.new_full((len(self.banned.rows),), float("-inf")))
