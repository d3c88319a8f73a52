"""GGUF -> HF-layout checkpoint: the weights dequantized, the tokenizer and template rebuilt.

Why convert rather than serve GGUF directly: the engine build already validates an HF-layout
checkpoint against the runner's own model (names, shapes, tokenizer, template) and writes the
serving dtype; a GGUF file goes through exactly that path once it is in HF layout, so a model
from llama.cpp's ecosystem and one from the hub end up as the same kind of engine.

Three things differ from an HF export and are undone here:
- weights are block-quantized (Q4_0, Q4_1, Q8_0, K-quants, ...): ``gguf``'s own dequantizer
  (llama.cpp's reference in numpy) turns each into float32;
- llama.cpp's converter changes some tensors per architecture (LLaMA's q/k rows permuted so
  its RoPE can rotate adjacent pairs, Gemma's norms stored as ``1 + w``): ``gguf_arch`` says
  which, and each is undone here;
- the tokenizer is stored as a token list, token types and BPE merges in the metadata: a
  ``tokenizers`` BPE is built from them with the pre-tokenizer llama.cpp names (a
  SentencePiece vocabulary, which has scores instead of merges, gets the merges its scores
  imply), and the chat template and special tokens go into ``tokenizer_config.json`` as HF
  writes them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from quanta.build.gguf_arch import ARCHITECTURES, TOP_TENSORS, GgufArch
from quanta.build.gguf_kept import KEEPABLE, GgufKept, kept_weight
from quanta.build.steps.base import BuildError

# llama.cpp's token types (llama_token_type): 2 unknown, 3 control (special), 4 user-defined
# (added).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split: LLaMA 3's with every digit on its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}", 1)
_GEMMA2_27B_LAYERS = 46
SHARD_BYTES = 1 << 30
_FLOAT_TYPES = ("F32", "F16", "BF16")
_ROPE_TENSORS = ("rope_freqs", "rope_factors")  # llama.cpp's per-frequency rope factors


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


def gguf_to_checkpoint(
    path: Path, out: Path, keep: frozenset[str] = frozenset(), keep_table: bool = False
) -> GgufSummary:
    """Write an HF-layout float32 checkpoint of the GGUF file ``path`` into the directory
    ``out`` (which must exist and be empty); raises ``BuildError`` naming what cannot be read.

    Linear weights of a type in ``keep`` (``gguf_kept.KEEPABLE``) are written quantized
    (``X.qweight``/``X.scales``/``X.mins``) instead of dequantized; with ``keep_table`` so is
    a token embedding of any type ``KEEPABLE`` names (llama.cpp's ``token_embd`` is often
    Q8_0 beside Q4 linears), which a lookup dequantizes row by row."""
    reader = _open(path)
    meta = _Metadata(reader)
    arch_name = meta.get("general.architecture")
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise BuildError(
            f"{path.name}: GGUF architecture {arch_name!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, tensors, path, arch)
    tokenizer = _tokenizer(meta, path)
    kept = GgufKept() if keep or keep_table else None
    _write_weights(tensors, config, arch, out, path, keep, kept, keep_table)
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
        architecture=arch.name,
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


def _config(meta: _Metadata, tensors: dict[str, Any], path: Path, arch: GgufArch) -> dict[str, Any]:
    """config.json as transformers writes it for the architecture's HF model."""

    def key(name: str) -> str:
        return f"{arch.name}.{name}"

    heads = int(meta.require(key("attention.head_count"), path))
    kv_heads = int(meta.get(key("attention.head_count_kv"), heads))
    hidden = int(meta.require(key("embedding_length"), path))
    head_dim = int(meta.get(key("attention.key_length"), hidden // heads))
    rot_dim = meta.get(key("rope.dimension_count"))
    config: dict[str, Any] = {}
    if rot_dim is not None and int(rot_dim) != head_dim:
        if not arch.partial_rotary:
            raise BuildError(f"{path.name}: partial rotary embeddings ({rot_dim} of {head_dim})")
        config["partial_rotary_factor"] = int(rot_dim) / head_dim
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise BuildError(f"{path.name}: no token_embd.weight tensor")
    vocab = int(embed.shape[1])  # GGUF shapes run innermost first: [hidden, vocab]
    config |= {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(key("feed_forward_length"), path)),
        "num_hidden_layers": int(meta.require(key("block_count"), path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get(key("context_length"), 2048)),
        # stored as float32: 1e-05 reads back as 9.9999997e-06; HF's configs say 1e-05
        "rms_norm_eps": _f32(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": _f32(meta.get(key("rope.freq_base"), 10000.0)),
        "rope_scaling": _rope_scaling(
            meta, key, path, tensors, arch, head_dim if rot_dim is None else int(rot_dim)
        ),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
        **arch.extra_config,
    }
    longrope = config["rope_scaling"] or {}
    if "original_max_position_embeddings" in longrope and arch.name == "phi3":
        # Phi-3's config holds it beside max_position_embeddings, as well
        config["original_max_position_embeddings"] = longrope["original_max_position_embeddings"]
    if arch.name == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    window = meta.get(key("attention.sliding_window"))
    if window is not None:
        config["sliding_window"] = int(window)
    if arch.name == "gemma2":
        config |= _gemma2_config(meta, key, config)
    for name, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = meta.get(gguf_key)
        if value is not None:
            config[name] = int(value)
    return config


def _gemma2_config(
    meta: _Metadata, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """Gemma 2's soft-caps (HF's defaults where the file names none), query scale and layer
    pattern.

    GGUF stores no ``query_pre_attn_scalar``: llama.cpp scales queries by ``1/sqrt(head_dim)``
    (what Gemma 2 2B and 9B configure) except in the 46-layer 27B, by
    ``1/sqrt(hidden/heads)``, so that is what the file means. Nor does it list
    which layers slide: llama.cpp's Gemma 2 slides every even layer, as HF's does."""
    layers = config["num_hidden_layers"]
    scalar = config["head_dim"]
    if layers == _GEMMA2_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    attn_cap = meta.get(key("attn_logit_softcapping"))
    final_cap = meta.get(key("final_logit_softcapping"))
    return {
        "attn_logit_softcapping": 50.0 if attn_cap is None else _f32(attn_cap),
        "final_logit_softcapping": 30.0 if final_cap is None else _f32(final_cap),
        "query_pre_attn_scalar": scalar,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
    }


def _f32(value: float) -> float:
    return float(f"{float(value):.7g}")


def _rope_scaling(
    meta: _Metadata,
    key: Callable[[str], str],
    path: Path,
    tensors: dict[str, Any],
    arch: GgufArch,
    rot_dim: int,
) -> dict[str, Any] | None:
    """HF's ``rope_scaling`` for what the file records: linear and yarn in its metadata,
    LLaMA 3's as a ``rope_freqs`` tensor, Phi-3's longrope as two factor tensors."""
    factor_tensors = sorted(n for n in tensors if n.startswith(_ROPE_TENSORS))
    if factor_tensors == ["rope_freqs.weight"] and arch.name == "llama":
        theta = float(meta.get(key("rope.freq_base"), 10000.0))
        factors = _factors(tensors["rope_freqs.weight"])
        return _llama3_scaling(factors, meta, key, theta, rot_dim, path)
    longrope = ["rope_factors_long.weight", "rope_factors_short.weight"]
    if factor_tensors == longrope and arch.name == "phi3":
        return _longrope_scaling(tensors, meta, key, path)
    if factor_tensors:
        raise BuildError(
            f"{path.name}: per-frequency rope factors ({', '.join(factor_tensors)}) are "
            f"not supported for {arch.name} (LLaMA 3's rope_freqs and Phi-3's longrope are)"
        )
    kind = meta.get(key("rope.scaling.type"))
    if kind in (None, "none"):
        return None
    factor = _f32(meta.require(key("rope.scaling.factor"), path))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":  # Qwen2.5's long-context setting
        original = int(meta.require(key("rope.scaling.original_context_length"), path))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise BuildError(f"{path.name}: rope scaling {kind!r} is not supported (only linear and yarn)")


def _factors(tensor: Any) -> np.ndarray:
    return np.asarray(tensor.data, dtype=np.float32).reshape(-1)


def _llama3_scaling(
    factors: np.ndarray,
    meta: _Metadata,
    key: Callable[[str], str],
    theta: float,
    rot_dim: int,
    path: Path,
) -> dict[str, Any]:
    """LLaMA 3's scaling from llama.cpp's ``rope_freqs``: each frequency's divisor, 1 below
    the short wavelength ``original / high_freq_factor``, ``factor`` above the long one
    ``original / low_freq_factor``, a blend linear in ``1 / wavelength`` between.

    The file records the divisors, not the settings. ``factor`` is the largest; LLaMA 3's
    own settings (``low_freq_factor`` 1, ``high_freq_factor`` 4, the file's original context
    or 8192) are tried first, then the two wavelengths fitted to the blended divisors (with
    ``low_freq_factor`` 1: only the wavelengths enter HF's formula), rounded to 4 digits,
    then to 7. The first settings that give back the file's divisors are taken; where
    none do, the build stops."""
    factor = float(factors.max())
    inv_freq = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    wavelen = 2 * np.pi / inv_freq
    tried = [(4.0, int(meta.get(key("rope.scaling.original_context_length"), 8192)))]
    blended = (factors > 1) & (factors < factor)
    if factor > 1 and int(blended.sum()) >= 2:
        # 1/f = (1 - s)/factor + s, and s = (original/wavelen - 1) / (high - 1)
        s = (1 / factors[blended].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
        slope, offset = np.polyfit(1 / wavelen[blended], s, 1)
        high, original = 1 - 1 / offset, round(slope * (-1 / offset))
        tried += [(float(f"{high:.4g}"), original), (_f32(high), original)]
    for high, original in tried:
        smooth = (original / wavelen - 1) / (high - 1)
        blend = 1 / ((1 - smooth) / factor + smooth)
        want = np.where(wavelen < original / high, 1.0, np.where(wavelen > original, factor, blend))
        if np.allclose(want, factors, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": _f32(factor),
                "low_freq_factor": 1.0,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise BuildError(
        f"{path.name}: rope_freqs.weight is not LLaMA 3's scaling for any setting tried "
        f"(factor {factor}); such per-frequency factors are not supported"
    )


def _longrope_scaling(
    tensors: dict[str, Any], meta: _Metadata, key: Callable[[str], str], path: Path
) -> dict[str, Any]:
    """Phi-3's longrope from llama.cpp's ``rope_factors_long``/``_short`` and its original
    context; the attention factor only where it is not the one HF derives from the two
    context lengths (``sqrt(1 + ln(max / original) / ln(original))``)."""
    original = int(meta.require(key("rope.scaling.original_context_length"), path))
    context = int(meta.get(key("context_length"), original))
    scale = context / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in _factors(tensors["rope_factors_long.weight"])],
        "short_factor": [float(x) for x in _factors(tensors["rope_factors_short.weight"])],
        "original_max_position_embeddings": original,
    }
    attn = meta.get(key("rope.scaling.attn_factor"))
    if attn is not None and abs(float(attn) - derived) > 1e-6 * derived:
        rope["attention_factor"] = _f32(attn)
    return rope


# -- weights ------------------------------------------------------------------------------------
def _write_weights(
    tensors: dict[str, Any],
    config: dict[str, Any],
    arch: GgufArch,
    out: Path,
    path: Path,
    keep: frozenset[str],
    kept: GgufKept | None,
    keep_table: bool,
) -> None:
    """Dequantize tensor by tensor (or keep quantized) into safetensors shards of at most
    SHARD_BYTES."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for hf_name, tensor in _hf_tensors(tensors, config, arch, path, keep, kept, keep_table):
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
    arch: GgufArch,
    path: Path,
    keep: frozenset[str] = frozenset(),
    kept: GgufKept | None = None,
    keep_table: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in tensors.items():
        if name.startswith(_ROPE_TENSORS):  # read into the config's rope_scaling
            continue
        hf_name = _hf_name(name, arch)
        if hf_name is None:
            raise BuildError(
                f"{path.name}: tensor {name!r} has no counterpart in a {arch.hf_class} model"
            )
        rope_heads = None
        if arch.rope_permuted and hf_name.endswith("q_proj.weight"):
            rope_heads = heads
        elif arch.rope_permuted and hf_name.endswith("k_proj.weight"):
            rope_heads = kv_heads
        type_name = tensor.tensor_type.name
        linear = hf_name.endswith("proj.weight") or hf_name == "lm_head.weight"
        table = keep_table and hf_name == TOP_TENSORS["token_embd.weight"]
        kept_here = type_name in keep if linear else table and type_name in KEEPABLE
        if kept is not None and type_name not in _FLOAT_TYPES:
            kept.count(type_name, kept_here, linear)
        if kept_here:
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
        if arch.norm_offset and hf_name.endswith("norm.weight"):
            array = array - np.float32(arch.norm_offset)
        yield hf_name, torch.from_numpy(np.array(array, dtype=np.float32, order="C"))


def _hf_name(name: str, arch: GgufArch) -> str | None:
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    prefix, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if prefix != "blk" or not index.isdigit() or suffix not in arch.block_tensors:
        return None
    return f"model.layers.{int(index)}.{arch.block_tensors[suffix]}"


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
    if kind not in ("gpt2", "llama"):
        raise BuildError(
            f"{path.name}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE "
            "'gpt2' and SentencePiece 'llama' are)"
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens", path))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tokenizer = (
        _byte_level_bpe(meta, tokens, path) if kind == "gpt2" else _sentencepiece(meta, tokens)
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    special = (_CONTROL, _UNKNOWN) if kind == "llama" else (_CONTROL,)
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k in special
        ]
    )
    return tokenizer


def _byte_level_bpe(meta: _Metadata, tokens: list[str], path: Path) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges", path)]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece(meta: _Metadata, tokens: list[str]) -> Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a ``tokenizers`` BPE.

    llama.cpp merges, again and again, the adjacent pair whose joined piece scores highest,
    and spells bytes no piece covers as ``<0xNN>`` tokens; a BPE whose merges are ranked by
    the joined piece's score, with byte fallback, does the same. A space goes in front of the
    text (``add_space_prefix``, on unless the file says otherwise) and every space is
    spelled as U+2581."""
    scores = [float(x) for x in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=tokens[int(unk)] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", _SPACE)]
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPACE), *steps] if prefix else steps
    )
    tail = [decoders.Strip(" ", 1, 0)] if prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
    )
    return tokenizer


def _pre_tokenizer(pre: str, path: Path) -> Any:
    """The split llama.cpp applies for ``tokenizer.ggml.pre`` before byte-level BPE."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):  # every digit on its own, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    splits = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if pre in splits:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(splits[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise BuildError(f"{path.name}: GGUF pre-tokenizer {pre!r} is not supported")


def _tokenizer_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens", []))
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"

    def text(key: str) -> str | None:
        value = config.get(key)
        return tokens[value] if isinstance(value, int) and 0 <= value < len(tokens) else None

    unk = meta.get("tokenizer.ggml.unknown_token_id")
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # llama.cpp puts BOS before a SentencePiece text unless the file says otherwise
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)),
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
