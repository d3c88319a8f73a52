"""The architecture summary an engine manifest records, read from a checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path

from quanta.build.manifest import ModelShape
from quanta.runner.models.config import ModelConfig


def model_shape(config: ModelConfig, model_dir: str | Path) -> ModelShape:
    """``config`` (the runner's parse of ``config.json``) in the manifest's terms."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    architectures = raw.get("architectures") or [f"{config.family.upper()}ForCausalLM"]
    return ModelShape(
        family=config.family,
        architecture=str(architectures[0]),
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_model_len,
    )
