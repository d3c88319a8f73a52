"""The PyTorch runner: executes one ``SchedulerOutput`` and never decides what runs.

It owns the weights and two KV tiers (device and host), each ONE tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.  A step copies blocks
(swap-outs first, so a block freed by a swap-out can be the target of a swap-in), then runs
one forward pass over all scheduled tokens packed together, samples only where asked, and
last copies the step's incremental checkpoints to the host tier.  A step of preemptible work
(``abort`` set) polls its signal every ``safepoint_interval`` layers and stops there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from quanta.core.config import AttentionKernel, LinearKernel, LoadFormat
from quanta.core.output import (
    MalformedStepError,
    RunnerCapabilities,
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
    TokenLogprob,
)
from quanta.core.request import HIDDEN_TOKENS_PER_BLOCK
from quanta.core.safepoint import AbortSignal, StepAborted
from quanta.core.sizes import format_size
from quanta.runner import decode_chain, graphs, native_prefill, panel_linear
from quanta.runner.attention import (
    AttentionMetadata,
    HiddenShard,
    PagedSeq,
    build_metadata,
    with_prompt_lens,
)
from quanta.runner.block_copies import BlockCopies, check_copies
from quanta.runner.cpu import has_fast_bf16, keep_freed_memory
from quanta.runner.decode_kernel import decode_kernel, resolve_attention_kernel
from quanta.runner.device_sampler import DeviceSampler, SampledTokens
from quanta.runner.devices import CudaMemory
from quanta.runner.draft import DraftModel
from quanta.runner.layer_ops import layer_ops
from quanta.runner.layers.rotary import by_prompt_length
from quanta.runner.lazy_zeros import zeros_on_demand
from quanta.runner.linear import fuse_model, onednn_supports, resolve_kernel
from quanta.runner.logits import process_logits, token_logprobs
from quanta.runner.memory import DeviceMemory, MemoryUse, describe_kv_sizing, kv_cache_blocks
from quanta.runner.models import build_model_skeleton
from quanta.runner.models.config import ModelConfig, load_model_config
from quanta.runner.models.loader import load_weights
from quanta.runner.models.safepoints import Safepoints
from quanta.runner.quantized import quantized_kernels, resident_weight_bytes
from quanta.runner.random_weights import fill_random_weights
from quanta.runner.speculative import verify
from quanta.runner.tensor_parallel import (
    Rank,
    WorkerGroup,
    agree,
    check_tensor_parallel,
    end_exchanges,
    exchange_rows,
    gather_columns,
    shard_model,
    start_workers,
    worker_step,
    wrap_row_parallel,
)
from quanta.runner.transfer import to_device
from quanta.structured.masks import GrammarMasks, PendingMasks

log = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# Overrides the machine's default dtype (float32, bfloat16, float16) where none is configured:
# for fleets of mixed CPUs that must round alike, and for test suites.
DEFAULT_DTYPE_ENV = "QUANTA_DEFAULT_DTYPE"


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """The caller's dtype, or the default (``default_dtype``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def default_dtype(device: torch.device) -> torch.dtype:
    """The fastest dtype that is correct here: fp16 on CUDA; on CPU bf16 where the CPU runs
    bf16 GEMMs natively (AMX or AVX512_BF16: 2-3x fp32's linears, measured in
    docs/results/benchmarks.md), else fp32 (emulated bf16 is slower than fp32).
    ``QUANTA_DEFAULT_DTYPE`` overrides it."""
    override = os.environ.get(DEFAULT_DTYPE_ENV, "").strip()
    if override:
        if override not in _DTYPES:
            raise ValueError(
                f"{DEFAULT_DTYPE_ENV}={override!r} is not a dtype; use one of {sorted(_DTYPES)}"
            )
        return _DTYPES[override]
    if device.type == "cuda":
        return torch.float16
    if has_fast_bf16() and onednn_supports(torch.bfloat16, device):
        return torch.bfloat16
    return torch.float32


