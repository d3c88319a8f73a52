"""What every product of the engine is, dense (``linear.py``) or quantized (``quantized.py``).

Its own module so that both kinds build on it without importing each other: ``linear.py``
picks a quantized product for a quantized weight, so ``quantized.py`` cannot import it back.
"""

from __future__ import annotations

import torch
from torch import nn


class Projection(nn.Module):
    """``y = act(x W^T + b)``, and ``add(x, r) = x W^T + b + r`` (the residual add fused where
    the kernel can); ``x`` is ``[rows, in_features]``."""

    in_features: int
    out_features: int
    activation: str

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
