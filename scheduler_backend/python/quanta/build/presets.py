"""Model shapes Quanta can build checkpoints for.

Why presets: model weights cannot be downloaded where Quanta is developed, so tests, the demo
server and benchmarks use checkpoints made locally with random weights. A preset names one
shape; `make_checkpoint` turns it into a standard HF directory that real-checkpoint code paths
load unchanged. Tiny presets make CPU tests fast; the large ones reproduce the compute and
memory footprint of real models for benchmarks.
"""

from __future__ import annotations

import math
from typing import Annotated, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from quanta.families import get_family, known_family
from quanta.shape import ModelShape

# NOTE: the size the tokenizer trainer reaches with TOKENIZER_VOCAB_TARGET on the embedded corpus
# (tests assert this). Tiny presets use it so that every model row is a real token.
TINY_VOCAB_SIZE = 512


class ModelPreset(BaseModel):
    """One decoder-only model shape, in family-neutral names.

    `intermediate_size` is OPT's `ffn_dim` or LLaMA's `intermediate_size`. Fields that only one
    family has are `None` for the other (its spec's `check_preset` says so), so a preset cannot
    describe a shape the family's HF config could not express.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    family: Annotated[str, AfterValidator(known_family)]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    # LLaMA only: grouped-query attention, RoPE and RMSNorm.
    num_key_value_heads: int | None = None
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    # OPT only: embedding width (project_in/project_out exist when it differs from hidden_size).
    word_embed_proj_dim: int | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> Self:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        get_family(self.family).check_preset(self)
        return self

    @property
    def shape(self) -> ModelShape:
        """The preset's sizes in the terms the manifest, the runner and the cost model use."""
        return ModelShape(
            family=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """KV heads per layer (OPT is multi-head: one KV head per query head)."""
        return self.num_key_value_heads or self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameters the shape implies: the family's stored tensors, so a tied LM head
        (OPT's; LLaMA's is not tied) counts once."""
        return sum(math.prod(shape) for _, shape, _ in get_family(self.family).tensor_specs(self))


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="opt-tiny",
            family="opt",
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
        ),
        ModelPreset(
            name="llama-tiny",
            family="llama",
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=176,
            max_position_embeddings=512,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
        # llama-tiny with multi-head attention (as LLaMA-1/2 7B and 13B): one KV head per
        # query head, so it is offered the hidden cache, which grouped-query llama-tiny is not.
        ModelPreset(
            name="llama-tiny-mha",
            family="llama",
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=176,
            max_position_embeddings=512,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
        # The real facebook/opt-125m shape (125,239,296 parameters).
        ModelPreset(
            name="opt-125m",
            family="opt",
            vocab_size=50272,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=2048,
            word_embed_proj_dim=768,
        ),
        # A ~100M LLaMA-2-style shape with grouped-query attention. Eight layers, because the
        # untied 32000-row embedding and LM head already hold 49M parameters.
        ModelPreset(
            name="llama-100m",
            family="llama",
            vocab_size=32000,
            hidden_size=768,
            num_hidden_layers=8,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
    )
}


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    """Resolve a preset name (or pass a preset through), with the known names in the error."""
    if isinstance(preset, ModelPreset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {preset!r}; known presets: {known}") from None
