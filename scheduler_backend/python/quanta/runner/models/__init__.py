"""Our own model implementations (not transformers'), keyed by HF ``model_type``.

Each family's spec (``quanta.families``) names its model class; it is imported only when a
model is built, so reading a config never loads the other families' model code.

Every model exposes ``forward(input_ids [T], positions [T], kv_cache, meta) -> hidden [T, d]``,
``compute_logits(hidden) -> [N, vocab]``, ``tie_weights()`` and ``is_ignorable_weight(name)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from quanta.families import FAMILIES
from quanta.runner.models.config import ModelConfig, load_model_config, parse_model_config


def build_model_skeleton(config: ModelConfig) -> nn.Module:
    """The model with every parameter on the meta device: shapes only, no memory, so the
    loader can fill in each tensor straight in the target dtype and device."""
    spec = FAMILIES.get(config.family)
    if spec is None:
        raise ValueError(f"no model implementation for family {config.family!r}")
    model_class = spec.model_class()
    with torch.device("meta"), _no_init():
        model: nn.Module = model_class(config)
    return model


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skip ``reset_parameters``' random init: every value is overwritten by the loader, and
    the first init op on the meta device costs ~0.9 s of one-time torch set-up (measured:
    most of a 125M model's load). transformers' ``no_init_weights`` does the same."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


__all__ = ["ModelConfig", "build_model_skeleton", "load_model_config", "parse_model_config"]
