"""Mistral: LLaMA's decoder with sliding-window attention in every layer, on the kit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families import decoder
from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import FamilySpec, TensorSpec

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return model_config(**decoder.kit_fields(raw, common, "mistral"))


def hf_config(preset: ModelPreset) -> dict[str, object]:
    return decoder.hf_config(preset, "MistralForCausalLM", sliding_window=4096)


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    return decoder.tensor_specs(preset)


MISTRAL = FamilySpec(
    name="mistral",
    architecture="MistralForCausalLM",
    model="quanta.runner.models.mistral:MistralForCausalLM",
    parse_config=parse_config,
    tokens=decoder.TOKENS,
    check_preset=decoder.check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
)
