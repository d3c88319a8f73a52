"""What a user sets to start Quanta, grouped as engine, cache, scheduler and serving options.

These models are the one place that says what each option means: the command-line options of
``quanta serve``, ``quanta openai`` and ``quanta simulate`` are derived from their fields
(``quanta.config.cli``), a ``--config`` YAML file names them, and the docs' option tables are
rendered from them (``quanta.config.docs``). A field's flag is ``--`` and its name with dashes;
``Flag`` adds other spellings. ``None`` means "not given": the engine's manifest, the model's
``config.pbtxt`` or the runtime config (``quanta.core.config``) supplies the value, which the
description names.

Pure pydantic, no torch and no Typer, so the frontends and the simulator both import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.core.config import AttentionKernel, LinearKernel
from quanta.core.sizes import parse_size
from quanta.core.speculative import SpeculativeConfig

MiB = 1 << 20
DEFAULT_MAX_REQUEST_BYTES = 4 * MiB  # a 128K-token prompt as JSON text or ids fits
DEFAULT_MAX_FILE_BYTES = 200 * MiB  # OpenAI's limit on a batch input file

Router = Literal["least-outstanding", "round-robin", "prefix-affinity"]


@dataclass(frozen=True, slots=True)
class Flag:
    """A field's command-line spelling beyond ``--field-name``: more names (vLLM's or
    trtllm-build's), and an environment variable of its own that predates the prefix."""

    aliases: tuple[str, ...] = ()
    envvar: str | None = None


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineArgs(_Options):
    """How the engine runs the model: precision, device, kernels, parallelism, decoding."""

    dtype: str | None = Field(
        None, description="float32, bfloat16 or float16 (default: the engine's)"
    )
    device: str | None = Field(None, description="cpu, cuda or cuda:N (default: cpu)")
    linear_kernel: LinearKernel | None = Field(
        None,
        description="projections: auto, native (bf16 panel kernel), onednn or torch "
        "(default: auto)",
    )
    attention_kernel: AttentionKernel | None = Field(
        None,
        description="decode attention: auto, native (C, built at load), compiled or eager "
        "(default: auto)",
    )
    safepoint_interval: int | None = Field(
        None, ge=1, description="layers between abort checks of a preemptible step (default: 8)"
    )
    max_seq_len: int | None = Field(
        None,
        ge=1,
        description="longest prompt + output of a request (default: the model's context length)",
    )
    enable_prefix_caching: bool | None = Field(
        None,
        description="share the KV of identical prompt prefixes between requests (vLLM's "
        "automatic prefix caching; default: on)",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='speculative decoding as JSON, vLLM\'s spelling: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(prompt lookup; default: off)",
    )
    tensor_parallel_size: Annotated[int | None, Flag(aliases=("--tp-size", "--tp_size", "-tp"))] = (
        Field(
            None,
            ge=1,
            description="split the model and its KV cache over this many ranks (worker "
            "processes, torch.distributed gloo on CPU); cache sizes are per rank (default: the "
            "engine's, else 1)",
        )
    )
    torch_threads: int | None = Field(
        None, ge=1, description="CPU threads of the engine (default: torch's)"
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        """On the command line the config is JSON text; in a YAML file, a mapping."""
        return json.loads(value) if isinstance(value, str) else value

    def runtime(self) -> dict[str, Any]:
        """The fields of the engine's config (``quanta.core.config.EngineConfig``) these
        options set; ``torch_threads`` belongs to the process, not the engine."""
        return self.model_dump(exclude_none=True, exclude={"torch_threads"})


class CacheArgs(_Options):
    """The KV cache: its block size and the size of its device and host tiers."""

    block_size: int | None = Field(None, ge=1, description="tokens per KV block (default: 16)")
    kv_cache_memory: str | None = Field(
        None, description="device KV tier, e.g. 4GiB (default: the engine's)"
    )
    host_cache_memory: str | None = Field(
        None, description="host (CPU) KV tier for swapped blocks, e.g. 8GiB (default: 2GiB)"
    )
    device_blocks: int | None = Field(
        None,
        ge=1,
        description="device KV tier in blocks, instead of a size (default: from the "
        "size; in the simulator, the cost profile's)",
    )
    host_blocks: int | None = Field(
        None,
        ge=0,
        description="host KV tier in blocks, instead of a size (default: from the size; "
        "in the simulator, the cost profile's)",
    )

    @field_validator("kv_cache_memory", "host_cache_memory")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        """A size is checked where it is given, and kept as written for ``config.pbtxt``."""
        if value is not None:
            parse_size(value)
        return value

    def runtime(self) -> dict[str, int]:
        """The fields of ``quanta.core.config.CacheConfig`` these options set (sizes in
        bytes, counts in blocks)."""
        sizes = {
            "block_size": self.block_size,
            "device_bytes": None
            if self.kv_cache_memory is None
            else parse_size(self.kv_cache_memory),
            "host_bytes": None
            if self.host_cache_memory is None
            else parse_size(self.host_cache_memory),
            "num_device_blocks": self.device_blocks,
            "num_host_blocks": self.host_blocks,
        }
        return {k: v for k, v in sizes.items() if v is not None}


class SchedulerArgs(_Options):
    """Which scheduling system runs, with what options, within what per-step limits."""

    policy: str | None = Field(
        None,
        description="scheduling policy, e.g. fcfs, sj-mlfq, fair+sj-mlfq (docs/policies.md; "
        "default: fcfs)",
    )
    policy_option: list[str] | None = Field(
        None,
        description="KEY=VALUE passed to the policy (JSON values); repeat for several",
    )
    state_url: str | None = Field(
        None,
        description="redis://HOST:PORT/DB: the fair policies' counters, windows and "
        "interactions shared with every replica naming it (the policy option state_url)",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="sequences per step (default: 128)")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens per step (default: 2048)"
    )

    def runtime(self) -> dict[str, int]:
        """The fields of ``quanta.core.config.SchedulerConfig`` these options set."""
        return self.model_dump(
            include={"max_num_seqs", "max_num_batched_tokens"}, exclude_none=True
        )


