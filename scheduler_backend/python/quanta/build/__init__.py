"""Build steps behind `quanta make-model` / `quanta build`: presets and local checkpoints.

Importing this package is cheap: presets are plain pydantic data; torch is only imported by
`quanta.build.checkpoint`, which writes the weights.
"""

from __future__ import annotations

from quanta.build.presets import PRESETS, ModelPreset, get_preset

__all__ = ["PRESETS", "ModelPreset", "get_preset"]
