"""Embeddings from a decoder model: which final hidden states a request pools, and how.

A pooling request is a prefill-only request. It is scheduled like any other (the same
policies, chunking, preemption and prefix cache), but instead of sampling after its prompt it
finishes with one vector: its prompt's final hidden states (after the model's last norm)
pooled. The runner returns the sum of the rows each chunk asks for (``PoolingAsk``); the
request adds the sums up across chunks, so a prompt computed in several chunks, or computed
again after a preemption, pools the same rows once each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator


class PoolingParams(BaseModel):
    """How an embedding is made (vLLM's ``PoolerConfig`` fields): ``LAST`` takes the last
    prompt token's hidden state, the default of decoder models; ``MEAN`` averages every prompt
    token's. ``normalize`` scales the result to unit L2 norm (cosine similarity becomes a dot
    product), as vLLM does by default for embeddings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pooling_type: Literal["LAST", "MEAN"] = "LAST"
    normalize: bool = True

    @field_validator("pooling_type", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def pooled_vector(
    total: Sequence[float], num_rows: int, params: PoolingParams
) -> tuple[float, ...]:
    """The embedding from the sum of ``num_rows`` pooled hidden states: their mean, L2
    normalized when asked (a zero vector stays zero)."""
    if num_rows <= 0:
        return ()
    mean = [v / num_rows for v in total]
    if not params.normalize:
        return tuple(mean)
    norm = math.sqrt(math.fsum(v * v for v in mean))
    return tuple(mean) if norm == 0.0 else tuple(v / norm for v in mean)
