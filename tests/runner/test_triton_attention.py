"""The Triton paged-attention and K/V-write kernels (``quanta.runner.triton_attention``), run on
the CPU by Triton's interpreter (``TRITON_INTERPRET=1``) in fp32 at tiny shapes, against the
engine's torch path (``quanta.runner.attention.paged_attention``) and a reference written from
first principles (gather K/V through the block table, masked softmax). On a GPU the same
kernels are compared with the torch path in ``tests/runner/test_cuda.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.core.window import RELEASED, first_held
from quanta.runner.attention import build_metadata, paged_attention
from quanta.runner.decode_kernel import decode_kernel
from runner_helpers import interpreted_triton_attention

ta = interpreted_triton_attention()

BLOCK_SIZE = 4
HEAD_DIM = 8
NUM_BLOCKS = 96
GQA = [(2, 2), (3, 1), (8, 1)]  # (query heads, KV heads): 1, 3 and 8 query heads per KV head


@dataclass(frozen=True)
class Seq:
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    hidden: bool = False


def _seqs(shapes: list[tuple[int, int]], rng: random.Random, released: int = 0) -> list[Seq]:
    """One sequence per (start_pos, new tokens), its blocks drawn out of order from one
    shuffled pool; the first ``released`` blocks of each table given back (a sliding window)."""
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)
    seqs = []
    for start, n in shapes:
        needed = -(-(start + n) // BLOCK_SIZE)
        table = [pool.pop() for _ in range(needed)]
        gone = min(released, start // BLOCK_SIZE)
        seqs.append(Seq(tuple(range(n)), start, tuple([RELEASED] * gone + table[gone:])))
    return seqs


def _step(heads: int, kv_heads: int, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of the step's rows and a cache full of earlier tokens' K/V."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, HEAD_DIM, generator=g)
    k = torch.randn(tokens, kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=g)
    cache = torch.randn(1, 2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM, generator=g)
    return q, k, v, cache


def _reference(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    seqs: list[Seq],
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each sequence's rows over its context, gathered position by position through its table."""
    out = torch.empty_like(q)
    row = 0
    groups = q.shape[1] // layer_cache.shape[3]
    for seq in seqs:
        n, start = len(seq.token_ids), seq.start_pos
        pos = torch.arange(start + n)
        blocks = torch.tensor(seq.block_table)[pos // BLOCK_SIZE].clamp(min=0)
        keys = layer_cache[0][blocks, pos % BLOCK_SIZE].repeat_interleave(groups, 1)
        vals = layer_cache[1][blocks, pos % BLOCK_SIZE].repeat_interleave(groups, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[row : row + n], keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(start, start + n)[:, None]
        visible = (pos[None, :] <= q_pos) & (
            pos[None, :] >= first_held(seq.block_table) * BLOCK_SIZE
        )
        if window:
            visible &= q_pos - pos[None, :] < window
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[row : row + n] = torch.einsum("hnl,lhd->nhd", weights, vals)
        row += n
    return out


def _slots(seqs: list[Seq]) -> torch.Tensor:
    return torch.tensor(
        [
            seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for seq in seqs
            for p in range(seq.start_pos, seq.start_pos + len(seq.token_ids))
        ]
    )


def _triton(q, k, v, cache, seqs, split_size=None, window=0, softcap=None):
    batch = ta.paged_batch(seqs, BLOCK_SIZE, torch.device("cpu"), split_size)
    out = ta.paged_attention(
        q, k, v, cache[0], _slots(seqs), batch, 0.5, window=window, softcap=softcap
    )
    return out, batch


def _torch_path(q, k, v, cache, seqs):
    kernel, _ = decode_kernel(
        "eager", heads=q.shape[1], kv_heads=k.shape[1], head_dim=HEAD_DIM, dtype=q.dtype
    )
    meta = build_metadata(seqs, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"), kernel)
    return paged_attention(q, k, v, cache[0], meta, 0.5)


def test_write_kv_stores_rows_by_slot_and_skips_padded_rows():
    _, k, v, cache = _step(2, 2, 6, seed=1)
    slots = torch.tensor([13, -1, 2, 40, -1, 7])
    expected = cache.clone()
    flat = expected[0].view(2, -1, 2, HEAD_DIM)
    real = slots >= 0
    flat[0][slots[real]] = k[real]
    flat[1][slots[real]] = v[real]
    ta.write_kv(k, v, cache[0][0], cache[0][1], slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_prefill_with_context_and_decode_rows_in_one_launch_match_the_torch_path(heads, kv_heads):
    """A fresh prompt, a chunk after cached context, and ragged decode rows, blocks shuffled."""
    seqs = _seqs([(0, 7), (9, 5), (13, 1), (2, 1), (30, 1)], random.Random(heads))
    tokens = sum(len(s.token_ids) for s in seqs)
    q, k, v, cache = _step(heads, kv_heads, tokens, seed=heads)
    theirs_cache = cache.clone()
    ours, batch = _triton(q, k, v, cache, seqs)
    theirs = _torch_path(q, k, v, theirs_cache, seqs)
    assert batch.num_splits == 1 and batch.block_q > 1
    assert torch.equal(cache, theirs_cache)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, _reference(q, cache[0], seqs, 0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 1), (8, 1)])
def test_long_decode_contexts_split_and_merge(heads, kv_heads):
    seqs = _seqs([(70, 1), (5, 1), (100, 1), (33, 1)], random.Random(7))
    q, k, v, cache = _step(heads, kv_heads, len(seqs), seed=7)
    theirs_cache = cache.clone()
    ours, batch = _triton(q, k, v, cache, seqs, split_size=ta.BLOCK_N)
    assert batch.num_splits == 4 and batch.block_q == 1
    torch.testing.assert_close(ours, _torch_path(q, k, v, theirs_cache, seqs), rtol=1e-5, atol=1e-5)


def test_a_mixed_step_split_by_request_merges_prefill_rows_too():
    seqs = _seqs([(40, 6), (60, 1)], random.Random(3))
    q, k, v, cache = _step(3, 1, 7, seed=3)
    ours, batch = _triton(q, k, v, cache, seqs, split_size=ta.BLOCK_N)
    assert batch.num_splits == 2
    torch.testing.assert_close(ours, _reference(q, cache[0], seqs, 0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (0, 2.0), (6, 1.5)])
def test_sliding_window_and_soft_cap(window, softcap):
    """Windowed rows read from their window's first position; released blocks are never read."""
    seqs = _seqs([(0, 9), (12, 4), (21, 1), (3, 1)], random.Random(5), released=2)
    assert any(first_held(s.block_table) for s in seqs)
    q, k, v, cache = _step(8, 1, 15, seed=5)
    ours, _ = _triton(q, k, v, cache, seqs, window=window, softcap=softcap)
    expected = _reference(q, cache[0], seqs, 0.5, window, softcap)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=4),
    gqa=st.sampled_from(GQA),
    seed=st.integers(0, 2**16),
)
def test_ragged_steps_match_the_reference_whatever_the_block_order(shapes, gqa, seed):
    """Relabelling the physical blocks (the cache and every table together) changes nothing."""
    heads, kv_heads = gqa
    seqs = _seqs(shapes, random.Random(seed))
    tokens = sum(n for _, n in shapes)
    q, k, v, cache = _step(heads, kv_heads, tokens, seed=seed)
    relabel = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))
    moved = torch.empty_like(cache)
    moved[:, :, relabel] = cache
    moved_seqs = [
        Seq(s.token_ids, s.start_pos, tuple(int(relabel[b]) for b in s.block_table)) for s in seqs
    ]
    ours, _ = _triton(q, k, v, cache, seqs, split_size=ta.BLOCK_N)
    relabelled, _ = _triton(q, k, v, moved, moved_seqs)
    torch.testing.assert_close(ours, _reference(q, cache[0], seqs, 0.5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(relabelled, ours, rtol=1e-5, atol=1e-5)


def test_half_precision_rows_and_cache_round_where_the_torch_path_does():
    """fp16: Triton's interpreter (3.9) computes bf16 products wrongly, so bf16 is checked on a
    GPU (tests/runner/test_cuda.py)."""
    seqs = _seqs([(0, 5), (10, 3), (6, 1)], random.Random(11))
    q, k, v, cache = (t.half() for t in _step(3, 1, 9, seed=11))
    theirs_cache = cache.clone()
    ours, _ = _triton(q, k, v, cache, seqs)
    theirs = _torch_path(q, k, v, theirs_cache, seqs)
    assert torch.equal(cache, theirs_cache)
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
