"""LLaMA 1/2/3 and lookalikes: RoPE (default, linear, llama3 scaling), RMSNorm, SwiGLU, GQA."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families.config import ModelConfig, RopeScaling, model_config
from quanta.families.spec import INIT_STD, FamilySpec, SpecialTokens, TensorSpec, linear

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """LLaMA's ``config.json``: grouped-query heads, an explicit head_dim, SiLU only."""
    heads = common["num_heads"]
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise NotImplementedError(f"LLaMA hidden_act {hidden_act!r} is not supported (only silu)")
    rope_theta, rope_scaling = _parse_rope(raw)
    return model_config(
        family="llama",
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or common["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        activation_function=hidden_act,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        **common,
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Accept both layouts: transformers<5 (``rope_theta`` + ``rope_scaling``) and
    transformers>=5 (``rope_parameters`` holding ``rope_type`` and ``rope_theta``)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    original = params.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings", 8192)
    )
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def check_preset(preset: ModelPreset) -> None:
    """A LLaMA preset states its RoPE base and RMSNorm epsilon, and no OPT field."""
    if preset.rope_theta is None:
        raise ValueError("llama presets need rope_theta")
    if preset.rms_norm_eps is None:
        raise ValueError("llama presets need rms_norm_eps")
    if preset.word_embed_proj_dim is not None:
        raise ValueError("word_embed_proj_dim is an OPT field")
    scaling = preset.rope_scaling
    if scaling is not None and scaling.rope_type not in ("linear", "llama3"):
        raise ValueError(f"llama presets scale RoPE by linear or llama3, not {scaling.rope_type!r}")


def hf_config(preset: ModelPreset) -> dict[str, object]:
    """The LLaMA keys of ``config.json`` as ``LlamaConfig.save_pretrained`` writes them."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "head_dim": preset.shape.head_dim,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "intermediate_size": preset.shape.intermediate_size,
        "mlp_bias": False,
        "model_type": "llama",
        "num_key_value_heads": preset.shape.num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": _rope_scaling(preset.rope_scaling),
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": preset.tie_word_embeddings,
    }


def _rope_scaling(scaling: RopeScaling | None) -> dict[str, object] | None:
    """``rope_scaling`` as LLaMA's config.json writes it (LLaMA-3.1 and 3.2: llama3)."""
    if scaling is None:
        return None
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {
        "factor": scaling.factor,
        "high_freq_factor": scaling.high_freq_factor,
        "low_freq_factor": scaling.low_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "rope_type": "llama3",
    }


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    """Stored tensors in HF order: no biases, RMSNorm weights of one, the lm_head unless it
    is the embedding (LLaMA-3.2's is; as ``save_pretrained``, a tied head is not stored)."""
    shape = preset.shape
    h, f, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out: list[TensorSpec] = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(shape.num_layers):
        lp = f"model.layers.{i}."
        out += linear(lp + "self_attn.q_proj", q, h)
        out += linear(lp + "self_attn.k_proj", kv, h)
        out += linear(lp + "self_attn.v_proj", kv, h)
        out += linear(lp + "self_attn.o_proj", h, q)
        out += linear(lp + "mlp.gate_proj", f, h)
        out += linear(lp + "mlp.up_proj", f, h)
        out += linear(lp + "mlp.down_proj", h, f)
        out += [(lp + "input_layernorm.weight", (h,), "ones")]
        out += [(lp + "post_attention_layernorm.weight", (h,), "ones")]
    out += [("model.norm.weight", (h,), "ones")]
    return out if preset.tie_word_embeddings else [*out, ("lm_head.weight", (v, h), "normal")]


LLAMA = FamilySpec(
    name="llama",
    architecture="LlamaForCausalLM",
    model="quanta.runner.models.llama:LlamaForCausalLM",
    parse_config=parse_config,
    tokens=SpecialTokens(tokens=("<unk>", "<s>", "</s>"), bos="<s>", pad=None),
    check_preset=check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
)
