"""Block bookkeeping for the two-tier paged KV cache (ids only; the tensors live in the runner).

A request owns a list of block ids in exactly one tier at a time, all of one ``CacheKind``
(K+V, or hidden states at twice the tokens per block: Apt-Serve's unified pool). The kind is
fixed from the first block until the request's blocks are freed; a switch is a discard and a
recompute. Allocation returns ``None``
when it cannot be done, and the caller (the decision applier, driven by a policy) decides what
to preempt. ``check_integrity`` proves the accounting is exact.

A request on the device may also own a *checkpoint*: host blocks mirroring the first blocks of
its device table, bit for bit for the tokens the checkpoint holds (ConServe's incremental
checkpointing). Each checkpoint copies only the blocks not yet mirrored (and the partly filled
last one again); a swap-out reuses the mirror and copies only what it lacks, so a request whose
checkpoint is complete leaves the device with no copy at all.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum

from quanta.core.request import HIDDEN_TOKENS_PER_BLOCK, CacheKind, blocks_for


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"


class BlockPool:
    """Free list of one tier's block ids."""

    def __init__(self, tier: Tier, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{tier.value} pool size must be >= 0, got {num_blocks}")
        self.tier = tier
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, or ``None`` (and take nothing) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def free_ids(self) -> list[int]:
        return list(self._free)


class BlockManager:
    """Per-request block tables over a device pool and a host pool."""

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pools = {
            Tier.DEVICE: BlockPool(Tier.DEVICE, num_device_blocks),
            Tier.HOST: BlockPool(Tier.HOST, num_host_blocks),
        }
        self._tables: dict[str, tuple[Tier, list[int]]] = {}
        self._kinds: dict[str, CacheKind] = {}  # of requests that hold blocks
        self._ckpt: dict[str, list[int]] = {}  # host mirror of a device table's first blocks
        self._ckpt_tokens: dict[str, int] = {}  # tokens the mirror holds (copies done)
        self._ckpt_pending: dict[str, int] = {}  # tokens it will hold once this step's copies are

    # -- queries -------------------------------------------------------------------------
    def num_free(self, tier: Tier) -> int:
        return self.pools[tier].num_free

    def num_total(self, tier: Tier) -> int:
        return self.pools[tier].num_blocks

    def blocks_for(self, num_tokens: int, kind: CacheKind = CacheKind.KV) -> int:
        return blocks_for(num_tokens, self.block_size, kind)

    def kind_of(self, request_id: str) -> CacheKind | None:
        """What the request's blocks hold; None while it holds none."""
        return self._kinds.get(request_id)

    def tier_of(self, request_id: str) -> Tier | None:
        entry = self._tables.get(request_id)
        return entry[0] if entry else None

    def num_blocks(self, request_id: str) -> int:
        entry = self._tables.get(request_id)
        return len(entry[1]) if entry else 0

    def usage(self, kind: CacheKind, tier: Tier = Tier.DEVICE) -> tuple[int, int]:
        """(requests, blocks) holding a ``kind`` cache in ``tier``."""
        tables = [
            table
            for rid, (t, table) in self._tables.items()
            if t is tier and self._kinds.get(rid) is kind
        ]
        return len(tables), sum(len(t) for t in tables)

    def checkpointed_tokens(self, request_id: str) -> int:
        """Tokens whose KV the request's host checkpoint holds (0: none)."""
        return self._ckpt_tokens.get(request_id, 0)

    def checkpoint_blocks(self, request_id: str) -> int:
        """Host blocks the request's checkpoint holds."""
        return len(self._ckpt.get(request_id, ()))

    def num_checkpoint_blocks(self) -> int:
        """Host blocks held by all checkpoints."""
        return sum(len(m) for m in self._ckpt.values())

    def checkpoint_need(self, request_id: str, num_tokens: int) -> int:
        """Extra host blocks a checkpoint of the request's first ``num_tokens`` tokens takes."""
        kind = self._kinds.get(request_id, CacheKind.KV)
        return max(0, self.blocks_for(num_tokens, kind) - self.checkpoint_blocks(request_id))

    def swap_out_need(self, request_id: str, num_tokens: int) -> int:
        """Host blocks a swap-out of a request with ``num_tokens`` valid tokens allocates: the
        blocks that hold them, less those its checkpoint already mirrors."""
        kind = self._kinds.get(request_id, CacheKind.KV)
        keep = min(self.num_blocks(request_id), self.blocks_for(num_tokens, kind))
        return max(0, keep - self.checkpoint_blocks(request_id))

    def block_table(self, request_id: str) -> tuple[int, ...]:
        entry = self._tables.get(request_id)
        return tuple(entry[1]) if entry else ()

    def blocks_to_grow(
        self, request_id: str, num_tokens: int, kind: CacheKind = CacheKind.KV
    ) -> int:
        """Extra device blocks needed so the request's table covers ``num_tokens`` tokens
        (of the kind it holds, or ``kind`` when it holds none)."""
        kind = self._kinds.get(request_id, kind)
        return max(0, self.blocks_for(num_tokens, kind) - self.num_blocks(request_id))

    # -- mutations -----------------------------------------------------------------------
    def allocate_slots(
        self, request_id: str, num_tokens: int, kind: CacheKind = CacheKind.KV
    ) -> list[int] | None:
        """Grow the request's device table to cover ``num_tokens``; new ids or ``None``.

        ``kind`` is taken when the request holds no blocks; one that holds blocks keeps its
        own, and asking for the other kind is a bug (a switch frees the blocks first)."""
        tier, table = self._tables.get(request_id, (Tier.DEVICE, []))
        if tier is not Tier.DEVICE:
            raise RuntimeError(f"request {request_id} has its KV in the {tier.value} tier")
        held = self._kinds.get(request_id)
        if held is not None and held is not kind:
            raise RuntimeError(f"request {request_id} holds a {held.value} cache, not {kind.value}")
        need = self.blocks_for(num_tokens, kind) - len(table)
        if need <= 0:
            return []
        new = self.pools[Tier.DEVICE].allocate(need)
        if new is None:
            return None
        table.extend(new)
        self._tables[request_id] = (Tier.DEVICE, table)
        self._kinds[request_id] = kind
        return new

    def swap_out(
        self, request_id: str, num_tokens: int | None = None
    ) -> list[tuple[int, int]] | None:
        """Move the request's blocks device -> host; the (device, host) copies it needs, or
        ``None`` (and nothing moved) when the host is short.

        With ``num_tokens`` (the tokens whose KV is valid) blocks past them are dropped rather
        than copied (an aborted step allocates some), and a checkpoint's mirror is reused: only
        the blocks it lacks are copied."""
        tier, table = self._tables[request_id]
        if tier is not Tier.DEVICE:
            raise RuntimeError(f"request {request_id} is in {tier.value}, not device")
        held = self._ckpt.get(request_id, [])
        if num_tokens is None:
            keep, done, mirror = len(table), 0, []
        else:
            keep = min(len(table), self.blocks_for(num_tokens, self._kinds[request_id]))
            mirrored = self._ckpt_tokens.get(request_id, 0)
            # NOTE: a partly filled last block is complete on the host when every valid
            # token is
            done = keep if mirrored >= num_tokens else self._full_blocks(request_id, mirrored)
            mirror = held
        reuse = mirror[:keep]
        new = self.pools[Tier.HOST].allocate(keep - len(reuse))
        if new is None:
            return None
        self._drop_checkpoint(request_id, release=False)
        self.pools[Tier.HOST].release(held[len(reuse) :])
        host = reuse + new
        self.pools[Tier.DEVICE].release(table)
        self._tables[request_id] = (Tier.HOST, host)
        return [(table[i], host[i]) for i in range(min(done, keep), keep)]

    def checkpoint(self, request_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Mirror the request's first ``num_tokens`` tokens on the host: the (device, host)
        copies that bring the mirror up to date, or ``None`` when the host is short.

        The copies happen after the step's forward pass; ``confirm_checkpoints`` records them
        once the step succeeded, ``drop_pending_checkpoints`` forgets them when it did not."""
        tier, table = self._tables[request_id]
        if tier is not Tier.DEVICE:
            raise RuntimeError(f"checkpoint of {request_id}, whose KV is in {tier.value}")
        want = self.blocks_for(num_tokens, self._kinds[request_id])
        if want > len(table):
            raise RuntimeError(f"checkpoint of {request_id} past its {len(table)} blocks")
        mirror = self._ckpt.get(request_id, [])
        if want > len(mirror):
            new = self.pools[Tier.HOST].allocate(want - len(mirror))
            if new is None:
                return None
            mirror = mirror + new
            self._ckpt[request_id] = mirror
        self._ckpt_pending[request_id] = num_tokens
        first = self._full_blocks(request_id, self._ckpt_tokens.get(request_id, 0))
        return [(table[i], mirror[i]) for i in range(first, want)]

    def confirm_checkpoints(self) -> None:
        """The step's checkpoint copies are done: their tokens count as mirrored."""
        for rid, n in self._ckpt_pending.items():
            if rid in self._ckpt:
                self._ckpt_tokens[rid] = max(n, self._ckpt_tokens.get(rid, 0))
        self._ckpt_pending.clear()

    def drop_pending_checkpoints(self) -> None:
        """The step stopped before its checkpoint copies: the mirrors keep what they held
        (their new blocks stay owned, to be filled by a later checkpoint)."""
        self._ckpt_pending.clear()

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks host -> device; (host, device) pairs or ``None``."""
        return self._move(request_id, Tier.HOST, Tier.DEVICE)

    def _move(self, request_id: str, src: Tier, dst: Tier) -> list[tuple[int, int]] | None:
        tier, table = self._tables[request_id]
        if tier is not src:
            raise RuntimeError(f"request {request_id} is in {tier.value}, not {src.value}")
        new = self.pools[dst].allocate(len(table))
        if new is None:
            return None
        self._drop_checkpoint(request_id)
        self.pools[src].release(table)
        self._tables[request_id] = (dst, new)
        return list(zip(table, new, strict=True))

    def free(self, request_id: str) -> int:
        """Return all the request's blocks to their pool (its checkpoint's too); the number
        of table blocks freed."""
        entry = self._tables.pop(request_id, None)
        self._kinds.pop(request_id, None)
        self._drop_checkpoint(request_id)
        if entry is None:
            return 0
        tier, table = entry
        self.pools[tier].release(table)
        return len(table)

    def _full_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens fill completely."""
        hidden = self._kinds.get(request_id) is CacheKind.HIDDEN
        return num_tokens // (self.block_size * (HIDDEN_TOKENS_PER_BLOCK if hidden else 1))

    def _drop_checkpoint(self, request_id: str, release: bool = True) -> None:
        mirror = self._ckpt.pop(request_id, None)
        self._ckpt_tokens.pop(request_id, None)
        self._ckpt_pending.pop(request_id, None)
        if mirror and release:
            self.pools[Tier.HOST].release(mirror)

    # -- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is either free or owned exactly once."""
        if set(self._kinds) != set(self._tables):
            raise AssertionError("a request has a cache kind without blocks, or blocks without one")
        for rid in self._ckpt:
            if self.tier_of(rid) is not Tier.DEVICE:
                raise AssertionError(f"{rid} has a checkpoint but its KV is not on the device")
            if len(self._ckpt[rid]) > self.num_blocks(rid):
                raise AssertionError(f"{rid}'s checkpoint has more blocks than its table")
        for tier, pool in self.pools.items():
            free = pool.free_ids()
            owned = [b for t, table in self._tables.values() if t is tier for b in table]
            if tier is Tier.HOST:
                owned += [b for mirror in self._ckpt.values() for b in mirror]
            seen = free + owned
            if len(seen) != len(set(seen)):
                raise AssertionError(f"{tier.value}: a block is free and owned, or owned twice")
            if sorted(seen) != list(range(pool.num_blocks)):
                raise AssertionError(
                    f"{tier.value}: {len(free)} free + {len(owned)} owned != {pool.num_blocks}"
                )

    def all_free(self) -> bool:
        pools_full = all(p.num_free == p.num_blocks for p in self.pools.values())
        return not (self._tables or self._kinds or self._ckpt) and pools_full
