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
"""

from __future__ import annotations

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


DATASETS: Mapping[str, LengthDist] = MappingProxyType(
    {
        "sharegpt": LengthDist(161, 338, sigma_input=1.0, sigma_output=0.9),
        "alpaca": LengthDist(19, 58, sigma_input=0.6, sigma_output=0.8),
        "humaneval": LengthDist(150, 70, sigma_input=0.35, sigma_output=0.45),
        "longbench": LengthDist(1500, 300, sigma_input=0.35, sigma_output=0.6),
    }
)


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
