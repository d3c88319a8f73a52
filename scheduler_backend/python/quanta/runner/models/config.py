"""What the runner needs from an HF ``config.json``, parsed once into a frozen record.

The runner's own model code reads only this record, never a transformers config object, so
the serving path does not import transformers and a malformed checkpoint fails at start-up
with a message naming the field, not deep inside a forward pass. Each family's part of the
parse is its spec's ``parse_config`` (``quanta.families``); the record itself lives there too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quanta.families import FAMILIES, family_names
from quanta.families.config import ModelConfig, RopeScaling, common_fields


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a checkpoint dir."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    raw = json.loads(config_path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, generation)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Turn HF config dicts into a ``ModelConfig``; unsupported families or RoPE types raise."""
    model_type = raw.get("model_type")
    spec = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; the runner supports {family_names()}"
        )
    return spec.parse_config(raw, common_fields(raw, generation))


__all__ = ["ModelConfig", "RopeScaling", "load_model_config", "parse_model_config"]
