"""Phi-3: fused ``qkv_proj`` and ``gate_up_proj``, partial rotation, on the kit. Its
``longrope`` scaling (two tables picked by the sequence's length) is refused by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families import decoder
from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import FamilySpec, TensorSpec

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
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
