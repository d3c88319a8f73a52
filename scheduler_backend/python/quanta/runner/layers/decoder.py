"""The pre-norm decoder every kit family is: embedding, layers of attention and gated MLP,
final norm, LM head. A family's model file picks the options (fused products) and names the
class; its config (``quanta.families``) sets the rest.

Module and parameter names copy HF's (``model.layers.N.self_attn.q_proj``), so the loader
installs a checkpoint as it is. Projections and the MLP run once over all ``[T, hidden]``
tokens of the step; rotary cos/sin come from one table per model (``rotary.RotaryTable``).

Each layer declares what the engine's shared machinery needs: its tensor-parallel splits
(``tensor_parallel``), and whether it is the plain LLaMA layer the decode chain computes
(``decode_chain_blocker``); the products ``fuse`` builds are the quantizable ones.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from quanta.families.config import ModelConfig
from quanta.runner.attention import AttentionMetadata
from quanta.runner.decode_chain import DecodeChain
from quanta.runner.layer_ops import TorchLayerOps
from quanta.runner.layers.attention import Attention, Rope
from quanta.runner.layers.mlp import GatedMLP
from quanta.runner.layers.norms import RMSNorm
from quanta.runner.layers.rotary import RotaryTable
from quanta.runner.linear import ProjectionFactory
from quanta.runner.models.safepoints import Safepoints, walk_layers


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP; with ``sandwich_norms`` (Gemma 2) also a norm after the
    attention and one after the MLP, each before its residual add."""

    def __init__(self, config: ModelConfig, index: int, *, fused: bool = False) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.self_attn = Attention(config, index, fused=fused)
        self.mlp = GatedMLP(config, fused=fused)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def fuse(self, make: ProjectionFactory) -> int:
        return self.self_attn.fuse(make) + self.mlp.fuse(make)

    def decode_chain_blocker(self) -> str | None:
        """Why the decode chain (LLaMA's layer in C) cannot run this layer, or None."""
        if not self.self_attn.plain():
            return "its attention has options the chain does not compute"
        if self.sandwich or self.input_layernorm.offset or self.mlp.activation != "silu":
            return "its norms or MLP are not LLaMA's"
        return None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        past_rope: Rope | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block output, residual stream)``. ``x`` is the previous layer's output, added
        into ``residual`` in place; with ``residual`` None (the first layer) ``x`` is the
        stream itself."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        attn = self.self_attn(h, rope, layer_cache, meta, past_rope=past_rope)
        if not self.sandwich:
            return self.mlp(self.post_attention_layernorm(attn, residual)), residual
        h = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, *, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, fused=fused) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.rotary = RotaryTable(config)
        self.embed_scale = config.hidden_size**0.5 if config.embed_scale else None
        # Decode steps' layers in one C call where every kernel allows (``use_decode_chain``).
        self.chain: DecodeChain | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        safepoints: Safepoints | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # NOTE: HF rounds the factor to the dtype first
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = self.rotary(positions, x.dtype)
        # Hidden-cache sequences' past tokens get their rotations once per step, not per layer.
        past_rope = self.rotary(meta.hidden.past_positions, x.dtype) if meta.hidden else None
        if self.chain is not None and self.chain.takes(x, meta):
            x, residual = self.chain.run(x, rope, kv_cache, meta, safepoints)
            return self.norm(x, residual)
        residual: torch.Tensor | None = None
        for i, layer in walk_layers(self.layers, safepoints):
            x, residual = layer(x, residual, rope, kv_cache[i], meta, past_rope)
        return self.norm(x, residual)


class DecoderForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits`` projects.
    A family sets ``fused`` when its checkpoints store q/k/v and gate/up as one tensor each."""

    fused: ClassVar[bool] = False
    # Where tensor parallelism finds the token embedding (``quanta.runner.tensor_parallel``).
    embedding: ClassVar[str] = "model.embed_tokens"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, fused=self.fused)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_softcap = config.final_logit_softcapping
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse(self, make: ProjectionFactory) -> int:
        """Fuse each layer's projections once the weights are loaded (``quanta.runner.linear``);
        returns how many linears were replaced."""
        return sum(layer.fuse(make) for layer in self.model.layers)

    def use_layer_ops(self, ops: TorchLayerOps) -> None:
        """Run the layers' small operations (norms, rotary embedding, SiLU * up) through
        ``ops`` (``quanta.runner.layer_ops``)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | GatedMLP):
                module.ops = ops

    def use_decode_chain(self, chain: DecodeChain | None) -> None:
        """Run decode steps' layers through ``chain`` (``quanta.runner.decode_chain``), or
        layer by layer with None."""
        self.model.chain = chain

    def is_ignorable_weight(self, name: str) -> bool:
        """A tied head, and the rotary tables some old checkpoints saved (we recompute them)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return name.endswith("rotary_emb.inv_freq")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        safepoints: Safepoints | None = None,
    ) -> torch.Tensor:
        """Final hidden states; with ``safepoints`` the pass may stop between layers."""
        return self.model(input_ids, positions, kv_cache, meta, safepoints)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
