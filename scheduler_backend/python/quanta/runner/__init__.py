"""The PyTorch execution engine: weights, paged KV tiers, forward pass and sampling.

Importing this package imports torch; ``quanta.core`` and ``quanta.policies`` never do.
"""

from __future__ import annotations

from quanta.runner.model_runner import ModelRunner
from quanta.runner.models.config import ModelConfig, load_model_config

__all__ = ["ModelConfig", "ModelRunner", "load_model_config"]
