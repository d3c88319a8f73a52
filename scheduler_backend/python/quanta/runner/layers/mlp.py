"""The gated MLP: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU) or tanh-GELU (GeGLU).

Checkpoints store gate and up as two linears (LLaMA, Qwen, Mistral, Gemma) or one
``gate_up_proj`` (Phi-3); either way ``fuse`` leaves one product whose first half is the gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quanta.families.config import ModelConfig
from quanta.runner.layer_ops import TorchLayerOps
from quanta.runner.layers.parallel import Split
from quanta.runner.linear import ProjectionFactory

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, *, fused: bool = False) -> None:
        super().__init__()
        if config.activation_function not in ACTIVATIONS:
            raise NotImplementedError(
                f"MLP activation {config.activation_function!r} is not served; "
                f"served: {ACTIVATIONS}"
            )
        dim, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.inner = inner
        self.activation = config.activation_function
        self.fused = fused
        if fused:
            self.gate_up_proj: nn.Module | None = nn.Linear(dim, 2 * inner, bias=bias)
        else:
            self.gate_proj = nn.Linear(dim, inner, bias=bias)
            self.up_proj = nn.Linear(dim, inner, bias=bias)
            self.gate_up_proj = None
        self.down_proj: nn.Module = nn.Linear(inner, dim, bias=bias)
        self.ops: TorchLayerOps = TorchLayerOps()

    def tensor_parallel(self) -> dict[str, Split]:
        """Gate and up split by columns (the fused product's halves each), down by rows."""
        inner = self.inner
        if self.fused:
            return {"gate_up_proj": Split.columns(inner, inner), "down_proj": Split.rows(inner)}
        return {
            "gate_proj": Split.columns(inner),
            "up_proj": Split.columns(inner),
            "down_proj": Split.rows(inner),
        }

    def fuse(self, make: ProjectionFactory) -> int:
        if self.fused:
            self.gate_up_proj = make([self.gate_up_proj])  # type: ignore[list-item]
        else:
            self.gate_up_proj = make([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj
        self.down_proj = make([self.down_proj])  # type: ignore[list-item]
        return 3 - int(self.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(x)`` (the residual add is the next norm's)."""
        assert self.gate_up_proj is not None, "call fuse() after loading the weights"
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            return self.down_proj(self.ops.silu_mul(gate_up))
        inner = gate_up.shape[1] // 2
        gated = F.gelu(gate_up[:, :inner], approximate="tanh") * gate_up[:, inner:]
        return self.down_proj(gated)
