"""Paged attention over block tables: a prefill kernel for multi-token chunks (the native AMX
one where it runs, ``quanta.runner.native_prefill``; SDPA elsewhere), a decode kernel for the
rest.

A KV tier is ONE tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, so
a swap is a single indexed copy over all layers; a layer sees ``cache[layer]``
(``[2, num_blocks, block_size, kv_heads, head_dim]``).  Token ``pos`` of a sequence lives in
slot ``block_table[pos // block_size] * block_size + pos % block_size``.

Every step first writes its new K/V through the slot mapping, then attends over the context
in the cache: one call per prefill chunk (the AMX kernel reads the chunk's blocks in place;
SDPA gets them gathered, with the causal mask offset by the chunk's start), and for all
single-token (decode) rows together a packed, unpadded attention over
the slots each row owns (``DecodeBatch``: the flat slots of every row's context, row after
row), through the kernel the runner chose (``quanta.runner.decode_kernel``: native C reading
the slots in place, or ``decode_kernel.varlen_decode``'s segmented softmax over one gathered
``[N, kv_heads, head_dim]`` buffer, compiled or eager). A padded layout
gathered every row up to the longest context and then had to zero the stale slots (a slot
past a row's context may hold inf/NaN from an earlier owner, and a masked score still
multiplies its value); that copy and fill were 56% of a batch-32 decode step. Here a stale
slot is never read, so NaN-safety holds by construction.

A sliding-window model's blocks that no window reaches any more go back to the pool; their
block-table entries are ``RELEASED`` (``quanta.core.window``), always the table's first ones.
Attention starts each sequence at its first held block, the window's first: a prefill chunk's
``block_ids`` begin at table index ``window_start_block``, and a decode row's slots (and its
``lens``, ``bounds``) at that block's first slot, so no released block id is ever read. Only
windowed layers meet such a sequence: its context is longer than the window.

Hidden-cache sequences (Apt-Serve) keep each layer's attention input instead of K and V: a
layer's cache viewed as ``[2 * num_blocks * block_size, hidden]`` gives a block room for
``2 * block_size`` such vectors (K and V are each as wide as the hidden state in multi-head
attention). Every step their past K and V are projected again from those vectors, in one
matrix product over all hidden sequences (the extra cost the scheduler weighs as rho), and
joined with the step's own K and V; then they attend exactly as KV sequences do: prefill
chunks through SDPA, single-token rows through the same packed decode kernel.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from quanta.core.request import HIDDEN_TOKENS_PER_BLOCK
from quanta.core.window import first_held
from quanta.runner.layer_ops import TorchLayerOps

if TYPE_CHECKING:
    from quanta.runner.triton_attention import PagedBatch

# On CUDA: "triton" or "torch" (the SDPA and packed decode path). An engine that replays
# decode graphs (``quanta.runner.graphs``, the CUDA default) attends through Triton whatever
# this says, except "torch", which turns the graphs off.
CUDA_ATTENTION_ENV = "QUANTA_CUDA_ATTENTION"


class PagedSeq(Protocol):
    """What attention needs of one scheduled sequence (``ScheduledSeq`` fits)."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_table(self) -> tuple[int, ...]: ...
    @property
    def hidden(self) -> bool: ...


