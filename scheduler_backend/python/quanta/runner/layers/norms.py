"""RMSNorm, LLaMA's and Gemma's, with the previous block's residual add fused in.

Layers pass ``(output, residual)`` as vLLM's do: each norm first adds the previous block's
output into the residual stream, so the add and the norm are one operation
(``quanta.runner.layer_ops``, native where it runs). Gemma scales by ``1 + weight`` and casts
after the scale; it keeps the torch sequence HF runs, since the native kernel has LLaMA's.
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
        if not self.offset:
            return self.ops.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)
