"""Sliding-window KV: the blocks of a sequence no layer reads again, and the most blocks a
windowed sequence holds at once.

In a model whose every layer attends only to the last ``window`` positions (Mistral), the
token at position ``p`` reads keys ``p - window + 1 .. p``. Once a sequence holds
``num_tokens`` tokens, every later token sits at ``num_tokens`` or after, so a block whose last
position is older than ``num_tokens - window`` is never read again: its K/V can go back to the
pool. Its entry in the request's block table becomes ``RELEASED``, so positions keep their
blocks' indices (``pos // block_size``) and the table keeps its length.

A model with one layer that attends to everything (Gemma 2's global layers) reads every block
to the end, so it releases none: ``kv_window`` of its layers is 0.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Final

# The block-table entry of a block given back to the pool: no block id, never read.
RELEASED: Final = -1


def kv_window(layer_windows: Sequence[int]) -> int:
    """The window every layer reads within (the widest of them), in tokens; 0 when some layer
    attends to the whole context (a 0 in ``layer_windows``) or none is given."""
    if not layer_windows or not all(layer_windows):
        return 0
    return max(layer_windows)


def blocks_behind(num_tokens: int, window: int, block_size: int) -> int:
    """The leading blocks of a ``num_tokens``-token sequence whose every position is older
    than ``num_tokens - window``: no later token's window reaches them (0 without a window)."""
    if not window:
        return 0
    return max(0, num_tokens - window) // block_size


def peak_blocks(num_tokens: int, window: int, block_size: int) -> int:
    """The most blocks a sequence that grows one token a step to ``num_tokens`` holds at once:
    all of them without a window, else the window's blocks plus the one the next token opens.
    (A prefill chunk of ``n`` tokens holds up to ``peak_blocks`` of ``window + n`` until its
    step is committed.)"""
    full = -(-num_tokens // block_size)
    if not window:
        return full
    return min(full, -(-window // block_size) + 1)


def first_held(table: Sequence[int]) -> int:
    """The index of the table's first held block: released entries lead a table, so a binary
    search finds it (a long sequence's table is mostly released)."""
    return bisect_left(table, True, key=_held)


def _held(block: int) -> bool:
    return block != RELEASED


def live(blocks: Iterable[int]) -> list[int]:
    """The block ids of a table or mirror, its ``RELEASED`` entries left out."""
    return [b for b in blocks if b != RELEASED]
