"""``quanta build``: turn an HF checkpoint into an engine directory with a manifest.

Why a build step at all: the checkpoint is validated once, against the runner's own model
(names, shapes, tokenizer, chat template), before any server depends on it; the weights are
stored in the dtype they are served in, so a load is a plain read with no cast and no second
copy; and the limits and cache sizing the engine was sized for travel with it
(``quanta_engine.json``), so a server cannot silently run it beyond them.

Peak memory of a build is one output shard plus one tensor: tensors are read one at a time and
shards are written as they fill. The directory appears atomically (built beside ``out``, then
renamed), so an interrupted build never leaves a half engine behind.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open

from quanta.build.checkpoint import PRESET_FILE, move_into_place
from quanta.build.gguf_kept import GgufKept
from quanta.build.manifest import (
    MANIFEST_FILE,
    CacheSizing,
    Capabilities,
    DeviceKind,
    Dtype,
    EngineManifest,
    Limits,
    Source,
    WeightFile,
    sha256_file,
)
from quanta.build.quantization import (
    QuantPlan,
    gguf_keep_types,
    gguf_keeps_table,
    quant_manifest,
    quant_plan,
    quantized_weight_bytes,
)
from quanta.build.shape import model_shape
from quanta.build.shards import name_shards, shard_writer
from quanta.build.steps import BuildError, FamilyBuilder, builder_for
from quanta.core.output import RunnerCapabilities
from quanta.runner.devices import device_memory_bytes
from quanta.runner.model_runner import ModelRunner, offers_hidden_cache, resolve_dtype
from quanta.runner.models import build_model_skeleton
from quanta.runner.models.config import ModelConfig, load_model_config
from quanta.runner.models.loader import checkpoint_files
from quanta.runner.quantized import QUANT_SUFFIXES
from quanta.runner.tensor_parallel.shard import check_divisible

GiB = 1 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_NOT_COPIED = {"config.json", MANIFEST_FILE, PRESET_FILE, "model.safetensors.index.json"}

Progress = Callable[[str, int], Callable[[int], None]]
"""``progress(description, total)`` starts a task and returns ``advance(amount)``."""


class BuildOptions(BaseModel):
    """What ``quanta build`` takes; names follow ``trtllm-build`` where they mean the same."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = None  # default: the output directory's name
    dtype: Dtype | None = None  # default: the runner's default for the device
    device: DeviceKind = "cpu"
    max_batch_size: int = Field(128, ge=1)
    max_num_tokens: int = Field(2048, ge=1)
    max_seq_len: int | None = Field(None, ge=1)  # default: the model's context length
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory: int = Field(1 * GiB, ge=1)
    host_cache_memory: int = Field(2 * GiB, ge=0)
    max_shard_size: int = Field(2 * GiB, ge=1)
    # Weight-only quantization of the linear layers (docs/quantization.md); keep: a GGUF's
    # quantized tensors as the file holds them. None: every weight in ``dtype``.
    quantization: Literal["int8", "int4", "keep"] | None = None
    # int4 input columns per scale: 32 by default, llama.cpp's Q4 group (docs/quantization.md
    # measures 64 re-quantizing a 135M model's weights at 2.5x the perplexity).
    group_size: Literal[32, 64, 128] = 32
    symmetric: bool = False  # int4 without zero points (int8 is always symmetric)
    quantize_lm_head: bool = False
    # The head's mode when it is quantized; None: the layers' (an int8 head beside int4 layers
    # keeps most of the head's quality, docs/quantization.md).
    lm_head_quantization: Literal["int8", "int4"] | None = None
    # The token embedding's table quantized as well; a tied head then shares it, stored once
    # (docs/quantization.md).
    quantize_embedding: bool = False
    # Ranks the engine is served on by default (trtllm-build's --tp_size); its KV sizing is
    # per rank. The weights stay whole on disk: every rank keeps its share at load.
    tensor_parallel_size: int = Field(1, ge=1)


