"""Decode steps replayed from CUDA graphs: one graph per padded batch size, over fixed buffers.

A decode step on a GPU is bound by the host: every layer's launches cost more CPU time than the
GPU spends on a small batch. A captured graph replays the whole step, embedding, every layer and
the LM head, in one launch. Its inputs must then sit where the capture saw them: ``DecodeGraphs``
owns fixed device buffers (token ids, positions, slot mapping, block tables, each row's start
and count, the logits) that ``load`` fills for a step with two host-to-device copies. A step of
``n`` rows replays the graph of the smallest captured size ``>= n`` (``graph_sizes``: 1, 2, 4, 8,
then steps of 8 up to 64 and of 16 beyond, up to ``max_num_seqs``); its padded rows write to no
slot (slot -1) and read no context (count 0), so they change no K/V and cost the real rows
nothing but their products. Every size is captured at start-up, the largest first, into one
memory pool (a smaller graph reuses the larger one's memory), and the capture time is logged.

Attention inside a graph must read block tables and lengths on the device, so it runs through
the Triton kernel (``quanta.runner.triton_attention``) with ``MAX_SPLITS`` splits fixed at
capture and each row's split size computed on the device (``fixed_decode_batch``); an engine
with graphs runs every step through that kernel, so an eager step rounds each row as a replay
does. The rotary table is filled to the model's context length before the capture, so no
position is read back to the host.

What runs eagerly (``eager_reason``): steps with prefill chunks (mixed prefill and decode
included), hidden-cache rows, draft verification, prompt log-probabilities or pooling, steps
with more rows than the largest graph, and preemptible steps (below). Models a graph cannot
hold run every step eagerly (``unsupported``): longrope (a row's rotation depends on its
prompt length), tensor parallelism (the ranks exchange over gloo from the host). Sliding-window
and soft-capped layers are held: the kernel takes the window and the cap, and a released
block's first held position is one of the buffers.

ConServe's layer safepoints: a preemptible step (``SchedulerOutput.abort``) runs eagerly,
checking its signal every ``safepoint_interval`` layers exactly as without graphs. The cost is
that steps holding only offline work, the only ones that carry a signal, lose the replay's
saving; online and mixed steps keep it. Capturing the layers in segments, one graph per
safepoint interval and size with the signal checked between replays, would keep offline decodes
fast at ``num_layers / safepoint_interval`` times the graphs and capture time; it waits until the
offline steps' share is measured on a GPU.

On a CPU the same buffers, padding and dispatch run with ``rerun`` in place of the capture (the
"graph" is the step's function, run again over the same buffers), which is how the tests check
them without a GPU.
"""

from __future__ import annotations

import bisect
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.core.window import first_held
from quanta.runner.attention import CUDA_ATTENTION_ENV, AttentionMetadata
from quanta.runner.layers.rotary import RotaryTable, by_prompt_length
from quanta.runner.models.config import ModelConfig

# Rows of the largest graph whatever ``max_num_seqs`` says: bigger decode batches are bound by
# the GPU, not the host, and each size holds its own activations in the pool.
MAX_GRAPH_ROWS = 512

# A replayable step: ``capture(fn)`` runs ``fn`` as it will be replayed and returns the replay.
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to 64 and every
    16 beyond, below ``max_num_seqs`` (at most ``MAX_GRAPH_ROWS``), and that bound itself."""
    top = min(max_num_seqs, MAX_GRAPH_ROWS)
    steps = (1, 2, 4, *range(8, 64, 8), *range(64, MAX_GRAPH_ROWS, 16))
    return (*(s for s in steps if s < top), top)


def cuda_capture() -> Capture:
    """Captures into CUDA graphs that share one memory pool. Each step function runs once
    before its capture, so Triton compiles and cuBLAS chooses its kernels outside it."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    return capture


def rerun(fn: Callable[[], None]) -> Callable[[], None]:
    """The stand-in for a capture where there is no GPU: the step function itself, replayed by
    running it again over the same buffers."""
    return fn


def unsupported(
    config: ModelConfig, device: torch.device, *, tensor_parallel: bool = False
) -> str | None:
    """Why decode graphs are off for this model on ``device``, or None where they run."""
    if device.type != "cuda":
        return "not a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if os.environ.get(CUDA_ATTENTION_ENV, "").strip() == "torch":
        return f"{CUDA_ATTENTION_ENV}=torch"
    return model_unsupported(config, tensor_parallel=tensor_parallel)


def model_unsupported(config: ModelConfig, *, tensor_parallel: bool = False) -> str | None:
    """Why this model's decode steps cannot be captured, on any device, or None."""
    if tensor_parallel:
        return "tensor parallelism"
    if by_prompt_length(config):
        return "longrope rotations"
    return None


@dataclass
class StepPaths:
    """How many steps replayed a graph and how many ran eagerly (for logs and engine info)."""

    graph: int = 0
    eager: int = 0


