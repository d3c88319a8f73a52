"""Gemma 2 on the kit: GeGLU, (1 + w) RMSNorms before and after each block, embeddings
scaled by sqrt(hidden), attention and final logits soft-capped, local (sliding) and global
layers alternating, attention scaled by ``query_pre_attn_scalar``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families import decoder
from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import FamilySpec, TensorSpec

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Gemma2Config's defaults where ``config.json`` leaves a key out."""
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise NotImplementedError(f"gemma2 hidden_activation {act!r} is not served")
    fields = decoder.kit_fields(raw, common, "gemma2") | {
        "activation_function": act,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
    }
    return model_config(
        **fields,
        attention_bias=bool(raw.get("attention_bias", False)),
        attn_logit_softcapping=_float(raw.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=_float(raw.get("final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=_float(raw.get("query_pre_attn_scalar", 256)),
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=True,
    )


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def hf_config(preset: ModelPreset) -> dict[str, object]:
    layers = preset.shape.num_layers
    return decoder.hf_config(
        preset,
        "Gemma2ForCausalLM",
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=preset.shape.head_dim,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        layer_types=[("sliding" if i % 2 == 0 else "full") + "_attention" for i in range(layers)],
        tie_word_embeddings=True,
    )


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    return decoder.tensor_specs(preset, sandwich=True, tied=True)


GEMMA2 = FamilySpec(
    name="gemma2",
    architecture="Gemma2ForCausalLM",
    model="quanta.runner.models.gemma2:Gemma2ForCausalLM",
    parse_config=parse_config,
    tokens=decoder.TOKENS,
    check_preset=decoder.check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
)