def build_engine_dir(
    checkpoint: Path,
    out: Path,
    options: BuildOptions | None = None,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> EngineManifest:
    """Validate ``checkpoint`` (an HF directory or a ``.gguf`` file), convert it into ``out``
    and return the manifest written."""
    options = options or BuildOptions()
    checkpoint, out = Path(checkpoint), Path(out)
    progress = progress or _no_progress
    if checkpoint.resolve() == out.resolve():
        raise BuildError("--out must differ from the checkpoint directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty")
    if checkpoint.is_file() and checkpoint.suffix == ".gguf":
        return _build_from_gguf(checkpoint, out, options, progress)
    if not checkpoint.is_dir():
        raise BuildError(f"{checkpoint} is neither a checkpoint directory nor a .gguf file")
    return _build(checkpoint, out, options, _hash_source(checkpoint, progress), progress)


def _build_from_gguf(
    gguf: Path, out: Path, options: BuildOptions, progress: Progress
) -> EngineManifest:
    """Dequantize into an HF-layout checkpoint beside ``out``, then build that; the manifest
    names the GGUF file (its digest and quantization), not the intermediate directory."""
    from quanta.build.gguf_import import gguf_to_checkpoint

    advance = progress("hashing the GGUF file", gguf.stat().st_size)
    digest = sha256_file(gguf, advance)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.gguf-", dir=out.parent) as tmp:
        keep = gguf_keep_types(options.quantization)
        advance = progress("reading the GGUF file" if keep else "dequantizing the GGUF file", 1)
        summary = gguf_to_checkpoint(
            gguf, Path(tmp), keep=keep, keep_table=gguf_keeps_table(options)
        )
        advance(1)
        source = Source(
            path=str(gguf.resolve()),
            sha256=digest,
            files={gguf.name: digest},
            format="gguf",
            quantization=summary.quantization,
        )
        try:
            return _build(Path(tmp), out, options, source, progress, summary.kept)
        except BuildError as exc:
            # The user gave the GGUF file: name it, not the directory it was unpacked into.
            why = str(exc).replace(f"{tmp}/config.json", f"{gguf}'s metadata")
            raise BuildError(why.replace(tmp, str(gguf))) from None


def _build(
    checkpoint: Path,
    out: Path,
    options: BuildOptions,
    source: Source,
    progress: Progress,
    kept: GgufKept | None = None,
) -> EngineManifest:
    config, raw = _read_config(checkpoint)
    builder = builder_for(config.family, options.device)
    builder.check_config(raw, config)
    dtype = resolve_dtype(options.dtype, torch.device(options.device))
    dtype_name = str(dtype).removeprefix("torch.")
    plan = _plan_tensors(checkpoint, config, builder)
    quant = quant_plan(options, config, frozenset(plan.prequantized), checkpoint)
    if quant is not None and quant.mode == "keep" and kept is None:
        # NOTE: only a GGUF file says which format its quantized tensors hold
        raise BuildError(
            f"{checkpoint} holds {len(plan.prequantized)} quantized weight(s) (e.g. "
            f"{sorted(plan.prequantized)[0]!r}): name the mode they were built with, "
            "--quantization int8 or int4 (keep reads a GGUF file's tensors)"
        )
    limits = _limits(options, config)
    _check_split(options, config, quant is not None)
    weight_bytes = plan.bytes_at(dtype)
    if quant is not None:
        weight_bytes = quantized_weight_bytes(build_model_skeleton(config), quant, dtype)
    sizing = _cache_sizing(options, config, dtype, limits, weight_bytes)
    chat_template = _check_tokenizer(checkpoint, config)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tmp.chmod(0o755)
        weights = _convert(checkpoint, tmp, plan, builder, dtype, options, progress, quant)
        _copy_side_files(checkpoint, tmp)
        serving = builder.serving_config(raw, dtype_name)
        (tmp / "config.json").write_text(json.dumps(serving, indent=2) + "\n", encoding="utf-8")
        manifest = EngineManifest(
            name=options.name or out.name,
            quanta_version=_quanta_version(),
            builder=builder.name,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            model=model_shape(config, checkpoint),
            num_parameters=plan.num_parameters,
            dtype=dtype_name,  # type: ignore[arg-type]
            device=options.device,
            limits=limits,
            cache=sizing,
            capabilities=Capabilities(
                **dataclasses.asdict(
                    RunnerCapabilities(
                        hidden_cache=offers_hidden_cache(config),
                        layer_safepoints=True,
                    )
                )
            ),
            chat_template=chat_template,
            weights=weights,
            source=source,
            quantization=quant_manifest(quant, frozenset(plan.prequantized), kept),
            tensor_parallel_size=options.tensor_parallel_size,
        )
        manifest.write(tmp)
        move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


# -- validation --------------------------------------------------------------------------------
def _read_config(checkpoint: Path) -> tuple[ModelConfig, dict[str, Any]]:
    if not (checkpoint / "config.json").is_file():
        raise BuildError(f"{checkpoint} is not a checkpoint directory (no config.json)")
    raw = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    try:
        return load_model_config(checkpoint), raw
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise BuildError(f"{checkpoint}/config.json: {exc}") from None


@dataclasses.dataclass
class _Plan:
    """Which stored tensor becomes which runner parameter, checked before anything is read."""

    keys: dict[Path, list[tuple[str, str]]]  # file -> [(checkpoint key, parameter name)]
    numel: dict[str, int]
    # Linear weights stored quantized already (a GGUF's kept tensors): name -> its parts.
    prequantized: dict[str, set[str]] = dataclasses.field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(self.numel.values())

    def bytes_at(self, dtype: torch.dtype) -> int:
        return self.num_parameters * torch.empty((), dtype=dtype).element_size()


def _plan_tensors(checkpoint: Path, config: ModelConfig, builder: FamilyBuilder) -> _Plan:
    """Names and shapes against a meta-device skeleton of the runner's model: a checkpoint
    that would fail to load (or load wrongly) fails here, before a byte is converted."""
    try:
        skeleton = build_model_skeleton(config)
    except (ValueError, NotImplementedError) as exc:
        raise BuildError(f"{checkpoint}: {exc}") from None
    params = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
    keys: dict[Path, list[tuple[str, str]]] = {}
    seen: dict[str, str] = {}
    unexpected: list[str] = []
    prequantized: dict[str, set[str]] = {}
    try:
        files = checkpoint_files(checkpoint)
    except FileNotFoundError as exc:
        raise BuildError(str(exc)) from None
    for path in files:
        keys[path] = []
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            for key in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                base, _, part = key.rpartition(".")
                if "." + part in QUANT_SUFFIXES:
                    weight = builder.tensor_name(base + ".weight", params | _head(params))
                    if weight is None:
                        unexpected.append(key)
                        continue
                    prequantized.setdefault(weight, set()).add(part)
                    keys[path].append((key, weight.removesuffix(".weight") + "." + part))
                    seen.setdefault(weight, key)
                    continue
                name = builder.tensor_name(key, params)
                if name is None:
                    if not builder.droppable(key, config):
                        unexpected.append(key)
                    continue
                if name in seen:
                    raise BuildError(f"checkpoint holds {name!r} twice ({seen[name]}, {key})")
                shape = tuple(reader.get_slice(key).get_shape())
                if shape != params[name]:
                    raise BuildError(
                        f"tensor {key!r} has shape {shape}; config.json implies {params[name]}"
                    )
                seen[name] = key
                keys[path].append((key, name))
    missing = sorted(set(params) - set(seen))
    incomplete = [n for n, parts in prequantized.items() if not {"qweight", "scales"} <= parts]
    if incomplete:
        raise BuildError(f"quantized weights without their qweight or scales: {incomplete[:3]}")
    if missing or unexpected:
        raise BuildError(
            f"{checkpoint} does not match its config.json: {len(missing)} tensor(s) missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    numel = {name: _numel(params[name]) for name in seen if name in params}
    return _Plan(keys, numel, prequantized)


def _head(params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A tied head's own name: a quantized head is stored apart from the embedding, whichever
    module holds the embedding (``model.embed_tokens``, OPT's ``model.decoder.embed_tokens``)."""
    embed = next((s for n, s in params.items() if n.endswith("embed_tokens.weight")), None)
    return {"lm_head.weight": embed} if embed is not None else {}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _limits(options: BuildOptions, config: ModelConfig) -> Limits:
    max_seq_len = options.max_seq_len or config.max_model_len
    if max_seq_len > config.max_model_len:
        raise BuildError(
            f"--max-seq-len {max_seq_len} exceeds the model's context length {config.max_model_len}"
        )
    return Limits(
        max_batch_size=options.max_batch_size,
        max_num_tokens=options.max_num_tokens,
        max_seq_len=max_seq_len,
    )


def _check_split(options: BuildOptions, config: ModelConfig, quantized: bool) -> None:
    """A --tp_size the model's heads or MLP cannot be split by, or quantized weights (which
    tensor parallelism does not cut), is a build error, not a serving one."""
    if options.tensor_parallel_size == 1:
        return
    try:
        check_divisible(config, options.tensor_parallel_size)
    except ValueError as exc:
        raise BuildError(f"--tp_size: {exc}") from None
    if quantized:
        raise BuildError("--tp_size: tensor parallelism serves bf16/fp32 weights, not quantized")
    if options.device != "cpu":
        raise BuildError("--tp_size: tensor-parallel ranks run on CPU (gloo) in this version")


def _cache_sizing(
    options: BuildOptions, config: ModelConfig, dtype: torch.dtype, limits: Limits, weights: int
) -> CacheSizing:
    # NOTE: per rank: each holds its heads' share of every block
    per_block = ModelRunner.kv_bytes_per_block(config, options.block_size, dtype)
    per_block //= options.tensor_parallel_size
    device_blocks = options.kv_cache_memory // per_block
    tokens = device_blocks * options.block_size
    if tokens < limits.max_seq_len:
        raise BuildError(
            f"--kv-cache-memory {options.kv_cache_memory} bytes holds {tokens} tokens "
            f"({per_block} bytes per block of {options.block_size}), fewer than one "
            f"--max-seq-len {limits.max_seq_len} request"
        )
    available = _device_memory(options.device)
    if weights + options.kv_cache_memory > available:
        raise BuildError(
            f"weights ({weights} bytes) plus --kv-cache-memory ({options.kv_cache_memory}) "
            f"exceed this machine's {options.device} memory ({available} bytes)"
        )
    return CacheSizing(
        block_size=options.block_size,
        kv_bytes_per_block=per_block,
        kv_cache_memory=options.kv_cache_memory,
        num_device_blocks=device_blocks,
        host_cache_memory=options.host_cache_memory,
        num_host_blocks=options.host_cache_memory // per_block,
        max_cached_tokens=tokens,
    )


def _device_memory(device: str) -> int:
    if device == "cuda" and not torch.cuda.is_available():
        raise BuildError("--device cuda, but CUDA is not available on this machine")
    return device_memory_bytes(device)


def _check_tokenizer(checkpoint: Path, config: ModelConfig) -> bool:
    """The tokenizer loads and fits the model; a chat template compiles and renders one user
    turn (a template that refuses a system turn, as Gemma's does, is still a template).
    Returns whether the checkpoint has its own chat template."""
    from quanta.text.chat_template import ChatTemplate, ChatTemplateLoadError
    from quanta.text.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(checkpoint)
    except (OSError, ValueError, KeyError) as exc:
        raise BuildError(f"{checkpoint}: the tokenizer does not load: {exc}") from None
    ids = tokenizer.encode("Hello, world")
    if not ids or max(ids) >= config.vocab_size:
        raise BuildError(
            f"{checkpoint}: the tokenizer produces ids up to {max(ids, default=-1)}, the model "
            f"has {config.vocab_size} embedding rows"
        )
    bad_eos = [t for t in config.eos_token_ids if not 0 <= t < config.vocab_size]
    if bad_eos:
        raise BuildError(f"{checkpoint}: eos_token_id {bad_eos} is outside the vocabulary")
    try:
        template = ChatTemplate.from_model_dir(checkpoint)
    except ChatTemplateLoadError as exc:
        raise BuildError(f"{checkpoint}: the chat template does not render: {exc}") from None
    return template.has_own_template


# -- conversion --------------------------------------------------------------------------------
def _hash_source(checkpoint: Path, progress: Progress) -> Source:
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    advance = progress("hashing the checkpoint", sum(p.stat().st_size for p in files))
    digests = {p.name: sha256_file(p, advance) for p in files}
    overall = hashlib.sha256()
    for name, digest in digests.items():
        overall.update(f"{name}\0{digest}\n".encode())
    return Source(path=str(checkpoint.resolve()), sha256=overall.hexdigest(), files=digests)


def _convert(
    checkpoint: Path,
    out: Path,
    plan: _Plan,
    builder: FamilyBuilder,
    dtype: torch.dtype,
    options: BuildOptions,
    progress: Progress,
    quant: QuantPlan | None = None,
) -> list[WeightFile]:
    """Stream tensors into shards of at most ``max_shard_size`` bytes (HF's sharded layout
    when more than one), so a build never holds the whole converted model."""
    advance = progress(f"converting to {str(dtype).removeprefix('torch.')}", len(plan.numel))
    shards: list[tuple[Path, list[str]]] = []
    with shard_writer(out, options.max_shard_size, shards) as add:
        for path, pairs in plan.keys.items():
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for key, name in pairs:
                    tensor = reader.get_tensor(key)
                    if name.endswith(QUANT_SUFFIXES):  # stored quantized: written as it is
                        add(name, tensor.contiguous())
                    elif quant is not None:
                        for part, t in quant.tensors(name, tensor, dtype):
                            add(part, t)
                    else:
                        add(name, builder.convert(name, tensor, dtype))
                    advance(1)
    files = name_shards(out, shards)
    return [WeightFile(name=p.name, bytes=p.stat().st_size, sha256=sha256_file(p)) for p in files]


def _copy_side_files(checkpoint: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template and the like, unchanged."""
    for path in sorted(checkpoint.iterdir()):
        if not path.is_file() or path.name in _NOT_COPIED:
            continue
        if path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        shutil.copy2(path, out / path.name)


def _no_progress(description: str, total: int) -> Callable[[int], None]:
    return lambda amount: None


def _quanta_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("quanta")
    except PackageNotFoundError:
        return "unknown"
