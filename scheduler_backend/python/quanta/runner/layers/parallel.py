"""How a layer's linear splits under tensor parallelism, declared by the layer itself.

A layer's ``tensor_parallel()`` maps each of its ``nn.Linear`` attributes to a ``Split``;
``quanta.runner.tensor_parallel.shard`` applies them, so sharding knows no family. A column
split keeps this rank's share of every segment of the output features (a fused q/k/v or
gate/up product is two or three segments, each split on its own); a row split keeps its share
of the input features and is followed by one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Split:
    kind: Literal["columns", "rows"]
    segments: tuple[int, ...]  # output features per fused part (columns) or input width (rows)

    @classmethod
    def columns(cls, *segments: int) -> Split:
        return cls("columns", segments)

    @classmethod
    def rows(cls, width: int) -> Split:
        return cls("rows", (width,))