class ServingArgs(_Options):
    """Where and how the servers listen, who may call them, and how they recover."""

    served_model_name: str | None = Field(
        None,
        description="Triton model name of MODEL or of the default model (default: quanta; "
        "ensemble for TensorRT-LLM clients)",
    )
    host: str = Field(
        "127.0.0.1",
        description="address the OpenAI gateway binds to (quanta serve binds Triton's ports to "
        "--triton-host)",
    )
    triton_host: str = Field(
        "127.0.0.1",
        description="address Triton's HTTP, gRPC and metrics ports bind to; the loopback keeps "
        "them behind the gateway, another address exposes them deliberately",
    )
    triton_admin_key: Annotated[str | None, Flag(envvar="QUANTA_TRITON_ADMIN_KEY")] = Field(
        None,
        description="value of the quanta-admin-key header Triton's admin APIs "
        "(model-repository, logging, trace, shared-memory, statistics) require (default: a "
        "random one per start; '': leave them open)",
    )
    http_port: Annotated[int, Flag(envvar="QUANTA_HTTP_PORT")] = Field(
        8000, description="Triton's HTTP port (0: any free port)"
    )
    grpc_port: Annotated[int, Flag(envvar="QUANTA_GRPC_PORT")] = Field(
        8001, description="Triton's gRPC port (0: any free port)"
    )
    metrics_port: Annotated[int, Flag(envvar="QUANTA_METRICS_PORT")] = Field(
        8002, description="Triton's Prometheus port (0: any free port)"
    )
    openai_port: int | None = Field(
        None,
        description="also serve the OpenAI-compatible API on this port (0: any free port)",
    )
    io_layout: Literal["quanta", "tensorrt_llm"] | None = Field(
        None,
        description="quanta (scalars are [1]) or tensorrt_llm (TensorRT-LLM's tensors: a batch "
        "dimension, prompt echo by default; with --served-model-name ensemble, a drop-in) "
        "(default: quanta)",
    )
    state_dir: Path = Field(
        Path("quanta-state"),
        description="where the OpenAI gateway keeps Batch API files and batches (they "
        "survive restarts)",
    )
    api_key: Annotated[list[str] | None, Flag(envvar="QUANTA_API_KEY")] = Field(
        None,
        description="require this key as 'Authorization: Bearer KEY' (vLLM's flag); repeat "
        "for several; tenant 'default' (default: none, every client is served)",
    )
    api_key_file: Path | None = Field(
        None,
        description="YAML or JSON file: API key -> {tenant, weight, priority_class, "
        "requests_per_minute, tokens_per_minute}; the tenant comes from the key",
    )
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES,
        ge=1,
        description="largest request body in bytes (413 before it is read)",
    )
    max_file_bytes: int = Field(
        DEFAULT_MAX_FILE_BYTES, ge=1, description="largest Batch API file upload in bytes (413)"
    )
    max_prompt_bytes: int | None = Field(
        None,
        ge=1,
        description="longest text prompt in UTF-8 bytes (400, before tokenizing; default: the "
        "context length times the tokenizer's longest token)",
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="serve only requests whose Host header is this (repeat; '*.example.com' "
        "matches subdomains; default: any)",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="tritonservers of the same model on this machine, replica i on the ports "
        "plus 10*i; with --openai-port the gateway routes to all of them",
    )
    router: Router = Field(
        "least-outstanding",
        description="how the OpenAI gateway picks a Triton replica (quanta serve --replicas, "
        "quanta openai --upstream)",
    )
    drain_timeout: float = Field(
        30.0,
        ge=0,
        description="on Ctrl-C or SIGTERM, seconds in-flight requests get to finish while new "
        "ones are refused (503); 0: end them at once",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="restarts of a tritonserver that dies: 0 restarts it forever; N gives up "
        "(exits with its status) after N restarts in a row (5 minutes up resets the count)",
    )
    max_restart_delay: float = Field(
        30.0,
        ge=0,
        description="the longest wait before a restart (the wait doubles from 1 s with each "
        "death in a row, jittered, up to this)",
    )
    ready_timeout: float = Field(600.0, description="seconds to wait for model load")
    tritonserver: Path | None = Field(
        None, description="tritonserver binary (default: on PATH, else nvidia-pytriton's)"
    )
    backend_dir: Path | None = Field(
        None, description="where to lay out the backends (default: a temp dir)"
    )
    log_file: Path | None = Field(
        None, description="write Triton's log here instead of the terminal"
    )
    log_verbose: int = Field(0, description="Triton --log-verbose level")


