"""GGUF -> HF-layout checkpoint: the weights dequantized, the tokenizer and template rebuilt.

Why convert rather than serve GGUF directly: the engine build already validates an HF-layout
checkpoint against the runner's own model (names, shapes, tokenizer, template) and writes the
serving dtype; a GGUF file goes through exactly that path once it is in HF layout, so a model
from llama.cpp's ecosystem and one from the hub end up as the same kind of engine.

Three things differ from an HF export and are undone here:
- weights are block-quantized (Q4_0, Q4_1, Q8_0, K-quants, ...): ``gguf``'s own dequantizer
  (llama.cpp's reference in numpy) turns each into float32;
- llama.cpp's converter permutes the rows of q and k so its RoPE can rotate adjacent pairs;
  HF's rotates the two halves of a head, so the permutation is inverted per head;
- the tokenizer is stored as a token list, token types and BPE merges in the metadata: a
  ``tokenizers`` BPE is built from them with the pre-tokenizer llama.cpp names, and the chat
  template and special tokens go into ``tokenizer_config.json`` as HF writes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from quanta.build.gguf_kept import GgufKept, kept_weight
from quanta.build.steps.base import BuildError

# llama.cpp's token types (llama_token_type): 3 control (special), 4 user-defined (added).
_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF tensor name (per block after "blk.N.") -> HF LLaMA parameter name.
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SHARD_BYTES = 1 << 30
_FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GgufSummary:
    """What the manifest records of a GGUF source: its quantization, as llama.cpp names it."""

    architecture: str
    name: str | None
    file_type: str
    tensor_types: dict[str, int]  # type name -> number of tensors stored in it
    kept: GgufKept | None = None  # with ``keep``: what stayed quantized, what did not

    @property
    def quantization(self) -> str:
        """``Q4_1 (Q4_1 x210, F32 x61, Q8_0 x1)``: the file's label, then what it holds."""
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(self.tensor_types.items(), key=_by_n))
        return f"{self.file_type} ({counts})"