class DecodeGraphs:
    """One replayable decode step per padded batch size over fixed buffers (module docstring).

    ``load`` checks a step and fills the buffers; ``replay`` then runs it and returns the real
    rows' logits, a view of a buffer the next replay overwrites."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: torch.Tensor,
        *,
        sizes: Sequence[int],
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = device
        self.capture_s = 0.0
        rows = self.sizes[-1]
        width = -(-max_model_len // block_size)
        # Token ids, positions, slot mapping and counts, one row each: one copy fills them.
        self._ints = torch.zeros((4, rows), dtype=torch.long, device=device)
        self._tables = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self._starts = torch.zeros(rows, dtype=torch.int32, device=device)
        self._counts = torch.zeros(rows, dtype=torch.int32, device=device)
        self._rows = torch.arange(rows, dtype=torch.int32, device=device)
        self._zeros = torch.zeros(rows, dtype=torch.int32, device=device)
        # Each row's first held position (a sliding window released the blocks before it).
        self._firsts = torch.zeros(rows, dtype=torch.int32, device=device)
        self._logits = torch.zeros((rows, vocab_size), dtype=dtype, device=device)
        self._pin = device.type == "cuda"
        self._replays: dict[int, Callable[[], None]] = {}
        self._metas: dict[int, AttentionMetadata] = {}

    def capture(self, capture: Capture) -> float:
        """Capture every size, the largest first (its pool then serves the smaller ones);
        returns the seconds it took. The buffers hold padded rows only meanwhile, so the
        captures write no K/V."""
        from quanta.runner.triton_attention import fixed_decode_batch

        started = time.perf_counter()
        self._ints[2] = -1  # every row padding: token 0 at position 0, no slot, no context
        rotary = getattr(getattr(self.model, "decoder", None), "rotary", None)
        if isinstance(rotary, RotaryTable):
            rotary.reserve(self.max_model_len, self._logits.dtype, self.device)
        for size in reversed(self.sizes):
            paged = fixed_decode_batch(
                self._tables[:size],
                self._rows[:size],
                self._starts[:size],
                self._counts[:size],
                self._firsts[:size],
                self._zeros[:size],
            )
            meta = AttentionMetadata(
                slot_mapping=self._ints[2, :size], prefills=(), decode=None, paged=paged
            )
            self._metas[size] = meta
            self._replays[size] = capture(self._step_fn(size, meta))
        self.capture_s = time.perf_counter() - started
        return self.capture_s

    def _step_fn(self, size: int, meta: AttentionMetadata) -> Callable[[], None]:
        ids, positions, counts = self._ints[0, :size], self._ints[1, :size], self._ints[3, :size]

        def step() -> None:
            self._starts[:size].copy_(positions)
            self._counts[:size].copy_(counts)
            hidden = self.model(ids, positions, self.kv_cache, meta)
            self._logits[:size].copy_(self.model.compute_logits(hidden))

        return step

    def padded_size(self, num_rows: int) -> int:
        """The captured size a step of ``num_rows`` rows replays."""
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    def eager_reason(self, so: SchedulerOutput) -> str | None:
        """Why ``so`` runs eagerly, or None where a graph replays it."""
        if so.abort is not None:
            return "preemptible"
        if len(so.seqs) > self.sizes[-1]:
            return "more rows than the largest graph"
        for seq in so.seqs:
            reason = _row_reason(seq)
            if reason is not None:
                return reason
        return None

    def load(
        self, seqs: Sequence[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Check a decode step and copy it into the buffers; returns the padded step as the
        graph reads it (token ids, positions, attention metadata). Raises ValueError (having
        written no K/V) for a block table too short or out of range, or a position past the
        model's context."""
        n, size, bs = len(seqs), self.padded_size(len(seqs)), self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        firsts: list[int] = []
        tables: list[tuple[int, ...]] = []
        for seq in seqs:
            pos = seq.start_pos
            table = seq.block_table[: pos // bs + 1]
            if len(table) <= pos // bs:
                raise ValueError(
                    f"sequence needs {pos // bs + 1} blocks for {pos + 1} tokens, "
                    f"block table has {len(seq.block_table)}"
                )
            ids.append(seq.token_ids[0])
            positions.append(pos)
            slots.append(table[-1] * bs + pos % bs)
            first = first_held(table)
            firsts.append(first * bs)
            tables.append((0,) * first + table[first:])  # released entries are never read
        if max(positions) >= self.max_model_len:
            raise ValueError(
                f"position {max(positions)} is beyond max_model_len {self.max_model_len}"
            )
        width = max(len(t) for t in tables)
        table_rows = torch.tensor(
            [(*t, *(0,) * (width - len(t))) for t in tables],
            dtype=torch.int32,
            pin_memory=self._pin,
        )
        if int(table_rows.min()) < 0 or int(table_rows.max()) >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks}) in a block table")
        pad = size - n
        ints = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, [1] * n + [0] * pad],
            dtype=torch.long,
            pin_memory=self._pin,
        )
        self._ints[:, :size].copy_(ints, non_blocking=True)
        self._tables[:n, :width].copy_(table_rows, non_blocking=True)
        held = torch.tensor(firsts + [0] * pad, dtype=torch.int32, pin_memory=self._pin)
        self._firsts[:size].copy_(held, non_blocking=True)
        return self._ints[0, :size], self._ints[1, :size], self._metas[size]

    def replay(self, num_rows: int) -> torch.Tensor:
        """Run the loaded step; the real rows' logits ``[num_rows, vocab]``."""
        self._replays[self.padded_size(num_rows)]()
        return self._logits[:num_rows]


def _row_reason(seq: ScheduledSeq) -> str | None:
    if seq.num_draft_tokens:
        return "draft verification"
    if len(seq.token_ids) != 1:
        return "prefill"
    if seq.hidden:
        return "hidden cache"
    if seq.prompt_logprobs is not None:
        return "prompt logprobs"
    if seq.pooling is not None:
        return "pooling"
    return None
