"""How long an iteration takes: what skip-join MLFQ places jobs by, and the simulator's clock.

FastServe's premise (§4.1) is that one iteration's time is predictable from the model, the
hardware and the batch, even though a job's number of iterations is not. This module states
that prediction as a small roofline-style formula whose coefficients are a JSON profile:

    step = overhead + per_seq * seqs + per_attention_call * attention calls
           + max(weights_read, compute_per_token * new_tokens)
           + sum over seqs of max(kv_read_per_token * context, attn_per_pair * query x key pairs)
           + decode_pad_per_token * decode seqs * longest decode context
           [+ the step's block copies, where they do not overlap compute]

With a ``sliding_window`` in every layer (Mistral) a token reads at most the window's keys, and
a sequence holds at most the window's blocks plus one (``kv_blocks``): the engine gives the
others back to the pool, and the simulator's block manager does the same with this window.

Decode iterations are memory-bound (the weights are streamed once per iteration, plus each
sequence's KV); prefill is compute-bound once enough tokens share the weight read. Swapping is
bytes over the host link. Presets come from published figures (the numbers' sources are next to
them); ``quanta profile`` fits the same coefficients to a real engine.

Pure Python (pydantic only): policies and the simulator import it, so it must never pull in
torch. It lives outside `policies/` because it also drives the simulator clock and reads profile
files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quanta.shape import PUBLISHED, ModelShape

GB = 1_000_000_000


class CostModel(BaseModel):
    """Iteration and swap times for one model on one hardware setup (seconds, bytes)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str
    source: str = Field("", description="where the numbers come from")
    step_overhead_s: float = Field(ge=0, description="fixed cost of any iteration")
    per_seq_s: float = Field(ge=0, description="per sequence in the batch (sampling, metadata)")
    weights_read_s: float = Field(ge=0, description="streaming all weights once from HBM")
    weight_bytes_per_param: float = Field(
        2.0, gt=0, description="bytes per parameter weights_read_s streams (fp16: 2)"
    )
    compute_per_token_s: float = Field(ge=0, description="dense FLOPs of one new token")
    attn_per_pair_s: float = Field(ge=0, description="prefill attention per (query, key) pair")
    kv_read_per_token_s: float = Field(ge=0, description="reading one context token's KV")
    per_attention_call_s: float = Field(
        0.0, ge=0, description="per attention call: each prefill chunk, all decode rows"
    )
    decode_pad_per_token_s: float = Field(
        0.0, ge=0, description="per key slot of a decode batch padded to its longest context"
    )
    hidden_projection_per_token_s: float | None = Field(
        None,
        ge=0,
        description="recomputing K and V of one context token of a hidden-cache request, all "
        "layers; None: compute_per_token_s / 6 (the K and V projections are 2 of the 12 H^2 "
        "weights of a multi-head layer)",
    )
    swap_overlaps_compute: bool = Field(
        True, description="block copies run beside the forward pass (else inside the step)"
    )
    kv_bytes_per_token: int = Field(gt=0, description="4 * layers * hidden for fp16 MHA")
    swap_bandwidth: float = Field(gt=0, description="host<->device bytes/s, effective")
    swap_latency_s: float = Field(0.0, ge=0, description="fixed cost per batch of copies")
    device_kv_bytes: int = Field(gt=0, description="device memory left for KV blocks")
    host_kv_bytes: int = Field(ge=0, description="host memory for swapped KV blocks")
    max_model_len: int = Field(2048, gt=0)
    sliding_window: int = Field(
        0, ge=0, description="tokens every layer attends within (Mistral's); 0: full attention"
    )
    num_layers: int = Field(
        32, gt=0, description="transformer layers: the granularity of layer safepoints"
    )
    safepoint_overhead: float = Field(
        0.0, ge=0, description="fraction a preemptible step is slowed by its safepoint checks"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split over")
    allreduce_calls: int = Field(
        0, ge=0, description="all-reduces per step (tensor parallelism: 2 per layer)"
    )
    allreduce_bytes_per_token: float = Field(
        0.0, ge=0, description="bytes one all-reduce sums per new token (hidden x fp16: 2h)"
    )
    allreduce_bandwidth: float = Field(
        1.0, gt=0, description="bytes/s of the link a ring all-reduce runs over, per GPU"
    )
    allreduce_latency_s: float = Field(0.0, ge=0, description="fixed cost of one all-reduce")

    # -- iteration times -----------------------------------------------------------------
    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One iteration over ``(new_tokens, start_pos)`` chunks: prefill chunks and decodes.

        ``start_pos`` is the number of tokens already in the KV cache before the chunk.
        """
        num_seqs = num_tokens = prefills = decodes = longest = 0
        attention = 0.0
        for new, start in chunks:
            num_seqs += 1
            num_tokens += new
            attention += self._attention(new, start)
            if new > 1:
                prefills += 1
            else:  # single-token rows share one decode attention call, padded to the longest
                decodes += 1
                longest = max(longest, self._seen(start + 1))
        if num_seqs == 0:
            return 0.0
        dense = max(self.weights_read_s, self.compute_per_token_s * num_tokens)
        return (
            self.step_overhead_s
            + self.allreduce_time(num_tokens)
            + self.per_seq_s * num_seqs
            + self.per_attention_call_s * (prefills + (decodes > 0))
            + dense
            + attention
            + self.decode_pad_per_token_s * decodes * longest
        )

    def shares(self, chunks: Sequence[tuple[int, int]]) -> list[float]:
        """Each chunk's own part of ``step_time(chunks)``; the parts add up to the step.

        A chunk pays its attention, its per-sequence cost, an equal part of the fixed
        overhead, and the dense part in proportion to its new tokens: a decode token that
        shares a step with a long prefill pays about what it would pay in a decode batch.
        """
        if not chunks:
            return []
        num_tokens = sum(new for new, _ in chunks)
        dense = max(self.weights_read_s, self.compute_per_token_s * num_tokens)
        dense += self.allreduce_time(num_tokens)  # per step and per token, like the GEMMs
        fixed = self.step_overhead_s / len(chunks) + self.per_seq_s
        decode_contexts = [self._seen(start + 1) for new, start in chunks if new == 1]
        longest = max(decode_contexts, default=0)
        decode_call = self.per_attention_call_s / max(1, len(decode_contexts))
        return [
            fixed
            + dense * new / num_tokens
            + self._attention(new, start)
            + (
                self.per_attention_call_s
                if new > 1
                else decode_call + self.decode_pad_per_token_s * longest
            )
            for new, start in chunks
        ]

    def allreduce_time(self, num_tokens: int) -> float:
        """The step's all-reduces under tensor parallelism: each moves ``2 (N-1)/N`` of its
        bytes over each GPU's link (a ring), plus a fixed latency; 0 on one GPU."""
        if self.allreduce_calls == 0 or self.tensor_parallel_size == 1:
            return 0.0
        n = self.tensor_parallel_size
        moved = 2 * (n - 1) / n * self.allreduce_bytes_per_token * num_tokens
        return self.allreduce_calls * (self.allreduce_latency_s + moved / self.allreduce_bandwidth)

    @property
    def hidden_per_token_s(self) -> float:
        """Extra time per step for each cached context token of a hidden-cache request."""
        if self.hidden_projection_per_token_s is not None:
            return self.hidden_projection_per_token_s
        return self.compute_per_token_s / 6

    def hidden_time(self, context_tokens: int) -> float:
        """A step's extra K/V projection over ``context_tokens`` hidden-cached tokens."""
        return self.hidden_per_token_s * max(0, context_tokens)

    def rho(self, block_size: int) -> float:
        """Apt-Serve's rho: the extra step time one KV block's worth of context costs a
        request that keeps it as hidden states instead (seconds per block per step)."""
        return self.hidden_per_token_s * block_size

    def _seen(self, context: int) -> int:
        """The keys a decode token with ``context`` tokens before and with it reads."""
        return min(context, self.sliding_window) if self.sliding_window else context

    def _attention(self, new: int, start: int) -> float:
        """One chunk's attention: reading its context's KV, or its causal query x key pairs
        (query t sees start + t keys), whichever bounds it."""
        pairs = new * (start + (new + 1) / 2)
        read = start + new
        if self.sliding_window:  # NOTE: each query sees at most the window's keys
            pairs = min(pairs, new * self.sliding_window)
            read = min(read, self.sliding_window + new)
        return max(self.kv_read_per_token_s * read, self.attn_per_pair_s * pairs)

    def prefill_time(self, num_tokens: int, context: int = 0) -> float:
        """A prefill of ``num_tokens`` after ``context`` cached tokens, alone in its batch."""
        return self.step_time([(num_tokens, context)])

    def decode_time(self, batch_size: int, total_context: int) -> float:
        """A decode iteration of ``batch_size`` sequences holding ``total_context`` tokens."""
        if batch_size <= 0:
            return 0.0
        each = total_context // batch_size
        chunks = [(1, max(0, each - 1))] * batch_size
        return self.step_time(chunks)

    @property
    def min_iteration_time(self) -> float:
        """The shortest iteration (one sequence decoding its first token): FastServe's q1."""
        return self.step_time([(1, 0)])

    # -- memory --------------------------------------------------------------------------
    def with_weight_bytes(self, bytes_per_param: float, label: str) -> CostModel:
        """The same model and hardware serving weights of ``bytes_per_param`` (weight-only
        quantization): the decode term's weight read scales with the bytes; the FLOPs, the
        KV cache (kept in its float dtype) and the overheads do not."""
        ratio = bytes_per_param / self.weight_bytes_per_param
        return self.model_copy(
            update={
                "name": f"{self.name}@{label}",
                "source": f"{self.source}; weights at {bytes_per_param:g} bytes/param ({label})",
                "weights_read_s": self.weights_read_s * ratio,
                "weight_bytes_per_param": bytes_per_param,
            }
        )

    def bytes_per_block(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def kv_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds while it decodes: all of them, or
        with a sliding window at most the window's and the one its next token opens (as
        ``quanta.core.window.peak_blocks`` counts them)."""
        full = -(-num_tokens // block_size)
        if not self.sliding_window:
            return full
        return min(full, -(-self.sliding_window // block_size) + 1)

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Copying ``num_blocks`` KV blocks one way over the host link."""
        if num_blocks <= 0:
            return 0.0
        return self.swap_latency_s + num_blocks * self.bytes_per_block(block_size) / (
            self.swap_bandwidth
        )

    def num_blocks(self, block_size: int) -> tuple[int, int]:
        """(device, host) KV blocks this setup holds with ``block_size``-token blocks."""
        per = self.bytes_per_block(block_size)
        return max(1, self.device_kv_bytes // per), self.host_kv_bytes // per


# -- presets -----------------------------------------------------------------------------
# A100-SXM4-40GB: 1555 GB/s HBM2, 312 TFLOP/s dense fp16 (NVIDIA datasheet). We assume 80% of
# the bandwidth and 50% of the FLOPs are reached by well-tuned kernels (typical of published
# vLLM/FasterTransformer measurements), 30% for attention. PCIe 4.0 x16 is 31.5 GB/s raw,
# ~25 GB/s measured with pinned memory. KV bytes per token = 4 * layers * hidden (FastServe
# §4.2: fp16, K and V). Layers/hidden: FastServe Table 1 and the OPT paper.
_HBM = 1555e9 * 0.8
_FLOPS = 312e12 * 0.5
_ATTN_FLOPS = 312e12 * 0.3
_PCIE = 25e9


def _preset(
    name: str,
    shape: ModelShape,
    *,
    params: float,
    gpus_per_stage: int,
    stages: int = 1,
    overhead_s: float,
    swap_bandwidth: float,
    device_kv_bytes: int,
    source: str,
) -> CostModel:
    """A dense fp16 model of ``shape`` (``params``: its published parameter count) whose
    critical path crosses ``gpus_per_stage`` tensor-parallel GPUs per pipeline stage; pipeline
    stages run one after the other for a single iteration."""
    layers = shape.num_layers
    # NOTE: QK^T and PV span the query heads' width, which is hidden only where head_dim is
    # hidden / heads (Gemma-2-2B's 8 x 256 heads sit on a hidden of 2304)
    width = shape.num_heads * shape.head_dim
    kv_per_token = shape.kv_bytes_per_token(2)
    bw, flops = _HBM * gpus_per_stage, _FLOPS * gpus_per_stage
    return CostModel(
        name=name,
        source=source,
        step_overhead_s=overhead_s,
        per_seq_s=1e-4,
        weights_read_s=2 * params / bw,  # fp16: 2 bytes per parameter
        compute_per_token_s=2 * params / flops,  # 2 FLOPs per parameter per token
        attn_per_pair_s=4 * layers * width / (_ATTN_FLOPS * gpus_per_stage),
        kv_read_per_token_s=kv_per_token / bw,
        kv_bytes_per_token=kv_per_token,
        swap_bandwidth=swap_bandwidth,
        device_kv_bytes=device_kv_bytes,
        # Swap space: 32 GB per GPU, as FastServe's public artifact scripts (--swap-space 32).
        host_kv_bytes=32 * GB * gpus_per_stage * stages,
        max_model_len=shape.max_position_embeddings,
        num_layers=layers,
    )


PROFILES: dict[str, CostModel] = {
    p.name: p
    for p in (
        # OPT-13B (12.85e9 params, 40 layers, hidden 5120) on one A100-40GB, FastServe §6.3.
        # Weights 25.7 GB -> a decode iteration of ~23-30 ms at typical batches, matching the
        # paper's SLO of 0.3 s = 10x one decode iteration. KV space: 40 GB - 25.7 GB weights
        # - ~2 GB activations/workspace ~= 12 GB, the >30% of memory vLLM's Fig. 1 shows for
        # a 13B model on an A100-40GB. Host link: one PCIe 4.0 x16.
        _preset(
            "a100-opt13b",
            PUBLISHED["opt-13b"],
            params=12.85e9,
            gpus_per_stage=1,
            overhead_s=2e-3,
            swap_bandwidth=_PCIE,
            device_kv_bytes=12 * GB,
            source="OPT-13B, 1x A100-40GB: datasheet roofline (80% HBM, 50% FLOPs), "
            "FastServe Table 1 and Sec. 6, vLLM Fig. 1 KV share, PCIe 4.0 x16 ~25 GB/s",
        ),
        # OPT-66B (65.7e9 params, 64 layers, hidden 9216), tensor parallel over 4 A100-40GB
        # (FastServe Fig. 11b). Overhead adds two all-reduces per layer (~20 us each). KV:
        # 160 GB - 131 GB weights - 4 x 2 GB. On a p4d two GPUs share a PCIe switch, so four
        # GPUs reach the host over two x16 links.
        _preset(
            "a100x4-opt66b",
            PUBLISHED["opt-66b"],
            params=65.7e9,
            gpus_per_stage=4,
            overhead_s=5e-3,
            swap_bandwidth=2 * _PCIE,
            device_kv_bytes=21 * GB,
            source="OPT-66B, 4x A100-40GB tensor parallel: roofline as a100-opt13b, "
            "2 all-reduces per layer, 2 PCIe 4.0 x16 host links (p4d switch layout)",
        ),
        # OPT-175B (96 layers, hidden 12288), 16 A100-40GB as 2 pipeline stages x 8-way tensor
        # parallel (FastServe Fig. 11c). One iteration crosses both stages: weights 350 GB over
        # 8 GPUs' bandwidth ~35 ms; the overhead (all-reduces on 96 layers + the cross-node
        # stage hop) brings a decode iteration to the ~60 ms FastServe §4.2 reports. Swap:
        # FastServe §4.2 moves a 2.3 GB job in ~36 ms, i.e. ~64 GB/s aggregate.
        # KV: 640 GB - 350 GB - 16 x 2 GB.
        _preset(
            "a100x16-opt175b",
            PUBLISHED["opt-175b"],
            params=175e9,
            gpus_per_stage=8,
            stages=2,
            overhead_s=20e-3,
            swap_bandwidth=64e9,
            device_kv_bytes=258 * GB,
            source="OPT-175B, 16x A100-40GB (PP=2 x TP=8): roofline as a100-opt13b, "
            "decode ~60 ms and 2.3 GB swapped in ~36 ms per FastServe Sec. 4.2",
        ),
        # LLaMA-2-7B (6.74e9 params, 32 layers, hidden 4096, 32 heads: multi-head attention,
        # so K+V is 4 x 32 x 4096 = 0.5 MB per fp16 token; 4k context) on one A100-40GB, as
        # ConServe's evaluation (§6.1). KV space: vLLM's default 90% of 40 GB = 36 GB, less
        # 13.5 GB of weights and ~2.5 GB of activations/workspace, ~20 GB (~40k tokens).
        _preset(
            "a100-llama7b",
            PUBLISHED["llama-2-7b"],
            params=6.74e9,
            gpus_per_stage=1,
            overhead_s=2e-3,
            swap_bandwidth=_PCIE,
            device_kv_bytes=20 * GB,
            source="LLaMA-2-7B, 1x A100-40GB (ConServe Sec. 6.1): roofline as a100-opt13b, "
            "Llama 2 paper shapes, vLLM's 0.9 memory utilization, PCIe 4.0 x16 ~25 GB/s",
        ),
    )
}


# Bytes per parameter of weight-only quantized linears, scales included: int8 per output
# channel (one scale per row, negligible), int4 in groups of 32 (``quanta build``'s default)
# with a bf16 scale and zero.
QUANTIZED_BYTES_PER_PARAM = {"int8": 1.0, "int4": 0.5 + 4 / 32}


# NVLink 3 on an A100 SXM: 600 GB/s both ways, of which NCCL's ring all-reduce reaches about
# 230 GB/s of bus bandwidth (nccl-tests on DGX A100); a launch costs ~10 us at decode sizes.
NVLINK_A100_BANDWIDTH = 230e9
ALLREDUCE_LATENCY_S = 10e-6
# What one A100-40GB holds beside its share of the weights: 40 GB less ~2 GB of activations.
A100_FREE_BYTES = 38 * GB


def tensor_parallel(
    model: CostModel,
    size: int,
    *,
    bandwidth: float = NVLINK_A100_BANDWIDTH,
    latency_s: float = ALLREDUCE_LATENCY_S,
    free_bytes_per_gpu: int = A100_FREE_BYTES,
) -> CostModel:
    """``model`` (one GPU) split Megatron-style over ``size`` GPUs: each streams and computes
    ``1/size`` of the weights, FLOPs and KV, and every step adds two all-reduces per layer of
    ``hidden`` fp16 values per token over ``bandwidth``. The KV space grows by what each
    added GPU holds beside its share (``free_bytes_per_gpu``), and the host tier with it."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return model
    if model.tensor_parallel_size != 1:
        raise ValueError(f"{model.name} is already split over {model.tensor_parallel_size} GPUs")
    hidden = model.kv_bytes_per_token / (4 * model.num_layers)  # K+V, fp16, multi-head
    return model.model_copy(
        update={
            "name": f"{model.name}@tp{size}",
            "source": f"{model.source}; tensor parallel over {size} GPUs, all-reduce at "
            f"{bandwidth / GB:g} GB/s + {latency_s * 1e6:g} us per call",
            "weights_read_s": model.weights_read_s / size,
            "compute_per_token_s": model.compute_per_token_s / size,
            "attn_per_pair_s": model.attn_per_pair_s / size,
            "kv_read_per_token_s": model.kv_read_per_token_s / size,
            "hidden_projection_per_token_s": (
                None
                if model.hidden_projection_per_token_s is None
                else model.hidden_projection_per_token_s / size
            ),
            "device_kv_bytes": model.device_kv_bytes + (size - 1) * free_bytes_per_gpu,
            "host_kv_bytes": model.host_kv_bytes * size,
            "tensor_parallel_size": size,
            "allreduce_calls": 2 * model.num_layers,
            "allreduce_bytes_per_token": 2 * hidden,
            "allreduce_bandwidth": bandwidth,
            "allreduce_latency_s": latency_s,
        }
    )


def available_profiles() -> list[str]:
    return sorted(PROFILES)


def _named(name: str) -> CostModel:
    """A preset, or ``preset@int8`` / ``preset@int4``: its weights read at that width."""
    base, _, quant = name.partition("@")
    model = PROFILES[base]
    if not quant:
        return model
    if quant not in QUANTIZED_BYTES_PER_PARAM:
        raise KeyError(name)
    return model.with_weight_bytes(QUANTIZED_BYTES_PER_PARAM[quant], quant)


def get_profile(profile: str | CostModel | dict[str, object]) -> CostModel:
    """A preset by name, a profile's parsed JSON, or a ``CostModel`` passed through.

    Policies take this (never a path) so that constructing one does no I/O; frontends read
    files with ``load_profile``.
    """
    if isinstance(profile, CostModel):
        return profile
    if isinstance(profile, dict):
        return CostModel.model_validate(profile)
    try:
        return _named(profile)
    except KeyError:
        known = ", ".join(available_profiles())
        raise ValueError(
            f"unknown cost profile {profile!r}; presets: {known} (each also as "
            "NAME@int8 or NAME@int4)"
        ) from None


def load_profile(name_or_path: str | Path) -> CostModel:
    """A preset name, or a JSON file written by ``save_profile`` / ``quanta profile``."""
    if isinstance(name_or_path, str) and name_or_path.partition("@")[0] in PROFILES:
        try:
            return _named(name_or_path)
        except KeyError:
            raise ValueError(
                f"{name_or_path!r}: quantized presets are {sorted(QUANTIZED_BYTES_PER_PARAM)}"
            ) from None
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(available_profiles())
        raise ValueError(f"{name_or_path!r} is neither a preset ({known}) nor a profile file")
    return CostModel.model_validate(json.loads(path.read_text()))


def save_profile(model: CostModel, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(model.model_dump(), indent=2, sort_keys=True) + "\n")
    return path
