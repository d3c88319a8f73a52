"""Write HF-layout checkpoints with random weights from a preset.

Why: real weights cannot be downloaded here, yet the runner, the parity tests against HF
transformers and the benchmarks all need checkpoints. The directory written here is exactly what
`save_pretrained` produces for OPTForCausalLM / LlamaForCausalLM (config.json,
generation_config.json, model.safetensors with HF parameter names) plus tokenizer files, so the
code that loads it is the code that loads a real checkpoint. It is built without transformers so
that building never depends on a test-only package.

The files are a pure function of (preset, seed, dtype): weights come from a seeded
`torch.Generator` in a fixed order, JSON is written with sorted keys, and the tokenizer trains
deterministically. Directories appear atomically (built in a sibling temp dir, then renamed), so
a crash or a concurrent builder never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from quanta.build.presets import ModelPreset, get_preset
from quanta.build.tokenizer import special_token_ids, write_tokenizer

# NOTE: config files follow the layout of real hub checkpoints (`torch_dtype`, `rope_theta`),
# which every transformers version and vLLM read; this version string says which layout.
HF_LAYOUT_VERSION = "4.46.0"
INIT_STD = 0.02
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
PRESET_FILE = "quanta_preset.json"

Init = Literal["normal", "ones", "zeros"]
TensorSpec = tuple[str, tuple[int, ...], Init]


def make_checkpoint(
    preset: str | ModelPreset,
    out_dir: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Build the preset's checkpoint into out_dir and return out_dir.

    Refuses (FileExistsError) when out_dir is a non-empty directory, unless overwrite=True, in
    which case the old contents are replaced only once the new checkpoint is complete.
    """
    spec = get_preset(preset)
    out_dir = Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if _is_nonempty_dir(out_dir) and not overwrite:
        raise FileExistsError(
            f"{out_dir} already exists and is not empty; pass overwrite=True to replace it"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)
        _write_checkpoint(spec, tmp, seed=seed, dtype=dtype)
        move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_checkpoint(
    preset: str | ModelPreset, out_dir: Path, seed: int = 0, *, dtype: str = "float32"
) -> Path:
    """Return out_dir, building the checkpoint first only if out_dir is missing or empty.

    An existing directory must have been built from the same preset, seed and dtype; anything
    else is an error rather than silently serving a different model.
    """
    spec = get_preset(preset)
    out_dir = Path(out_dir)
    if not _is_nonempty_dir(out_dir):
        try:
            return make_checkpoint(spec, out_dir, seed=seed, dtype=dtype)
        except FileExistsError:
            if not out_dir.is_dir():
                raise
            # Another process finished the same build first; check what it made below.
    _check_provenance(out_dir, _provenance(spec, seed, dtype))
    return out_dir


def hf_config(spec: ModelPreset, dtype: str = "float32") -> dict[str, object]:
    """config.json as HF writes it for the family's *ForCausalLM class."""
    common: dict[str, object] = special_token_ids(spec.family) | {
        "attention_dropout": 0.0,
        "hidden_size": spec.hidden_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "torch_dtype": dtype,
        "transformers_version": HF_LAYOUT_VERSION,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if spec.family == "opt":
        return common | {
            "_remove_final_layer_norm": False,
            "activation_dropout": 0.0,
            "activation_function": "relu",
            "architectures": ["OPTForCausalLM"],
            "do_layer_norm_before": True,
            "dropout": 0.1,
            "enable_bias": True,
            "ffn_dim": spec.intermediate_size,
            "init_std": INIT_STD,
            "layer_norm_elementwise_affine": True,
            "layerdrop": 0.0,
            "model_type": "opt",
            "prefix": "</s>",
            "tie_word_embeddings": True,
            "word_embed_proj_dim": spec.word_embed_proj_dim,
        }
    return common | {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "intermediate_size": spec.intermediate_size,
        "mlp_bias": False,
        "model_type": "llama",
        "num_key_value_heads": spec.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
    }


def tensor_specs(spec: ModelPreset) -> list[TensorSpec]:
    """Every stored tensor in HF names, with its shape and HF's initialisation.

    OPT ties lm_head to embed_tokens, so (as in HF's save_pretrained) lm_head is not stored.
    """
    h, f, v, n = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.num_hidden_layers
    out: list[TensorSpec] = []
    if spec.family == "opt":
        e = spec.word_embed_proj_dim or h
        p = "model.decoder."
        out += [(p + "embed_tokens.weight", (v, e), "normal")]
        # OPT's learned positions are offset by 2, so the table has 2 extra rows.
        out += [(p + "embed_positions.weight", (spec.max_position_embeddings + 2, h), "normal")]
        if e != h:
            out += [(p + "project_in.weight", (h, e), "normal")]
            out += [(p + "project_out.weight", (e, h), "normal")]
        for i in range(n):
            lp = f"{p}layers.{i}."
            for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
                out += _linear(f"{lp}self_attn.{proj}", h, h, bias=True)
            out += _layer_norm(f"{lp}self_attn_layer_norm", h)
            out += _linear(f"{lp}fc1", f, h, bias=True)
            out += _linear(f"{lp}fc2", h, f, bias=True)
            out += _layer_norm(f"{lp}final_layer_norm", h)
        out += _layer_norm(p + "final_layer_norm", h)
        return out
    out += [("model.embed_tokens.weight", (v, h), "normal")]
    kv = spec.kv_heads * spec.head_dim
    for i in range(n):
        lp = f"model.layers.{i}."
        out += _linear(lp + "self_attn.q_proj", h, h)
        out += _linear(lp + "self_attn.k_proj", kv, h)
        out += _linear(lp + "self_attn.v_proj", kv, h)
        out += _linear(lp + "self_attn.o_proj", h, h)
        out += _linear(lp + "mlp.gate_proj", f, h)
        out += _linear(lp + "mlp.up_proj", f, h)
        out += _linear(lp + "mlp.down_proj", h, f)
        out += [(lp + "input_layernorm.weight", (h,), "ones")]
        out += [(lp + "post_attention_layernorm.weight", (h,), "ones")]
    out += [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "normal")]
    return out


