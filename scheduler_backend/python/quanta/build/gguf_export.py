"""Write a GGUF file from an HF-layout checkpoint, the way llama.cpp's converter does.

Why Quanta writes GGUF at all: to hand llama.cpp exactly the weights Quanta serves (the quality
and speed benchmarks run llama.cpp at F16 on a dequantized model), and to give the import tests
files whose every byte is known, for every architecture ``gguf_arch`` maps. LLaMA's q/k rows
are permuted with llama.cpp's own formula, Gemma's norms stored as ``1 + w``, the
tokenizer goes in as token list, token types and merges, and tensors are stored as F32, F16 or
quantized with the ``gguf`` library's reference quantizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from quanta.build.gguf_arch import ARCHITECTURES, TOP_TENSORS, GgufArch
from quanta.runner.models.loader import checkpoint_files


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute``: HF's halves to interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf: str, arch: GgufArch = ARCHITECTURES["llama"]) -> str:
    top = {h: g for g, h in TOP_TENSORS.items()}
    if hf in top:
        return top[hf]
    _, _, index, rest = hf.split(".", 3)
    return f"blk.{index}.{arch.gguf_block_name(rest)}"


def _quantized(
    array: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.ndim != 2 or qtype == gguf.GGMLQuantizationType.F32 or array.shape[-1] % block:
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(
    checkpoint: Path,
    out: Path,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    embedding_qtype: gguf.GGMLQuantizationType | None = None,
    arch: str | None = None,
    tokenizer_model: str = "gpt2",
    pre: str | None = None,
    chat_template: str | None = None,
) -> dict[str, np.ndarray]:
    """Write ``checkpoint`` as GGUF to ``out``; returns the HF-named float32 arrays a correct
    reader must recover (after quantization, in HF's row order). ``embedding_qtype``: the
    token embedding's type where it differs from the rest (llama.cpp's Q4 files hold a Q8_0
    ``token_embd``). ``arch`` defaults to the
    checkpoint's model_type, ``pre`` to what the checkpoint's tokenizer.json splits like;
    ``arch``, ``tokenizer_model`` and ``pre`` may name what Quanta cannot read, for the
    tests of its refusals."""
    config = json.loads((checkpoint / "config.json").read_text())
    # llama.cpp's converter writes Mistral as LLaMA (its sliding window dropped)
    arch = arch or {"mistral": "llama"}.get(config["model_type"], config["model_type"])
    layout = ARCHITECTURES.get(arch, ARCHITECTURES["llama"])
    tensors: dict[str, np.ndarray] = {}
    for path in checkpoint_files(checkpoint):  # torch reads bf16, which numpy cannot
        tensors |= {k: v.float().numpy() for k, v in load_file(str(path)).items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    file_type = "ALL_F32" if qtype == gguf.GGMLQuantizationType.F32 else f"MOSTLY_{qtype.name}"
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rotary = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(head_dim * rotary))
    rope_tensors = _add_rope_scaling(
        writer, config, config.get("rope_scaling") or rope, int(head_dim * rotary)
    )
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if config.get("sliding_window") and arch == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    _add_tokenizer(writer, checkpoint, config, tokenizer_model, pre)
    template = chat_template or _checkpoint_template(checkpoint)
    if template is not None:
        writer.add_chat_template(template)
    expected: dict[str, np.ndarray] = {}
    for name, array in sorted(tensors.items()):
        if layout.rope_permuted and name.endswith("q_proj.weight"):
            array_gguf = permute_rope_rows(array, heads)
        elif layout.rope_permuted and name.endswith("k_proj.weight"):
            array_gguf = permute_rope_rows(array, kv_heads)
        elif layout.norm_offset and name.endswith("norm.weight"):
            array_gguf = array + np.float32(layout.norm_offset)
        else:
            array_gguf = array
        own = embedding_qtype if embedding_qtype and name.endswith("embed_tokens.weight") else qtype
        data, kind = _quantized(array_gguf, own)
        writer.add_tensor(gguf_name(name, layout), data, raw_dtype=kind)
        # NOTE: rows are quantized one by one, so quantizing commutes with the row permutation:
        # what a correct reader recovers is the HF array quantized in place.
        expected[name] = gguf.quants.dequantize(*_quantized(array, own)).reshape(array.shape)
    for name, factors in rope_tensors.items():
        writer.add_tensor(name, factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _add_rope_scaling(
    writer: gguf.GGUFWriter, config: dict, rope: dict, rot_dim: int
) -> dict[str, np.ndarray]:
    """Rope scaling as llama.cpp's converter records it: linear and yarn in the metadata;
    LLaMA 3's as per-frequency factors (``rope_freqs``) and Phi-3's longrope as two factor
    tensors with the original context and attention factor in the metadata. Returns the
    tensors to write."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(rope["factor"])
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        return {}
    if kind == "llama3":
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        return {"rope_freqs.weight": _llama3_factors(rope, config, theta, rot_dim)}
    if kind == "longrope":
        original = config.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings"
        )
        scale = config["max_position_embeddings"] / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(attn)
        return {
            "rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
        }
    return {}


def _llama3_factors(rope: dict, config: dict, theta: float, dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for LLaMA 3 scaling: the divisor of each frequency
    (1 for short wavelengths, ``factor`` for long ones, a blend between), computed as its
    converter does (the original context defaulting to LLaMA 3's 8192)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = config.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", 8192
    )
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _checkpoint_template(checkpoint: Path) -> str | None:
    path = checkpoint / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _pre_name(spec: dict) -> str:
    """llama.cpp's name for the split tokenizer.json's pre-tokenizer makes."""
    text = json.dumps(spec.get("pre_tokenizer"))
    if '"Digits"' in text:
        return "smollm"
    return "llama-bpe" if '"Split"' in text else "gpt-2"


def _add_tokenizer(
    writer: gguf.GGUFWriter, checkpoint: Path, config: dict, model: str, pre: str | None
) -> None:
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre or _pre_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(_first(config["eos_token_id"]))
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    tok_config_path = checkpoint / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", True)))


def _first(value: int | list[int]) -> int:
    return value[0] if isinstance(value, list) else value
