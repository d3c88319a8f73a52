"""The MLPs: gated, ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU) or tanh-GELU (GeGLU),
and plain, ``down(act(up(x)))`` with biases (OPT's ``fc2(relu(fc1(x)))``).

Checkpoints store gate and up as two linears (LLaMA, Qwen, Mistral, Gemma) or one
``gate_up_proj`` (Phi-3); either way ``fuse`` leaves one product whose first half is the gate.
OPT stores its two linears on the layer itself (``fc1``, ``fc2``), so the plain MLP is made
from them when the layer fuses (``MLP.fused``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quanta.families.config import ModelConfig
from quanta.runner.layer_ops import TorchLayerOps
from quanta.runner.layers.parallel import Split
from quanta.runner.linear import ProjectionFactory, fusable_activation

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
        return self.down_proj(self.ops.gelu_tanh_mul(gate_up))


# The plain MLP's activations (HF's names), each as HF computes it.
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def check_plain_activation(name: str) -> None:
    """Refuse, when the model is built, an activation the plain MLP does not compute."""
    if name not in PLAIN_ACTIVATIONS:
        raise NotImplementedError(
            f"MLP activation {name!r} is not served; served: {tuple(PLAIN_ACTIVATIONS)}"
        )


class MLP(nn.Module):
    """``down_proj(act(up_proj(x)))``: two products, the activation riding on the first
    where its kernel computes it (ReLU)."""

    def __init__(self, up_proj: nn.Module, down_proj: nn.Module, activation: str) -> None:
        super().__init__()
        self.up_proj = up_proj
        self.down_proj = down_proj
        self.activation = activation
        self.fused_activation = fusable_activation(activation) != "none"  # as ``fused`` made it

    @classmethod
    def fused(cls, make: ProjectionFactory, up: nn.Linear, down: nn.Linear, activation: str) -> MLP:
        """The MLP of a layer's two loaded (and, under tensor parallelism, cut) linears."""
        return cls(make([up], fusable_activation(activation)), make([down]), activation)

    def tensor_parallel(self) -> dict[str, Split]:
        """Only its down product's all-reduce: the layer cut both linears before they were
        fused (``DecoderLayer.tensor_parallel``)."""
        return {"down_proj": Split.rows(self.down_proj.in_features)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(x)`` (the residual add is the next norm's)."""
        h = self.up_proj(x)
        if not self.fused_activation:
            h = PLAIN_ACTIVATIONS[self.activation](h)
        return self.down_proj(h)
