"""Paged attention on CUDA in Triton: one launch for every row of a step (prefill chunks and
decode rows alike), reading the block tables and lengths on the device, plus a kernel that
writes the step's K/V into the cache by slot mapping.

The cache is a layer's ``[2, num_blocks, block_size, kv_heads, head_dim]``
(``quanta.runner.attention``). A step's sequences are described once (``paged_batch``) and
shared by every layer: per sequence its packed rows, start position, new-token count, first
held position (blocks before it were released by a sliding window) and block table; the grid
walks *tiles* of up to ``block_q`` consecutive query tokens of one sequence. A program serves
one tile, one KV head (all the query heads of its group, so a K/V tile is read once for them)
and one *split* of the positions: query token ``i`` at position ``p`` attends causally to
``[max(first_held, p - window + 1), p]``, so a prefill chunk attends to its cached context and
its own earlier tokens, and a decode row is a chunk of one token.

A long decode context leaves few programs per split-less launch (one per row and KV head), so
decode-only steps split the positions into ``num_splits`` ranges, each program keeps an
online-softmax partial (running max, sum, unnormalised output) and a second kernel merges the
splits (flash-decoding). Steps with prefill tokens have tiles enough and run unsplit, which
also keeps the partials' memory off the long prompts. A decode row's split size is its own,
computed on the device from its context (``row_splits``: ``DECODE_SPLIT`` positions, widened
so no context needs more than ``MAX_SPLITS``), so a row attends alike whatever the other rows'
lengths and however many splits the launch has: splits past a row's context add nothing. A
captured CUDA graph (``quanta.runner.graphs``) launches ``MAX_SPLITS`` for any step
(``fixed_decode_batch``) and rounds each row exactly as an eager step sized on the host does.

Slot ``-1`` in a slot mapping writes nothing (a padded row). Scores, softmax and the
accumulator are fp32 whatever the cache dtype; fp32 products run in IEEE precision (no TF32),
so an fp32 engine matches its torch path token for token.

This module imports triton at import time: ``quanta.runner.attention`` imports it only on a
CUDA device where triton is installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import triton
import triton.language as tl

from quanta.core.window import first_held
from quanta.runner.attention import PagedSeq

# Query tokens per tile when a step holds prefill tokens (decode-only steps use 1).
PREFILL_BLOCK_Q = 16
# Positions per split of a decode-only step (widened so no step runs more than MAX_SPLITS).
DECODE_SPLIT = 512
MAX_SPLITS = 16
# Key positions per inner iteration.
BLOCK_N = 32


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """A step's sequences as the kernel reads them (int32 device tensors), built once per step."""

    block_tables: torch.Tensor  # [S, W] block ids; RELEASED entries before first held are unread
    rows: torch.Tensor  # [S] packed row of each sequence's first new token
    starts: torch.Tensor  # [S] position of that token
    counts: torch.Tensor  # [S] new tokens
    firsts: torch.Tensor  # [S] first held position (a sliding window's first block)
    tile_seq: torch.Tensor  # [num_tiles] the sequence of each tile
    tile_q0: torch.Tensor  # [num_tiles] its first query token, counted within the sequence
    block_q: int  # query tokens per tile
    num_splits: int
    split_size: int  # positions per split, a multiple of BLOCK_N
    # Decode-only: ``split_size`` is the least, each row widens it to its own context's need.
    row_splits: bool = False


