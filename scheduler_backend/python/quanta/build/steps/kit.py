"""The families on the runner's layer kit beyond LLaMA: Qwen2/2.5, Qwen3, Mistral, Phi-3 and
Gemma 2. The runner serves every option their configs parse to; what it cannot serve, the
parser refuses by name (rope types, activations, layer types), and this refuses the rest."""

from __future__ import annotations

from typing import Any, ClassVar

from quanta.build.steps.base import BuildError, FamilyBuilder
from quanta.runner.models.config import ModelConfig


class KitBuilder(FamilyBuilder):
    """Grouped-query heads must divide evenly; the attention implementation a checkpoint
    asks for must be one the runner's attention equals (eager, or sdpa without soft-caps)."""

    eager_only: ClassVar[bool] = False

    def check_config(self, raw: dict[str, Any], config: ModelConfig) -> None:
        super().check_config(raw, config)
        if config.num_heads % config.num_kv_heads:
            raise BuildError(
                f"num_attention_heads {config.num_heads} is not a multiple of "
                f"num_key_value_heads {config.num_kv_heads}"
            )
        implementation = raw.get("attn_implementation") or raw.get("_attn_implementation")
        if self.eager_only and implementation not in (None, "eager"):
            raise BuildError(
                f"{self.family} with attn_implementation {implementation!r} is not served "
                "(its soft-capped scores are HF's eager attention's)"
            )


class Qwen2Builder(KitBuilder):
    family = "qwen2"


class Qwen3Builder(KitBuilder):
    family = "qwen3"


class MistralBuilder(KitBuilder):
    family = "mistral"


class Phi3Builder(KitBuilder):
    family = "phi3"


class Gemma2Builder(KitBuilder):
    family = "gemma2"
    eager_only = True


BUILDERS = [Qwen2Builder(), Qwen3Builder(), MistralBuilder(), Phi3Builder(), Gemma2Builder()]
