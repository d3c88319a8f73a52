"""Token sampling: greedy, or temperature / top-k / top-p / min-p with a per-token random
stream.

Each sampled token draws its noise from a generator seeded by ``(seed, output_index)`` alone,
so the token does not depend on which other requests shared the batch, and a request that was
preempted and recomputed samples exactly the tokens it would have sampled anyway.

This is the definition, a row at a time on the CPU, which draft verification
(``runner/speculative.py``) samples with; a step's rows are sampled together on the logits'
device by ``runner/device_sampler.py``, which picks the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

_MASK64 = (1 << 64) - 1


class SamplingRow(Protocol):
    """What the sampler needs of a row (``ScheduledSeq`` fits)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def output_index(self) -> int: ...


def splitmix64(x: int) -> int:
    """A well-mixed 64-bit hash, so neighbouring (seed, index) pairs get unrelated streams."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, output_index: int) -> int:
    """Generator seed of one sampled token; depends on nothing but its two arguments."""
    return splitmix64((seed * 1_000_003 + output_index) & _MASK64)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """One token id per row of ``logits`` ``[N, vocab]`` (any float dtype; picks compute in
    fp32); rows with temperature 0 are greedy."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    out = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.temperature <= 0.0]
    if len(greedy) == len(rows):  # the common case: no row to pick out
        return greedy_tokens(logits)
    if greedy:
        index = torch.tensor(greedy, dtype=torch.long, device=logits.device)
        picked = greedy_tokens(logits.index_select(0, index))
        for i, token in zip(greedy, picked, strict=True):
            out[i] = token
    seeded = [i for i, row in enumerate(rows) if row.temperature > 0.0]
    if seeded:
        cpu_logits = logits[seeded].float().cpu()
        for j, i in enumerate(seeded):
            out[i] = sample_row(cpu_logits[j], rows[i])
    return out


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first most likely token of each row, as ``argmax`` defines it.

    Why not ``argmax``: on CPU torch's ``max(dim)`` is 1.6x faster in fp32 (measured at 8-32
    rows of a 50k vocabulary) and its bf16 ``argmax`` 2x slower again than fp32's; casting to
    fp32 is exact, so the pick is the same."""
    return logits.float().max(dim=-1).indices.tolist()


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """Sample one token from fp32 CPU ``logits`` ``[vocab]`` with the row's own generator."""
    scores = filter_top_k_top_p(logits.float() / row.temperature, row.top_k, row.top_p)
    scores = filter_min_p(scores, row.min_p)
    # Gumbel-max in its exponential form: argmax(p / E) with E ~ Exp(1) samples from p.
    noise = exponential_noise(torch.empty_like(scores), row.seed, row.output_index)
    probs = torch.softmax(scores, dim=-1)
    return int((probs / noise).argmax().item())


def exponential_noise(
    out: torch.Tensor, seed: int, output_index: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Fill fp32 CPU ``out`` ``[vocab]`` with one token's Exp(1) draws: the stream of a CPU
    generator seeded with ``token_seed(seed, output_index)`` (``generator``, when given, is
    reseeded, which starts the same stream as a fresh one)."""
    if generator is None:
        generator = torch.Generator(device="cpu")
    generator.manual_seed(token_seed(seed, output_index))
    return out.exponential_(generator=generator)


def filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set scores outside the top-k (0 = off) and the top-p nucleus (1 = off) to -inf.

    The most likely token always survives, so top_k=1 or a tiny top_p reduce to greedy.
    """
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # keep the smallest prefix reaching top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def filter_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set scores whose probability is below ``min_p`` times the most likely token's to -inf
    (0 = off). After top-k and top-p, as HF's warpers run; the ratio to the most likely token
    does not depend on which others were filtered, so only top-p's choice of what to drop
    depends on the order (vLLM filters by min-p first)."""
    if min_p <= 0.0:
        return scores
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.max(), float("-inf"))
