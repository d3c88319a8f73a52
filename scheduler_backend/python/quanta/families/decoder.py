"""What the families built on the runner's layer kit share: reading their RoPE and
sliding-window settings, and their random-weight checkpoints' config keys and tensors.

A kit family's spec (``qwen2.py``, ``mistral.py`` ...) is then its own options only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families.config import RopeScaling
from quanta.families.spec import INIT_STD, SpecialTokens, TensorSpec, linear

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope")
# The special tokens of every kit family's random checkpoints (the LLaMA tokenizer's layout).
TOKENS = SpecialTokens(tokens=("<unk>", "<s>", "</s>"), bos="<s>", pad=None)


def parse_rope(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor`` from either layout:
    transformers<5 (``rope_theta`` + ``rope_scaling``) or >=5 (``rope_parameters``)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(
            f"{family}: rope type {rope_type!r} is not served (its angles depend on the "
            f"sequence length); served: {ROPE_TYPES}"
        )
    out: dict[str, Any] = {"rope_theta": theta, "partial_rotary_factor": partial}
    if rope_type == "default":
        return out | {"rope_scaling": None}
    if rope_type == "longrope":
        return out | {"rope_scaling": _longrope(raw, params, partial, family)}
    if "factor" not in params:
        raise ValueError(f"{family}: rope type {rope_type!r} needs a 'factor'")
    factor = float(params["factor"])
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw.get("max_position_embeddings", 8192)
    )
    fields: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
    if rope_type in ("llama3", "yarn"):
        fields["original_max_position_embeddings"] = original
    if rope_type == "llama3":
        fields["low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        fields["high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
    if rope_type == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise NotImplementedError(f"{family}: yarn's mscale settings are not served")
        fields["beta_fast"] = float(params.get("beta_fast") or 32.0)
        fields["beta_slow"] = float(params.get("beta_slow") or 1.0)
        if params.get("attention_factor") is not None:
            fields["attention_factor"] = float(params["attention_factor"])
        fields["truncate"] = bool(params.get("truncate", True))
    return out | {"rope_scaling": RopeScaling(**fields)}


def _longrope(
    raw: dict[str, Any], params: dict[str, Any], partial: float, family: str
) -> RopeScaling:
    """LongRoPE (Phi-3's 128k and 3.5 models): a long and a short set of per-frequency
    factors. As HF reads it, the config's top-level ``original_max_position_embeddings`` comes
    first, and a missing ``factor`` is the ratio of the two context lengths (it sets the
    default attention factor)."""
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    half = int(head_dim * partial) // 2
    factors: dict[str, tuple[float, ...]] = {}
    for key in ("long_factor", "short_factor"):
        values = tuple(float(v) for v in params.get(key) or ())
        if len(values) != half:
            raise ValueError(
                f"{family}: longrope's {key} needs {half} values (one per rotated frequency), "
                f"has {len(values)}"
            )
        factors[key] = values
    original = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or raw.get("max_position_embeddings", 4096)
    )
    factor = params.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        attention_factor=None if attention is None else float(attention),
        **factors,
    )


def _default_layer_types(raw: dict[str, Any], num_layers: int, family: str) -> list[str]:
    """The layer types transformers gives a config that lists none: Gemma 2 alternates local
    and global layers from the first; Qwen2 and Qwen3 slide from ``max_window_layers`` on;
    every other family slides everywhere (Mistral)."""
    if family == "gemma2":
        slides = [i % 2 == 0 for i in range(num_layers)]
    elif family in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", 28))  # transformers' default
        slides = [i >= first for i in range(num_layers)]
    else:
        slides = [True] * num_layers
    return ["sliding_attention" if s else "full_attention" for s in slides]


def sliding_windows(raw: dict[str, Any], num_layers: int, family: str) -> tuple[int, ...]:
    """Each layer's window (0: full attention): ``layer_types`` where the config lists them,
    else the family's default layout, unless ``use_sliding_window`` is off."""
    window = raw.get("sliding_window")
    # Qwen's configs carry a window they do not use unless use_sliding_window says so.
    used = raw.get("use_sliding_window", family not in ("qwen2", "qwen3"))
    if not window or not used:
        return ()
    types = raw.get("layer_types")
    if types is None:
        types = _default_layer_types(raw, num_layers, family)
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise NotImplementedError(f"layer types {sorted(unknown)} are not served")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def kit_fields(raw: dict[str, Any], common: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields every kit family reads the same way."""
    heads = common["num_heads"]
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    return {
        "family": family,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or common["hidden_size"] // heads),
        "intermediate_size": int(raw["intermediate_size"]),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "activation_function": str(act),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "sliding_windows": sliding_windows(raw, common["num_layers"], family),
        **parse_rope(raw, family),
        **common,
    }


def check_preset(preset: ModelPreset) -> None:
    """A kit family's preset states its RoPE base and RMSNorm epsilon, and no OPT field."""
    if preset.rope_theta is None or preset.rms_norm_eps is None:
        raise ValueError(f"{preset.family} presets need rope_theta and rms_norm_eps")
    if preset.word_embed_proj_dim is not None:
        raise ValueError("word_embed_proj_dim is an OPT field")


def hf_config(preset: ModelPreset, architecture: str, **keys: object) -> dict[str, object]:
    """The keys of ``config.json`` every kit family's ``save_pretrained`` writes, and its own."""
    shape = preset.shape
    return {
        "architectures": [architecture],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "intermediate_size": shape.intermediate_size,
        "model_type": preset.family,
        "num_key_value_heads": shape.num_kv_heads,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": preset.tie_word_embeddings,
        **keys,
    }


def tensor_specs(
    preset: ModelPreset,
    *,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    fused: bool = False,
    sandwich: bool = False,
    tied: bool = False,
) -> list[TensorSpec]:
    """Stored tensors in HF order for the kit's decoder with these options."""
    shape = preset.shape
    h, f, v, d = shape.hidden_size, shape.intermediate_size, shape.vocab_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    norm = "zeros" if sandwich else "ones"  # Gemma scales by 1 + weight
    out: list[TensorSpec] = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(shape.num_layers):
        lp = f"model.layers.{i}."
        if fused:
            out += linear(lp + "self_attn.qkv_proj", q + 2 * kv, h)
        else:
            out += linear(lp + "self_attn.q_proj", q, h, bias=qkv_bias)
            out += linear(lp + "self_attn.k_proj", kv, h, bias=qkv_bias)
            out += linear(lp + "self_attn.v_proj", kv, h, bias=qkv_bias)
        out += linear(lp + "self_attn.o_proj", h, q)
        if qk_norm:
            out += [(lp + "self_attn.q_norm.weight", (d,), "ones")]
            out += [(lp + "self_attn.k_norm.weight", (d,), "ones")]
        if fused:
            out += linear(lp + "mlp.gate_up_proj", 2 * f, h)
        else:
            out += linear(lp + "mlp.gate_proj", f, h) + linear(lp + "mlp.up_proj", f, h)
        out += linear(lp + "mlp.down_proj", h, f)
        names = ["input_layernorm", "post_attention_layernorm"]
        if sandwich:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        out += [(f"{lp}{n}.weight", (h,), norm) for n in names]
    out += [("model.norm.weight", (h,), norm)]
    if not (tied or preset.tie_word_embeddings):
        out += [("lm_head.weight", (v, h), "normal")]
    return out
