"""Phi-3: fused ``qkv_proj`` and ``gate_up_proj``, partial rotation, on the kit, and its
``longrope`` scaling (Phi-3-mini-128k, Phi-3.5-mini: long or short rotation factors picked by
each request's length, ``quanta.runner.layers.rotary``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families import decoder
from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import FamilySpec, TensorSpec

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


# Phi3Config's pretraining context where a config.json omits it.
ORIGINAL_CONTEXT = 4096
# Phi3Config's older names for longrope.
LONGROPE_ALIASES = ("su", "yarn")


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    raw = {"original_max_position_embeddings": ORIGINAL_CONTEXT} | raw
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params:  # NOTE: the key ``decoder.parse_rope`` reads first
            if params.get("rope_type", params.get("type")) in LONGROPE_ALIASES:
                raw = raw | {key: {**params, "rope_type": "longrope"}}
            break
    return model_config(**decoder.kit_fields(raw, common, "phi3"))


def hf_config(preset: ModelPreset) -> dict[str, object]:
    return decoder.hf_config(
        preset,
        "Phi3ForCausalLM",
        original_max_position_embeddings=preset.shape.max_position_embeddings,
        sliding_window=None,
    )


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    return decoder.tensor_specs(preset, fused=True)


PHI3 = FamilySpec(
    name="phi3",
    architecture="Phi3ForCausalLM",
    model="quanta.runner.models.phi3:Phi3ForCausalLM",
    parse_config=parse_config,
    tokens=decoder.TOKENS,
    check_preset=decoder.check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
)