def paged_batch(
    seqs: Sequence[PagedSeq],
    block_size: int,
    device: torch.device,
    split_size: int | None = None,
) -> PagedBatch:
    """The launch description of ``seqs``, packed in order (every row a KV row).

    ``split_size`` None splits decode-only steps by each row's own split size (``row_splits``)
    and runs others unsplit; a number splits every step by it (tests use it to reach the merge
    with tiny contexts)."""
    counts = [len(seq.token_ids) for seq in seqs]
    starts = [seq.start_pos for seq in seqs]
    rows = [0, *accumulate(counts)][:-1]
    tables = [list(seq.block_table) for seq in seqs]
    firsts = [first_held(table) * block_size for table in tables]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    block_q = 1 if max(counts) == 1 else PREFILL_BLOCK_Q
    tile_seq: list[int] = []
    tile_q0: list[int] = []
    for index, n in enumerate(counts):
        q0s = range(0, n, block_q)
        tile_seq.extend([index] * len(q0s))
        tile_q0.extend(q0s)
    longest = max(s + n for s, n in zip(starts, counts, strict=True))
    row_splits = split_size is None and block_q == 1
    if split_size is None:  # prefill tiles are programs enough; decode rows split
        split_size = longest if block_q > 1 else DECODE_SPLIT
    split_size = triton.cdiv(split_size, BLOCK_N) * BLOCK_N
    # the splits the longest row needs; the others need no more
    widest = row_split_size(longest) if row_splits else split_size

    def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return PagedBatch(
        block_tables=ints(padded),
        rows=ints(rows),
        starts=ints(starts),
        counts=ints(counts),
        firsts=ints(firsts),
        tile_seq=ints(tile_seq),
        tile_q0=ints(tile_q0),
        block_q=block_q,
        num_splits=triton.cdiv(longest, widest),
        split_size=split_size,
        row_splits=row_splits,
    )


def row_split_size(context_len: int) -> int:
    """Positions per split of a decode row with ``context_len`` positions, as the kernel
    computes it with ``row_splits``: ``DECODE_SPLIT``, widened so at most ``MAX_SPLITS``."""
    widened = triton.cdiv(triton.cdiv(context_len, MAX_SPLITS), BLOCK_N) * BLOCK_N
    return max(DECODE_SPLIT, widened)


def fixed_decode_batch(
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    firsts: torch.Tensor,
    tile_q0: torch.Tensor,
) -> PagedBatch:
    """A decode-only step over fixed int32 buffers (one row per sequence, ``rows`` its index):
    ``MAX_SPLITS`` splits whatever the contexts, so nothing is sized on the host and one launch
    serves every step a CUDA graph replays. A row with ``counts`` 0 reads and writes nothing
    (a padded row)."""
    return PagedBatch(
        block_tables=block_tables,
        rows=rows,
        starts=starts,
        counts=counts,
        firsts=firsts,
        tile_seq=rows,
        tile_q0=tile_q0,
        block_q=1,
        num_splits=MAX_SPLITS,
        split_size=DECODE_SPLIT,
        row_splits=True,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store this step's K/V, then attend. q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]."""
    write_kv(k, v, layer_cache[0], layer_cache[1], slot_mapping)
    return attend(q, layer_cache[0], layer_cache[1], batch, scale, window, softcap)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Row ``t`` of k and v ([T, KVH, D]) into slot ``slot_mapping[t]`` of the caches
    ([num_blocks, block_size, KVH, D]); slot -1 writes nothing."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _unit_stride(k), _unit_stride(v)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        KV_HEADS=kv_heads,
        HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )


def attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Every row of ``q`` ([T, H, D]) over its sequence's cached context -> [T, H, D]."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = key_cache.shape[2]
    groups = heads // kv_heads
    q = _unit_stride(q)
    out = torch.empty_like(q)
    group_pad = triton.next_power_of_2(groups)
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot's smallest K
    split = batch.num_splits > 1
    if split:
        part_m = torch.empty((batch.num_splits, num_tokens, heads), device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch.num_splits, num_tokens, heads, head_dim), device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (batch.tile_seq.shape[0], kv_heads, batch.num_splits)
    block_m = max(16, batch.block_q * group_pad)
    _attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        part_m,
        part_l,
        part_acc,
        batch.block_tables,
        batch.rows,
        batch.starts,
        batch.counts,
        batch.firsts,
        batch.tile_seq,
        batch.tile_q0,
        scale,
        softcap or 1.0,
        window,
        batch.split_size,
        num_tokens,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        batch.block_tables.stride(0),
        HEADS=heads,
        GROUPS=groups,
        GROUP_PAD=group_pad,
        BLOCK_Q=batch.block_q,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1],
        SOFTCAP=softcap is not None,
        SPLIT=split,
        ROW_SPLITS=batch.row_splits,
        MAX_SPLITS=MAX_SPLITS,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m * head_pad >= 128 * 128 else 4,  # the accumulator's registers
    )
    if split:
        _merge_kernel[(num_tokens, heads)](
            part_m,
            part_l,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            num_tokens,
            batch.num_splits,
            HEADS=heads,
            HEAD_DIM=head_dim,
            HEAD_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(batch.num_splits),
        )
    return out


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension contiguously; views of a fused product already are."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kb,
    stride_ks,
    stride_kkh,
    stride_vb,
    stride_vs,
    stride_vvh,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM) & (h * 0 + slot >= 0)  # a tensor, not a scalar
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_at = key_cache_ptr + block * stride_kb + offset * stride_ks + h * stride_kkh + d
    v_at = value_cache_ptr + block * stride_vb + offset * stride_vs + h * stride_vvh + d
    tl.store(k_at, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_at, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    block_tables_ptr,
    rows_ptr,
    starts_ptr,
    counts_ptr,
    firsts_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    scale,
    softcap,
    window,
    split_size,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    ROW_SPLITS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    left = tl.load(counts_ptr + seq) - q0  # the sequence's query tokens from the tile's first
    first_pos = tl.load(starts_ptr + seq) + q0
    held = tl.load(firsts_ptr + seq)

    # Row r of the tile: query token r // GROUP_PAD, query head r % GROUP_PAD of the group.
    r = tl.arange(0, BLOCK_M)
    qi = r // GROUP_PAD
    head = kv_head * GROUPS + r % GROUP_PAD
    row_ok = (qi < BLOCK_Q) & (qi < left) & (r % GROUP_PAD < GROUPS)
    token = (tl.load(rows_ptr + seq) + q0 + qi).to(tl.int64)
    pos = first_pos + qi
    lowest = held + pos * 0
    if window > 0:
        lowest = tl.maximum(lowest, pos - window + 1)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # The positions any row of the tile reads, within this program's split.
    tile_lo = held
    if window > 0:
        tile_lo = tl.maximum(held, first_pos - window + 1)
    tile_hi = first_pos + tl.minimum(left, BLOCK_Q)
    if ROW_SPLITS:  # a decode tile ends where its context does (``row_split_size``)
        widened = tl.cdiv(tl.cdiv(tile_hi, MAX_SPLITS), BLOCK_N) * BLOCK_N
        split_size = tl.maximum(split_size, widened)
    lo = tl.maximum(tile_lo, split * split_size)
    hi = tl.minimum(tile_hi, (split + 1) * split_size)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        block = tl.load(table + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        at = block * stride_kb + (j % BLOCK_SIZE) * stride_ks
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            key_cache_ptr + at[:, None] + kv_head * stride_kh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / cap)
        visible = (
            row_ok[:, None] & j_ok[None, :] & (j[None, :] <= pos[:, None])
            & (j[None, :] >= lowest[:, None])
        )  # fmt: skip
        s = tl.where(visible, s, float("-inf"))
        peak = tl.maximum(m, tl.max(s, 1))
        base = tl.where(peak == float("-inf"), 0.0, peak)  # a row with nothing visible yet
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        total = total * alpha + tl.sum(p, 1)
        at = block * stride_vb + (j % BLOCK_SIZE) * stride_vs
        v = tl.load(
            value_cache_ptr + at[:, None] + kv_head * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m = peak

    if SPLIT:
        part = (split * num_tokens + token) * HEADS + head
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, total, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        out = acc / tl.where(row_ok, total, 1.0)[:, None]  # padding rows summed nothing
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_tokens,
    num_splits,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One (token, head): the splits' partials rescaled to their common max and summed."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    part = (s * num_tokens + token) * HEADS + head
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    total = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    peak = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - peak))
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