def gguf_label(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``Q4_1``: the quantization a file's name states,
    as llama.cpp's files are named (the whole stem when the name states none)."""
    stem = path.stem
    return stem.rsplit(".", 1)[-1] if "." in stem else stem


def _by_n(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


def gguf_to_checkpoint(path: Path, out: Path, keep: frozenset[str] = frozenset()) -> GgufSummary:
    """Write an HF-layout float32 checkpoint of the GGUF file ``path`` into the directory
    ``out`` (which must exist and be empty); raises ``BuildError`` naming what cannot be read.

    Linear weights of a type in ``keep`` (``gguf_kept.KEEPABLE``) are written quantized
    (``X.qweight``/``X.scales``/``X.zeros``) instead of dequantized."""
    reader = _open(path)
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise BuildError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (only 'llama'; the "
            "runner's LLaMA family covers LLaMA 1/2/3, SmolLM and lookalikes)"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _llama_config(meta, tensors, path)
    tokenizer = _tokenizer(meta, path)
    kept = GgufKept() if keep else None
    _write_weights(tensors, config, out, path, keep, kept)
    _write_json(out / "config.json", config)
    special = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    _write_json(out / "generation_config.json", special | {"_from_model_config": True})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(meta, config))
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GgufSummary(
        architecture=arch,
        name=meta.get("general.name"),
        file_type=_file_type_name(meta.get("general.file_type")),
        tensor_types=types,
        kept=kept,
    )


# -- metadata -----------------------------------------------------------------------------------
def _open(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise BuildError(f"{path}: not a readable GGUF file: {exc}") from None


class _Metadata:
    """The GGUF key/value store as plain Python values."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str, path: Path) -> Any:
        value = self.get(key)
        if value is None:
            raise BuildError(f"{path.name}: GGUF metadata has no {key!r}")
        return value


def _file_type_name(value: int | None) -> str:
    from gguf import LlamaFileType

    if value is None:
        return "unknown"
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file_type {value}"


def _llama_config(meta: _Metadata, tensors: dict[str, Any], path: Path) -> dict[str, Any]:
    """config.json as transformers writes it for LlamaForCausalLM."""
    heads = int(meta.require("llama.attention.head_count", path))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    hidden = int(meta.require("llama.embedding_length", path))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rot_dim = meta.get("llama.rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise BuildError(f"{path.name}: partial rotary embeddings ({rot_dim} of {head_dim})")
    if "rope_freqs.weight" in tensors:
        raise BuildError(f"{path.name}: per-frequency rope factors (rope_freqs) are not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise BuildError(f"{path.name}: no token_embd.weight tensor")
    vocab = int(embed.shape[1])  # GGUF shapes run innermost first: [hidden, vocab]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length", path)),
        "num_hidden_layers": int(meta.require("llama.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        # stored as float32: 1e-05 reads back as 9.9999997e-06; HF's configs say 1e-05
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, path),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    for key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = meta.get(gguf_key)
        if value is not None:
            config[key] = int(value)
    return config


def _f32(value: float) -> float:
    return float(f"{float(value):.7g}")


def _rope_scaling(meta: _Metadata, path: Path) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = _f32(meta.require("llama.rope.scaling.factor", path))
        return {"rope_type": "linear", "factor": factor}
    raise BuildError(f"{path.name}: rope scaling {kind!r} is not supported (only linear)")


# -- weights ------------------------------------------------------------------------------------
def _write_weights(
    tensors: dict[str, Any],
    config: dict[str, Any],
    out: Path,
    path: Path,
    keep: frozenset[str],
    kept: GgufKept | None,
) -> None:
    """Dequantize tensor by tensor (or keep quantized) into safetensors shards of at most
    SHARD_BYTES."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for hf_name, tensor in _hf_tensors(tensors, config, path, keep, kept):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][hf_name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _hf_tensors(
    tensors: dict[str, Any],
    config: dict[str, Any],
    path: Path,
    keep: frozenset[str] = frozenset(),
    kept: GgufKept | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in tensors.items():
        hf_name = _hf_name(name)
        if hf_name is None:
            raise BuildError(f"{path.name}: tensor {name!r} has no counterpart in a LLaMA model")
        rope_heads = None
        if hf_name.endswith("q_proj.weight"):
            rope_heads = heads
        elif hf_name.endswith("k_proj.weight"):
            rope_heads = kv_heads
        type_name = tensor.tensor_type.name
        linear = hf_name.endswith("proj.weight") or hf_name == "lm_head.weight"
        if kept is not None and type_name not in _FLOAT_TYPES:
            kept.count(type_name, linear and type_name in keep)
        if linear and type_name in keep:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))
            permute = None
            if rope_heads is not None:
                n = rope_heads

                def permute(a: np.ndarray, n: int = n) -> np.ndarray:
                    return unpermute_rope_rows(a, n)

            weight = kept_weight(tensor.data, type_name, shape, permute)
            base = hf_name.removesuffix(".weight")
            for part, t in weight.tensors().items():
                yield f"{base}.{part}", t
            continue
        array = _dequantize(tensor, path)
        if rope_heads is not None:
            array = unpermute_rope_rows(array, rope_heads)
        yield hf_name, torch.from_numpy(np.array(array, dtype=np.float32, order="C"))


def _hf_name(name: str) -> str | None:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    prefix, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if prefix != "blk" or not index.isdigit() or suffix not in _BLOCK_TENSORS:
        return None
    return f"model.layers.{int(index)}.{_BLOCK_TENSORS[suffix]}"


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # numpy order: outermost first
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise BuildError(
            f"{path.name}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which "
            "the gguf library cannot dequantize"
        ) from None
    return np.asarray(array, dtype=np.float32).reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row order (pairs interleaved per head) to HF's (halves).

    llama.cpp's converter views each head's rows as (2, head_dim/2) and transposes them to
    (head_dim/2, 2); transposing back restores HF's order.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# -- tokenizer ----------------------------------------------------------------------------------
def _tokenizer(meta: _Metadata, path: Path) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise BuildError(
            f"{path.name}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
            "'gpt2')"
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens", path))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges", path)]
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    return tokenizer


def _pre_tokenizer(pre: str, path: Path) -> Any:
    """The split llama.cpp applies for ``tokenizer.ggml.pre`` before byte-level BPE."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):  # every digit on its own, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise BuildError(f"{path.name}: GGUF pre-tokenizer {pre!r} is not supported")


def _tokenizer_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens", []))

    def text(key: str) -> str | None:
        value = config.get(key)
        return tokens[value] if isinstance(value, int) and 0 <= value < len(tokens) else None

    unk = meta.get("tokenizer.ggml.unknown_token_id")
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "pad_token": text("pad_token_id"),
        "unk_token": tokens[int(unk)] if unk is not None and int(unk) < len(tokens) else None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        out["chat_template"] = template
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
