"""Model shapes Quanta can build checkpoints for.

Why presets: model weights cannot be downloaded where Quanta is developed, so tests, the demo
server and benchmarks use checkpoints made locally with random weights. A preset names one
shape; `make_checkpoint` turns it into a standard HF directory that real-checkpoint code paths
load unchanged. Tiny presets make CPU tests fast; the large ones reproduce the compute and
memory footprint of real models for benchmarks.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["opt", "llama"]

# NOTE: the size the tokenizer trainer reaches with TOKENIZER_VOCAB_TARGET on the embedded corpus
# (tests assert this). Tiny presets use it so that every model row is a real token.
TINY_VOCAB_SIZE = 512


class ModelPreset(BaseModel):
    """One decoder-only model shape, in family-neutral names.

    `intermediate_size` is OPT's `ffn_dim` or LLaMA's `intermediate_size`. Fields that only one
    family has are `None` for the other (validated), so a preset cannot describe a shape the
    family's HF config could not express.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    family: Family
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
        if self.family == "llama":
            if self.num_key_value_heads is None or self.rope_theta is None:
                raise ValueError("llama presets need num_key_value_heads and rope_theta")
            if self.rms_norm_eps is None:
                raise ValueError("llama presets need rms_norm_eps")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
            if self.word_embed_proj_dim is not None:
                raise ValueError("word_embed_proj_dim is an OPT field")
        else:
            if self.word_embed_proj_dim is None:
                raise ValueError("opt presets need word_embed_proj_dim")
            if (self.num_key_value_heads, self.rope_theta, self.rms_norm_eps) != (None,) * 3:
                raise ValueError("num_key_value_heads, rope_theta, rms_norm_eps are LLaMA fields")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """KV heads per layer (OPT is multi-head: one KV head per query head)."""
        return self.num_key_value_heads or self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameters the shape implies, counting a tied LM head once (OPT ties, LLaMA not)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.kv_heads * self.head_dim
        if self.family == "opt":
            e = self.word_embed_proj_dim or h
            attn = 2 * h * h + 2 * h * kv + 2 * h + 2 * kv  # q, k, v, out with biases
            mlp = 2 * h * f + f + h
            layer = attn + mlp + 4 * h  # two LayerNorms
            proj = 2 * e * h if e != h else 0
            return (
                v * e
                + (self.max_position_embeddings + 2) * h
                + proj
                + self.num_hidden_layers * layer
                + 2 * h
            )
        attn = 2 * h * h + 2 * h * kv
        layer = attn + 3 * h * f + 2 * h
        return 2 * v * h + self.num_hidden_layers * layer + h


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
