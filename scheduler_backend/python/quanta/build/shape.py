"""The architecture summary an engine manifest records, read from a checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path

from quanta.build.manifest import ModelShape
from quanta.families import get_family
from quanta.runner.models.config import ModelConfig

# Manifest names that differ from the runner's (``ModelConfig``) ones.
_RENAMED = {"max_position_embeddings": "max_model_len"}


def model_shape(config: ModelConfig, model_dir: str | Path) -> ModelShape:
    """``config`` (the runner's parse of ``config.json``) in the manifest's terms."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    architectures = raw.get("architectures") or [get_family(config.family).architecture]
    fields = {
        name: getattr(config, _RENAMED.get(name, name))
        for name in ModelShape.model_fields
        if name != "architecture"
    }
    return ModelShape(architecture=str(architectures[0]), **fields)
