"""Qwen3 (dense): per-head RMSNorm of q and k before the rotation, no biases, on the kit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families import decoder
from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import FamilySpec, TensorSpec

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return model_config(
        qk_norm=True,
        attention_bias=bool(raw.get("attention_bias", False)),
        **decoder.kit_fields(raw, common, "qwen3"),
    )


def hf_config(preset: ModelPreset) -> dict[str, object]:
    return decoder.hf_config(
        preset, "Qwen3ForCausalLM", attention_bias=False, use_sliding_window=False
    )


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    return decoder.tensor_specs(preset, qk_norm=True)


QWEN3 = FamilySpec(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    model="quanta.runner.models.qwen3:Qwen3ForCausalLM",
    parse_config=parse_config,
    tokens=decoder.TOKENS,
    check_preset=decoder.check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
)
