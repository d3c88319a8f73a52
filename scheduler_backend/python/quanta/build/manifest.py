"""The engine manifest: what an engine directory was built for, and the check at load.

An engine directory (``quanta build``) is an HF-layout checkpoint converted to its serving
dtype, plus ``quanta_engine.json``. The manifest records the limits and cache sizing the
engine was validated for, so a server can take them as its defaults and refuse settings that
go beyond them, and so a copied, edited or half-written engine is caught at start-up rather
than by a wrong answer. Pure pydantic, no torch: ``quanta check-config`` and the Triton
backend run the same check before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from quanta.core.config import CacheConfig, EngineConfig, SchedulerConfig
from quanta.families import known_family
from quanta.shape import ModelShape

MANIFEST_FILE = "quanta_engine.json"
# 2: int4 and grouped int8 scales stored in fp16 and int4 zero points as fp16 ``mins``
# (``quanta.runner.quantized``); a format-1 engine (fp32 scales and ``zeros``) still loads.
ENGINE_FORMAT = 2
Dtype = Literal["float32", "float16", "bfloat16"]
DeviceKind = Literal["cpu", "cuda"]


class EngineManifestError(ValueError):
    """An engine directory does not match its manifest, the machine, or the serving config."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineModel(ModelShape):
    """The model an engine holds: its shape, as the runner reads it from ``config.json``, of a
    registered family, and the HF architecture class it names."""

    family: Annotated[str, AfterValidator(known_family)]
    architecture: str


class Limits(_Frozen):
    """The most a server of this engine may ask for (``trtllm-build``'s names)."""

    max_batch_size: int = Field(ge=1)  # sequences per step: the server's max_num_seqs
    max_num_tokens: int = Field(ge=1)  # tokens per step: max_num_batched_tokens
    max_seq_len: int = Field(ge=1)  # prompt + output tokens of one request


class CacheSizing(_Frozen):
    """The KV pools for the stated memory budgets, in blocks of ``block_size`` tokens."""

    block_size: int = Field(ge=1)
    kv_bytes_per_block: int = Field(ge=1)
    kv_cache_memory: int = Field(ge=1)
    num_device_blocks: int = Field(ge=1)
    host_cache_memory: int = Field(ge=0)
    num_host_blocks: int = Field(ge=0)
    max_cached_tokens: int = Field(ge=1)


class Capabilities(_Frozen):
    """Runner capabilities the engine offers (policies that need more are refused)."""

    hidden_cache: bool
    layer_safepoints: bool
    async_swap: bool


class WeightFile(_Frozen):
    name: str
    bytes: int = Field(ge=0)
    sha256: str


class Source(_Frozen):
    """The checkpoint the engine was built from: every file's digest and one over all; for a
    GGUF file, also the quantization its weights were stored in before dequantizing."""

    path: str
    sha256: str
    files: dict[str, str]
    format: Literal["hf", "gguf"] = "hf"
    quantization: str | None = None


class Quantization(_Frozen):
    """How the engine's linear layers are stored (``docs/quantization.md``): ``mode`` int8 or
    int4 (``mixed`` when a GGUF's kept tensors differ), ``group_size`` input columns per scale
    (None: int8 per output channel, or mixed), and for a GGUF which of its tensor types were
    kept quantized and which were dequantized."""

    mode: Literal["int8", "int4", "mixed"]
    group_size: int | None = None
    symmetric: bool = True
    lm_head: bool = False
    lm_head_mode: Literal["int8", "int4"] | None = None  # the head's, when quantized
    embedding: bool = False
    kept: dict[str, int] = Field(default_factory=dict)
    dequantized: dict[str, int] = Field(default_factory=dict)
    # Linears left in the serving dtype (int4 groups must divide their input width).
    not_quantized: list[str] = Field(default_factory=list)
    # Linears in smaller int4 groups than group_size (the largest that divides their width).
    smaller_groups: dict[str, int] = Field(default_factory=dict)


class EngineManifest(_Frozen):
    """``quanta_engine.json``."""

    format: int = ENGINE_FORMAT
    name: str
    quanta_version: str
    builder: str
    created: str
    model: EngineModel
    num_parameters: int
    dtype: Dtype
    device: DeviceKind
    limits: Limits
    cache: CacheSizing
    capabilities: Capabilities
    chat_template: bool
    weights: list[WeightFile]
    source: Source
    quantization: Quantization | None = None  # None: every weight in ``dtype``
    # Ranks a server runs by default (``--tp_size``); ``cache`` is sized per rank for it.
    tensor_parallel_size: int = Field(1, ge=1)

    def write(self, engine_dir: Path) -> Path:
        path = Path(engine_dir) / MANIFEST_FILE
        path.write_text(json.dumps(self.model_dump(), indent=2) + "\n", encoding="utf-8")
        return path


