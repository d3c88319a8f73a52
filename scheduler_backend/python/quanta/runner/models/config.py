"""What the runner needs from an HF ``config.json``, parsed once into a frozen record.

The runner's own model code reads only this record, never a transformers config object, so
the serving path does not import transformers and a malformed checkpoint fails at start-up
with a message naming the field, not deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Family = Literal["opt", "llama"]

SUPPORTED_FAMILIES: tuple[str, ...] = ("opt", "llama")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


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
    """Architecture of one decoder-only checkpoint (OPT or LLaMA), in HF's own terms.

    Family-specific fields carry defaults so that one record type serves both families;
    fields that do not apply to a family are ignored by its model code.
    """

    family: Family
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


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a checkpoint dir."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    raw = json.loads(config_path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, generation)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Turn HF config dicts into a ``ModelConfig``; unsupported families or RoPE types raise."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; the runner supports {SUPPORTED_FAMILIES}"
        )
    eos = _eos_token_ids(raw, generation)
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    common: dict[str, Any] = {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": int(raw["num_attention_heads"]),
        "max_model_len": int(raw.get("max_position_embeddings", 2048)),
        "eos_token_ids": eos,
        "bos_token_id": raw.get("bos_token_id"),
        "torch_dtype": str(dtype) if dtype is not None else None,
    }
    if model_type == "opt":
        return _parse_opt(raw, common)
    return _parse_llama(raw, common)


def _parse_opt(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    hidden = common["hidden_size"]
    heads = common["num_heads"]
    if hidden % heads:
        raise ValueError(f"OPT hidden_size {hidden} is not divisible by num_heads {heads}")
    return ModelConfig(
        family="opt",
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(raw.get("ffn_dim", 4 * hidden)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
        word_embed_proj_dim=int(raw.get("word_embed_proj_dim") or hidden),
        enable_bias=bool(raw.get("enable_bias", True)),
        layer_norm_elementwise_affine=bool(raw.get("layer_norm_elementwise_affine", True)),
        activation_function=str(raw.get("activation_function", "relu")),
        remove_final_layer_norm=bool(raw.get("_remove_final_layer_norm", False)),
        **common,
    )


def _parse_llama(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    heads = common["num_heads"]
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise NotImplementedError(f"LLaMA hidden_act {hidden_act!r} is not supported (only silu)")
    rope_theta, rope_scaling = _parse_rope(raw)
    return ModelConfig(
        family="llama",
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or common["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        activation_function=hidden_act,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        **common,
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Accept both layouts: transformers<5 (``rope_theta`` + ``rope_scaling``) and
    transformers>=5 (``rope_parameters`` holding ``rope_type`` and ``rope_theta``)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    original = params.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings", 8192)
    )
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """Union of the model's and the generation config's EOS ids, in first-seen order."""
    ids: list[int] = []
    for source in (raw, generation or {}):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)