# (query rows [B, H, D], key cache, value cache [slots, KVH, D], the batch, scale) -> [B, H, D]
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "DecodeBatch", float], torch.Tensor
]
# (hidden states [P, hidden], layer) -> K and V [P, kv_heads, head_dim] of those tokens
ProjectKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class PrefillKernel(Protocol):
    """A native kernel for prefill chunks (``quanta.runner.native_prefill``): reads the
    chunk's context in place from the paged cache, with the causal bound implicit, and
    serves sliding-window and soft-capped layers too."""

    def serves(self, q: torch.Tensor, key_cache: torch.Tensor) -> bool: ...

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_ids: torch.Tensor,
        block_size: int,
        start: int,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A multi-token chunk: rows ``[token_start, token_end)`` of the packed batch."""

    token_start: int
    token_end: int
    context_len: int
    block_ids: torch.Tensor  # [num_context_blocks - window_start_block]
    mask: torch.Tensor | None  # [n, context_len] bool; None means plain causal (start_pos == 0)
    # Table index of ``block_ids[0]``; the blocks before it were released (sliding window).
    window_start_block: int = 0


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """All single-token rows of the step, attended together over their packed contexts."""

    token_index: torch.Tensor  # [B] rows of the packed batch
    # [N] flat cache slots of every row's context, row after row: from its first held block
    # (a sliding window's first) to its own token
    slots: torch.Tensor
    owner: torch.Tensor  # [N] which of the B rows each slot belongs to
    kernel: DecodeKernel  # the runner's choice (``quanta.runner.decode_kernel``)
    lens: tuple[int, ...]  # each row's share of ``slots`` (its context length, none released)
    bounds: torch.Tensor  # [B + 1] row b's slots are ``slots[bounds[b]:bounds[b + 1]]``


@dataclass(frozen=True, slots=True)
class HiddenShard:
    """Under tensor parallelism a rank's share of a block holds ``1/N`` of each hidden
    state: these ``columns``. Its K and V heads need the whole state of every past token,
    so ``gather`` puts the ranks' columns back together (one all-gather per layer)."""

    columns: slice
    gather: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class HiddenBatch:
    """The step's hidden-cache sequences. Their contexts are assembled, sequence after
    sequence, in one buffer ``cat(past K/V [P], the rows' new K/V [R])[context_index]``;
    ``prefills`` and ``decode`` index that buffer, as KV ones index the cache."""

    rows: torch.Tensor  # [R] packed-batch rows of the hidden sequences' new tokens
    slots: torch.Tensor  # [R] hidden slots the rows' attention inputs are stored in
    past_slots: torch.Tensor  # [P] hidden slots of their cached tokens, sequence after sequence
    past_positions: torch.Tensor  # [P] positions of those tokens (rotary embeddings)
    context_index: torch.Tensor  # [P + R] assembles every sequence's context contiguously
    prefills: tuple[PrefillChunk, ...]  # block_ids: the chunk's context rows in the buffer
    decode: DecodeBatch | None  # slots: each row's context rows in the buffer
    shard: HiddenShard | None = None  # tensor parallelism: what this rank stores
    # [P] each cached token's request's prompt length, where the rotation needs it
    past_prompt_lens: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step index tensors, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T'] flat cache slot of each new token of the KV sequences
    prefills: tuple[PrefillChunk, ...]
    decode: DecodeBatch | None
    kv_rows: torch.Tensor | None = None  # [T'] their rows; None: every row is a KV row
    hidden: HiddenBatch | None = None
    # Runs the KV prefill chunks it serves (``PrefillKernel.serves``); None: SDPA runs all.
    prefill_kernel: PrefillKernel | None = None
    # [T] each row's request's prompt length, where the rotation needs it (longrope picks
    # its frequencies by it, ``quanta.runner.layers.rotary``); None elsewhere.
    prompt_lens: torch.Tensor | None = None
    # CUDA: the step as the Triton kernels read it (``quanta.runner.triton_attention``); set,
    # ``paged_attention`` runs every row through them (``prefills`` and ``decode`` stay for
    # the layers that attend elsewhere: sliding windows, soft-caps).
    paged: PagedBatch | None = None


# K/V stores where the caller names no layer operations (torch's index_copy_).
_TORCH_OPS = TorchLayerOps()


def build_metadata(
    seqs: Sequence[PagedSeq],
    block_size: int,
    num_blocks: int,
    device: torch.device,
    decode_kernel: DecodeKernel,
    hidden_shard: HiddenShard | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> AttentionMetadata:
    """Index tensors for one packed step; raises ValueError on a too-short or bad block table.

    Per-token indices (slots of new tokens, decode contexts) are computed with tensor ops
    from the per-block tables, so a step's Python work grows with its blocks, not its tokens.
    """
    kv: list[tuple[int, PagedSeq, list[int]]] = []
    hidden: list[tuple[int, PagedSeq, list[int]]] = []
    offset = 0
    for seq in seqs:
        is_hidden = seq.hidden
        per_block = block_size * (HIDDEN_TOKENS_PER_BLOCK if is_hidden else 1)
        table = _checked_table(seq, per_block, num_blocks)
        (hidden if is_hidden else kv).append((offset, seq, table))
        offset += len(seq.token_ids)
    meta = _kv_metadata(kv, block_size, device, decode_kernel, prefill_kernel)
    if not hidden:
        if _triton_attention(device):
            from quanta.runner.triton_attention import paged_batch

            return replace(meta, paged=paged_batch(seqs, block_size, device))
        return meta
    kv_rows = [o + i for o, seq, _ in kv for i in range(len(seq.token_ids))]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        prefills=meta.prefills,
        decode=meta.decode,
        kv_rows=torch.tensor(kv_rows, dtype=torch.long, device=device),
        hidden=_hidden_metadata(
            hidden, block_size, num_blocks, device, decode_kernel, hidden_shard
        ),
        prefill_kernel=meta.prefill_kernel,
    )