# Rows of prompt logprobs per LM-head call: bounds the [rows, vocab] fp32 logits it holds.
_PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    """Loads a checkpoint of a registered family and executes scheduler steps over a paged KV
    cache."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_device_blocks: int | None,
        num_host_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        linear_kernel: LinearKernel = "auto",
        attention_kernel: AttentionKernel = "auto",
        safepoint_interval: int = 8,
        draft_model: str | Path | None = None,
        tensor_parallel_size: int = 1,
        tensor_rank: Rank | None = None,
        load_format: LoadFormat = "auto",
        enforce_eager: bool = False,
        max_num_seqs: int = 128,
    ) -> None:
        """``draft_model``: a smaller model of the same vocabulary whose greedy proposals the
        steps verify (``runner/draft.py``); its caches get this runner's blocks.
        ``tensor_parallel_size`` > 1 splits the model and every KV block over that many
        ranks (``quanta.runner.tensor_parallel``): this runner is rank 0 and starts the
        others; ``tensor_rank`` is how a worker process builds its own shard.
        ``load_format`` "dummy" creates seeded random weights on the device instead of reading
        them (``runner/random_weights.py``): ``model_dir`` then needs only its config.json.
        On CUDA, decode steps of up to ``max_num_seqs`` rows replay CUDA graphs
        (``runner/graphs.py``) unless ``enforce_eager``."""
        if (num_device_blocks is not None and num_device_blocks <= 0) or (
            num_host_blocks < 0 or block_size <= 0
        ):
            raise ValueError("need num_device_blocks > 0, num_host_blocks >= 0, block_size > 0")
        if safepoint_interval < 1:
            raise ValueError(f"safepoint_interval must be >= 1, got {safepoint_interval}")
        # Layers between checks of a preemptible step's abort signal: a check costs little
        # (an Event read), but a stop is only as early as the next check.
        self.safepoint_interval = safepoint_interval
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = resolve_dtype(dtype, self.device)
        self.block_size = block_size
        # 0 until ``allocate_device_kv``: at once when the size is given, after profiling
        # when the device's memory sizes it (``sized_by_memory``)
        self.num_device_blocks = 0
        self.num_host_blocks = num_host_blocks
        # Swaps and checkpoints run on a side stream on CUDA, in line on the CPU.
        self._copies = BlockCopies(self.device)
        self.model_config: ModelConfig = load_model_config(model_dir)
        self.tp: WorkerGroup | None = None
        rank = tensor_rank
        if rank is None and tensor_parallel_size > 1:
            check_tensor_parallel(self.model_config, tensor_parallel_size, self.device, draft_model)
            if num_device_blocks is None:
                raise ValueError("tensor parallelism needs num_device_blocks up front")
            rank = Rank(0, tensor_parallel_size)
            self._threads_before = torch.get_num_threads()
            # the workers load their shards while this one loads its own
            self.tp = start_workers(
                tensor_parallel_size,
                model_dir=model_dir,
                num_device_blocks=num_device_blocks,
                num_host_blocks=num_host_blocks,
                block_size=block_size,
                dtype=self.dtype,
                device=str(self.device),
                linear_kernel=linear_kernel,
                attention_kernel=attention_kernel,
                safepoint_interval=safepoint_interval,
                load_format=load_format,
            )
        # What this rank's KV cache and attention kernels hold: its heads (all without TP).
        self.kv_config = self.model_config
        self.model = build_model_skeleton(self.model_config)
        try:
            if load_format == "dummy":
                fill_random_weights(self.model, dtype=self.dtype, device=self.device)
            else:
                load_weights(self.model, model_dir, dtype=self.dtype, device=self.device)
            if rank is not None:
                if any(getattr(m, "quantized", None) is not None for m in self.model.modules()):
                    raise ValueError(
                        "tensor parallelism runs bf16/fp32 engines; this one holds quantized "
                        "weights: build it without --quantization"
                    )
                self.kv_config = shard_model(self.model, self.model_config, rank, self._exchange)
            self.linear_kernel = resolve_kernel(linear_kernel, self.dtype, self.device)
            # "amx": the panel kernel's products of a few rows and more run on AMX tiles
            self.linear_tiles = panel_linear.tiles() if self.linear_kernel == "native" else "none"
            fuse_model(self.model, self.linear_kernel)
            # Quantized products' kernels (int8pack, int4pack, dequant), "none" for floats.
            self.quantized_kernel = ",".join(quantized_kernels(self.model)) or "none"
            if rank is not None:
                wrap_row_parallel(self.model, self.model_config)
            if self.tp is not None:
                self.tp.connect()
                weakref.finalize(self, self.tp.close)  # a dropped runner stops its workers
        except BaseException:
            self.close()
            raise
        self.model.eval()
        ops = layer_ops(self.device)
        use_layer_ops = getattr(self.model, "use_layer_ops", None)
        if use_layer_ops is not None:  # models whose layers run through quanta.runner.layer_ops
            use_layer_ops(ops)
        cfg = self.kv_config
        self._decode_kernel, self.attention_kernel = decode_kernel(
            resolve_attention_kernel(attention_kernel, self.device, self.dtype),
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        # "amx": prefill chunks attend on AMX tiles (quanta.runner.native_prefill), else "sdpa"
        self.prefill_kernel, self.prefill_attention = native_prefill.choose(
            dtype=self.dtype,
            device=self.device,
            block_size=block_size,
            head_dim=cfg.head_dim,
        )
        # "chain": decode steps run their layers in one native call (quanta.runner.decode_chain)
        self.layer_path = "layer-by-layer"
        use_decode_chain = getattr(self.model, "use_decode_chain", None)
        if use_decode_chain is not None and decode_chain.enabled():
            chain = decode_chain.build(self.model, ops, self.attention_kernel)
            use_decode_chain(chain)
            if chain is not None:
                self.layer_path = "chain"
        self.host_kv_cache = self._allocate_kv(
            num_host_blocks, torch.device("cpu"), pin=self.device.type == "cuda"
        )
        self.bytes_per_block = self.kv_bytes_per_block(cfg, block_size, self.dtype)
        self.grammar_masks = GrammarMasks(cfg.vocab_size)
        self.sampler = DeviceSampler()  # sampling on the logits' device
        # Under tensor parallelism each rank stores its columns of a hidden-cache token's
        # state and gathers the others' to project its K and V heads (``HiddenShard``).
        self._hidden_shard = None
        if rank is not None:
            columns = rank.span(self.model_config.hidden_size)
            self._hidden_shard = HiddenShard(columns, gather_columns)
        self.capabilities = RunnerCapabilities(
            hidden_cache=offers_hidden_cache(self.model_config), layer_safepoints=True
        )
        # Decode steps replayed from CUDA graphs (``quanta.runner.graphs``), captured once the
        # device KV tier exists (``allocate_device_kv``); ``graphs_off`` says why not.
        self.decode_graphs: graphs.DecodeGraphs | None = None
        self.step_paths = graphs.StepPaths()
        self.max_num_seqs = max_num_seqs
        off = graphs.unsupported(self.model_config, self.device, tensor_parallel=rank is not None)
        self.graphs_off = "enforce-eager" if enforce_eager else off
        self.draft: DraftModel | None = None
        if draft_model is not None:
            # The draft's own runner, over the same blocks, so both caches move together.
            draft_runner = ModelRunner(
                draft_model,
                num_device_blocks=None,  # allocated with this runner's, below
                num_host_blocks=num_host_blocks,
                block_size=block_size,
                dtype=self.dtype,
                device=self.device,
                linear_kernel=linear_kernel,
                attention_kernel=attention_kernel,
                enforce_eager=True,
            )
            self.draft = DraftModel(draft_model, draft_runner, cfg)
        if num_device_blocks is not None:
            self.allocate_device_kv(num_device_blocks)

    @classmethod
    def sized_by_memory(
        cls,
        model_dir: str | Path,
        *,
        utilization: float,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        memory: DeviceMemory | None = None,
        **options: Any,
    ) -> ModelRunner:
        """A runner whose device KV tier takes what ``utilization`` of the device's memory
        leaves once the weights are loaded and the largest step has run (vLLM's
        ``gpu_memory_utilization``; the arithmetic: ``quanta.runner.memory``). ``memory``
        reads the device (default: the CUDA device's; a stand-in in tests); ``options`` are
        the constructor's, ``num_device_blocks`` aside."""
        memory = memory or CudaMemory(str(options.get("device") or "cuda"))
        free_at_start = memory.free()  # before the weights: other processes hold the rest
        runner = cls(model_dir, num_device_blocks=None, max_num_seqs=max_num_seqs, **options)
        try:
            runner.size_kv_from_memory(
                memory,
                free_at_start,
                utilization=utilization,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
            )
        except BaseException:
            runner.close()
            raise
        return runner

    def size_kv_from_memory(
        self,
        memory: DeviceMemory,
        free_at_start: int,
        *,
        utilization: float,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        graph_pool: int = 0,
    ) -> int:
        """Profile the largest step, size the device KV tier from what is left and allocate
        it; returns its blocks. ``free_at_start``: the device's free memory before the
        weights were loaded.

        NOTE: the order is weights, profiling forward, KV cache, then CUDA graphs: graphs
        read the cache's addresses, so they are captured after ``allocate_device_kv``, and
        the pool they will hold (``graph_pool``) must be measured before this call so the
        cache leaves room for it."""
        peak = self._profile_peak(memory, max_num_batched_tokens, max_num_seqs)
        # measured after the profiling forward: library workspaces it created stay
        loaded = max(0, free_at_start - memory.free())
        models = [self.model] + ([] if self.draft is None else [self.draft.runner.model])
        use = MemoryUse(
            total=memory.total(),
            free_at_start=free_at_start,
            loaded=loaded,
            weights=sum(resident_weight_bytes(m) for m in models),
            peak_activation=peak,
            graph_pool=graph_pool,
        )
        per_block = self.bytes_per_block
        if self.draft is not None:  # the draft's cache has the same blocks
            per_block += self.draft.runner.bytes_per_block
        blocks = kv_cache_blocks(use, utilization, per_block)
        log.info("%s", describe_kv_sizing(use, utilization, blocks, per_block))
        before = memory.free()
        self.allocate_device_kv(blocks)  # and the decode graphs, where they run
        graph_bytes = before - memory.free() - blocks * per_block
        if graph_bytes > graph_pool:
            log.info(
                "CUDA graphs hold %s beyond the %s reserved for them in the sizing",
                format_size(graph_bytes),
                format_size(graph_pool),
            )
        return blocks

    def allocate_device_kv(self, num_blocks: int) -> None:
        """Allocate the device KV tier (and the draft model's beside it) with ``num_blocks``
        blocks; once, before the first step."""
        if num_blocks < 1:
            raise ValueError(f"need num_device_blocks > 0, got {num_blocks}")
        self.num_device_blocks = num_blocks
        self.device_kv_cache = self._allocate_kv(num_blocks, self.device)
        if self.draft is not None:
            self.draft.runner.allocate_device_kv(num_blocks)
        if self.graphs_off is None:
            try:
                self.capture_decode_graphs(graphs.cuda_capture())
            except Exception as exc:  # an operator a graph cannot hold: slower, never broken
                log.warning("capturing decode graphs failed, decoding eagerly: %s", exc)
                self.graphs_off = f"capture failed: {type(exc).__name__}"

    def capture_decode_graphs(self, capture: graphs.Capture) -> None:
        """Capture a decode step per padded batch size over the device KV tier (on CUDA
        ``graphs.cuda_capture``; the CPU's stand-in ``graphs.rerun``, for tests); from then on
        every step attends through the Triton kernel the graphs replay."""
        reason = graphs.model_unsupported(self.model_config, tensor_parallel=self.tp is not None)
        if reason is not None:
            raise ValueError(f"decode graphs cannot hold this model: {reason}")
        decode_graphs = graphs.DecodeGraphs(
            self.model,
            self.device_kv_cache,
            sizes=graphs.graph_sizes(self.max_num_seqs),
            block_size=self.block_size,
            num_blocks=self.num_device_blocks,
            max_model_len=self.model_config.max_model_len,
            vocab_size=self.model_config.vocab_size,
            dtype=self.dtype,
            device=self.device,
        )
        with torch.inference_mode():
            seconds = decode_graphs.capture(capture)
        self.decode_graphs, self.graphs_off = decode_graphs, None
        sizes = decode_graphs.sizes
        log.info("captured %d decode graphs (%d to %d rows) in %.2f s", len(sizes), sizes[0],
                 sizes[-1], seconds)  # fmt: skip

    def decode_graph_info(self) -> dict[str, str]:
        """What the engine's info says of the decode graphs: on or off (and why), the sizes,
        the capture time, and how many steps replayed a graph or ran eagerly so far."""
        g = self.decode_graphs
        return {
            "cuda_graphs": "on" if g is not None else f"off ({self.graphs_off})",
            "cuda_graph_sizes": ",".join(map(str, g.sizes)) if g is not None else "none",
            "graph_capture_s": f"{g.capture_s:.2f}" if g is not None else "0",
            "graph_steps": str(self.step_paths.graph),
            "eager_steps": str(self.step_paths.eager),
        }

    def _profile_peak(
        self, memory: DeviceMemory, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """The activations' peak of the largest step, in bytes: ``max_num_batched_tokens``
        prompt tokens in sequences as long as the context allows (one long prompt is where
        attention holds the most), then the LM head and an fp32 softmax over
        ``max_num_seqs`` rows, as sampling takes them. It runs over a cache of its own,
        allocated before the measurement starts and dropped after. The draft model, which
        runs after the target, holds less and is not profiled."""
        longest = self.model_config.max_model_len
        chunks: list[_Chunk] = []
        num_blocks = 0
        for start in range(0, max_num_batched_tokens, longest):
            n = min(longest, max_num_batched_tokens - start)
            used = -(-n // self.block_size)
            table = tuple(range(num_blocks, num_blocks + used))
            chunks.append(_Chunk((0,) * n, 0, table, False, n))
            num_blocks += used
        cache = self._allocate_kv(num_blocks, self.device)
        with torch.inference_mode():
            batch = self._prepare(chunks, num_blocks)
            memory.start_peak()
            hidden = self.model(batch.input_ids, batch.positions, cache, batch.meta)
            rows = hidden[-min(max_num_seqs, hidden.shape[0]) :]
            torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            return memory.peak()

    @staticmethod
    def hidden_blocks_ratio(config: ModelConfig) -> float:
        """How many times more tokens a block holds as hidden states than as K and V:
        ``2 * kv_heads * head_dim / hidden_size`` (2.0 for multi-head attention; below 2 for
        grouped-query models, which is why they are not offered the hidden cache)."""
        return 2 * config.num_kv_heads * config.head_dim / config.hidden_size

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers (K and V); lets frontends turn a memory
        budget into block counts before loading anything."""
        elements = config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim
        return elements * torch.empty((), dtype=dtype).element_size()

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Swap-outs, then swap-ins, then one forward pass and sampling, then checkpoints.

        Returns the sampled token per seq (None where ``sample`` is False).  A malformed step
        (bad block ids, too-short block table, position past ``max_model_len``) raises before
        any block is copied or written; the runner keeps no per-request state to undo.

        With ``abort`` set, the forward pass raises ``StepAborted`` at the first safepoint
        after the signal is raised.  What it leaves behind is harmless: the swaps done before
        it stand (the core already moved those blocks), the KV it wrote lies past the
        requests' computed tokens and is written again when they are computed, nothing was
        sampled and the checkpoint copies were not made.
        """
        started = time.perf_counter()
        so = scheduler_output
        seqs = so.seqs
        with torch.inference_mode():
            try:
                batch = self._prepare_step(so) if seqs else None
                check_copies(so.swap_out, self.num_device_blocks, self.num_host_blocks)
                check_copies(so.swap_in, self.num_host_blocks, self.num_device_blocks)
                check_copies(so.checkpoint, self.num_device_blocks, self.num_host_blocks)
            except ValueError as exc:  # NOTE: nothing copied or written: the loop can tell
                raise MalformedStepError(str(exc)) from exc
            with self._tp_call(lambda: ("step", worker_step(so))):
                self._copy_blocks(so.swap_out, self.device_kv_cache, self.host_kv_cache)
                self._copy_blocks(so.swap_in, self.host_kv_cache, self.device_kv_cache)
                if self.draft is not None:
                    self.draft.copy(so.swap_out, to_host=True)
                    self.draft.copy(so.swap_in, to_host=False)
                sampled: list[int | None] = [None] * len(seqs)
                logprobs: list[TokenLogprob | None] = [None] * len(seqs)
                prompt_logprobs: list[tuple[TokenLogprob, ...]] = [()] * len(seqs)
                pooled: list[tuple[float, ...]] = [()] * len(seqs)
                accepted = [0] * len(seqs)
                if batch is not None:
                    masks = self.grammar_masks.start(seqs)  # filled while the model runs
                    safepoints = (
                        None if so.abort is None else self.safepoints_for(so.abort, started)
                    )
                    hidden = self._forward(batch, safepoints)
                    for i, seq in enumerate(seqs):
                        if seq.prompt_logprobs is not None:
                            first_row = batch.last_rows[i] - seq.num_new_tokens + 1
                            prompt_logprobs[i] = self._prompt_logprobs(hidden, first_row, seq)
                        if seq.pooling is not None:
                            first_row = batch.last_rows[i] - seq.num_new_tokens + 1
                            pooled[i] = _pooled_sum(hidden, first_row, seq)
                    self._sample(hidden, batch, seqs, sampled, logprobs, accepted, masks)
                # NOTE: on CUDA queued on the copy stream, the host going on at once; the next
                # forward waits for it on the GPU (``quanta.runner.block_copies``), so it does
                # not yet overlap that forward (ConServe's background copies).
                self._copy_blocks(so.checkpoint, self.device_kv_cache, self.host_kv_cache)
                proposals: tuple[tuple[int, ...], ...] = ()
                if self.draft is not None:
                    self.draft.copy(so.checkpoint, to_host=True)
                    proposals = self.draft.run(so, sampled, accepted)
        return RunnerOutput(
            request_ids=tuple(seq.request_id for seq in seqs),
            sampled_token_ids=tuple(sampled),
            step_time=time.perf_counter() - started,
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else (),
            prompt_logprobs=tuple(prompt_logprobs) if any(prompt_logprobs) else (),
            pooled=tuple(pooled) if any(pooled) else (),
            num_accepted=tuple(accepted) if any(s.num_draft_tokens for s in seqs) else (),
            proposals=proposals if any(proposals) else (),
        )

    def safepoints_for(self, signal: AbortSignal, started: float) -> Safepoints:
        """The checks of ``signal`` a forward pass makes: every ``safepoint_interval``
        layers, raising ``StepAborted`` (with the seconds since ``started``, the step's
        ``perf_counter`` start) once it is raised. Under tensor parallelism every rank
        stops at the same check (``agree``)."""
        tp = self.tp

        def check(layers_done: int) -> None:
            raised = signal.is_set()
            if tp is not None:
                raised = agree(raised)
            if raised:
                raise StepAborted(layers_done, time.perf_counter() - started)

        # NOTE: on CUDA the check runs when the CPU has queued the layers, not when the GPU has
        # run them; stopping there leaves at most the queued layers to run.
        return Safepoints(self.safepoint_interval, check)

    def _sample(
        self,
        hidden: torch.Tensor,
        batch: _Batch,
        seqs: Sequence[ScheduledSeq],
        sampled: list[int | None],
        logprobs: list[TokenLogprob | None],
        accepted: list[int],
        masks: PendingMasks | None = None,
    ) -> None:
        """Fill ``sampled`` (and ``logprobs`` where asked) for the seqs that sample, and
        ``accepted`` for those that verify drafts (``runner/speculative.py``); the grammar
        masks go first, so log-probabilities are those of the allowed tokens (as vLLM reports
        them under guided decoding)."""
        chosen = [i for i, seq in enumerate(seqs) if seq.sample]
        if not chosen:
            return
        result = self._sampled_tokens(hidden, batch, seqs, chosen, accepted, masks)
        for i, token in zip(chosen, result.tokens(), strict=True):
            sampled[i] = token
        for j, lp in result.logprobs().items():
            logprobs[chosen[j]] = lp

    def _sampled_tokens(
        self,
        hidden: torch.Tensor,
        batch: _Batch,
        seqs: Sequence[ScheduledSeq],
        chosen: list[int],
        accepted: list[int],
        masks: PendingMasks | None,
    ) -> SampledTokens:
        """The tokens of the ``chosen`` seqs, sampled on the device (``runner/device_sampler.py``)
        but for the seqs that verify drafts; the host waits for nothing here where no seq
        verifies drafts or follows a grammar."""
        rows_at = [batch.last_rows[i] for i in chosen]
        # Speculative seqs: the rows before the last one predict their drafts.
        drafted = [i for i in chosen if seqs[i].num_draft_tokens]
        draft_rows = [
            r
            for i in drafted
            for r in range(batch.last_rows[i] - seqs[i].num_draft_tokens, batch.last_rows[i])
        ]
        index = to_device(rows_at + draft_rows, torch.long, self.device)
        picked = hidden.index_select(0, index)  # a replayed graph's rows are logits already
        all_logits = picked if batch.graph is not None else self.model.compute_logits(picked)
        logits = all_logits[: len(chosen)]
        rows = [seqs[i] for i in chosen]
        plain = [j for j, i in enumerate(chosen) if not seqs[i].num_draft_tokens]
        # drawn on the host while the device computes the logits
        noise = self.sampler.start([rows[j] for j in plain], logits.shape[-1], self.device)
        # NOTE: the sampler casts what it picks from; processing and log-probabilities need
        # fp32 for every row, so they get it here.
        if any(row.processing is not None for row in rows):
            logits = logits.float()
        if masks is not None:
            self.grammar_masks.apply(logits, masks)
        raw = process_logits(logits, rows)
        if len(plain) == len(chosen):
            return self.sampler.sample(logits, rows, noise, raw)
        tokens = [0] * len(chosen)
        if plain:
            picked = logits.index_select(0, to_device(plain, torch.long, self.device))
            plain_rows = [rows[j] for j in plain]
            plain_tokens = self.sampler.sample(picked, plain_rows, noise).tokens()
            for j, token in zip(plain, plain_tokens, strict=True):
                tokens[j] = token
        first = len(chosen)
        for j, i in enumerate(chosen):
            k = seqs[i].num_draft_tokens
            if not k:
                continue
            rows_k = torch.cat((all_logits[first : first + k], logits[j : j + 1]))
            accepted[i], tokens[j] = verify(rows_k, seqs[i].token_ids[-k:], rows[j])
            first += k
        ids = to_device(tokens, torch.long, self.device)
        return SampledTokens(ids, None if raw is None else raw.pick(ids))

    def _prompt_logprobs(
        self, hidden: torch.Tensor, first_row: int, seq: ScheduledSeq
    ) -> tuple[TokenLogprob, ...]:
        """Log-probabilities of the prompt tokens ``seq`` asks about, from its rows of
        ``hidden``; the LM head runs on a few hundred rows at a time, so a long prompt never
        holds a ``[prompt, vocab]`` tensor."""
        ask = seq.prompt_logprobs
        assert ask is not None
        start = first_row + ask.first - seq.start_pos
        out: list[TokenLogprob] = []
        for lo in range(0, len(ask.targets), _PROMPT_LOGPROB_ROWS):
            targets = ask.targets[lo : lo + _PROMPT_LOGPROB_ROWS]
            rows = hidden[start + lo : start + lo + len(targets)]
            raw = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            out.extend(token_logprobs(raw, targets, ask.top))
        return tuple(out)

    def forward_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` (fp32) of one sequence, computed through the same
        paged path as ``execute`` on a temporary cache whose block ids run backwards.  With
        ``chunk_size`` the prompt goes through as successive prefill chunks.  For tests."""
        num_blocks = -(-len(token_ids) // self.block_size)
        cache = self._allocate_kv(num_blocks, self.device)
        table = tuple(reversed(range(num_blocks)))
        step = chunk_size or len(token_ids)
        outputs = []
        with torch.inference_mode(), self._tp_call(lambda: ("logits", list(token_ids), chunk_size)):
            for start in range(0, len(token_ids), step):
                chunk = _Chunk(
                    tuple(token_ids[start : start + step]), start, table, False, len(token_ids)
                )
                batch = self._prepare([chunk], num_blocks)
                hidden = self.model(batch.input_ids, batch.positions, cache, batch.meta)
                outputs.append(self.model.compute_logits(hidden).float())
                if self.tp is not None:
                    end_exchanges()
        return torch.cat(outputs)

    def _tp_call(
        self, message: Callable[[], tuple[object, ...]]
    ) -> contextlib.AbstractContextManager[None]:
        """The workers' share of what runs inside (nothing without tensor parallelism);
        ``message`` is built only when there are workers."""
        return contextlib.nullcontext() if self.tp is None else self.tp.call(message())

    def _exchange(
        self, hidden: torch.Tensor, local: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The LM head's logits over every rank's vocabulary shard (rank 0 only)."""
        if self.tp is None:
            raise RuntimeError("only rank 0 of a tensor-parallel group computes logits")
        return exchange_rows(hidden, local, self.tp.world)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the runner is unusable afterwards."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None
            torch.set_num_threads(self._threads_before)

    def bind_thread(self) -> None:
        """Make this runner's device the calling thread's current one (CUDA's is per
        thread): the loop calls it on the thread that runs steps while it schedules the next
        (``quanta.core.overlap``), so a runner on ``cuda:1`` launches its kernels there."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _prepare_step(self, so: SchedulerOutput) -> _Batch:
        """The step's batch: loaded into the decode graphs' buffers where a graph replays it
        (``quanta.runner.graphs``), else packed by ``_prepare``; counts the path it takes."""
        decode_graphs = self.decode_graphs
        reason = "graphs off" if decode_graphs is None else decode_graphs.eager_reason(so)
        if decode_graphs is None or reason is not None:
            batch = self._prepare(so.seqs, self.num_device_blocks)
            self.step_paths.eager += 1
            log.debug("step of %d rows runs eagerly: %s", len(so.seqs), reason)
            return batch
        input_ids, positions, meta = decode_graphs.load(so.seqs)
        self.step_paths.graph += 1
        last_rows = list(range(len(so.seqs)))
        return _Batch(input_ids, positions, meta, last_rows, graph=decode_graphs)

    def _forward(self, batch: _Batch, safepoints: Safepoints | None) -> torch.Tensor:
        """The rows' final hidden states; where a decode graph replays the step, their logits
        (the graph holds the LM head)."""
        if batch.graph is not None:
            return batch.graph.replay(len(batch.last_rows))
        return self.model(
            batch.input_ids, batch.positions, self.device_kv_cache, batch.meta, safepoints
        )

    def _prepare(self, seqs: Sequence[PagedSeq], num_blocks: int) -> _Batch:
        """Pack the step's tokens and build the attention indices; validates, writes nothing."""
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        if not self.capabilities.hidden_cache and any(s.hidden for s in seqs):
            raise ValueError(
                f"{self.model_config.family} model with {self.model_config.num_kv_heads} KV "
                f"heads for {self.model_config.num_heads} query heads offers no hidden cache"
            )
        for seq in seqs:
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
            last_rows.append(len(token_ids) - 1)
        meta = build_metadata(
            seqs,
            self.block_size,
            num_blocks,
            self.device,
            self._decode_kernel,
            self._hidden_shard,
            self.prefill_kernel,
        )
        if by_prompt_length(self.model_config):
            meta = with_prompt_lens(meta, seqs, self.device)
        if self.decode_graphs is not None and meta.paged is None and meta.hidden is None:
            # every step attends through the kernel the graphs replay, so rows round alike
            from quanta.runner.triton_attention import paged_batch

            meta = replace(meta, paged=paged_batch(seqs, self.block_size, self.device))
        max_pos = max(positions)
        if max_pos >= self.model_config.max_model_len:
            raise ValueError(
                f"position {max_pos} is beyond max_model_len {self.model_config.max_model_len}"
            )
        return _Batch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            last_rows=last_rows,
        )

    def _allocate_kv(
        self, num_blocks: int, device: torch.device, pin: bool = False
    ) -> torch.Tensor:
        cfg = self.kv_config
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        if device.type == "cpu" and not pin:  # committed as blocks are written (lazy_zeros)
            return zeros_on_demand(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)

    def _copy_blocks(
        self, pairs: tuple[tuple[int, int], ...], src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy blocks ``src_id -> dst_id`` between this runner's tiers (``src`` and ``dst``
        are its device and host caches, either way round), all layers, K and V
        (``quanta.runner.block_copies``: on CUDA on a side stream, ordered by events)."""
        self._copies.copy(pairs, src, dst, self.host_kv_cache)


@dataclass(frozen=True, slots=True)
class _Batch:
    """One step's packed inputs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    last_rows: list[int]  # row of each seq's last token
    # Set where a decode graph replays the step: its inputs are the graph's buffers
    graph: graphs.DecodeGraphs | None = None


class _Chunk:
    """A minimal ``PagedSeq`` for ``forward_logits``."""

    __slots__ = ("block_table", "hidden", "num_prompt_tokens", "start_pos", "token_ids")

    def __init__(
        self,
        token_ids: tuple[int, ...],
        start_pos: int,
        block_table: tuple[int, ...],
        hidden: bool = False,
        num_prompt_tokens: int = 0,
    ):
        self.token_ids = token_ids
        self.start_pos = start_pos
        self.block_table = block_table
        self.hidden = hidden
        self.num_prompt_tokens = num_prompt_tokens


def offers_hidden_cache(config: ModelConfig) -> bool:
    """A hidden-cache request halves its blocks only where K and V are each as wide as the
    attention input (multi-head attention: OPT, LLaMA-1/2 7B/13B): there a block holds the
    core's ``HIDDEN_TOKENS_PER_BLOCK`` times as many hidden tokens. Grouped-query models
    would need more blocks for hidden states than for K and V, so they are not offered it."""
    return ModelRunner.hidden_blocks_ratio(config) == HIDDEN_TOKENS_PER_BLOCK


def _pooled_sum(hidden: torch.Tensor, first_row: int, seq: ScheduledSeq) -> tuple[float, ...]:
    """The fp32 sum of the final hidden states an embedding request's chunk asks for
    (``PoolingAsk``); ``first_row`` is the row of the chunk's first token in ``hidden``."""
    ask = seq.pooling
    assert ask is not None
    start = first_row + ask.first - seq.start_pos
    rows = hidden[start : start + ask.num_rows].float()
    return tuple(rows.sum(dim=0).tolist())
