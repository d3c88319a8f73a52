"""Write a GGUF file from an HF-layout LLaMA checkpoint, the way llama.cpp's converter does.

Why Quanta writes GGUF at all: to hand llama.cpp exactly the weights Quanta serves (the quality
and speed benchmarks run llama.cpp at F16 on a dequantized model), and to give the import tests
files whose every byte is known. The q/k rows are permuted with llama.cpp's own formula, the
tokenizer goes in as token list, token types and merges, and tensors are stored as F32, F16 or
quantized with the ``gguf`` library's reference quantizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from quanta.runner.models.loader import checkpoint_files

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute``: HF's halves to interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, index, rest = hf.split(".", 3)
    return f"blk.{index}.{_NAMES[rest]}"


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
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str | None = None,
    chat_template: str | None = None,
) -> dict[str, np.ndarray]:
    """Write ``checkpoint`` as GGUF to ``out``; returns the HF-named float32 arrays a correct
    reader must recover (after quantization, in HF's row order). ``pre`` defaults to what
    the checkpoint's tokenizer.json splits like; ``arch``, ``tokenizer_model`` and ``pre``
    may name what Quanta cannot read, for the tests of its refusals."""
    config = json.loads((checkpoint / "config.json").read_text())
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
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    _add_tokenizer(writer, checkpoint, config, tokenizer_model, pre)
    template = chat_template or _checkpoint_template(checkpoint)
    if template is not None:
        writer.add_chat_template(template)
    expected: dict[str, np.ndarray] = {}
    for name, array in sorted(tensors.items()):
        if name.endswith("q_proj.weight"):
            array_gguf = permute_rope_rows(array, heads)
        elif name.endswith("k_proj.weight"):
            array_gguf = permute_rope_rows(array, kv_heads)
        else:
            array_gguf = array
        data, kind = _quantized(array_gguf, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        # NOTE: rows are quantized one by one, so quantizing commutes with the row permutation:
        # what a correct reader recovers is the HF array quantized in place.
        expected[name] = gguf.quants.dequantize(*_quantized(array, qtype)).reshape(array.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


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
    tok_config_path = checkpoint / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", True)))


def _first(value: int | list[int]) -> int:
    return value[0] if isinstance(value, list) else value
