"""OPT (125M to 66B): learned positions offset by 2, LayerNorm, biases, LM head tied to the
embedding, and an optional embedding projection (``word_embed_proj_dim``, as in opt-350m)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quanta.families.config import ModelConfig, model_config
from quanta.families.spec import INIT_STD, FamilySpec, SpecialTokens, TensorSpec, layer_norm, linear

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset


def parse_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """OPT's ``config.json``: multi-head attention, ``ffn_dim``, the tied head by default."""
    hidden = common["hidden_size"]
    heads = common["num_heads"]
    if hidden % heads:
        raise ValueError(f"OPT hidden_size {hidden} is not divisible by num_heads {heads}")
    return model_config(
        family="opt",
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(raw.get("ffn_dim", 4 * hidden)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
        word_embed_proj_dim=int(raw.get("word_embed_proj_dim") or hidden),
        enable_bias=bool(raw.get("enable_bias", True)),
        layer_norm_elementwise_affine=bool(raw.get("layer_norm_elementwise_affine", True)),
        activation_function=str(raw.get("activation_function", "relu")),
        remove_final_layer_norm=bool(raw.get("_remove_final_layer_norm", False)),
        **common,
    )


def check_preset(preset: ModelPreset) -> None:
    """An OPT preset is multi-head, states its embedding width and none of LLaMA's fields."""
    if preset.word_embed_proj_dim is None:
        raise ValueError("opt presets need word_embed_proj_dim")
    if preset.shape.num_kv_heads != preset.shape.num_heads:
        raise ValueError("opt is multi-head attention: num_kv_heads must equal num_heads")
    if preset.shape.num_heads * preset.shape.head_dim != preset.shape.hidden_size:
        # NOTE: OPTConfig has no head_dim; its attention derives it as hidden / heads
        raise ValueError("opt's hidden_size must be num_heads * head_dim")
    if (preset.rope_theta, preset.rms_norm_eps) != (None, None):
        raise ValueError("rope_theta and rms_norm_eps are LLaMA fields")


def hf_config(preset: ModelPreset) -> dict[str, object]:
    """The OPT keys of ``config.json`` as ``OPTConfig.save_pretrained`` writes them."""
    return {
        "_remove_final_layer_norm": False,
        "activation_dropout": 0.0,
        "activation_function": "relu",
        "architectures": ["OPTForCausalLM"],
        "do_layer_norm_before": True,
        "dropout": 0.1,
        "enable_bias": True,
        "ffn_dim": preset.shape.intermediate_size,
        "init_std": INIT_STD,
        "layer_norm_elementwise_affine": True,
        "layerdrop": 0.0,
        "model_type": "opt",
        "prefix": "</s>",
        "tie_word_embeddings": True,
        "word_embed_proj_dim": preset.word_embed_proj_dim,
    }


def tensor_specs(preset: ModelPreset) -> list[TensorSpec]:
    """Stored tensors in HF order; the tied lm_head is not stored (as ``save_pretrained``)."""
    shape = preset.shape
    h, f, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    e = preset.word_embed_proj_dim or h
    p = "model.decoder."
    out: list[TensorSpec] = [(p + "embed_tokens.weight", (v, e), "normal")]
    # OPT's learned positions are offset by 2, so the table has 2 extra rows.
    out += [(p + "embed_positions.weight", (shape.max_position_embeddings + 2, h), "normal")]
    if e != h:
        out += [(p + "project_in.weight", (h, e), "normal")]
        out += [(p + "project_out.weight", (e, h), "normal")]
    for i in range(shape.num_layers):
        lp = f"{p}layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            out += linear(f"{lp}self_attn.{proj}", h, h, bias=True)
        out += layer_norm(f"{lp}self_attn_layer_norm", h)
        out += linear(f"{lp}fc1", f, h, bias=True)
        out += linear(f"{lp}fc2", h, f, bias=True)
        out += layer_norm(f"{lp}final_layer_norm", h)
    out += layer_norm(p + "final_layer_norm", h)
    return out


OPT = FamilySpec(
    name="opt",
    architecture="OPTForCausalLM",
    model="quanta.runner.models.opt:OPTForCausalLM",
    parse_config=parse_config,
    # HF's OPT tokenizer prepends `</s>` (id 2) as BOS, not `<s>`.
    tokens=SpecialTokens(
        tokens=("<s>", "<pad>", "</s>", "<unk>"), bos="</s>", pad="<pad>", always_adds_bos=True
    ),
    check_preset=check_preset,
    hf_config=hf_config,
    tensor_specs=tensor_specs,
    pad_embedding="model.decoder.embed_tokens.weight",
)