def read_manifest(model_dir: str | Path) -> EngineManifest | None:
    """The manifest of an engine directory, or None for a plain checkpoint."""
    path = Path(model_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineManifestError(f"{path} is not readable JSON: {exc}") from None
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if isinstance(fmt, int) and fmt > ENGINE_FORMAT:
        raise EngineManifestError(
            f"{path}: engine format {fmt} is newer than this Quanta reads "
            f"({ENGINE_FORMAT}); upgrade Quanta or rebuild the engine with this one"
        )
    try:
        return EngineManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "manifest"
        raise EngineManifestError(
            f"{path}: {where}: {first['msg']} ({exc.error_count()} problem(s)); rebuild the "
            "engine with `quanta build`"
        ) from None


def sha256_file(path: Path, advance: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file read in chunks (``advance`` learns each chunk's size)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return digest.hexdigest()


def check_files(manifest: EngineManifest, engine_dir: Path, shape: EngineModel) -> None:
    """The directory holds what the manifest lists: same shape in config.json, every weight
    file present with its recorded size (digests are checked by ``check-config --verify``)."""
    if shape != manifest.model:
        diff = [
            f"{k} {getattr(manifest.model, k)} -> {getattr(shape, k)}"
            for k in EngineModel.model_fields
            if getattr(shape, k) != getattr(manifest.model, k)
        ]
        raise EngineManifestError(
            f"{engine_dir}: config.json no longer matches the engine's manifest "
            f"({', '.join(diff)}); rebuild the engine"
        )
    for weight in manifest.weights:
        path = engine_dir / weight.name
        if not path.is_file():
            raise EngineManifestError(f"{engine_dir}: weight file {weight.name} is missing")
        size = path.stat().st_size
        if size != weight.bytes:
            raise EngineManifestError(
                f"{engine_dir}: {weight.name} has {size} bytes, the manifest says "
                f"{weight.bytes}: the engine was changed or not fully copied; rebuild it"
            )


def apply_manifest(config: EngineConfig, manifest: EngineManifest) -> EngineConfig:
    """``config`` with the engine's limits and cache sizing as defaults.

    What the caller set explicitly (pydantic's ``model_fields_set``) wins, within the limits
    the engine was built for; a dtype or device other than the engine's is refused, since
    its weights and cache sizing were made for them.
    """
    where = f"engine {manifest.name!r}"
    if config.dtype is not None and config.dtype != manifest.dtype:
        raise EngineManifestError(
            f"{where} was built for dtype {manifest.dtype}, the server asks for "
            f"{config.dtype}: drop the dtype setting or rebuild with --dtype {config.dtype}"
        )
    built = manifest.quantization.mode if manifest.quantization else "none"
    if config.quantization is not None and config.quantization != built:
        raise EngineManifestError(
            f"{where} was built with quantization {built}, the server asks for "
            f"{config.quantization}: drop the quantization setting or rebuild with "
            f"--quantization {config.quantization}"
        )
    device_kind = config.device.split(":", 1)[0]
    if device_kind != manifest.device:
        raise EngineManifestError(
            f"{where} was built for device {manifest.device}, the server asks for "
            f"{config.device}: rebuild with --device {device_kind}"
        )
    limits = manifest.limits
    sched_set = config.scheduler.model_fields_set
    sched = config.scheduler.model_dump()
    for key, limit, flag in (
        ("max_num_seqs", limits.max_batch_size, "--max-batch-size"),
        ("max_num_batched_tokens", limits.max_num_tokens, "--max-num-tokens"),
    ):
        if key not in sched_set:
            sched[key] = limit
        elif sched[key] > limit:
            raise EngineManifestError(
                f"{key} {sched[key]} exceeds the {limit} {where} was built for "
                f"(rebuild with {flag} {sched[key]})"
            )
    max_seq_len = config.max_seq_len
    if max_seq_len is None:
        max_seq_len = limits.max_seq_len
    elif max_seq_len > limits.max_seq_len:
        raise EngineManifestError(
            f"max_seq_len {max_seq_len} exceeds the {limits.max_seq_len} {where} was built for "
            f"(rebuild with --max-seq-len {max_seq_len})"
        )
    sizing = manifest.cache
    given = config.cache.model_dump(include=config.cache.model_fields_set)
    tp = config.tensor_parallel_size
    if "tensor_parallel_size" not in config.model_fields_set:
        tp = manifest.tensor_parallel_size
    same_split = tp == manifest.tensor_parallel_size
    cache: dict[str, Any] = {
        "block_size": sizing.block_size,
        "device_bytes": sizing.kv_cache_memory,
        "host_bytes": sizing.host_cache_memory,
    }
    if given.get("block_size", sizing.block_size) == sizing.block_size and same_split:
        # The manifest's block counts hold for its block size and split; a budget given
        # explicitly (in bytes or blocks) replaces them, and another split resizes the bytes.
        if not {"device_bytes", "num_device_blocks"} & given.keys():
            cache["num_device_blocks"] = sizing.num_device_blocks
        if not {"host_bytes", "num_host_blocks"} & given.keys():
            cache["num_host_blocks"] = sizing.num_host_blocks
    return config.model_copy(
        update={
            "dtype": manifest.dtype,
            "max_seq_len": max_seq_len,
            "scheduler": SchedulerConfig(**sched),
            "cache": CacheConfig(**(cache | given)),
            "tensor_parallel_size": tp,
        }
    )
