"""Sampling a whole step's rows at once, on the logits' device.

``runner/sampler.py`` defines what a row samples; this module samples every row of a step
together with the same arithmetic, as tensor operations over all rows with each row's
temperature, top-k, top-p and min-p in device tensors (no loop over rows). On the CPU the
token is the per-row sampler's bit for bit (``tests/runner/test_device_sampler.py`` holds
them together over random logits, ties and parameters). On a GPU the arithmetic is the same
but its softmaxes round differently, so a row whose two best candidates lie within float
rounding of each other could pick the other one (the top-p cumulative sum is taken in fp64
there, so the nucleus' edge moves no further than the softmax's rounding), and so could a
row whose scores tie at the nucleus' edge, which the GPU's sort may order differently.

Only the sampled ids, and the log-probabilities a request asked for, leave the device, through
pinned memory and an event (``SampledTokens``): the host queues the step without waiting and
waits only where it reads the ids. The ids stay on the device too, for a next step that
reads them there.

The random streams. A sampled row's noise is the stream of a CPU ``torch.Generator`` seeded
by ``(seed, output_index)`` (``sampler.exponential_noise``), which keeps every seeded request's
tokens as they were. Torch draws it from a Mersenne twister, one element at a time, which a
GPU cannot reproduce cheaply; it depends on nothing the step computes, so the host draws it on
worker threads while the device runs the step's forward pass and LM head, into pinned
memory that is copied over without blocking. It is the one host cost that grows with the
vocabulary: 0.8-1.0 / 3.0-4.1 / 3.6-4.8 ms a row at a vocabulary of 32k / 128k / 152k on
one core of the 2-core development machine (23-32 ns an element), spread over the worker
threads (torch releases the GIL while it draws). Greedy rows draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from quanta.core.output import TokenLogprob
from quanta.runner.logits import LogprobPicks, RawLogprobs
from quanta.runner.sampler import SamplingRow, exponential_noise
from quanta.runner.transfer import HostCopies, to_device


class PendingNoise:
    """The sampled rows' noise ``[rows, vocab]`` (fp32), being drawn on the host."""

    def __init__(self, buffer: torch.Tensor, jobs: list[Future[None]]) -> None:
        self._buffer = buffer
        self._jobs = jobs

    def on(self, device: torch.device) -> torch.Tensor:
        """The noise on ``device``, once drawn; the copy does not block the host."""
        for job in self._jobs:
            job.result()
        if device.type != "cuda":
            return self._buffer.to(device)
        return self._buffer.to(device, non_blocking=True)


class SampledTokens:
    """A step's sampled ids: ``ids`` on the device at once, ``tokens()`` on the host once
    the copy has landed (at once on a CPU device)."""

    def __init__(self, ids: torch.Tensor, logprobs: LogprobPicks | None = None) -> None:
        self.ids = ids  # [rows] int64, on the logits' device
        self._picks = logprobs
        self._copies = HostCopies([ids, *(logprobs.tensors() if logprobs else ())])

    def ready(self) -> bool:
        """Whether ``tokens()`` would return without waiting for the device."""
        return self._copies.ready()

    def tokens(self) -> list[int]:
        return self._copies.wait()[0].tolist()

    def logprobs(self) -> dict[int, TokenLogprob]:
        """The asked rows' log-probabilities, by row position."""
        if self._picks is None:
            return {}
        return self._picks.on_host(self._copies.wait()[1:])


class DeviceSampler:
    """Draws the noise of a step's sampled rows on worker threads (started on first use)
    and samples on the logits' device."""

    def __init__(self, workers: int | None = None) -> None:
        """``workers``: threads drawing noise; by default torch's thread count (what the
        engine was given), at most 8, read when the first noise is drawn."""
        self._threads = workers or 0
        self._pool: ThreadPoolExecutor | None = None

    def start(
        self, rows: Sequence[SamplingRow], vocab: int, device: torch.device
    ) -> PendingNoise | None:
        """Begin drawing the noise of ``rows``' sampled (temperature > 0) rows, in order;
        None when every row is greedy."""
        sampled = [row for row in rows if row.temperature > 0.0]
        if not sampled:
            return None
        buffer = torch.empty(
            (len(sampled), vocab), dtype=torch.float32, pin_memory=device.type == "cuda"
        )
        if self._pool is None:
            self._threads = self._threads or max(1, min(8, torch.get_num_threads()))
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="sampling-noise")
        shares = min(self._threads, len(sampled))
        jobs = [
            self._pool.submit(_draw, buffer, sampled, range(k, len(sampled), shares))
            for k in range(shares)
        ]
        return PendingNoise(buffer, jobs)

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        noise: PendingNoise | None,
        raw: RawLogprobs | None = None,
    ) -> SampledTokens:
        """Every row's token (``noise`` from ``start(rows, ...)``), and the log-probabilities
        of the rows in ``raw``."""
        ids = sample_tokens(logits, rows, None if noise is None else noise.on(logits.device))
        return SampledTokens(ids, None if raw is None else raw.pick(ids))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _draw(buffer: torch.Tensor, rows: Sequence[SamplingRow], share: range) -> None:
    generator = torch.Generator(device="cpu")
    # inference mode is per thread, and a buffer made under it is written only under it
    with torch.inference_mode():
        for j in share:
            exponential_noise(buffer[j], rows[j].seed, rows[j].output_index, generator)


