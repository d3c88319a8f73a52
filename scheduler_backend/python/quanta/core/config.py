"""Small frozen configs, one per component, validated by pydantic.

Only frontends parse files into these; nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quanta.core.speculative import SpeculativeConfig

GiB = 1 << 30

# How the engine runs its projections and its decode attention (see quanta.runner.linear and
# quanta.runner.decode_kernel); one definition for the config, the CLI and the runner.
LinearKernel = Literal["auto", "torch", "onednn", "native"]
AttentionKernel = Literal["auto", "eager", "compiled", "native"]
# Where the weights come from: the checkpoint ("auto"), or seeded random values made on the
# device ("dummy", vLLM's name), for benchmarks of a real shape with no checkpoint on disk.
LoadFormat = Literal["auto", "dummy"]


# The fraction of a CUDA device's memory an engine uses when none is given (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class CacheConfig(BaseModel):
    """Sizes of the two KV tiers, in blocks or in bytes (blocks win when both are given).

    On CUDA the device tier is sized instead from ``gpu_memory_utilization`` (default
    ``DEFAULT_GPU_MEMORY_UTILIZATION``) once the weights are loaded, unless
    ``num_device_blocks`` or ``device_bytes`` is given: an explicit size wins, as vLLM's
    ``num_gpu_blocks_override`` and ``kv_cache_memory_bytes`` do. The CPU never reads it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(16, ge=1, le=1024)
    num_device_blocks: int | None = Field(None, ge=1)
    device_bytes: int = Field(1 * GiB, ge=1)
    num_host_blocks: int | None = Field(None, ge=0)
    host_bytes: int = Field(2 * GiB, ge=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)

    def resolve(self, bytes_per_block: int) -> tuple[int, int]:
        """(device blocks, host blocks) for an engine whose block takes ``bytes_per_block``."""
        device = self.num_device_blocks or self.device_bytes // bytes_per_block
        host = (
            self.num_host_blocks
            if self.num_host_blocks is not None
            else self.host_bytes // bytes_per_block
        )
        if device < 1:
            raise ValueError(
                f"device_bytes={self.device_bytes} holds no block of {bytes_per_block} bytes"
            )
        return device, host


class SchedulerConfig(BaseModel):
    """Limits every policy respects: the per-step token budget and batch size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    enable_chunked_prefill: bool = True


class EngineConfig(BaseModel):
    """Everything needed to build one loop over one model replica."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    policy: str = "fcfs"
    policy_options: dict[str, Any] = Field(default_factory=dict)
    dtype: str | None = None
    device: str = "cpu"
    # How projections run: prepacked oneDNN weights (CPU) or torch's F.linear; auto: oneDNN
    # wherever it runs the dtype (see quanta.runner.linear for the measurements behind it).
    linear_kernel: LinearKernel = "auto"
    # The weight quantization the engine must hold (none, int8, int4); None: whatever it holds.
    # Like dtype, a mismatch with the engine's manifest is refused at load.
    quantization: Literal["none", "int8", "int4", "mixed"] | None = None
    # Decode attention: the native C kernel, fused by torch.compile, or eager; auto: native on
    # CPU (fp32, bf16) where a C compiler is found (see quanta.runner.decode_kernel).
    attention_kernel: AttentionKernel = "auto"
    # Layers between checks of a preemptible step's abort signal (ConServe's safepoints).
    safepoint_interval: int = Field(8, ge=1)
    # Longest prompt + output a request may have; None: the model's own context length.
    max_seq_len: int | None = Field(None, ge=1)
    # Share the K/V of full blocks of identical prefixes between requests (vLLM's automatic
    # prefix caching, on by default there too); off: every prompt is computed from token 0.
    enable_prefix_caching: bool = True
    # Speculative decoding (vLLM's ``--speculative-config``): None decodes one token a step.
    speculative_config: SpeculativeConfig | None = None
    # Ranks the model and every KV block are split over (vLLM's ``--tensor-parallel-size``):
    # worker processes joined by torch.distributed (gloo on CPU). KV cache sizes are per rank.
    tensor_parallel_size: int = Field(1, ge=1)
    # "dummy": random weights of the checkpoint's shape, made on the device; only its
    # config.json and tokenizer are read (quanta.runner.random_weights).
    load_format: LoadFormat = "auto"
    # Decode steps run eagerly, never replayed from CUDA graphs (vLLM's ``--enforce-eager``);
    # graphs run only on CUDA (quanta.runner.graphs).
    enforce_eager: bool = False
    # Schedule each step while the one before it runs on the device (vLLM's
    # ``--async-scheduling``; quanta.core.overlap); None: on for CUDA, off on the CPU.
    async_scheduling: bool | None = None
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @model_validator(mode="after")
    def _known_dtype(self) -> EngineConfig:
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        return self