def random_weights(spec: ModelPreset, seed: int, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: normal(0, 0.02) matrices, unit norm weights, zero biases.

    Sampled in float32 in tensor_specs order from one seeded generator, then cast, so the bytes
    depend only on (spec, seed, dtype). OPT's padding row of embed_tokens is zero, as HF's
    nn.Embedding(padding_idx=pad_token_id) initialises it.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, init in tensor_specs(spec):
        if init == "normal":
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
        else:
            t = torch.ones(shape) if init == "ones" else torch.zeros(shape)
        tensors[name] = t.to(DTYPES[dtype])
    pad_id = special_token_ids(spec.family)["pad_token_id"]
    if spec.family == "opt" and pad_id is not None:
        tensors["model.decoder.embed_tokens.weight"][pad_id].zero_()
    return tensors


def _linear(prefix: str, rows: int, cols: int, *, bias: bool = False) -> list[TensorSpec]:
    weight: TensorSpec = (f"{prefix}.weight", (rows, cols), "normal")
    return [weight, (f"{prefix}.bias", (rows,), "zeros")] if bias else [weight]


def _layer_norm(prefix: str, width: int) -> list[TensorSpec]:
    return [(f"{prefix}.weight", (width,), "ones"), (f"{prefix}.bias", (width,), "zeros")]


def _write_checkpoint(spec: ModelPreset, out: Path, *, seed: int, dtype: str) -> None:
    tokenizer = write_tokenizer(spec.family, out, model_max_length=spec.max_position_embeddings)
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise ValueError(
            f"preset {spec.name!r} has vocab_size {spec.vocab_size} but its tokenizer has "
            f"{tokenizer.get_vocab_size()} tokens; the model must cover every token id"
        )
    config = hf_config(spec, dtype)
    ids = {k: v for k, v in special_token_ids(spec.family).items() if v is not None}
    generation = ids | {"_from_model_config": True, "transformers_version": HF_LAYOUT_VERSION}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    _write_json(out / PRESET_FILE, _provenance(spec, seed, dtype))
    weights = out / "model.safetensors"
    save_file(random_weights(spec, seed, dtype), weights, metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it owner-only; match the other files


def _provenance(spec: ModelPreset, seed: int, dtype: str) -> dict[str, object]:
    return {"preset": spec.name, "seed": seed, "dtype": dtype, "spec": spec.model_dump()}


def _check_provenance(out_dir: Path, expected: dict[str, object]) -> None:
    path = out_dir / PRESET_FILE
    if not path.is_file():
        raise FileExistsError(
            f"{out_dir} is not empty and was not built by quanta (no {path.name})"
        )
    found = json.loads(path.read_text(encoding="utf-8"))
    if found != expected:
        raise ValueError(
            f"{out_dir} holds a different checkpoint (preset {found.get('preset')!r}, seed "
            f"{found.get('seed')}, dtype {found.get('dtype')!r}) than requested (preset "
            f"{expected['preset']!r}, seed {expected['seed']}, dtype {expected['dtype']!r}); "
            "remove it or use make_checkpoint(..., overwrite=True)"
        )


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename tmp to out_dir; an existing out_dir is moved aside first and removed after."""
    old: Path | None = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex}")
        out_dir.rename(old)
    try:
        os.rename(tmp, out_dir)
    except OSError as exc:
        if old is not None and not out_dir.exists():
            old.rename(out_dir)
            old = None
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"{out_dir} was created by someone else meanwhile") from exc
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
