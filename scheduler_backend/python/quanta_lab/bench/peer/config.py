"""What a Quanta-vs-vLLM comparison holds fixed (``PeerSetup``), the systems it can run, and
what vLLM's priority policy is told per request."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from quanta.metrics import SLO
from quanta.workloads import WorkloadRequest

GiB = 1 << 30
SYSTEMS = ("vllm-fcfs", "vllm-priority", "quanta-fcfs", "quanta-sj-mlfq")
# What vLLM's priority policy is told per request (lower runs first). "prompt-length" is the
# nearest a client can get to skip-join MLFQ's placement by input length: shortest prompt
# first; "class" is online 0 / offline 1; "none" sends nothing (so it runs as FCFS).
VLLM_PRIORITIES: Mapping[str, Callable[[WorkloadRequest], int] | None] = MappingProxyType(
    {
        "prompt-length": lambda r: r.prompt_tokens,
        "class": lambda r: 0 if r.priority_class == "online" else 1,
        "none": None,
    }
)


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """Everything a comparison run holds fixed."""

    model_dir: Path
    vllm_python: Path | None  # None: no vLLM (llama.cpp's engine-only figures alone)
    out_dir: Path
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    num_requests: int = 40
    prompt_tokens: tuple[int, int] = (64, 128)
    output_tokens: tuple[int, int] = (32, 64)
    seed: int = 0
    threads: int = 1
    dtype: str = "float32"  # both engines, servers and engine-only runs: float32 or bfloat16
    systems: tuple[str, ...] = SYSTEMS
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=2.0, tpot_s=0.3, tbt_s=1.0))
    slo_goal: float = 0.9
    kv_cache_bytes: int = GiB
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 32  # tokens per KV block, both servers: the prefix caches' granularity
    engine_batches: tuple[int, ...] = (1, 8, 32)
    engine_prompt_len: int = 96
    engine_gen_len: int = 32
    engine_repeat: int = 3  # best of this many timings, for both engines
    vllm_bench: bool = True
    vllm_bench_rate: float = 0.5
    vllm_bench_prompts: int = 20
    sj_profile: Path | None = None  # cost profile for sj-mlfq (default: measured here)
    vllm_priority: str = "prompt-length"  # a key of VLLM_PRIORITIES
    ready_timeout_s: float = 600.0
    chat_prompts: bool = False  # real chat questions that end at EOS, not length-only prompts
    # A workload file (``quanta bench workload``: chat, agents...) replayed at every rate, its
    # arrivals (and think times) rescaled to the rate; None: uniform lengths as above.
    workload: Path | None = None
    # Automatic prefix caching on both servers alike (vLLM's default: on). Each rate starts
    # with empty caches, so a rate never finds an earlier rate's prompts.
    prefix_caching: bool = True
    llama_cpp_python: Path | None = None  # llama-cpp-python's venv interpreter
    llama_cpp_gguf: tuple[Path, ...] = ()  # GGUF files llama.cpp runs (batch 1, engine only)
    # Quanta's engine-only figures from this engine instead of model_dir: the same model built
    # with --quantization, set by ``--quantization`` (the servers and vLLM keep model_dir)
    quanta_engine_dir: Path | None = None
