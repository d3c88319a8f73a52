"""Request lengths: seeded samplers of (prompt tokens, output tokens) that fit a model.

The named distributions are *approximations* of published statistics (the datasets cannot be
downloaded here): independent log-normal input and output lengths with the quoted means.

=========  ============  =============  =====================================================
name       mean in/out   sigma in/out   source of the means / shape
=========  ============  =============  =====================================================
sharegpt   161 / 338     1.0 / 0.9      vLLM paper (OPT tokenizer); heavy tail, our sigma
alpaca     19 / 58       0.6 / 0.8      vLLM paper (8.4x shorter inputs, 5.8x shorter outputs)
humaneval  150 / 70      0.35 / 0.45    164 problems, signature+docstring prompts; Apt-Serve
                                        §6.2: shorter outputs, low variance in both (our means)
longbench  1500 / 300    0.35 / 0.6     LongBench summarisation clipped to OPT's 2048 tokens
                                        (Apt-Serve §6.1 fn. 5): inputs ~10x ShareGPT, outputs
                                        comparable to ShareGPT (Apt-Serve §6.2; our means)
=========  ============  =============  =====================================================

Samples are redrawn until prompt + output fits ``max_len``, so for ``longbench`` the realised
means sit below the table's.

Single lengths (``TokenCount``), for generators that build prompts from parts (the turns of a
conversation): ``LogNormalCount`` and ``QuantileCount``, an empirical distribution.
``AZURE_CONV_OUTPUT`` is the distribution of ``GeneratedTokens`` in the Azure LLM inference
trace's conversation service (one hour, 19,366 requests; mean 211, median 129, P99 601,
max 1000), measured from the trace: Azure Public Dataset (AzureLLMInferenceDataset2023),
CC BY 4.0; Patel et al., "Splitwise: Efficient generative LLM inference using phase
splitting", ISCA 2024. ``SHAREGPT_INPUT`` is the ``sharegpt`` row's input length alone.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from quanta.workloads.model import WorkloadError


class LengthSampler(Protocol):
    """Draws (prompt tokens, output tokens) that fit ``max_len`` together."""

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Independent log-normal input and output lengths with the given means."""

    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]:
        mu_in = math.log(self.mean_input) - self.sigma_input**2 / 2
        mu_out = math.log(self.mean_output) - self.sigma_output**2 / 2
        while True:
            n_in = max(1, round(rng.lognormvariate(mu_in, self.sigma_input)))
            n_out = max(1, round(rng.lognormvariate(mu_out, self.sigma_output)))
            if n_in + n_out <= max_len:
                return n_in, n_out


@dataclass(frozen=True, slots=True)
class UniformLengths:
    """Uniform integer lengths in [lo, hi] (inclusive): easy to reason about in small runs."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def __post_init__(self) -> None:
        for lo, hi in (self.prompt, self.output):
            if not 1 <= lo <= hi:
                raise WorkloadError(f"need 1 <= lo <= hi, got {lo}:{hi}")

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]:
        if self.prompt[0] + self.output[0] > max_len:
            raise WorkloadError(f"{self} cannot fit max_len={max_len}")
        while True:
            n_in, n_out = rng.randint(*self.prompt), rng.randint(*self.output)
            if n_in + n_out <= max_len:
                return n_in, n_out


class TokenCount(Protocol):
    """Draws one length in tokens (>= 1)."""

    def sample(self, rng: random.Random) -> int: ...


@dataclass(frozen=True, slots=True)
class LogNormalCount:
    """A log-normal length with the given mean."""

    mean: float
    sigma: float

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2
        return max(1, round(rng.lognormvariate(mu, self.sigma)))


@dataclass(frozen=True, slots=True)
class QuantileCount:
    """An empirical length: ``points`` are (cumulative probability, tokens), from (0, min) to
    (1, max), and a draw interpolates linearly between the two around a uniform number (the
    inverse of a piecewise-linear CDF), so a table of a trace's quantiles reproduces it."""

    points: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        probs, counts = [p for p, _ in self.points], [n for _, n in self.points]
        if len(probs) < 2 or probs[0] != 0 or probs[-1] != 1:
            raise WorkloadError("quantile points must run from probability 0 to 1")
        if probs != sorted(set(probs)) or counts != sorted(counts) or counts[0] < 1:
            raise WorkloadError("quantile points need increasing probabilities, counts >= 1")

    def sample(self, rng: random.Random) -> int:
        u = rng.random()
        probs = [p for p, _ in self.points]
        k = min(bisect.bisect_right(probs, u), len(probs) - 1)
        (p0, n0), (p1, n1) = self.points[k - 1], self.points[k]
        return round(n0 + (n1 - n0) * (u - p0) / (p1 - p0))


AZURE_CONV_OUTPUT = QuantileCount(
    (
        (0.0, 7), (0.01, 16), (0.02, 24), (0.05, 41), (0.1, 54), (0.15, 67), (0.2, 77),
        (0.25, 85), (0.3, 91), (0.35, 96), (0.4, 103), (0.45, 113), (0.5, 129), (0.55, 151),
        (0.6, 177), (0.65, 217), (0.66, 237), (0.67, 371), (0.7, 384), (0.75, 395),
        (0.8, 400), (0.85, 411), (0.9, 424), (0.95, 451), (0.98, 540), (0.99, 601),
        (1.0, 1000),
    )
)  # fmt: skip


DATASETS: Mapping[str, LengthDist] = MappingProxyType(
    {
        "sharegpt": LengthDist(161, 338, sigma_input=1.0, sigma_output=0.9),
        "alpaca": LengthDist(19, 58, sigma_input=0.6, sigma_output=0.8),
        "humaneval": LengthDist(150, 70, sigma_input=0.35, sigma_output=0.45),
        "longbench": LengthDist(1500, 300, sigma_input=0.35, sigma_output=0.6),
    }
)
SHAREGPT_INPUT = LogNormalCount(DATASETS["sharegpt"].mean_input, DATASETS["sharegpt"].sigma_input)


def length_sampler(spec: str | LengthSampler) -> LengthSampler:
    """A dataset name, ``uniform:IN_LO-IN_HI:OUT_LO-OUT_HI``, or a sampler passed through."""
    if not isinstance(spec, str):
        return spec
    if spec in DATASETS:
        return DATASETS[spec]
    if spec.startswith("uniform:"):
        try:
            _, p, o = spec.split(":")
            (a, b), (c, d) = (tuple(int(x) for x in part.split("-")) for part in (p, o))
        except ValueError:
            raise WorkloadError(f"bad length spec {spec!r}; e.g. uniform:64-128:32-64") from None
        return UniformLengths((a, b), (c, d))
    known = ", ".join(sorted(DATASETS))
    raise WorkloadError(f"unknown lengths {spec!r}; datasets: {known}, or uniform:64-128:32-64")
