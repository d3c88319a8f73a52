"""LLaMA (RMSNorm, rotary positions, SwiGLU, grouped-query attention) for packed batches.

Module and parameter names copy HF's ``LlamaForCausalLM``.  Projections and the MLP run once
over all ``[T, hidden]`` tokens of the step; rotary cos/sin come from a table of every
position computed as HF computes them, so a prefill chunk or a decode token gets exactly the
angles it would get in a full-sequence forward.

Layers pass ``(output, residual)`` as vLLM's do: each RMSNorm first adds the previous block's
output into the residual stream, so the add and the norm are one operation
(``quanta.runner.layer_ops``), like the rotary embedding and SiLU * up. At batch 1 a decode
step is dominated by such small operations' dispatch once the weights stream fast.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quanta.runner.attention import AttentionMetadata, paged_attention
from quanta.runner.decode_chain import DecodeChain
from quanta.runner.layer_ops import TorchLayerOps
from quanta.runner.linear import ProjectionFactory
from quanta.runner.models.config import ModelConfig
from quanta.runner.models.safepoints import Safepoints, walk_layers
from quanta.runner.projection import Projection


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, CPU), with "linear" or "llama3" scaling as HF computes them."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaRMSNorm(nn.Module):
    """``weight * normalise(x)``, or with ``residual``: ``residual += x`` in place, then
    ``weight * normalise(residual)`` (the block's residual add and the next norm, fused)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: TorchLayerOps = TorchLayerOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """Loads HF's q/k/v/o projections; after ``fuse`` q, k and v are one product."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj: nn.Module = nn.Linear(self.num_heads * self.head_dim, dim, bias=bias)
        self.qkv_proj: Projection | None = None
        self.ops: TorchLayerOps = TorchLayerOps()

    def fuse(self, make: ProjectionFactory) -> int:
        self.qkv_proj = make([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = make([self.o_proj])  # type: ignore[list-item]
        del self.q_proj, self.k_proj, self.v_proj
        return 4

    def _rotated(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` of ``x``, q and k rotated: views of the
        fused product's columns, rotated in place (q's and k's heads in one call)."""
        assert self.qkv_proj is not None, "call fuse() after loading the weights"
        qkv = self.qkv_proj(x)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        tokens, q_width, kv_width = qkv.shape[0], heads * dim, kv_heads * dim
        self.ops.rope_(qkv[:, : q_width + kv_width].view(tokens, heads + kv_heads, dim), *rope)
        q = qkv[:, :q_width].view(tokens, heads, dim)
        k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, dim)
        v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        past_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``attention(x)``, its output projection included (the residual add is the next
        norm's)."""
        q, k, v = self._rotated(x, rope)

        def project_kv(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """K (rotated to each token's position) and V of cached attention inputs; the
            fused product also computes q, which is dropped."""
            assert past_rope is not None
            _, k_past, v_past = self._rotated(h, past_rope)
            return k_past, v_past

        out = paged_attention(
            q,
            k,
            v,
            layer_cache,
            meta,
            scale=self.head_dim**-0.5,
            hidden_input=x,
            project_kv=project_kv,
        )
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    """Loads HF's gate/up/down projections; after ``fuse`` gate and up are one product."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj: nn.Module = nn.Linear(inner, dim, bias=bias)
        self.gate_up_proj: Projection | None = None
        self.ops: TorchLayerOps = TorchLayerOps()

    def fuse(self, make: ProjectionFactory) -> int:
        self.gate_up_proj = make([self.gate_proj, self.up_proj])
        self.down_proj = make([self.down_proj])  # type: ignore[list-item]
        del self.gate_proj, self.up_proj
        return 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(x)`` (the residual add is the next norm's)."""
        assert self.gate_up_proj is not None, "call fuse() after loading the weights"
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self, make: ProjectionFactory) -> int:
        return self.self_attn.fuse(make) + self.mlp.fuse(make)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        past_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``. ``x`` is the previous layer's MLP output, added
        into ``residual`` in place; with ``residual`` None (the first layer) ``x`` is the
        stream itself."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        attn = self.self_attn(h, rope, layer_cache, meta, past_rope=past_rope)
        return self.mlp(self.post_attention_layernorm(attn, residual)), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # A plain attribute, not a buffer: weights are loaded onto a meta-built module and
        # buffers would stay on meta; the table is tiny and moved per step.
        self.inv_freq = rope_inv_freq(config)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
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
        rope = self._rope(positions, x.dtype)
        # Hidden-cache sequences' past tokens get their rotations once per step, not per layer.
        past_rope = self._rope(meta.hidden.past_positions, x.dtype) if meta.hidden else None
        if self.chain is not None and self.chain.takes(x, meta):
            x, residual = self.chain.run(x, rope, kv_cache, meta, safepoints)
            return self.norm(x, residual)
        residual: torch.Tensor | None = None
        for i, layer in walk_layers(self.layers, safepoints):
            x, residual = layer(x, residual, rope, kv_cache[i], meta, past_rope)
        return self.norm(x, residual)

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, D]`` of ``positions``: rows of a table of every position so far
        (grown to the next power of two when a step reaches past it), computed in fp32 and
        cast as HF computes them per step."""
        table = self._rope_table
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if table is None or table[0].shape[0] < needed or table[0].dtype != dtype:
            table = self._rope_table = self._rope_rows(
                1 << (needed - 1).bit_length(), dtype, positions.device
            )
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _rope_rows(
        self, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=device)
        freqs = positions.float()[:, None] * self.inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits`` projects."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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
            if isinstance(module, LlamaRMSNorm | LlamaAttention | LlamaMLP):
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
        return self.lm_head(hidden)
