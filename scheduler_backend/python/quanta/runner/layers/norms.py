"""RMSNorm (LLaMA's and Gemma's) and LayerNorm (OPT's), with the previous block's residual
add fused in.

Layers pass ``(output, residual)`` as vLLM's do: each norm first adds the previous block's
output into the residual stream, so the add and the norm are one operation
(``quanta.runner.layer_ops``, native where it runs). Gemma scales by ``1 + weight`` and casts
after the scale, as HF does; the layer ops have both sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.runner.layer_ops import TorchLayerOps


class RMSNorm(nn.Module):
    """``weight * normalise(x)``, or with ``residual``: ``residual += x`` in place, then
    ``weight * normalise(residual)``. ``offset`` 1 is Gemma's ``(1 + weight)``."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.ops: TorchLayerOps = TorchLayerOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.rms_norm(x, residual, self.weight, self.eps, self.offset)


class LayerNorm(nn.Module):
    """``weight * standardise(x) + bias`` (OPT's), with the same residual protocol as
    ``RMSNorm``: given ``residual``, ``residual += x`` in place first. ``affine`` False has
    neither weight nor bias (HF's ``layer_norm_elementwise_affine``); ``eps`` is torch's and
    HF's default."""

    def __init__(self, dim: int, eps: float = 1e-5, *, affine: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None
        self.ops: TorchLayerOps = TorchLayerOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.layer_norm(x, residual, self.weight, self.bias, self.eps)
