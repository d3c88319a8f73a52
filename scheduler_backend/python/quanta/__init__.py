"""Quanta: an LLM serving backend with preemptive, fair and SLO-aware in-flight batching.

``quanta.LLM`` is loaded lazily so that ``import quanta.core`` never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.core.pooling import PoolingParams
from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.structured import StructuredOutput

if TYPE_CHECKING:
    from quanta.frontends.offline import LLM, EmbeddingResult, GenerationResult

__all__ = [
    "LLM",
    "EmbeddingResult",
    "GenerationResult",
    "PoolingParams",
    "RequestMetadata",
    "SamplingParams",
    "StructuredOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "EmbeddingResult", "GenerationResult"):
        from quanta.frontends import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'quanta' has no attribute {name!r}")
