"""How each GGUF architecture Quanta reads names its tensors and differs from HF's layout.

One table serves both directions (``gguf_import`` reads it, ``gguf_export`` writes it), so a
name mapped one way is mapped back the same way. What llama.cpp's converter changes, per
architecture, and what is undone on import:

- ``llama``: q's and k's rows permuted to interleaved pairs (``rope_permuted``);
- ``qwen2``/``qwen3``/``phi3``/``gemma2``: rows kept in HF's order (llama.cpp rotates these
  families with NEOX-style RoPE, the two halves as HF does);
- ``gemma2``: every RMSNorm weight stored as ``1 + w`` (``norm_offset``), the scale its
  kernel multiplies by, where HF stores ``w``;
- ``phi3``: q/k/v fused in ``attn_qkv`` and gate/up in ``ffn_up``, exactly as HF's
  ``qkv_proj`` and ``gate_up_proj`` hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_GATED_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_PRE_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QKV_BIAS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GgufArch:
    """One GGUF architecture: its HF model, tensor names and stored-layout differences."""

    name: str  # general.architecture
    model_type: str  # HF config.json's model_type
    hf_class: str
    block_tensors: dict[str, str]  # GGUF name after "blk.N." -> HF name after "model.layers.N."
    rope_permuted: bool = False
    norm_offset: float = 0.0
    partial_rotary: bool = False  # rope.dimension_count below the head size is served
    extra_config: dict[str, object] = field(default_factory=dict)

    def gguf_block_name(self, hf_suffix: str) -> str:
        """HF's per-layer name -> GGUF's (``KeyError`` for a tensor this family lacks)."""
        return {hf: g for g, hf in self.block_tensors.items()}[hf_suffix]


ARCHITECTURES: dict[str, GgufArch] = {
    arch.name: arch
    for arch in (
        GgufArch(
            "llama",
            "llama",
            "LlamaForCausalLM",
            _PRE_NORMS | _ATTENTION | _GATED_MLP,
            rope_permuted=True,
            extra_config={"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
        ),
        GgufArch(
            "qwen2",
            "qwen2",
            "Qwen2ForCausalLM",
            _PRE_NORMS | _ATTENTION | _QKV_BIAS | _GATED_MLP,
            extra_config={"hidden_act": "silu", "use_sliding_window": False},
        ),
        GgufArch(
            "qwen3",
            "qwen3",
            "Qwen3ForCausalLM",
            _PRE_NORMS
            | _ATTENTION
            | _QKV_BIAS
            | _GATED_MLP
            | {
                "attn_q_norm.weight": "self_attn.q_norm.weight",
                "attn_k_norm.weight": "self_attn.k_norm.weight",
            },
            extra_config={"hidden_act": "silu", "use_sliding_window": False},
        ),
        GgufArch(
            "phi3",
            "phi3",
            "Phi3ForCausalLM",
            _PRE_NORMS
            | {
                "attn_qkv.weight": "self_attn.qkv_proj.weight",
                "attn_output.weight": "self_attn.o_proj.weight",
                "ffn_up.weight": "mlp.gate_up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight",
            },
            partial_rotary=True,
            extra_config={"hidden_act": "silu"},
        ),
        GgufArch(
            "gemma2",
            "gemma2",
            "Gemma2ForCausalLM",
            _ATTENTION
            | _GATED_MLP
            | {
                "attn_norm.weight": "input_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
            },
            norm_offset=1.0,
            extra_config={"hidden_activation": "gelu_pytorch_tanh"},
        ),
    )
}
