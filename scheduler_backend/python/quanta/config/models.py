"""What a user sets to start Quanta, grouped as engine, cache, scheduler and serving options.

These models are the one place that says what each option means: the command-line options of
``quanta serve``, ``quanta openai``, ``quanta simulate``, ``quanta build`` and the benchmarks are
derived from their fields (``quanta.config.cli``), a ``--config`` YAML file names them, a
model's ``config.pbtxt`` parameters are the fields marked ``Pbtxt`` (``quanta.config.pbtxt``),
and the docs' option and parameter tables are rendered from them (``quanta.config.docs``). A
field's flag is ``--`` and its name with dashes; ``Flag`` adds other spellings. ``None`` means
"not given": the engine's manifest, the model's ``config.pbtxt`` or the runtime config
(``quanta.core.config``) supplies the value, which the description names.

Pure pydantic, no torch and no Typer, so the frontends and the simulator both import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Json, field_validator

from quanta.core.config import AttentionKernel, LinearKernel
from quanta.core.pooling import PoolingParams
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


@dataclass(frozen=True, slots=True)
class Pbtxt:
    """A field that is also a ``config.pbtxt`` parameter: its key there (default: the field's
    name), and where the file spells the value another way than the command line does, the
    type its string is read as (``form``, turned into the field's value by the field's own
    validator) and what the parameter means in that spelling (``description``)."""

    key: str | None = None
    form: Any = None
    description: str | None = None


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineArgs(_Options):
    """How the engine runs the model: precision, device, kernels, parallelism, decoding."""

    dtype: Annotated[str | None, Pbtxt()] = Field(
        None,
        description="float32, bfloat16 or float16 (default: the engine's, else the machine's "
        "fastest)",
    )
    device: Annotated[str | None, Pbtxt()] = Field(
        None, description="cpu, cuda or cuda:N (default: cpu)"
    )
    linear_kernel: Annotated[LinearKernel | None, Pbtxt()] = Field(
        None,
        description="projections: auto, native (bf16 panel kernel), onednn or torch "
        "(default: auto)",
    )
    attention_kernel: Annotated[AttentionKernel | None, Pbtxt()] = Field(
        None,
        description="decode attention: auto, native (C, built at load), compiled or eager "
        "(default: auto)",
    )
    safepoint_interval: Annotated[int | None, Pbtxt()] = Field(
        None, ge=1, description="layers between abort checks of a preemptible step (default: 8)"
    )
    max_seq_len: Annotated[int | None, Pbtxt()] = Field(
        None,
        ge=1,
        description="longest prompt + output of a request (default: the model's context length)",
    )
    enable_prefix_caching: Annotated[bool | None, Pbtxt()] = Field(
        None,
        description="share the KV of identical prompt prefixes between requests (vLLM's "
        "automatic prefix caching; default: on)",
    )
    speculative_config: Annotated[SpeculativeConfig | None, Pbtxt()] = Field(
        None,
        description='speculative decoding as JSON, vLLM\'s spelling: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(prompt lookup; default: off)",
    )
    tensor_parallel_size: Annotated[
        int | None, Flag(aliases=("--tp-size", "--tp_size", "-tp")), Pbtxt()
    ] = Field(
        None,
        ge=1,
        description="split the model and its KV cache over this many ranks (worker "
        "processes, torch.distributed gloo on CPU); cache sizes are per rank (default: the "
        "engine's, else 1)",
    )
    enforce_eager: Annotated[bool | None, Pbtxt()] = Field(
        None,
        description="run every decode step eagerly instead of replaying CUDA graphs (vLLM's "
        "flag; default: graphs on CUDA, where the model allows them; the CPU has none)",
    )
    async_scheduling: Annotated[bool | None, Pbtxt()] = Field(
        None,
        description="schedule each step while the one before it runs on the device (vLLM's "
        "flag); structured output and speculative decoding steps still wait (default: on "
        "for CUDA, off on the CPU)",
    )
    torch_threads: Annotated[int | None, Pbtxt()] = Field(
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

    block_size: Annotated[int | None, Pbtxt()] = Field(
        None, ge=1, description="tokens per KV block (default: 16)"
    )
    kv_cache_memory: Annotated[str | None, Pbtxt("device_bytes")] = Field(
        None, description="device KV tier, e.g. 4GiB (default: the engine's)"
    )
    host_cache_memory: Annotated[str | None, Pbtxt("host_bytes")] = Field(
        None,
        description="host (CPU) KV tier for swapped blocks, e.g. 8GiB; 0: none (default: 2GiB)",
    )
    device_blocks: Annotated[int | None, Pbtxt("num_device_blocks")] = Field(
        None,
        ge=1,
        description="device KV tier in blocks, instead of a size (default: from the "
        "size; in the simulator, the cost profile's)",
    )
    host_blocks: Annotated[int | None, Pbtxt("num_host_blocks")] = Field(
        None,
        ge=0,
        description="host KV tier in blocks, instead of a size (default: from the size; "
        "in the simulator, the cost profile's)",
    )
    gpu_memory_utilization: Annotated[float | None, Pbtxt()] = Field(
        None,
        gt=0,
        le=1,
        description="fraction of the CUDA device's memory the engine uses in all (vLLM's "
        "flag): the device KV tier gets what the weights and the largest step's activations "
        "leave of it; a kv-cache-memory or device-blocks given wins; the CPU ignores it "
        "(default: 0.9 on CUDA)",
    )

    @field_validator("kv_cache_memory", "host_cache_memory")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        """A size is checked where it is given, and kept as written for ``config.pbtxt``."""
        if value is not None:
            parse_size(value)
        return value

    def runtime(self) -> dict[str, int | float]:
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
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        return {k: v for k, v in sizes.items() if v is not None}


class SchedulerArgs(_Options):
    """Which scheduling system runs, with what options, within what per-step limits."""

    policy: Annotated[str | None, Pbtxt()] = Field(
        None,
        description="scheduling policy, e.g. fcfs, sj-mlfq, fair+sj-mlfq (docs/policies.md; "
        "default: fcfs)",
    )
    policy_option: Annotated[
        list[str] | None,
        Pbtxt(
            "policy_options",
            form=Json[dict[str, Any]],
            description='keyword options of the policy, as one JSON object ({"starve_limit": 2})',
        ),
    ] = Field(
        None,
        description="KEY=VALUE passed to the policy (JSON values); repeat for several",
    )
    state_url: str | None = Field(
        None,
        description="redis://HOST:PORT/DB: the fair policies' counters, windows and "
        "interactions shared with every replica naming it (the policy option state_url)",
    )
    max_num_seqs: Annotated[int | None, Pbtxt()] = Field(
        None, ge=1, description="sequences per step (default: 128)"
    )
    max_num_batched_tokens: Annotated[int | None, Pbtxt()] = Field(
        None, ge=1, description="tokens per step (default: 2048)"
    )

    @field_validator("policy_option", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        """A mapping (``config.pbtxt``'s JSON object, a YAML file's mapping) is the same
        options as ``KEY=VALUE`` pairs; a pair without ``=`` is refused where it is given."""
        if isinstance(value, dict):
            return [f"{key}={json.dumps(raw)}" for key, raw in value.items()]
        for pair in value or ():
            key, sep, _ = str(pair).partition("=")
            if not sep or not key:
                raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        return value

    def policy_options(self) -> dict[str, Any]:
        """The pairs as the policy's keyword options: a value is read as JSON where it parses
        (``2``, ``false``), else kept as text (``memory=reactive``)."""
        out: dict[str, Any] = {}
        for pair in self.policy_option or ():
            key, _, raw = pair.partition("=")
            try:
                out[key] = json.loads(raw)
            except json.JSONDecodeError:
                out[key] = raw
        return out

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
    io_layout: Annotated[Literal["quanta", "tensorrt_llm"] | None, Pbtxt()] = Field(
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
    pooler_config: PoolingParams | None = Field(
        None,
        description='how /v1/embeddings pools the final hidden states, as JSON (vLLM\'s flag): '
        '{"pooling_type": "LAST" or "MEAN", "normalize": true or false} (default: LAST, '
        "normalized)",
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
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="how the OpenAI gateway reads tool calls from an answer (vLLM's flag): "
        "hermes (JSON in tool_call tags: Hermes, Qwen2.5, SmolLM2) or llama3_json "
        "(default: llama3_json for a Llama 3 chat template, else hermes)",
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


class BackendArgs(_Options):
    """What a model's ``config.pbtxt`` sets beyond the options the commands share: the
    checkpoint, settings of the engine no command takes, and the Triton backend's own
    intervals and watchdog. Every field is a parameter; no command has them as options."""

    model_dir: Annotated[str, Pbtxt()] = Field(
        description="engine directory (quanta build: its manifest supplies dtype, limits and "
        "cache sizes) or HF-layout checkpoint directory; a relative path resolves against the "
        "server's working directory"
    )
    preset: Annotated[str | None, Pbtxt()] = Field(
        None,
        description="build this random-weight preset into model_dir when it is missing "
        "(any of quanta make-model's presets, e.g. opt-tiny, llama-tiny, qwen2-tiny)",
    )
    preset_seed: Annotated[int, Pbtxt()] = Field(
        0, ge=0, description="the preset's weights are a function of this seed"
    )
    quantization: Annotated[Literal["none", "int8", "int4", "mixed"] | None, Pbtxt()] = Field(
        None,
        description="the weight quantization the engine must hold (docs/quantization.md); "
        "another one is refused at load (default: whatever it holds)",
    )
    device_memory_fraction: Annotated[float | None, Pbtxt()] = Field(
        None,
        gt=0,
        le=1,
        description="device KV tier as a fraction of the device's memory (physical RAM on "
        "CPU, the GPU's memory on CUDA), instead of device_bytes or num_device_blocks",
    )
    enable_chunked_prefill: Annotated[bool | None, Pbtxt()] = Field(
        None, description="split long prompts over several steps (default: true)"
    )
    metrics_interval_ms: Annotated[float, Pbtxt()] = Field(
        500.0, gt=0, description="how often metrics are pushed to Triton"
    )
    max_tenant_labels: Annotated[int, Pbtxt()] = Field(
        32,
        ge=0,
        description="tenants that get their own label in the per-tenant series; later ones "
        "count as other",
    )
    cancel_check_interval_ms: Annotated[float, Pbtxt()] = Field(
        20.0,
        gt=0,
        description="how often a quiet request is asked whether its client cancelled "
        "(streaming requests are asked at every token)",
    )
    stall_timeout_s: Annotated[float, Pbtxt()] = Field(
        120.0,
        gt=0,
        description="the watchdog: no engine step for this long while requests wait or run "
        "makes the engine unhealthy (every request in flight ends with an error)",
    )
    unhealthy_exit_s: Annotated[float, Pbtxt()] = Field(
        5.0,
        description="seconds after the engine turns unhealthy that tritonserver is ended, so "
        "its supervisor restarts it; negative: never",
    )
    fault_injection: Annotated[str, Pbtxt()] = Field(
        "",
        description="tests only: faults to inject, site:seed,... (quanta.core.faults)",
    )


GROUPS: tuple[type[BaseModel], ...] = (EngineArgs, CacheArgs, SchedulerArgs, ServingArgs)

# The options ``quanta.LLM`` takes by name beyond its own parameters: those that set the
# engine's config (the rest of a group is a server's or the simulator's).
OFFLINE_OPTIONS: dict[type[_Options], tuple[str, ...]] = {
    EngineArgs: (
        "linear_kernel",
        "attention_kernel",
        "safepoint_interval",
        "max_seq_len",
        "enforce_eager",
        "async_scheduling",
    ),
    CacheArgs: (
        "block_size",
        "kv_cache_memory",
        "host_cache_memory",
        "device_blocks",
        "host_blocks",
        "gpu_memory_utilization",
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
