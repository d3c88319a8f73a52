"""A decoder-only model's shape, declared once for every layer that reasons about one.

The engine manifest stores it, the runner's ``ModelConfig`` and the build presets hold it (with
their family's facts beside it), the cost model's presets are made from it. It sits below all
of them and imports nothing of Quanta (pydantic only, no torch), so the cost model and the
simulator can take it too.
Field names are the manifest's (``quanta_engine.json``'s ``model`` object), which engines on
disk already hold.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelShape(BaseModel):
    """The sizes that decide a model's weights, KV cache and step time; ``family`` is a model
    family's name (its HF ``model_type``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)

    @model_validator(mode="after")
    def _kv_heads_divide_heads(self) -> Self:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> int:
        """K and V of one token over every layer (fp16: 2 bytes a value)."""
        return round(2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value)


def _mha(
    family: str, vocab: int, hidden: int, layers: int, heads: int, ffn: int, context: int
) -> ModelShape:
    """A multi-head-attention shape (one KV head per query head)."""
    return ModelShape(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=ffn,
        max_position_embeddings=context,
    )


# Published shapes (the models' own config.json) that presets and cost profiles are made of.
PUBLISHED: dict[str, ModelShape] = {
    "opt-125m": _mha("opt", 50272, 768, 12, 12, 3072, 2048),
    "opt-13b": _mha("opt", 50272, 5120, 40, 40, 20480, 2048),
    "opt-66b": _mha("opt", 50272, 9216, 64, 72, 36864, 2048),
    "opt-175b": _mha("opt", 50272, 12288, 96, 96, 49152, 2048),
    "llama-2-7b": _mha("llama", 32000, 4096, 32, 32, 11008, 4096),
}
