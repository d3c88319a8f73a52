"""Verification of speculative drafts: the accepted prefix and the token that follows it.

A seq with k drafts has k + 1 rows of logits: row i predicts the token after draft i (row 0:
after the last real token). Each row is sampled exactly as plain decoding samples that output
position (the same temperature, top-k, top-p and min-p, and the random stream of the request's seed
and the position), and drafts are accepted while each equals its row's token; the first row
that disagrees gives the next token, and when every draft is accepted the last row gives one
more. So the output is token for token the one plain decoding gives, greedy and seeded alike,
whatever was proposed, and however many drafts a step verified.

This is rejection sampling for a proposer that puts all its mass on one token (prompt lookup
does): a draft d is accepted with probability p(d), the target's probability, and a refused
position's token follows p with d's mass removed and renormalized (Leviathan et al., 2023;
Chen et al., 2023), since the Gumbel-max draw behind ``sample_row`` picks d exactly with
probability p(d) and otherwise picks from the rest in proportion. Each position's distribution
is therefore the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.runner.sampler import SamplingRow, sample


@dataclass(frozen=True, slots=True)
class _Position:
    """A ``SamplingRow`` for output position ``output_index`` of the same request."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    output_index: int


def verify(logits: torch.Tensor, drafts: tuple[int, ...], row: SamplingRow) -> tuple[int, int]:
    """(drafts accepted, the token after them) from ``logits`` ``[len(drafts) + 1, vocab]``."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(drafts)} drafts")
    positions = [
        _Position(row.temperature, row.top_p, row.top_k, row.min_p, row.seed, row.output_index + i)
        for i in range(len(drafts) + 1)
    ]
    tokens = sample(logits, positions)
    n = 0
    while n < len(drafts) and drafts[n] == tokens[n]:
        n += 1
    return n, tokens[n]
