"""LLaMA 1/2/3 and lookalikes: RoPE (default, linear, llama3 scaling), RMSNorm, SwiGLU, GQA."""

from __future__ import annotations

from typing import Any

from quanta.build.steps.base import BuildError, FamilyBuilder
from quanta.runner.models.config import ModelConfig


class LlamaBuilder(FamilyBuilder):
    family = "llama"

    def check_config(self, raw: dict[str, Any], config: ModelConfig) -> None:
        super().check_config(raw, config)
        if config.num_heads % config.num_kv_heads:
            raise BuildError(
                f"num_attention_heads {config.num_heads} is not a multiple of "
                f"num_key_value_heads {config.num_kv_heads}"
            )
        if raw.get("sliding_window"):
            raise BuildError("sliding-window attention is not served (a Mistral checkpoint?)")


BUILDERS = [LlamaBuilder()]