GROUPS: tuple[type[BaseModel], ...] = (EngineArgs, CacheArgs, SchedulerArgs, ServingArgs)

# The options ``quanta.LLM`` takes by name beyond its own parameters: those that set the
# engine's config (the rest of a group is a server's or the simulator's).
OFFLINE_OPTIONS: dict[type[_Options], tuple[str, ...]] = {
    EngineArgs: ("linear_kernel", "attention_kernel", "safepoint_interval", "max_seq_len"),
    CacheArgs: (
        "block_size",
        "kv_cache_memory",
        "host_cache_memory",
        "device_blocks",
        "host_blocks",
    ),
    SchedulerArgs: ("max_num_seqs", "max_num_batched_tokens"),
}


def offline_options(options: dict[str, Any]) -> tuple[EngineArgs, CacheArgs, SchedulerArgs]:
    """``quanta.LLM``'s keyword options, checked by the models the commands use; a name it
    does not take is a ``TypeError``, as for any other keyword."""
    known = {name for names in OFFLINE_OPTIONS.values() for name in names}
    for name in options:
        if name not in known:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")

    def group(model: type[_Options]) -> Any:
        return model.model_validate(
            {k: v for k, v in options.items() if k in OFFLINE_OPTIONS[model]}
        )

    return group(EngineArgs), group(CacheArgs), group(SchedulerArgs)