def sample_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[N, vocab]`` (any float dtype), as an int64
    tensor on its device; ``noise`` holds the sampled (temperature > 0) rows' draws, in
    order, on the same device. Rows with temperature 0 are greedy."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    sampled = [i for i, row in enumerate(rows) if row.temperature > 0.0]
    if not sampled:
        return greedy_ids(logits)
    vocab = logits.shape[-1]
    if noise is None or tuple(noise.shape) != (len(sampled), vocab):
        shape = None if noise is None else tuple(noise.shape)
        raise ValueError(
            f"{len(sampled)} sampled rows of {vocab} need noise of that shape, got {shape}"
        )
    params = _RowParams.of([rows[i] for i in sampled], vocab, logits.device)
    if len(sampled) == len(rows):
        return _sample_rows(logits, params, noise)
    index = to_device(sampled, torch.long, logits.device)
    picked = _sample_rows(logits.index_select(0, index), params, noise)
    return greedy_ids(logits).index_copy_(0, index, picked)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The first most likely token of each row (``sampler.greedy_tokens``, on the device)."""
    return logits.float().max(dim=-1).indices


@dataclass(frozen=True, slots=True)
class _RowParams:
    """The sampled rows' parameters on the device (``[rows, 1]`` each, to broadcast over the
    vocabulary), and which filters any row uses, known on the host."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # int64; rows without top-k hold 1 and are masked by top_k_on
    top_k_on: torch.Tensor  # bool
    top_p: torch.Tensor
    min_p: torch.Tensor
    max_top_k: int  # 0: no row uses top-k
    top_p_rows: list[int]  # the rows that use top-p
    top_p_index: torch.Tensor | None  # top_p_rows on the device; None when they are all
    any_min_p: bool

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> _RowParams:
        top_k = [row.top_k if 0 < row.top_k < vocab else 0 for row in rows]
        # fp32, as the per-row sampler's Python floats are rounded when they meet fp32 scores;
        # top-k counts are exact in fp32 below 2**24
        packed = to_device(
            [
                [row.temperature for row in rows],
                [float(k) for k in top_k],
                [row.top_p for row in rows],
                [row.min_p for row in rows],
            ],
            torch.float32,
            device,
        ).unsqueeze(-1)
        k = packed[1].long()
        top_p_rows = [j for j, row in enumerate(rows) if row.top_p < 1.0]
        top_p_index = None
        if 0 < len(top_p_rows) < len(rows):
            top_p_index = to_device(top_p_rows, torch.long, device)
        return cls(
            temperature=packed[0],
            top_k=k.clamp(min=1),
            top_k_on=k > 0,
            top_p=packed[2],
            min_p=packed[3],
            max_top_k=max(top_k),
            top_p_rows=top_p_rows,
            top_p_index=top_p_index,
            any_min_p=any(row.min_p > 0.0 for row in rows),
        )


_NEG_INF = float("-inf")


def _sample_rows(logits: torch.Tensor, p: _RowParams, noise: torch.Tensor) -> torch.Tensor:
    """``sampler.sample_row`` over every row at once: temperature, top-k, top-p, min-p, then
    the exponential-race pick ``argmax(probs / noise)``."""
    scores = logits.float() / p.temperature
    if p.max_top_k:
        kth = torch.topk(scores, p.max_top_k, dim=-1).values.gather(1, p.top_k - 1)
        scores = scores.masked_fill((scores < kth) & p.top_k_on, _NEG_INF)
    if p.top_p_rows:
        if p.top_p_index is None:
            scores = scores.masked_fill(_outside_nucleus(scores, p.top_p), _NEG_INF)
        else:  # sort only the rows that use top-p: the sort is the sampler's costliest step
            part = scores.index_select(0, p.top_p_index)
            drop = _outside_nucleus(part, p.top_p.index_select(0, p.top_p_index))
            scores.index_copy_(0, p.top_p_index, part.masked_fill(drop, _NEG_INF))
    if p.any_min_p:
        probs = torch.softmax(scores, dim=-1)
        floor = p.min_p * probs.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(probs < floor, _NEG_INF)
    probs = torch.softmax(scores, dim=-1)
    return (probs / noise).argmax(dim=-1)


def _outside_nucleus(
    scores: torch.Tensor, top_p: torch.Tensor, wide: bool | None = None
) -> torch.Tensor:
    """Where ``scores`` lie outside each row's top-p nucleus: past the smallest prefix of
    the most likely tokens whose probability reaches ``top_p`` (``sampler.filter_top_k_top_p``).
    ``wide``: add the probabilities up in fp64 (by default off the CPU)."""
    # NOTE: which of two tied tokens at the nucleus' edge is dropped follows the order the
    # sort leaves ties in: the per-row sampler's unstable CPU sort, which sorts each row of a
    # batch the same way; a GPU's sort may leave ties in another order.
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # The CPU's cumsum adds in fp64 and rounds each sum to fp32; fp64 on a GPU stays that close.
    if wide is None:
        wide = scores.device.type != "cpu"
    mass = torch.cumsum(probs, dim=-1, dtype=torch.float64 if wide else None).float()
    mass_before = mass - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[:, 0] = False  # the most likely token always survives
    return torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
