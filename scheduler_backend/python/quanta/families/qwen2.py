"""Qwen2 and Qwen2.5: LLaMA's decoder with q/k/v biases (no o_proj bias), on the layer kit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families import decoder
from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import FamilySpec, TensorSpec

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return model_config(qkv_bias=True, **decoder.kit_fields(raw, common, "qwen2"))


def hf_config(preset: ModelPreset) -> dict[str, object]:
    return decoder.hf_config(preset, "Qwen2ForCausalLM", use_sliding_window=False)


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    return decoder.tensor_specs(preset, qkv_bias=True)


QWEN2 = FamilySpec(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    model="quanta.runner.models.qwen2:Qwen2ForCausalLM",
    parse_config=parse_config,
    tokens=decoder.TOKENS,
    check_preset=decoder.check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
)
