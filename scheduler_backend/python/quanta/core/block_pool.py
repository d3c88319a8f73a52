"""One tier's pool of blocks: reference counts, the free lists and the prefix cache's names.

Kept apart from ``core/blocks.py``, which keeps the per-request tables over two of these: a
pool knows blocks, not requests.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from enum import StrEnum


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"


class BlockPool:
    """One tier's blocks: reference counts, the free blocks, and the prefix cache's names.

    A block is free when no table or checkpoint refers to it. A free block that still holds
    a full block's KV under a name (``core/prefix.py``) stays findable in ``cached`` until it
    is needed: allocation takes never-named free blocks first, then evicts named ones least
    recently freed first. Without prefix caching nothing is ever named, and the pool is the
    plain first-in first-out free list it always was.
    """

    def __init__(self, tier: Tier, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{tier.value} pool size must be >= 0, got {num_blocks}")
        self.tier = tier
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.name_of: dict[int, bytes] = {}  # named blocks, free or not
        self.cached: dict[bytes, int] = {}  # name -> the block that answers for it
        self._plain: deque[int] = deque(range(num_blocks))  # free, never named
        self._lru: OrderedDict[int, None] = OrderedDict()  # free and named, oldest first
        self.reserved: set[int] = set()  # blocks this step's copies read: not reallocated
        self.changed: list[bytes] = []  # names whose answer changed since the manager looked

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._lru)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a named block's KV (evictable)."""
        return len(self._lru)

    def num_allocatable(self, skip: frozenset[int] | set[int] = frozenset()) -> int:
        """Free blocks ``allocate`` may hand out: not reserved, not in ``skip``."""
        avoid = self.reserved | skip if skip else self.reserved
        return self.num_free - sum(1 for b in avoid if self.ref[b] == 0)

    def allocate(
        self,
        n: int,
        on_evict: Callable[[int, bytes], None] | None = None,
        skip: frozenset[int] | set[int] = frozenset(),
    ) -> list[int] | None:
        """Take ``n`` blocks, or ``None`` (and take nothing) when fewer can be had; never a
        reserved one or one in ``skip``.

        ``on_evict(block, name)`` hears of each named block given up, before it is reused."""
        if n > self.num_allocatable(skip):
            return None
        avoid = self.reserved | skip if skip else self.reserved
        out: list[int] = []
        if not avoid:
            out = [self._plain.popleft() for _ in range(min(n, len(self._plain)))]
        else:
            kept: list[int] = []
            while self._plain and len(out) < n:
                b = self._plain.popleft()
                (kept if b in avoid else out).append(b)
            self._plain.extendleft(reversed(kept))
        if len(out) < n:
            # NOTE: only as far into the LRU as it takes: the cache may hold most of the pool
            victims = list(itertools.islice((b for b in self._lru if b not in avoid), n - len(out)))
            for b in victims:
                del self._lru[b]
                name = self._unname(b)
                if on_evict is not None:
                    on_evict(b, name)
            out += victims
        for b in out:
            self.ref[b] = 1
        return out

    def pin(self, block: int) -> None:
        """One more reference to a named block (a prefix hit or a shared copy)."""
        if self.ref[block] == 0:
            del self._lru[block]
        self.ref[block] += 1

    def pin_all(self, blocks: list[int]) -> None:
        """``pin`` of each of ``blocks``, in one call: a start on a long cached prefix pins
        every block of it."""
        ref, lru = self.ref, self._lru
        for b in blocks:
            if ref[b] == 0:
                del lru[b]
            ref[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each; a block nobody refers to is free (kept under its name
        when it has one). Free ``block_ids`` in the order they should be evicted."""
        for b in block_ids:
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise RuntimeError(f"{self.tier.value} block {b} released twice")
            if self.ref[b] == 0:
                if b in self.name_of:
                    self._lru[b] = None
                else:
                    self._plain.append(b)

    def name(self, block: int, name: bytes) -> None:
        """Record that ``block`` holds the K/V ``name`` stands for; it answers lookups for the
        name unless another block already does (a duplicate is kept, never found)."""
        if block in self.name_of:
            return
        self.name_of[block] = name
        if self.cached.setdefault(name, block) == block:
            self.changed.append(name)

    def forget_names(self) -> int:
        """Drop every name (a reset of the prefix cache); free named blocks become plain."""
        n = len(self.cached)
        self.cached.clear()
        self.name_of.clear()
        self._plain.extend(self._lru)
        self._lru.clear()
        self.changed.clear()  # NOTE: the manager forgets every lookup on a reset
        return n

    def _unname(self, block: int) -> bytes:
        name = self.name_of.pop(block)
        if self.cached.get(name) == block:
            del self.cached[name]
            self.changed.append(name)
        return name

    def free_ids(self) -> list[int]:
        return [*self._plain, *self._lru]

    def check(self, owners: Counter[int]) -> None:
        """Raise AssertionError unless the counts match ``owners`` (references per block)."""
        where = self.tier.value
        plain, lru = set(self._plain), set(self._lru)
        if len(plain) != len(self._plain) or plain & lru:
            raise AssertionError(f"{where}: a free block is listed twice")
        for b in range(self.num_blocks):
            if self.ref[b] != owners.get(b, 0):
                raise AssertionError(
                    f"{where}: block {b} has {self.ref[b]} references, {owners.get(b, 0)} owners"
                )
            if (self.ref[b] == 0) != (b in plain or b in lru):
                raise AssertionError(f"{where}: block {b} is free and owned, or neither")
        if set(owners) - set(range(self.num_blocks)):
            raise AssertionError(f"{where}: a table names a block outside the pool")
        if any(b in self.name_of for b in plain) or any(b not in self.name_of for b in lru):
            raise AssertionError(f"{where}: a free block is on the wrong list for its name")
        for name, b in self.cached.items():
            if self.name_of.get(b) != name:
                raise AssertionError(f"{where}: name and block disagree")