def with_prompt_lens(
    meta: AttentionMetadata, seqs: Sequence[PagedSeq], device: torch.device
) -> AttentionMetadata:
    """``meta`` with each row's request's prompt length (``prompt_lens``), and each
    hidden-cache sequence's for its cached tokens (``HiddenBatch.past_prompt_lens``), for
    rotations that depend on it (``quanta.runner.layers.rotary``). A sequence that does not
    give it (``num_prompt_tokens`` 0 or absent: a test's or the draft model's chunks) counts
    its context up to this chunk's end, which is right for a whole prompt, a prompt's last
    chunk and a decode."""
    lens = torch.tensor(
        [getattr(s, "num_prompt_tokens", 0) or s.start_pos + len(s.token_ids) for s in seqs],
        dtype=torch.long,
    )
    counts = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.long)
    rows = torch.repeat_interleave(lens, counts).to(device)
    if meta.hidden is None:
        return replace(meta, prompt_lens=rows)
    # NOTE: the hidden batch holds its sequences' cached tokens in step order, all of each
    hidden = torch.tensor([s.hidden for s in seqs], dtype=torch.bool)
    past = torch.tensor([s.start_pos for s in seqs], dtype=torch.long)[hidden]
    past_lens = torch.repeat_interleave(lens[hidden], past).to(device)
    return replace(meta, prompt_lens=rows, hidden=replace(meta.hidden, past_prompt_lens=past_lens))


