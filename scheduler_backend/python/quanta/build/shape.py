"""The model an engine manifest records, read from a checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path

from quanta.build.manifest import EngineModel
from quanta.families import get_family
from quanta.runner.models.config import ModelConfig


def model_shape(config: ModelConfig, model_dir: str | Path) -> EngineModel:
    """``config`` (the runner's parse of ``config.json``) with the architecture it names."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    architectures = raw.get("architectures") or [get_family(config.family).architecture]
    return EngineModel(architecture=str(architectures[0]), **config.shape.model_dump())
