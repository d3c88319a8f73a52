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
    """RoPE frequency scaling; ``rope_type`` is "linear", "llama3", "yarn" or "longrope"
    ("default" means None). The fields are HF's names; each type reads its own."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn and longrope
    truncate: bool = True
    # longrope: per-frequency divisors of the rotation, the long ones for requests that
    # outgrow ``original_max_position_embeddings`` (``quanta.runner.layers.rotary``)
    long_factor: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of one decoder-only checkpoint: its shape (``quanta.shape``, the sizes
    every layer reasons about) and the facts of its family's HF config a shape does not hold.

    The shape's sizes read as the record's own (``config.num_layers``), as the model code
    reads them. Family-specific facts carry defaults so that one record type serves every
    family; facts that do not apply to a family are ignored by its model code.
    """

    shape: ModelShape
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
    # The layer kit's options (``quanta.runner.layers``); the defaults are LLaMA's.
    qkv_bias: bool = False  # q/k/v biases without an o_proj bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation (Qwen3)
    partial_rotary_factor: float = 1.0  # the share of each head the rotation turns
    sliding_windows: tuple[int, ...] = ()  # per layer; 0 (or none given) is full attention
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma 2)
    norm_offset: float = 0.0  # RMSNorm scales by ``offset + weight`` (Gemma's is 1)
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma 2)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)

    def sliding_window(self, layer: int) -> int:
        """Layer ``layer``'s attention window in tokens, 0 for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def family(self) -> str:
        return self.shape.family

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def num_heads(self) -> int:
        return self.shape.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.shape.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.shape.intermediate_size

    @property
    def max_model_len(self) -> int:
        """The context length: the shape's ``max_position_embeddings``."""
        return self.shape.max_position_embeddings


_SIZES = frozenset(ModelShape.model_fields)


def model_config(**fields: Any) -> ModelConfig:
    """A ``ModelConfig`` from one flat set of fields, as a family's parser gathers them: the
    shape's sizes (``quanta.shape``'s names) and the family's facts beside them."""
    sizes = {k: v for k, v in fields.items() if k in _SIZES}
    facts = {k: v for k, v in fields.items() if k not in _SIZES}
    return ModelConfig(shape=ModelShape(**sizes), **facts)


def common_fields(raw: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way from HF's config dicts;
    a family's parser adds its own and builds the record (``model_config``)."""
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": int(raw["num_attention_heads"]),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
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
