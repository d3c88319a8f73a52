"""Paged attention over block tables, in plain PyTorch (``scaled_dot_product_attention``).

A KV tier is ONE tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, so
a swap is a single indexed copy over all layers; a layer sees ``cache[layer]``
(``[2, num_blocks, block_size, kv_heads, head_dim]``).  Token ``pos`` of a sequence lives in
slot ``block_table[pos // block_size] * block_size + pos % block_size``.

Every step first writes its new K/V through the slot mapping, then attends over the context
gathered from the cache: one SDPA call per prefill chunk (the causal mask is offset by the
chunk's start) and one batched, key-padded SDPA call for all single-token rows.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """All single-token rows of the step, attended in one batched call."""

    token_index: torch.Tensor  # [B] rows of the packed batch
    block_table: torch.Tensor  # [B, max_blocks], padded with block 0
    key_mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step index tensors, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    prefills: tuple[PrefillChunk, ...]
    decode: DecodeBatch | None


def build_metadata(
    seqs: Sequence[PagedSeq], block_size: int, num_blocks: int, device: torch.device
) -> AttentionMetadata:
    """Index tensors for one packed step; raises ValueError on a too-short or bad block table."""
    slots: list[int] = []
    prefills: list[PrefillChunk] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
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
        for pos in range(seq.start_pos, context_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        if n == 1:
            decode_rows.append(offset)
            decode_tables.append(table)
            decode_lens.append(context_len)
        else:
            prefills.append(_prefill_chunk(offset, seq.start_pos, n, table, device))
        offset += n
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        prefills=tuple(prefills),
        decode=_decode_batch(decode_rows, decode_tables, decode_lens, block_size, device),
    )


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


def _decode_batch(
    rows: list[int],
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    device: torch.device,
) -> DecodeBatch | None:
    if not rows:
        return None
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    return DecodeBatch(
        token_index=torch.tensor(rows, dtype=torch.long, device=device),
        block_table=torch.tensor(padded, dtype=torch.long, device=device),
        key_mask=(key_pos[None, :] < lens_t[:, None])[:, None, None, :],
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
    """One SDPA call for all decode rows: [B, H, 1, D] against padded [B, KVH, Lmax, D]."""
    num_seqs, max_blocks = batch.block_table.shape
    _, _, block_size, kv_heads, head_dim = layer_cache.shape
    shape = (num_seqs, max_blocks * block_size, kv_heads, head_dim)
    # NOTE: slots past a row's context hold whatever an earlier owner of the block left there,
    # possibly inf/NaN; a masked score still multiplies its value (0 * NaN = NaN), so zero them
    # rather than trust the mask alone.
    stale = ~batch.key_mask.view(num_seqs, -1, 1, 1)
    keys = layer_cache[0][batch.block_table].view(shape).masked_fill_(stale, 0)
    vals = layer_cache[1][batch.block_table].view(shape).masked_fill_(stale, 0)
    attn = F.scaled_dot_product_attention(
        q.index_select(0, batch.token_index).unsqueeze(2),
        keys.transpose(1, 2).to(q.dtype),
        vals.transpose(1, 2).to(q.dtype),
        attn_mask=batch.key_mask,
        scale=scale,
        enable_gqa=q.shape[1] != kv_heads,
    )
    return attn.squeeze(2)
