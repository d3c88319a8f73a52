"""The decoder every kit family is: embedding, layers of attention and MLP, final norm, LM
head. A family's model file picks the options its config does not state (``Layout``: fused
products, LayerNorm, learned positions, a plain MLP, its checkpoint's names) and names the
class; its config (``quanta.families``) sets the rest.

Module and parameter names copy HF's (``model.layers.N.self_attn.q_proj``; OPT's
``model.decoder.layers.N.fc1``), so the loader installs a checkpoint as it is; ``fuse`` then
leaves the kit's names on every family (``self_attn.qkv_proj``/``o_proj``, ``mlp``).
Projections and the MLP run once over all ``[T, hidden]`` tokens of the step; rotary cos/sin
come from one table per model (``rotary.RotaryTable``).

Each layer declares what the engine's shared machinery needs: its tensor-parallel splits
(``tensor_parallel``), and whether it is the plain LLaMA layer the decode chain computes
(``decode_chain_blocker``); the products ``fuse`` builds are the quantizable ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from quanta.families.config import ModelConfig
from quanta.runner.attention import AttentionMetadata
from quanta.runner.decode_chain import DecodeChain
from quanta.runner.layer_ops import TorchLayerOps
from quanta.runner.layers.attention import Attention, Rope
from quanta.runner.layers.mlp import MLP, GatedMLP, check_plain_activation
from quanta.runner.layers.norms import LayerNorm, RMSNorm
from quanta.runner.layers.parallel import Split
from quanta.runner.layers.rotary import RotaryTable
from quanta.runner.linear import ProjectionFactory
from quanta.runner.models.safepoints import Safepoints, walk_layers


@dataclass(frozen=True, slots=True)
class Layout:
    """A family's choices that its config does not state, and the names its checkpoint gives
    what the kit's modules are otherwise called (HF's, so a checkpoint loads as it is)."""

    layer_norm: bool = False  # LayerNorm with biases (OPT) where the others have RMSNorm
    learned_positions: bool = False  # OPT's position table (offset by 2), no rotation
    # The layer's own two MLP linears (OPT's fc1, fc2): a plain MLP, not the gated one.
    plain_mlp: tuple[str, str] | None = None
    decoder: str = "model"  # the decoder's path (OPT's model.decoder)
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    final_norm: str = "norm"
    out_proj: str = "o_proj"


# OPT's learned positions are stored shifted by two (a fairseq legacy).
POSITION_OFFSET = 2


def _norm(config: ModelConfig, layout: Layout) -> nn.Module:
    if layout.layer_norm:
        return LayerNorm(config.hidden_size, affine=config.layer_norm_elementwise_affine)
    return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP; with ``sandwich_norms`` (Gemma 2) also a norm after the
    attention and one after the MLP, each before its residual add; with
    ``do_layer_norm_before`` False (OPT-350m) each norm after its residual add instead."""

    def __init__(
        self, config: ModelConfig, index: int, layout: Layout, *, fused: bool = False
    ) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.self_attn = Attention(
            config,
            index,
            fused=fused,
            rotary=not layout.learned_positions,
            out_name=layout.out_proj,
        )
        self.mlp: nn.Module | None = None
        self.plain_mlp = layout.plain_mlp
        if layout.plain_mlp is None:
            self.mlp = GatedMLP(config, fused=fused)
        else:  # the linears stay the layer's own until ``fuse`` makes them the MLP
            check_plain_activation(config.activation_function)
            dim, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
            up, down = layout.plain_mlp
            self.add_module(up, nn.Linear(dim, inner, bias=bias))
            self.add_module(down, nn.Linear(inner, dim, bias=bias))
        self.activation = config.activation_function
        self.inner = config.intermediate_size
        self.norm_names = layout.norms
        for name in layout.norms:
            self.add_module(name, _norm(config, layout))
        self.pre_norm = config.do_layer_norm_before
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    @property
    def norms(self) -> tuple[nn.Module, nn.Module]:
        """The norm before the attention and the one before the MLP, whatever the
        checkpoint calls them (``input_layernorm``/``post_attention_layernorm``; OPT's
        ``self_attn_layer_norm``/``final_layer_norm``)."""
        first, second = self.norm_names
        return getattr(self, first), getattr(self, second)

    def tensor_parallel(self) -> dict[str, Split]:
        """A plain MLP's linears while the layer holds them: the first by columns, the
        second by rows (the attention and a gated MLP declare their own)."""
        if self.plain_mlp is None or self.mlp is not None:
            return {}
        up, down = self.plain_mlp
        return {up: Split.columns(self.inner), down: Split.rows(self.inner)}

    def fuse(self, make: ProjectionFactory) -> int:
        if self.plain_mlp is None:
            assert isinstance(self.mlp, GatedMLP)
            return self.self_attn.fuse(make) + self.mlp.fuse(make)
        up, down = (getattr(self, name) for name in self.plain_mlp)
        for name in self.plain_mlp:
            delattr(self, name)
        self.mlp = MLP.fused(make, up, down, self.activation)
        return self.self_attn.fuse(make) + 2

    def decode_chain_blocker(self) -> str | None:
        """Why the decode chain (``quanta.runner.decode_chain``) cannot run this layer, or
        None: it computes pre-norm layers of either norm (and the sandwich ones), the gated
        MLPs and a plain ReLU one, and every option of the attention."""
        reasons = []
        if not self.pre_norm:
            reasons.append("its norms follow the residual adds (post-norm)")
        if isinstance(self.mlp, MLP) and self.mlp.activation != "relu":
            reasons.append(f"its plain MLP runs {self.mlp.activation}, not ReLU")
        return "; ".join(reasons) or None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope | None,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        past_rope: Rope | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(block output, residual stream)``. ``x`` is the previous layer's output, added
        into ``residual`` in place; with ``residual`` None (the first layer) ``x`` is the
        stream itself. A post-norm layer returns the normalised stream and None."""
        assert self.mlp is not None, "call fuse() after loading the weights"
        first, second = self.norms
        if not self.pre_norm:
            # NOTE: out of place, since ``x`` is also the attention input a hidden cache keeps.
            x = first(x + self.self_attn(x, rope, layer_cache, meta, past_rope=past_rope))
            return second(x + self.mlp(x)), None
        if residual is None:
            residual, h = x, first(x)
        else:
            h = first(x, residual)
        attn = self.self_attn(h, rope, layer_cache, meta, past_rope=past_rope)
        if not self.sandwich:
            return self.mlp(second(attn, residual)), residual
        h = self.pre_feedforward_layernorm(second(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    """Embedding (with OPT's learned positions and its projections in and out where its
    embedding is narrower than the layers), the layers, the final norm (none post-norm)."""

    def __init__(self, config: ModelConfig, layout: Layout, *, fused: bool = False) -> None:
        super().__init__()
        dim, width = config.hidden_size, config.word_embed_proj_dim or config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, width)
        self.embed_positions = (
            nn.Embedding(config.max_model_len + POSITION_OFFSET, dim)
            if layout.learned_positions
            else None
        )
        self.project_in = nn.Linear(width, dim, bias=False) if width != dim else None
        self.project_out = nn.Linear(dim, width, bias=False) if width != dim else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, layout, fused=fused) for i in range(config.num_layers)
        )
        self.final_norm_name = layout.final_norm
        if config.do_layer_norm_before and not config.remove_final_layer_norm:
            self.add_module(layout.final_norm, _norm(config, layout))
        self.rotary = None if layout.learned_positions else RotaryTable(config)
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
        if self.project_in is not None:
            x = self.project_in(x)
        rope = past_rope = None
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + POSITION_OFFSET)
        else:
            assert self.rotary is not None
            rope = self.rotary(positions, x.dtype, meta.prompt_lens)
            # Hidden-cache sequences' past tokens get their rotations once per step.
            hidden = meta.hidden
            past_rope = (
                self.rotary(hidden.past_positions, x.dtype, hidden.past_prompt_lens)
                if hidden
                else None
            )
        if self.chain is not None and self.chain.takes(x, meta):
            x, residual = self.chain.run(x, rope, kv_cache, meta, safepoints)
            return self._final(x, residual)
        residual: torch.Tensor | None = None
        for i, layer in walk_layers(self.layers, safepoints):
            x, residual = layer(x, residual, rope, kv_cache[i], meta, past_rope)
        return self._final(x, residual)

    @property
    def final_norm(self) -> nn.Module | None:
        """The final norm, whatever the checkpoint calls it (OPT's ``final_layer_norm``);
        None where there is none (post-norm, or OPT's ``_remove_final_layer_norm``)."""
        return getattr(self, self.final_norm_name, None)

    def _final(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final norm of the stream, then OPT's projection out."""
        norm = self.final_norm
        if norm is not None:
            x = norm(x, residual)
        elif residual is not None:
            x = residual.add_(x)
        return x if self.project_out is None else self.project_out(x)


class DecoderForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]`` (OPT's: ``[T,
    word_embed_proj_dim]``); ``compute_logits`` projects. A family sets ``fused`` when its
    checkpoints store q/k/v and gate/up as one tensor each, and ``layout`` for the rest."""

    fused: ClassVar[bool] = False
    layout: ClassVar[Layout] = Layout()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        layout = self.layout
        # The decoder sits at its checkpoint path: ``model``, or OPT's ``model.decoder``.
        owner: nn.Module = self
        *parents, name = layout.decoder.split(".")
        for parent in parents:
            owner.add_module(parent, nn.Module())
            owner = owner.get_submodule(parent)
        owner.add_module(name, DecoderModel(config, layout, fused=self.fused))
        width = config.word_embed_proj_dim or config.hidden_size
        self.lm_head = nn.Linear(width, config.vocab_size, bias=False)
        self.final_softcap = config.final_logit_softcapping
        self.tie_weights()

    @property
    def decoder(self) -> DecoderModel:
        """The decoder (``model``; OPT's ``model.decoder``)."""
        decoder = self.get_submodule(self.layout.decoder)
        assert isinstance(decoder, DecoderModel)
        return decoder

    @property
    def embedding(self) -> str:
        """Where tensor parallelism finds the token embedding
        (``quanta.runner.tensor_parallel``)."""
        return f"{self.layout.decoder}.embed_tokens"

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    def fuse(self, make: ProjectionFactory) -> int:
        """Fuse each layer's projections once the weights are loaded (``quanta.runner.linear``);
        returns how many linears were replaced."""
        return sum(layer.fuse(make) for layer in self.decoder.layers)

    def use_layer_ops(self, ops: TorchLayerOps) -> None:
        """Run the layers' small operations (norms, rotary embedding, SiLU * up) through
        ``ops`` (``quanta.runner.layer_ops``)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | LayerNorm | Attention | GatedMLP):
                module.ops = ops

    def use_decode_chain(self, chain: DecodeChain | None) -> None:
        """Run decode steps' layers through ``chain`` (``quanta.runner.decode_chain``), or
        layer by layer with None."""
        self.decoder.chain = chain

    def is_ignorable_weight(self, name: str) -> bool:
        """A tied head, the rotary tables some old checkpoints saved (we recompute them), and
        a final norm the model does not have (OPT post-norm; HF drops it too)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        if self.decoder.final_norm is None and name.startswith(
            f"{self.layout.decoder}.{self.layout.final_norm}."
        ):
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
        return self.decoder(input_ids, positions, kv_cache, meta, safepoints)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            # HF's three operators in place: the same values, no new [rows, vocab] tensors
            logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits
