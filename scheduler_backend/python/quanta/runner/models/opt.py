"""OPT, written for packed batches: every projection runs once over ``[T, hidden]``.

Module and parameter names copy HF's ``OPTForCausalLM`` so checkpoint names map one to one
(``model.decoder.layers.N.self_attn.q_proj.weight`` ...).  Only attention is per sequence,
through the paged cache (see ``quanta.runner.attention``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quanta.runner.attention import AttentionMetadata, paged_attention
from quanta.runner.layers.parallel import Split
from quanta.runner.linear import ProjectionFactory, fusable_activation
from quanta.runner.models.config import ModelConfig
from quanta.runner.models.safepoints import Safepoints, walk_layers
from quanta.runner.projection import Projection

POSITION_OFFSET = 2  # OPT's learned positions are stored shifted by two (a fairseq legacy)

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class OPTAttention(nn.Module):
    """Loads HF's q/k/v/out projections; after ``fuse`` q, k and v are one product and the
    residual add rides on the output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, bias = config.hidden_size, config.enable_bias
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj: nn.Module = nn.Linear(dim, dim, bias=bias)
        self.qkv_proj: Projection | None = None

    def tensor_parallel(self) -> dict[str, Split]:
        """Heads by columns, the output projection by rows."""
        width = self.num_heads * self.head_dim
        return {
            "q_proj": Split.columns(width),
            "k_proj": Split.columns(width),
            "v_proj": Split.columns(width),
            "out_proj": Split.rows(width),
        }

    def fuse(self, make: ProjectionFactory) -> int:
        self.qkv_proj = make([self.q_proj, self.k_proj, self.v_proj])
        self.out_proj = make([self.out_proj])  # type: ignore[list-item]
        del self.q_proj, self.k_proj, self.v_proj
        return 4

    def forward(
        self,
        x: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """``residual + attention(x)``."""
        assert self.qkv_proj is not None, "call fuse() after loading the weights"
        dim = self.num_heads * self.head_dim
        shape = (x.shape[0], self.num_heads, self.head_dim)
        qkv = self.qkv_proj(x)
        # NOTE: HF scales q before the product; attention applies the scale instead, which
        # saves a pass over q per layer and differs from HF only in rounding (fp32: ~1e-7).
        q = qkv[:, :dim].view(shape)
        k = qkv[:, dim : 2 * dim].view(shape)
        v = qkv[:, 2 * dim :].view(shape)
        out = paged_attention(
            q,
            k,
            v,
            layer_cache,
            meta,
            scale=self.head_dim**-0.5,
            hidden_input=x,
            project_kv=self._project_kv,
        )
        return self.out_proj.add(out.flatten(1), residual)  # type: ignore[operator]

    def _project_kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of cached attention inputs (hidden-cache sequences). The fused product
        also computes q, which is dropped: one wider call instead of a second packed copy
        of the k and v weights."""
        assert self.qkv_proj is not None
        dim = self.num_heads * self.head_dim
        shape = (h.shape[0], self.num_heads, self.head_dim)
        kv = self.qkv_proj(h)
        return kv[:, dim : 2 * dim].view(shape), kv[:, 2 * dim :].view(shape)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = config.do_layer_norm_before
        self.activation_name = config.activation_function
        self.activation = _activation(config.activation_function)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.fc1: nn.Module = nn.Linear(dim, config.intermediate_size, bias=config.enable_bias)
        self.fc2: nn.Module = nn.Linear(config.intermediate_size, dim, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.inner = config.intermediate_size

    def tensor_parallel(self) -> dict[str, Split]:
        """The MLP: fc1 by columns, fc2 by rows (the attention declares its own)."""
        return {"fc1": Split.columns(self.inner), "fc2": Split.rows(self.inner)}

    def fuse(self, make: ProjectionFactory) -> int:
        post_op = fusable_activation(self.activation_name)
        if post_op != "none":
            self.activation = _identity
        self.fc1 = make([self.fc1], post_op)  # type: ignore[list-item]
        self.fc2 = make([self.fc2])  # type: ignore[list-item]
        return self.self_attn.fuse(make) + 2

    def forward(
        self, x: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Pre-LN (125m, 1.3b, ...) normalises before each block, post-LN (350m) after.
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = self.self_attn(h, layer_cache, meta, residual=x)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = self.fc2.add(self.activation(self.fc1(h)), x)  # type: ignore[operator]
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_model_len + POSITION_OFFSET, dim)
        self.project_in = nn.Linear(proj, dim, bias=False) if proj != dim else None
        self.project_out = nn.Linear(dim, proj, bias=False) if proj != dim else None
        has_final_norm = config.do_layer_norm_before and not config.remove_final_layer_norm
        self.final_layer_norm = (
            nn.LayerNorm(dim, elementwise_affine=config.layer_norm_elementwise_affine)
            if has_final_norm
            else None
        )
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        safepoints: Safepoints | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for i, layer in walk_layers(self.layers, safepoints):
            x = layer(x, kv_cache[i], meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    """Exists only so parameter names carry HF's ``model.decoder.`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    """``forward`` returns hidden states ``[T, word_embed_proj_dim]``; logits are computed
    separately so the runner projects only the rows it samples."""

    # Where tensor parallelism finds the token embedding (``quanta.runner.tensor_parallel``).
    embedding = "model.decoder.embed_tokens"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = nn.Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def fuse(self, make: ProjectionFactory) -> int:
        """Fuse each layer's projections once the weights are loaded (``quanta.runner.linear``);
        returns how many linears were replaced."""
        return sum(layer.fuse(make) for layer in self.model.decoder.layers)

    def is_ignorable_weight(self, name: str) -> bool:
        """Checkpoint entries that HF also drops: a tied head, a final norm post-LN never uses."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return self.model.decoder.final_layer_norm is None and name.startswith(
            "model.decoder.final_layer_norm."
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        safepoints: Safepoints | None = None,
    ) -> torch.Tensor:
        """Hidden states; with ``safepoints`` the pass may stop between layers (it raises)."""
        return self.model.decoder(input_ids, positions, kv_cache, meta, safepoints)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"OPT activation_function {name!r} is not supported")
    return _ACTIVATIONS[name]
