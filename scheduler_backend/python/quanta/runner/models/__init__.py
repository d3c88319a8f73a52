"""Our own model implementations (not transformers'), keyed by HF ``model_type``.

Every model exposes ``forward(input_ids [T], positions [T], kv_cache, meta) -> hidden [T, d]``,
``compute_logits(hidden) -> [N, vocab]``, ``tie_weights()`` and ``is_ignorable_weight(name)``.
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.runner.models.config import ModelConfig, load_model_config, parse_model_config
from quanta.runner.models.llama import LlamaForCausalLM
from quanta.runner.models.opt import OPTForCausalLM

_MODELS: dict[str, type[nn.Module]] = {"opt": OPTForCausalLM, "llama": LlamaForCausalLM}


def build_model_skeleton(config: ModelConfig) -> nn.Module:
    """The model with every parameter on the meta device: shapes only, no memory, so the
    loader can fill in each tensor straight in the target dtype and device."""
    if config.family not in _MODELS:
        raise ValueError(f"no model implementation for family {config.family!r}")
    with torch.device("meta"):
        return _MODELS[config.family](config)


__all__ = ["ModelConfig", "build_model_skeleton", "load_model_config", "parse_model_config"]
