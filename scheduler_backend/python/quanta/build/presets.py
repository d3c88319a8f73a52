"""Model shapes Quanta can build checkpoints for.

Why presets: model weights cannot be downloaded where Quanta is developed, so tests, the demo
server and benchmarks use checkpoints made locally with random weights. A preset names one
shape; `make_checkpoint` turns it into a standard HF directory that real-checkpoint code paths
load unchanged. Tiny presets make CPU tests fast; the large ones reproduce the compute and
memory footprint of real models for benchmarks.
"""

from __future__ import annotations

import math
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, model_validator

from quanta.families import get_family, known_family
from quanta.families.config import RopeScaling
from quanta.shape import PUBLISHED, ModelShape

# NOTE: the size the tokenizer trainer reaches with TOKENIZER_VOCAB_TARGET on the embedded corpus
# (tests assert this). Tiny presets use it so that every model row is a real token.
TINY_VOCAB_SIZE = 512


class ModelPreset(BaseModel):
    """One model to build with random weights: its shape (``quanta.shape``, the sizes every
    layer reasons about) and the facts of its family's HF config a shape does not hold.

    Fields that only one family has are ``None`` for the other (its spec's ``check_preset``
    says so), so a preset cannot describe a model the family's HF config could not express.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape: ModelShape
    # LLaMA only: RoPE and RMSNorm.
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    # LLaMA only: RoPE's frequency scaling as the real model's config.json states it
    # (LLaMA-3.2's llama3 scaling); it changes the angles, not the cost of a step.
    rope_scaling: RopeScaling | None = None
    # OPT only: embedding width (project_in/project_out exist when it differs from hidden_size).
    word_embed_proj_dim: int | None = None
    # Kit families: the LM head is the embedding (Qwen2.5-0.5B's is; most larger models' not).
    tie_word_embeddings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _hf_named(cls, data: Any) -> Any:
        """A preset as ``quanta_preset.json`` held it before presets had a shape: its sizes
        flat, in HF's ``config.json`` names. Read as the same preset, so the checkpoints on
        disk keep matching the preset they were built from."""
        if not isinstance(data, dict) or "shape" in data or "num_hidden_layers" not in data:
            return data
        rest = dict(data)
        heads = rest.pop("num_attention_heads")
        kv_heads = rest.pop("num_key_value_heads", None)
        shape = {
            "family": rest.pop("family"),
            "vocab_size": rest.pop("vocab_size"),
            "hidden_size": rest["hidden_size"],
            "num_layers": rest.pop("num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": kv_heads or heads,
            "head_dim": rest.pop("hidden_size") // heads,
            "intermediate_size": rest.pop("intermediate_size"),
            "max_position_embeddings": rest.pop("max_position_embeddings"),
        }
        return {**rest, "shape": shape}

    @model_validator(mode="after")
    def _check_shape(self) -> Self:
        known_family(self.shape.family)
        get_family(self.family).check_preset(self)
        if self.rope_scaling is not None and self.family != "llama":
            raise ValueError("rope_scaling is a LLaMA field")
        return self

    @property
    def family(self) -> str:
        return self.shape.family

    def num_parameters(self) -> int:
        """Parameters the shape implies: the family's stored tensors, so a tied LM head
        (OPT's; LLaMA's is not tied) counts once."""
        return sum(math.prod(shape) for _, shape, _ in get_family(self.family).tensor_specs(self))


def _shape(
    family: str,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    context: int,
    head_dim: int | None = None,
) -> ModelShape:
    """A preset's shape: head_dim is hidden / heads unless the model states its own (Gemma-2-2B's
    8 heads of 256 over a hidden of 2304; Qwen3-0.6B's 16 of 128 over 1024)."""
    return ModelShape(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        intermediate_size=ffn,
        max_position_embeddings=context,
    )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="opt-tiny",
            shape=_shape("opt", TINY_VOCAB_SIZE, 64, 2, 4, 4, 256, 512),
            word_embed_proj_dim=64,
        ),
        ModelPreset(
            name="llama-tiny",
            shape=_shape("llama", TINY_VOCAB_SIZE, 64, 2, 4, 2, 176, 512),
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
        # llama-tiny with multi-head attention (as LLaMA-1/2 7B and 13B): one KV head per
        # query head, so it is offered the hidden cache, which grouped-query llama-tiny is not.
        ModelPreset(
            name="llama-tiny-mha",
            shape=_shape("llama", TINY_VOCAB_SIZE, 64, 2, 4, 4, 176, 512),
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
        # The real facebook/opt-125m shape (125,239,296 parameters).
        ModelPreset(name="opt-125m", shape=PUBLISHED["opt-125m"], word_embed_proj_dim=768),
        # A ~100M LLaMA-2-style shape with grouped-query attention. Eight layers, because the
        # untied 32000-row embedding and LM head already hold 49M parameters.
        ModelPreset(
            name="llama-100m",
            shape=_shape("llama", 32000, 768, 8, 12, 4, 2048, 2048),
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
    )
}
# The models FastServe and Apt-Serve measured and today's small and mid-size LLaMA, at their
# published sizes (the models' own config.json): `quanta bench engine --preset NAME` creates
# their random weights on the device, with no checkpoint on disk (bench/gpu/README.md).
_LLAMA3_THETA, _LLAMA3_EPS = 500000.0, 1e-5
for _preset in (
    ModelPreset(name="opt-13b", shape=PUBLISHED["opt-13b"], word_embed_proj_dim=5120),
    ModelPreset(
        name="llama-3-8b",
        shape=_shape("llama", 128256, 4096, 32, 32, 8, 14336, 8192),
        rope_theta=_LLAMA3_THETA,
        rms_norm_eps=_LLAMA3_EPS,
    ),
    ModelPreset(
        name="llama-3.2-1b",
        shape=_shape("llama", 128256, 2048, 16, 32, 8, 8192, 131072),
        rope_theta=_LLAMA3_THETA,
        rms_norm_eps=_LLAMA3_EPS,
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
    ),
):
    PRESETS[_preset.name] = _preset
# The layer kit's families, with the RMSNorm epsilon and RoPE base their real models use.
_KIT_FAMILIES: dict[str, tuple[float, float]] = {
    "qwen2": (1e-6, 1e6),
    "qwen3": (1e-6, 1e6),
    "mistral": (1e-5, 1e6),
    "phi3": (1e-5, 1e4),
    "gemma2": (1e-6, 1e4),
}
# Published shapes of real models (their config.json's sizes: family, vocab, hidden, layers,
# heads, KV heads, ffn, context, and head_dim where it is not hidden / heads) for the
# simulator, the cost model and GPU benchmarks, and whether their LM head is the embedding.
_REAL_SHAPES: dict[str, tuple[tuple[str, int, int, int, int, int, int, int, int | None], bool]] = {
    "qwen2.5-0.5b": (("qwen2", 151936, 896, 24, 14, 2, 4864, 32768, None), True),
    "qwen3-0.6b": (("qwen3", 151936, 1024, 28, 16, 8, 3072, 40960, 128), True),
    "qwen3-8b": (("qwen3", 151936, 4096, 36, 32, 8, 12288, 40960, None), False),
    "mistral-7b": (("mistral", 32000, 4096, 32, 32, 8, 14336, 32768, None), False),
    "phi3-mini": (("phi3", 32064, 3072, 32, 32, 32, 8192, 4096, None), False),
    "gemma-2-2b": (("gemma2", 256000, 2304, 26, 8, 4, 9216, 8192, 256), True),
}
# llama-100m's shape in each family (8 layers, hidden 768, 12 heads, ffn 2048, vocab 32000, so
# runs compare across families), with the family's own features: Mistral's 4096 window (the
# real one, wider than the 2048 context), Gemma 2's soft-caps and alternating layers (and its
# tied head: 25M parameters fewer), Qwen2's q/k/v biases and 2 KV heads (as Qwen2.5-0.5B),
# Qwen3's q/k norms. Phi-3-mini has no grouped-query
# attention, so its shape keeps 12 KV heads.
_BENCH_KV_HEADS = {"qwen2": 2, "mistral": 4, "phi3": 12, "gemma2": 4, "qwen3": 4}

for _family, (_eps, _theta) in _KIT_FAMILIES.items():
    PRESETS[f"{_family}-tiny"] = ModelPreset(
        name=f"{_family}-tiny",
        shape=_shape(_family, TINY_VOCAB_SIZE, 64, 2, 4, 2, 176, 512),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
for _family, _kv_heads in _BENCH_KV_HEADS.items():
    _eps, _theta = _KIT_FAMILIES[_family]
    PRESETS[f"{_family}-100m"] = ModelPreset(
        name=f"{_family}-100m",
        shape=_shape(_family, 32000, 768, 8, 12, _kv_heads, 2048, 2048),
        rope_theta=_theta,
        rms_norm_eps=_eps,
        tie_word_embeddings=_family == "gemma2",
    )
for _name, (_sizes, _tied) in _REAL_SHAPES.items():
    _eps, _theta = _KIT_FAMILIES[_sizes[0]]
    PRESETS[_name] = ModelPreset(
        name=_name,
        shape=_shape(*_sizes),
        rope_theta=_theta,
        rms_norm_eps=_eps,
        tie_word_embeddings=_tied,
    )


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    """Resolve a preset name (or pass a preset through), with the known names in the error."""
    if isinstance(preset, ModelPreset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {preset!r}; known presets: {known}") from None
