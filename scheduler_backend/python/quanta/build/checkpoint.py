"""Write HF-layout checkpoints with random weights from a preset.

Why: real weights cannot be downloaded here, yet the runner, the parity tests against HF
transformers and the benchmarks all need checkpoints. The directory written here is exactly what
`save_pretrained` produces for the family's *ForCausalLM class (config.json,
generation_config.json, model.safetensors with HF parameter names) plus tokenizer files, so the
code that loads it is the code that loads a real checkpoint. It is built without transformers so
that building never depends on a test-only package. What differs per family (its config keys,
tensor layout and special tokens) comes from its spec in ``quanta.families``.

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

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from quanta.build.presets import ModelPreset, get_preset
from quanta.build.tokenizer import special_token_ids, write_tokenizer
from quanta.families import get_family
from quanta.families.spec import INIT_STD, TensorSpec

# NOTE: config files follow the layout of real hub checkpoints (`torch_dtype`, `rope_theta`),
# which every transformers version and vLLM read; this version string says which layout.
HF_LAYOUT_VERSION = "4.46.0"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
PRESET_FILE = "quanta_preset.json"


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
        "hidden_size": spec.shape.hidden_size,
        "max_position_embeddings": spec.shape.max_position_embeddings,
        "num_attention_heads": spec.shape.num_heads,
        "num_hidden_layers": spec.shape.num_layers,
        "torch_dtype": dtype,
        "transformers_version": HF_LAYOUT_VERSION,
        "use_cache": True,
        "vocab_size": spec.shape.vocab_size,
    }
    return common | get_family(spec.family).hf_config(spec)


def tensor_specs(spec: ModelPreset) -> list[TensorSpec]:
    """Every stored tensor in HF names, with its shape and HF's initialisation.

    A tied LM head (OPT's) is not stored, as in HF's save_pretrained.
    """
    return get_family(spec.family).tensor_specs(spec)


def random_weights(spec: ModelPreset, seed: int, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: normal(0, 0.02) matrices, unit norm weights, zero biases.

    Sampled in float32 in tensor_specs order from one seeded generator, then cast, so the bytes
    depend only on (spec, seed, dtype). The padding row of the family's ``pad_embedding`` (OPT's
    embed_tokens) is zero, as HF's nn.Embedding(padding_idx=pad_token_id) initialises it.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, init in tensor_specs(spec):
        if init == "normal":
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
        else:
            t = torch.ones(shape) if init == "ones" else torch.zeros(shape)
        tensors[name] = t.to(DTYPES[dtype])
    pad_embedding = get_family(spec.family).pad_embedding
    pad_id = special_token_ids(spec.family)["pad_token_id"]
    if pad_embedding is not None and pad_id is not None:
        tensors[pad_embedding][pad_id].zero_()
    return tensors


def write_model_files(preset: str | ModelPreset, out: Path, dtype: str = "float32") -> Path:
    """Everything a checkpoint of the preset holds but its weights (config.json,
    generation_config.json, the tokenizer) into the existing directory ``out``.

    An engine loads such a directory with random weights made on its device
    (``EngineConfig.load_format="dummy"``), and HF transformers builds the model from its
    config: how a real shape is benchmarked with no checkpoint on disk."""
    spec = get_preset(preset)
    shape = spec.shape
    tokenizer = write_tokenizer(spec.family, out, model_max_length=shape.max_position_embeddings)
    if tokenizer.get_vocab_size() > shape.vocab_size:
        raise ValueError(
            f"preset {spec.name!r} has vocab_size {shape.vocab_size} but its tokenizer has "
            f"{tokenizer.get_vocab_size()} tokens; the model must cover every token id"
        )
    config = hf_config(spec, dtype)
    ids = {k: v for k, v in special_token_ids(spec.family).items() if v is not None}
    generation = ids | {"_from_model_config": True, "transformers_version": HF_LAYOUT_VERSION}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    return out


def _write_checkpoint(spec: ModelPreset, out: Path, *, seed: int, dtype: str) -> None:
    write_model_files(spec, out, dtype)
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
    if _as_read(found) != _as_read(expected):
        raise ValueError(
            f"{out_dir} holds a different checkpoint (preset {found.get('preset')!r}, seed "
            f"{found.get('seed')}, dtype {found.get('dtype')!r}) than requested (preset "
            f"{expected['preset']!r}, seed {expected['seed']}, dtype {expected['dtype']!r}); "
            "remove it or use make_checkpoint(..., overwrite=True)"
        )


def _as_read(provenance: dict[str, object]) -> dict[str, object]:
    """A provenance with its preset read as a ``ModelPreset``, so one written before presets
    held a shape (its sizes in HF's flat names) matches the same preset written now."""
    try:
        return {**provenance, "spec": ModelPreset.model_validate(provenance.get("spec"))}
    except ValidationError:
        return provenance  # not a preset this version can read: it matches nothing


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
