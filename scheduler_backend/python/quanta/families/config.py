"""The runner's record of one checkpoint's architecture, and the fields every family shares.

It lives here, beside the family specs and free of torch, because each family's parser builds
it: reading a ``config.json`` (to build, check or list a model) must not load model code.
``quanta.runner.models.config`` re-exports it for the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quanta.shape import ModelShape


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is "linear" or "llama3" ("default" means None)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of one decoder-only checkpoint, in HF's own terms.

    ``family`` is a registered family's name (its HF ``model_type``). Family-specific fields
    carry defaults so that one record type serves every family; fields that do not apply to a
    family are ignored by its model code.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None  # as written in the checkpoint; the caller picks the runtime one
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    activation_function: str = "relu"
    remove_final_layer_norm: bool = False
    # LLaMA
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def shape(self) -> ModelShape:
        """The sizes, in the terms every other layer uses (``quanta.shape``)."""
        return ModelShape(
            family=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_model_len,
        )


def common_fields(raw: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way from HF's config dicts;
    a family's parser adds its own and builds the record."""
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": int(raw["num_attention_heads"]),
        "max_model_len": int(raw.get("max_position_embeddings", 2048)),
        "eos_token_ids": _eos_token_ids(raw, generation),
        "bos_token_id": raw.get("bos_token_id"),
        "torch_dtype": str(dtype) if dtype is not None else None,
    }


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """Union of the model's and the generation config's EOS ids, in first-seen order."""
    ids: list[int] = []
    for source in (raw, generation or {}):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)