def _checked_table(seq: PagedSeq, per_block: int, num_blocks: int) -> list[int]:
    """The blocks ``seq``'s context spans (``per_block`` tokens each), checked."""
    n = len(seq.token_ids)
    context_len = seq.start_pos + n
    num_ctx_blocks = -(-context_len // per_block)
    table = list(seq.block_table[:num_ctx_blocks])
    if n == 0 or len(table) < num_ctx_blocks:
        raise ValueError(
            f"sequence needs {num_ctx_blocks} blocks for {context_len} tokens, "
            f"block table has {len(seq.block_table)} (tokens this step: {n})"
        )
    first = first_held(table)
    held = table[first:]
    if not held or min(held) < 0 or max(held) >= num_blocks:
        raise ValueError(f"block id out of range [0, {num_blocks}) in {table}")
    if seq.start_pos < first * per_block:
        raise ValueError(f"tokens from {seq.start_pos} written into a released block: {table}")
    return table


def _kv_metadata(
    entries: list[tuple[int, PagedSeq, list[int]]],
    block_size: int,
    device: torch.device,
    kernel: DecodeKernel,
    prefill_kernel: PrefillKernel | None = None,
) -> AttentionMetadata:
    """Cache slots, prefill chunks and the packed decode batch of the KV sequences."""
    if not entries:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return AttentionMetadata(slot_mapping=empty, prefills=(), decode=None)
    tables = [table for _, _, table in entries]
    starts = [seq.start_pos for _, seq, _ in entries]
    counts = [len(seq.token_ids) for _, seq, _ in entries]
    firsts = [first_held(table) * block_size for table in tables]  # first readable positions
    prefills = [
        _prefill_chunk(o, seq.start_pos, len(seq.token_ids), table, device)
        for o, seq, table in entries
        if len(seq.token_ids) > 1 and not _verifies(seq)
    ]
    # NOTE: a verification's rows each decode over the context up to their own token, through
    # the decode kernel, so each row's logits are rounded exactly as plain decoding's are.
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    decode_lens: list[int] = []
    decode_firsts: list[int] = []
    for index, (o, seq, _) in enumerate(entries):
        n = len(seq.token_ids)
        if n == 1 or _verifies(seq):
            decode_rows.extend(range(o, o + n))
            decode_seqs.extend([index] * n)
            decode_lens.extend(range(seq.start_pos + 1, seq.start_pos + n + 1))
            decode_firsts.extend([firsts[index]] * n)
    slot_table = _slot_table(tables, block_size)  # [S, max_blocks * block_size]
    lens = torch.tensor([s + n for s, n in zip(starts, counts, strict=True)], dtype=torch.long)
    start_t = torch.tensor(starts, dtype=torch.long)
    positions = torch.arange(slot_table.shape[1])
    new = (positions[None, :] >= start_t[:, None]) & (positions[None, :] < lens[:, None])
    decode = None
    if decode_rows:
        ctx = slot_table[torch.tensor(decode_seqs, dtype=torch.long)]
        ctx_firsts = torch.tensor(decode_firsts, dtype=torch.long)
        ctx_ends = torch.tensor(decode_lens, dtype=torch.long)
        at = positions[None, :]
        owned = (at >= ctx_firsts[:, None]) & (at < ctx_ends[:, None])
        ctx_lens = ctx_ends - ctx_firsts
        decode = DecodeBatch(
            token_index=torch.tensor(decode_rows, dtype=torch.long, device=device),
            slots=ctx[owned].to(device),
            owner=torch.repeat_interleave(torch.arange(len(decode_rows)), ctx_lens).to(device),
            kernel=kernel,
            lens=tuple(ctx_lens.tolist()),
            bounds=_bounds(ctx_lens).to(device),
        )
    return AttentionMetadata(
        slot_mapping=slot_table[new].to(device),  # row-major: the packed batch's token order
        prefills=tuple(prefills),
        decode=decode,
        prefill_kernel=prefill_kernel if prefills else None,
    )


def _triton_attention(device: torch.device) -> bool:
    """Whether a step on ``device`` attends through the Triton kernels: on CUDA where triton
    is installed and ``QUANTA_CUDA_ATTENTION=triton`` asks for them. Without decode graphs
    (``--enforce-eager``, or a capture that failed) the torch path stays the default until the
    kernels have been checked on a GPU (their tests so far ran under Triton's CPU interpreter);
    with graphs the runner sets the Triton batch itself (``ModelRunner._prepare``)."""
    if device.type != "cuda":
        return False
    choice = os.environ.get(CUDA_ATTENTION_ENV, "").strip() or "torch"
    if choice not in ("triton", "torch"):
        raise ValueError(f"{CUDA_ATTENTION_ENV}={choice!r}: use triton or torch")
    return choice == "triton" and importlib.util.find_spec("triton") is not None


def _verifies(seq: PagedSeq) -> bool:
    """A decode token with drafts after it (``ScheduledSeq.num_draft_tokens``)."""
    return getattr(seq, "num_draft_tokens", 0) > 0


def _bounds(lens: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]``: where each row's slots start and end."""
    return torch.cat((lens.new_zeros(1), lens.cumsum(0)))


def _hidden_slots(table: list[int], stop: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """Hidden slots of positions ``[0, stop)`` in a layer's cache viewed as
    ``[2 * num_blocks * block_size, hidden]``: a block's first ``block_size`` tokens sit where
    its K would, the next ``block_size`` where its V would."""
    pos = torch.arange(stop)
    per_block = block_size * HIDDEN_TOKENS_PER_BLOCK
    blocks = torch.tensor(table, dtype=torch.long)[pos // per_block]
    within = pos % per_block
    return (
        (within // block_size) * (num_blocks * block_size)
        + blocks * block_size
        + (within % block_size)
    )


def _hidden_metadata(
    entries: list[tuple[int, PagedSeq, list[int]]],
    block_size: int,
    num_blocks: int,
    device: torch.device,
    kernel: DecodeKernel,
    shard: HiddenShard | None = None,
) -> HiddenBatch:
    rows: list[int] = []
    slots: list[torch.Tensor] = []
    past_slots: list[torch.Tensor] = []
    past_positions: list[torch.Tensor] = []
    past_total = sum(seq.start_pos for _, seq, _ in entries)
    new_total = sum(len(seq.token_ids) for _, seq, _ in entries)
    context_index: list[torch.Tensor] = []
    prefills: list[PrefillChunk] = []
    decode_rows: list[int] = []
    decode_ctx: list[torch.Tensor] = []
    decode_lens: list[int] = []
    past_at = new_at = assembled = 0
    for offset, seq, table in entries:
        n, start = len(seq.token_ids), seq.start_pos
        context_len = start + n
        all_slots = _hidden_slots(table, context_len, block_size, num_blocks)
        rows.extend(range(offset, offset + n))
        slots.append(all_slots[start:])
        past_slots.append(all_slots[:start])
        past_positions.append(torch.arange(start))
        context_index.append(torch.arange(past_at, past_at + start))
        context_index.append(torch.arange(past_total + new_at, past_total + new_at + n))
        span = torch.arange(assembled, assembled + context_len)
        if n == 1:
            decode_rows.append(offset)
            decode_ctx.append(span)
            decode_lens.append(context_len)
        else:
            mask = _chunk_mask(start, n, device)
            prefills.append(PrefillChunk(offset, offset + n, context_len, span.to(device), mask))
        past_at += start
        new_at += n
        assembled += context_len
    assert past_at == past_total and new_at == new_total
    decode = None
    if decode_rows:
        decode = DecodeBatch(
            token_index=torch.tensor(decode_rows, dtype=torch.long, device=device),
            slots=torch.cat(decode_ctx).to(device),
            owner=torch.repeat_interleave(
                torch.arange(len(decode_rows)), torch.tensor(decode_lens)
            ).to(device),
            kernel=kernel,
            lens=tuple(decode_lens),
            bounds=_bounds(torch.tensor(decode_lens)).to(device),
        )
    return HiddenBatch(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        slots=torch.cat(slots).to(device),
        past_slots=torch.cat(past_slots).to(device),
        past_positions=torch.cat(past_positions).to(device),
        context_index=torch.cat(context_index).to(device),
        prefills=tuple(prefills),
        decode=decode,
        shard=shard,
    )


def _slot_table(tables: list[list[int]], block_size: int) -> torch.Tensor:
    """``[S, max_blocks * block_size]``: the flat slot of every position of every sequence
    (positions past a table's end point at slot 0 and are never selected)."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (padded[:, :, None] * block_size + offsets).view(len(tables), -1)


def _prefill_chunk(
    offset: int, start_pos: int, n: int, table: list[int], device: torch.device
) -> PrefillChunk:
    first = first_held(table)
    return PrefillChunk(
        token_start=offset,
        token_end=offset + n,
        context_len=start_pos + n,
        block_ids=torch.tensor(table[first:], dtype=torch.long, device=device),
        mask=_chunk_mask(start_pos, n, device),
        window_start_block=first,
    )


def _chunk_mask(start_pos: int, n: int, device: torch.device) -> torch.Tensor | None:
    """None (plain causal) for a chunk at position 0, else the offset causal mask.

    NOTE: SDPA's is_causal aligns the mask top-left; a chunk that starts at start_pos needs
    query i (absolute position start_pos + i) to see keys 0..start_pos + i."""
    if start_pos == 0:
        return None
    q_pos = torch.arange(start_pos, start_pos + n, device=device)
    return torch.arange(start_pos + n, device=device)[None, :] <= q_pos[:, None]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    hidden_input: torch.Tensor | None = None,
    project_kv: ProjectKV | None = None,
    window: int = 0,
    softcap: float | None = None,
    ops: TorchLayerOps = _TORCH_OPS,
) -> torch.Tensor:
    """Store this step's K/V (through ``ops``), then attend.  q: [T, H, D]; k, v: [T, KVH,
    D] -> [T, H, D].

    With hidden-cache sequences in the step, ``hidden_input`` ([T, hidden], what q, k and v
    were projected from) is stored for them instead, and ``project_kv`` turns their cached
    inputs back into K and V. ``window`` and ``softcap`` reach the Triton kernels only
    (``meta.paged``); elsewhere a layer whose window a context outgrows, or that soft-caps,
    attends through ``quanta.runner.layers.attention.windowed_attention``."""
    if meta.paged is not None:
        from quanta.runner import triton_attention

        return triton_attention.paged_attention(
            q, k, v, layer_cache, meta.slot_mapping, meta.paged, scale, window, softcap
        )
    _, num_blocks, block_size, kv_heads, head_dim = layer_cache.shape
    flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    k_new, v_new = k, v
    if meta.kv_rows is not None:
        k_new, v_new = k.index_select(0, meta.kv_rows), v.index_select(0, meta.kv_rows)
    ops.store_kv_(flat, meta.slot_mapping, k_new, v_new)
    decode = meta.decode
    if (
        decode is not None
        and not meta.prefills
        and meta.hidden is None
        and len(decode.lens) == q.shape[0]
        and q.is_contiguous()
    ):
        # Every row decodes, in order: the kernel's output is the whole step's, with no row
        # gather or scatter (two operators and a copy per layer at batch 1).
        return decode.kernel(q, flat[0], flat[1], decode, scale)
    out = torch.empty_like(q)
    native = meta.prefill_kernel
    for chunk in meta.prefills:
        if chunk.window_start_block:
            raise ValueError("full attention over a context whose first blocks were released")
        if native is not None and attend_natively(native, chunk, q, out, flat, block_size, scale):
            continue
        keys = layer_cache[0].index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.context_len]
        vals = layer_cache[1].index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.context_len]
        _prefill(q, keys, vals, chunk, out, scale)
    if meta.decode is not None:
        out.index_copy_(0, meta.decode.token_index, _decode(q, layer_cache, meta.decode, scale))
    if meta.hidden is not None:
        if hidden_input is None or project_kv is None:
            raise ValueError("hidden-cache sequences need the layer's input and projections")
        _attend_hidden(q, k, v, hidden_input, project_kv, layer_cache, meta.hidden, out, scale)
    return out


def attend_natively(
    native: PrefillKernel,
    chunk: PrefillChunk,
    q: torch.Tensor,
    out: torch.Tensor,
    flat: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> bool:
    """``chunk``'s rows of ``q`` into ``out`` on the native prefill kernel, over the cache
    ``flat`` ([2, slots, KVH, D]), where the kernel serves them; whether it did. Positions
    count from the chunk's first held block, as its ``block_ids`` do."""
    rows = q[chunk.token_start : chunk.token_end]
    if not native.serves(rows, flat[0]):
        return False
    start = chunk.context_len - rows.shape[0] - chunk.window_start_block * block_size
    native(out[chunk.token_start : chunk.token_end], rows, flat[0], flat[1], chunk.block_ids,
           block_size, start, scale, window, softcap)  # fmt: skip
    return True


def _prefill(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    chunk: PrefillChunk,
    out: torch.Tensor,
    scale: float,
) -> None:
    """One chunk's rows of ``q`` against its context ``keys``/``vals`` ([L, KVH, D])."""
    # [1, H, n, D] against [1, KVH, L, D]
    attn = F.scaled_dot_product_attention(
        q[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0),
        keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
        vals.to(q.dtype).transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    out[chunk.token_start : chunk.token_end] = attn[0].transpose(0, 1)


def _attend_hidden(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hidden_input: torch.Tensor,
    project_kv: ProjectKV,
    layer_cache: torch.Tensor,
    batch: HiddenBatch,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Store the hidden sequences' inputs, rebuild their contexts' K and V (past tokens
    projected again, the step's own rows as computed), and attend over them."""
    shard = batch.shard
    stored = hidden_input if shard is None else hidden_input[:, shard.columns]
    slots = layer_cache.view(-1, stored.shape[1])  # [2 * num_blocks * block_size, width]
    slots.index_copy_(0, batch.slots, stored.index_select(0, batch.rows).to(slots.dtype))
    k_rows, v_rows = k.index_select(0, batch.rows), v.index_select(0, batch.rows)
    if batch.past_slots.numel():
        past = slots.index_select(0, batch.past_slots)
        if shard is not None:
            past = shard.gather(past)
        k_past, v_past = project_kv(past.to(hidden_input.dtype))
        k_rows = torch.cat((k_past, k_rows))
        v_rows = torch.cat((v_past, v_rows))
    keys = k_rows.index_select(0, batch.context_index)  # [contexts, KVH, D]
    vals = v_rows.index_select(0, batch.context_index)
    for chunk in batch.prefills:
        _prefill(
            q,
            keys.index_select(0, chunk.block_ids),
            vals.index_select(0, chunk.block_ids),
            chunk,
            out,
            scale,
        )
    if batch.decode is not None:
        d = batch.decode
        out.index_copy_(0, d.token_index, _attend_decode(q, keys, vals, d, scale))


def _decode(
    q: torch.Tensor, layer_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """Single-token rows against their own slots only. q: [T, H, D] -> [B, H, D]."""
    _, num_blocks, block_size, kv_heads, head_dim = layer_cache.shape
    flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    return _attend_decode(q, flat[0], flat[1], batch, scale)


def _attend_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
) -> torch.Tensor:
    """The decode rows of ``q`` ([T, H, D]) against their packed contexts -> [B, H, D]."""
    rows = q.index_select(0, batch.token_index)
    return batch.kernel(rows, key_cache, value_cache, batch, scale)
