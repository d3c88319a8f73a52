"""Paged attention over block tables, in plain PyTorch (``scaled_dot_product_attention``).

A KV tier is ONE tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, so
a swap is a single indexed copy over all layers; a layer sees ``cache[layer]``
(``[2, num_blocks, block_size, kv_heads, head_dim]``).  Token ``pos`` of a sequence lives in
slot ``block_table[pos // block_size] * block_size + pos % block_size``.

Every step first writes its new K/V through the slot mapping, then attends over the context
gathered from the cache: one SDPA call per prefill chunk (the causal mask is offset by the
chunk's start), and for all single-token (decode) rows together a packed, unpadded
attention: only the slots each row owns are gathered, one flat ``[N, kv_heads, head_dim]``
buffer for the whole batch, with a segmented softmax over each row's slots. A padded layout
gathered every row up to the longest context and then had to zero the stale slots (a slot
past a row's context may hold inf/NaN from an earlier owner, and a masked score still
multiplies its value); that copy and fill were 56% of a batch-32 decode step. Here a stale
slot is never read, so NaN-safety holds by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class PagedSeq(Protocol):
    """What attention needs of one scheduled sequence (``ScheduledSeq`` fits)."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_table(self) -> tuple[int, ...]: ...


DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A multi-token chunk: rows ``[token_start, token_end)`` of the packed batch."""

    token_start: int
    token_end: int
    context_len: int
    block_ids: torch.Tensor  # [num_context_blocks]
    mask: torch.Tensor | None  # [n, context_len] bool; None means plain causal (start_pos == 0)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """All single-token rows of the step, attended together over their packed contexts."""

    token_index: torch.Tensor  # [B] rows of the packed batch
    slots: torch.Tensor  # [N] flat cache slots of every row's context, row after row
    owner: torch.Tensor  # [N] which of the B rows each slot belongs to
    kernel: DecodeKernel  # ``varlen_decode``, eager or compiled (the runner's choice)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step index tensors, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    prefills: tuple[PrefillChunk, ...]
    decode: DecodeBatch | None


def build_metadata(
    seqs: Sequence[PagedSeq],
    block_size: int,
    num_blocks: int,
    device: torch.device,
    decode_kernel: DecodeKernel | None = None,
) -> AttentionMetadata:
    """Index tensors for one packed step; raises ValueError on a too-short or bad block table.

    Per-token indices (slots of new tokens, decode contexts) are computed with tensor ops
    from the per-block tables, so a step's Python work grows with its blocks, not its tokens.
    """
    tables: list[list[int]] = []
    starts: list[int] = []
    counts: list[int] = []
    prefills: list[PrefillChunk] = []
    decode_rows: list[int] = []
    offset = 0
    for seq in seqs:
        n = len(seq.token_ids)
        context_len = seq.start_pos + n
        num_ctx_blocks = -(-context_len // block_size)
        table = list(seq.block_table[:num_ctx_blocks])
        if n == 0 or len(table) < num_ctx_blocks:
            raise ValueError(
                f"sequence needs {num_ctx_blocks} blocks for {context_len} tokens, "
                f"block table has {len(seq.block_table)} (tokens this step: {n})"
            )
        if min(table) < 0 or max(table) >= num_blocks:
            raise ValueError(f"block id out of range [0, {num_blocks}) in {table}")
        tables.append(table)
        starts.append(seq.start_pos)
        counts.append(n)
        if n == 1:
            decode_rows.append(offset)
        else:
            prefills.append(_prefill_chunk(offset, seq.start_pos, n, table, device))
        offset += n
    slot_table = _slot_table(tables, block_size)  # [S, max_blocks * block_size]
    lens = torch.tensor([s + n for s, n in zip(starts, counts, strict=True)], dtype=torch.long)
    start_t = torch.tensor(starts, dtype=torch.long)
    positions = torch.arange(slot_table.shape[1])
    new = (positions[None, :] >= start_t[:, None]) & (positions[None, :] < lens[:, None])
    decode = None
    if decode_rows:
        one = torch.tensor(counts, dtype=torch.long) == 1
        ctx = slot_table[one]
        ctx_lens = lens[one]
        owned = positions[None, :] < ctx_lens[:, None]
        decode = DecodeBatch(
            token_index=torch.tensor(decode_rows, dtype=torch.long, device=device),
            slots=ctx[owned].to(device),
            owner=torch.repeat_interleave(torch.arange(len(decode_rows)), ctx_lens).to(device),
            kernel=decode_kernel or varlen_decode,
        )
    return AttentionMetadata(
        slot_mapping=slot_table[new].to(device),  # row-major: the packed batch's token order
        prefills=tuple(prefills),
        decode=decode,
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
    context_len = start_pos + n
    mask = None
    if start_pos > 0:
        # NOTE: SDPA's is_causal aligns the mask top-left; a chunk that starts at start_pos
        # needs query i (absolute position start_pos + i) to see keys 0..start_pos + i.
        q_pos = torch.arange(start_pos, context_len, device=device)
        mask = torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]
    return PrefillChunk(
        token_start=offset,
        token_end=offset + n,
        context_len=context_len,
        block_ids=torch.tensor(table, dtype=torch.long, device=device),
        mask=mask,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V, then attend.  q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]."""
    _, num_blocks, block_size, kv_heads, head_dim = layer_cache.shape
    flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, meta.slot_mapping, k.to(layer_cache.dtype))
    flat[1].index_copy_(0, meta.slot_mapping, v.to(layer_cache.dtype))
    gqa = q.shape[1] != kv_heads
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        # [1, H, n, D] against [1, KVH, L, D]
        keys = layer_cache[0].index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.context_len]
        vals = layer_cache[1].index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.context_len]
        attn = F.scaled_dot_product_attention(
            q[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0),
            keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
            vals.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[chunk.token_start : chunk.token_end] = attn[0].transpose(0, 1)
    if meta.decode is not None:
        out.index_copy_(0, meta.decode.token_index, _decode(q, layer_cache, meta.decode, scale))
    return out


def _decode(
    q: torch.Tensor, layer_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """Single-token rows against their own slots only. q: [T, H, D] -> [B, H, D]."""
    _, num_blocks, block_size, kv_heads, head_dim = layer_cache.shape
    flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    rows = q.index_select(0, batch.token_index)
    return batch.kernel(rows, flat[0], flat[1], batch.slots, batch.owner, scale)


def varlen_decode(
    rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    owner: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of B query rows ``[B, H, D]`` over their packed contexts: scores per (slot,
    head), a softmax per row's segment, then the weighted sum of its values. Scores and
    weights are fp32 whatever the cache dtype. Caches are flat ``[slots, KVH, D]``.

    Written as whole-tensor ops so ``torch.compile`` can fuse it into one loop
    (``quanta.runner.decode_kernel``); run eagerly it makes one pass per op."""
    heads, kv_heads = rows.shape[1], key_cache.shape[1]
    keys = key_cache.index_select(0, slots).float()  # [N, KVH, D]
    vals = value_cache.index_select(0, slots).float()
    if heads != kv_heads:  # grouped-query: each KV head serves heads // kv_heads query heads
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        vals = vals.repeat_interleave(heads // kv_heads, dim=1)
    queries = rows.float()
    scores = (queries.index_select(0, owner) * keys).sum(-1) * scale  # [N, H]
    num_rows = queries.shape[0]
    peak = torch.full((num_rows, heads), float("-inf"), device=rows.device)
    peak = peak.scatter_reduce(0, owner[:, None].expand(-1, heads), scores, "amax")
    weights = torch.exp(scores - peak.index_select(0, owner))
    total = torch.zeros((num_rows, heads), device=rows.device).index_add(0, owner, weights)
    out = torch.zeros((num_rows, heads, queries.shape[2]), device=rows.device)
    out = out.index_add(0, owner, weights[:, :, None] * vals)
    return (out / total[:, :, None]).to(rows.dtype)
