"""What a family builder supplies to ``quanta build``; the driver does the rest.

The driver (``quanta.build.engine_build``) validates the checkpoint against the runner's own
model (a meta-device skeleton, so names and shapes are checked without loading a weight),
then streams every tensor through ``tensor_name`` and ``convert`` into the engine's shards.
A family adds what is specific to it: configurations the runner does not serve, names that
exports write differently, and tensors to leave out.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

import torch

from quanta.runner.models.config import ModelConfig
from quanta.runner.models.loader import resolve_name


class BuildError(ValueError):
    """The checkpoint cannot be built into an engine, said in terms of the checkpoint."""


class FamilyBuilder:
    """Build steps for one model family; subclasses override what differs."""

    family: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    priority: ClassVar[int] = 0

    @property
    def name(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}"

    def check_config(self, raw: dict[str, Any], config: ModelConfig) -> None:
        """Refuse configurations the runner would misread; ``raw`` is ``config.json``."""
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise BuildError(f"quantized checkpoints ({method}) are not supported")

    def tensor_name(self, key: str, params: Collection[str]) -> str | None:
        """The runner's parameter name for a checkpoint key; None leaves the tensor out."""
        return resolve_name(key, params)

    def droppable(self, key: str, config: ModelConfig) -> bool:
        """A stored tensor the runner does not need (the driver refuses any other extra)."""
        return key.endswith("rotary_emb.inv_freq") or (
            config.tie_word_embeddings and key == "lm_head.weight"
        )

    def convert(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One tensor in the serving dtype and a dense layout the loader installs as is."""
        return tensor.to(dtype=dtype).contiguous()

    def serving_config(self, raw: dict[str, Any], dtype: str) -> dict[str, Any]:
        """``config.json`` of the engine: the checkpoint's, stating the dtype it now holds."""
        out = {k: v for k, v in raw.items() if k != "dtype"}
        out["torch_dtype"] = dtype
        return out
