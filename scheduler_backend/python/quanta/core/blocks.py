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

With a ``sliding_window`` (every layer of the model attends within it) a running request's
blocks that no later token reads go back to the pool as its tokens are committed
(``release_behind_window``); their table entries become ``RELEASED`` (``core/window.py``), and
every path here (swaps, checkpoints, the prefix cache, freeing, the counts) skips them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import countOf, itemgetter

from quanta.core.block_pool import BlockPool, Tier
from quanta.core.lookups import LookupMemo
from quanta.core.request import HIDDEN_TOKENS_PER_BLOCK, CacheKind, Request, blocks_for
from quanta.core.window import RELEASED, blocks_behind, first_held, live, peak_blocks

_tier, _block = itemgetter(0), itemgetter(1)
_HIT_LOG_KEPT = 8192  # changes ``hit_changes`` can name: many steps' worth of lookups


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest cached prefix of a waiting request: for each of its first full blocks, in
    order, the tier and block that hold it. Device blocks are shared as they are; host blocks
    are copied back into new device blocks (cheaper than computing them again)."""

    blocks: tuple[tuple[Tier, int], ...]
    block_size: int
    # NOTE: counted once: a lookup is kept across steps, and Apt-Serve's packer reads this
    # for every waiting request at every step. A lookup that counted them as it walked
    # passes the count; otherwise (-1) it is counted here
    num_device: int = field(default=-1, repr=False, compare=False)
    # the ids of ``blocks`` when all are on the device, listed on first use: a start reads
    # them several times (its cost, then its references, in the packer's plan and in the
    # applier's check, then its pins)
    _ids: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_device < 0:
            object.__setattr__(self, "num_device", countOf(map(_tier, self.blocks), Tier.DEVICE))

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def of(self, tier: Tier) -> list[int]:
        """The blocks of the hit that ``tier`` holds, in order (a new list: the caller's)."""
        if self.num_device == len(self.blocks):  # NOTE: most hits are all on the device
            if tier is not Tier.DEVICE:
                return []
            if self._ids is None:
                object.__setattr__(self, "_ids", tuple(map(_block, self.blocks)))
            return list(self._ids)  # type: ignore[arg-type]
        return [b for t, b in self.blocks if t is tier]


class BlockManager:
    """Per-request block tables over a device pool and a host pool.

    With ``prefix_caching`` full KV blocks are named by their content (``core/prefix.py``) and
    shared: a request starts with its longest cached prefix attached, a block lives as long as
    some table refers to it, and a free named block stays cached in its tier until evicted. A
    device block evicted from the cache is offloaded to the host tier when the host has room,
    and a request swapped out copies only the blocks the host does not hold already.

    ``sliding_window`` (tokens; 0: none) is the window every layer of the model attends
    within: blocks behind it go back to the pool (see the module docstring).
    """

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        prefix_caching: bool = False,
        sliding_window: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.sliding_window = sliding_window
        self.pools = {
            Tier.DEVICE: BlockPool(Tier.DEVICE, num_device_blocks),
            Tier.HOST: BlockPool(Tier.HOST, num_host_blocks),
        }
        self._tables: dict[str, tuple[Tier, list[int]]] = {}
        self._kinds: dict[str, CacheKind] = {}  # of requests that hold blocks
        self._ckpt: dict[str, list[int]] = {}  # host mirror of a device table's first blocks
        self._ckpt_tokens: dict[str, int] = {}  # tokens the mirror holds (copies done)
        self._ckpt_pending: dict[str, int] = {}  # tokens it will hold once this step's copies are
        self._ckpt_shared: dict[str, set[int]] = {}  # mirror blocks the host cache already held
        self._named: dict[str, int] = {}  # leading device blocks of a table already named
        self._hits: dict[str, PrefixHit] = {}  # lookups of waiting requests, as they stand
        self._memo = LookupMemo()  # which of them still hold (``core/lookups.py``)
        # The requests whose entry in ``_hits`` changed, in order, from version
        # ``_hit_log_start`` on (``hit_changes``); the oldest half goes when it is long.
        self._hit_log: list[str] = []
        self._hit_log_start = 0
        self._offloads: list[tuple[int, int]] = []  # (device, host) copies of evicted blocks
        self._offload_dst: set[int] = set()  # host blocks those copies write this step

    # -- queries -------------------------------------------------------------------------
    def num_free(self, tier: Tier) -> int:
        return self.pools[tier].num_free

    def num_total(self, tier: Tier) -> int:
        return self.pools[tier].num_blocks

    def num_cached(self, tier: Tier) -> int:
        """Named blocks in ``tier``: the prefix cache's content there."""
        return len(self.pools[tier].cached)

    def blocks_for(self, num_tokens: int, kind: CacheKind = CacheKind.KV) -> int:
        return blocks_for(num_tokens, self.block_size, kind)

    def kind_of(self, request_id: str) -> CacheKind | None:
        """What the request's blocks hold; None while it holds none."""
        return self._kinds.get(request_id)

    @property
    def kinds(self) -> Mapping[str, CacheKind]:
        """``kind_of`` of every request that holds blocks, read only: the same dict for the
        manager's life, so a reader may bind its ``get`` once."""
        return self._kinds

    def tier_of(self, request_id: str) -> Tier | None:
        entry = self._tables.get(request_id)
        return entry[0] if entry else None

    def num_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table's entries, less those released)."""
        entry = self._tables.get(request_id)
        return len(entry[1]) - first_held(entry[1]) if entry else 0

    def table_length(self, request_id: str) -> int:
        """Blocks its table spans, released ones included: its positions' reach."""
        entry = self._tables.get(request_id)
        return len(entry[1]) if entry else 0

    def held_blocks(self, request_id: str) -> list[int]:
        """The ids of the blocks the request holds, in table order."""
        entry = self._tables.get(request_id)
        return entry[1][first_held(entry[1]) :] if entry else []

    def peak_blocks(self, num_tokens: int) -> int:
        """The most device blocks a KV request decoding to ``num_tokens`` holds at once
        (``core/window.py``): what admission weighs against the pool."""
        return peak_blocks(num_tokens, self.sliding_window, self.block_size)

    def refs(self, tier: Tier, block: int) -> int:
        """Tables and checkpoints that refer to ``block``."""
        return self.pools[tier].ref[block]

    def name_of(self, tier: Tier, block: int) -> bytes | None:
        return self.pools[tier].name_of.get(block)

    def cached_block(self, tier: Tier, name: bytes) -> int | None:
        """The block of ``tier`` that answers for ``name``, if any."""
        return self.pools[tier].cached.get(name)

    def usage(self, kind: CacheKind, tier: Tier = Tier.DEVICE) -> tuple[int, int]:
        """(requests, blocks) holding a ``kind`` cache in ``tier``."""
        tables = [
            table
            for rid, (t, table) in self._tables.items()
            if t is tier and self._kinds.get(rid) is kind
        ]
        return len(tables), sum(len(t) - first_held(t) for t in tables)

    def checkpointed_tokens(self, request_id: str) -> int:
        """Tokens whose KV the request's host checkpoint holds (0: none)."""
        return self._ckpt_tokens.get(request_id, 0)

    def checkpoint_blocks(self, request_id: str) -> int:
        """Host blocks the request's checkpoint holds."""
        return len(self._ckpt.get(request_id, ()))

    def num_checkpoint_blocks(self) -> int:
        """Host blocks held by all checkpoints."""
        return sum(len(live(m)) for m in self._ckpt.values())

    def checkpoint_need(self, request_id: str, num_tokens: int) -> int:
        """Extra host blocks a checkpoint of the request's first ``num_tokens`` tokens takes."""
        kind = self._kinds.get(request_id, CacheKind.KV)
        return max(0, self.blocks_for(num_tokens, kind) - self.checkpoint_blocks(request_id))

    def swap_out_plan(self, request_id: str, num_tokens: int) -> tuple[list[int], list[int]]:
        """What a swap-out of a request with ``num_tokens`` valid tokens takes from the host:
        (blocks it must copy to new host blocks, host blocks it shares instead of copying).
        Blocks its checkpoint mirrors are in neither list."""
        _, table = self._tables[request_id]
        keep = min(len(table), self.blocks_for(num_tokens, self._kinds[request_id]))
        mirrored = min(len(self._ckpt.get(request_id, ())), keep)
        host = self.pools[Tier.HOST]
        device = self.pools[Tier.DEVICE]
        new, shared = [], []
        for b in live(table[mirrored:keep]):
            name = device.name_of.get(b)
            hit = host.cached.get(name) if name is not None else None
            if hit is None:
                new.append(b)
            else:
                shared.append(hit)
        return new, shared

    def swap_out_need(self, request_id: str, num_tokens: int) -> int:
        """Host blocks a swap-out of a request with ``num_tokens`` valid tokens takes from the
        free pool: new copies, and shared host blocks that are free now (cached only)."""
        new, shared = self.swap_out_plan(request_id, num_tokens)
        host = self.pools[Tier.HOST]
        return len(new) + sum(1 for b in set(shared) if host.ref[b] == 0)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        entry = self._tables.get(request_id)
        return tuple(entry[1]) if entry else ()

    def blocks_to_grow(
        self, request_id: str, num_tokens: int, kind: CacheKind = CacheKind.KV
    ) -> int:
        """Extra device blocks needed so the request's table covers ``num_tokens`` tokens
        (of the kind it holds, or ``kind`` when it holds none)."""
        kind = self._kinds.get(request_id, kind)
        return max(0, self.blocks_for(num_tokens, kind) - self.table_length(request_id))

    # -- the prefix cache ----------------------------------------------------------------
    def lookup(self, request_id: str, names: Sequence[bytes], limit: int | None = None) -> int:
        """Find the longest cached prefix of a waiting request whose full blocks are named
        ``names`` (its first ``limit``: as many as a hit may cover); remembered for this
        step's decision. Returns its tokens."""
        if not self.prefix_caching or request_id in self._tables:
            if self._hits.pop(request_id, None) is not None:
                self._hit_changed(request_id)
            self._memo.drop(request_id)
            return 0
        device, host = self.pools[Tier.DEVICE].cached, self.pools[Tier.HOST].cached
        on_device, on_host = Tier.DEVICE, Tier.HOST
        found: list[tuple[Tier, int]] = []
        hosts = 0  # NOTE: of ``found``: the hit's ``num_device`` without a second pass
        held = self._memo.resume_at(request_id)  # NOTE: the names a stale lookup read that hold
        if held:
            before = self._hits[request_id]
            found.extend(before.blocks[:held])
            if limit is not None:
                del found[limit:]
            if before.num_device < len(before.blocks):
                hosts = countOf(map(_tier, found), on_host)
        for name in itertools.islice(names, len(found), limit):
            b = device.get(name)
            if b is not None:
                found.append((on_device, b))
                continue
            b = host.get(name)
            if b is None:
                break
            found.append((on_host, b))
            hosts += 1
        stop = len(names) if limit is None else min(limit, len(names))
        self._memo.keep(request_id, names[: min(len(found) + 1, stop)])  # where the walk went
        self._hit_changed(request_id)
        if not found:
            self._hits.pop(request_id, None)
            return 0
        hit = PrefixHit(tuple(found), self.block_size, len(found) - hosts)
        self._hits[request_id] = hit
        return hit.num_tokens

    def forget_lookups(self) -> None:
        """A new step: forget the lookups that a name coming into or leaving a cache since
        made stale; the others still hold."""
        for pool in self.pools.values():
            if pool.changed:
                self._memo.changed(pool.changed)
                pool.changed.clear()

    def hit_changes(self, since: int) -> tuple[int, list[str] | None]:
        """The version of the lookups now, and the requests whose ``prefix_hit`` changed
        after version ``since`` (in order, a request perhaps more than once; None: too long
        ago to tell, or the cache was reset). A reader that keeps what it worked out from
        every waiting request's hit redoes only these."""
        now = self._hit_log_start + len(self._hit_log)
        if since < self._hit_log_start:
            return now, None
        return now, self._hit_log[since - self._hit_log_start :]

    def _hit_changed(self, request_id: str) -> None:
        log = self._hit_log
        log.append(request_id)
        if len(log) > _HIT_LOG_KEPT:
            half = len(log) // 2
            del log[:half]
            self._hit_log_start += half

    def stale_lookups(self, requests: Sequence[Request]) -> list[Request]:
        """The ``requests`` whose lookup does not hold (never made, or made stale): only
        these need ``lookup`` again; the others' hits and ``num_cached_tokens`` stand."""
        current = self._memo.current()
        return [r for r in requests if r.request_id not in current]

    def prefix_hit(self, request_id: str) -> PrefixHit | None:
        """This step's lookup of ``request_id``, if it found anything."""
        return self._hits.get(request_id)

    @property
    def hits(self) -> Mapping[str, PrefixHit]:
        """``prefix_hit`` of every waiting request whose lookup found something, read only:
        the same dict for the manager's life, so a reader may bind its ``get`` once."""
        return self._hits

    def trim_hit(self, request_id: str, kept: int) -> int:
        """Cut the request's hit to its first ``kept`` blocks (the host could not keep the
        rest this step); the tokens it still covers."""
        hit = self._hits.pop(request_id)
        self._memo.drop(request_id)
        self._hit_changed(request_id)
        if not kept:
            return 0
        self._hits[request_id] = PrefixHit(hit.blocks[:kept], hit.block_size)
        return kept * self.block_size

    def reserve(self, tier: Tier, blocks: Sequence[int]) -> None:
        """Keep free cached ``blocks`` from eviction until ``end_reservations``: this step
        reads them."""
        self.pools[tier].reserved.update(blocks)

    def end_reservations(self) -> None:
        for pool in self.pools.values():
            pool.reserved.clear()

    def pin_prefix(self, request_id: str) -> None:
        """Start the request's table with the device blocks of its hit (shared, not copied);
        its host blocks come with ``load_prefix``."""
        hit = self._hits[request_id]
        self._memo.drop(request_id)
        on_device = hit.of(Tier.DEVICE)
        self.pools[Tier.DEVICE].pin_all(on_device)
        if len(on_device) == len(hit.blocks):
            table = on_device
        else:  # NOTE: the host blocks' places are filled by ``load_prefix``
            table = [b if tier is Tier.DEVICE else -1 for tier, b in hit.blocks]
        self._tables[request_id] = (Tier.DEVICE, table)
        self._kinds[request_id] = CacheKind.KV

    def load_prefix(self, request_id: str) -> list[tuple[int, int]] | None:
        """Copy the hit's host blocks into new device blocks: the (host, device) copies, or
        ``None`` (nothing changed) when the device is short."""
        hit = self._hits[request_id]
        _, table = self._tables[request_id]
        copies: list[tuple[int, int]] = []
        if hit.num_device < len(hit.blocks):  # NOTE: most hits hold no host block to copy
            slots = [i for i, (tier, _) in enumerate(hit.blocks) if tier is Tier.HOST]
            new = self._allocate(Tier.DEVICE, len(slots))
            if new is None:
                return None
            host, device = self.pools[Tier.HOST], self.pools[Tier.DEVICE]
            for i, b in zip(slots, new, strict=True):
                src = hit.blocks[i][1]
                table[i] = b
                device.name(b, host.name_of[src])
                copies.append((src, b))
        self._named[request_id] = len(table)
        del self._hits[request_id]
        self._hit_changed(request_id)
        return copies

    def name_blocks(self, request_id: str, names: Sequence[bytes]) -> None:
        """The request's first ``len(names)`` blocks are full and computed: name them, so
        later requests with the same prefix share them."""
        if not self.prefix_caching or self._kinds.get(request_id) is not CacheKind.KV:
            return
        tier, table = self._tables[request_id]
        if tier is not Tier.DEVICE:
            return
        pool = self.pools[Tier.DEVICE]
        first = self._named.get(request_id, 0)
        last = min(len(names), len(table))
        for i in range(first, last):
            if table[i] != RELEASED:
                pool.name(table[i], names[i])
        self._named[request_id] = max(first, last)

    def take_offloads(self) -> list[tuple[int, int]]:
        """(device, host) copies that keep evicted cached blocks on the host; made before the
        step's forward pass, with the swap-outs."""
        out, self._offloads = self._offloads, []
        self._offload_dst.clear()
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every name in both tiers (new requests share nothing cached before); blocks
        in use stay with their requests. Returns the names dropped."""
        self._named = {rid: len(t) for rid, (_, t) in self._tables.items()}
        self._hits.clear()
        self._memo.clear()
        self._hit_log_start += len(self._hit_log) + 1  # NOTE: no reader can tell what changed
        self._hit_log.clear()
        return sum(pool.forget_names() for pool in self.pools.values())

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
        new = self._allocate(Tier.DEVICE, need)
        if new is None:
            return None
        if not table:
            self._memo.drop(request_id)  # NOTE: it holds blocks now: no lookup of it holds
        table.extend(new)
        self._tables[request_id] = (Tier.DEVICE, table)
        self._kinds[request_id] = kind
        return new

    def trim_slots(self, request_id: str, num_tokens: int) -> int:
        """Return the device blocks past what ``num_tokens`` tokens need (the slots of drafts
        a verification rejected); how many. Named blocks are never past them."""
        tier, table = self._tables.get(request_id, (Tier.HOST, []))
        if tier is not Tier.DEVICE:
            return 0
        keep = self.blocks_for(num_tokens, self._kinds[request_id])
        spare = table[keep:]
        if spare:
            del table[keep:]
            self.pools[Tier.DEVICE].release(spare[::-1])
        return len(spare)

    def swap_out(
        self, request_id: str, num_tokens: int | None = None
    ) -> list[tuple[int, int]] | None:
        """Move the request's blocks device -> host; the (device, host) copies it needs, or
        ``None`` (and nothing moved) when the host is short.

        With ``num_tokens`` (the tokens whose KV is valid) blocks past them are dropped rather
        than copied (an aborted step allocates some), and a checkpoint's mirror is reused: only
        the blocks it lacks are copied. A named block the host already holds is shared with
        the host's copy, not copied again."""
        tier, table = self._tables[request_id]
        if tier is not Tier.DEVICE:
            raise RuntimeError(f"request {request_id} is in {tier.value}, not device")
        held = self._ckpt.get(request_id, [])
        kind = self._kinds[request_id]
        if num_tokens is None:
            keep, done = len(table), 0
        else:
            keep = min(len(table), self.blocks_for(num_tokens, kind))
            mirrored = self._ckpt_tokens.get(request_id, 0)
            # NOTE: a partly filled last block is complete on the host when every valid
            # token is
            done = keep if mirrored >= num_tokens else self._full_blocks(request_id, mirrored)
        reuse = held[:keep] if num_tokens is not None else []
        free_ride = self._ckpt_shared.get(request_id, set())  # mirror blocks never copied
        device, host = self.pools[Tier.DEVICE], self.pools[Tier.HOST]
        shares: dict[int, int] = {}  # table index -> host block already holding it
        for i in range(len(reuse), keep):
            name = device.name_of.get(table[i])
            hit = host.cached.get(name) if name is not None else None
            if hit is not None:
                shares[i] = hit
        gone = table[len(reuse) : keep].count(RELEASED)
        fresh = keep - len(reuse) - len(shares) - gone
        taken = {b for b in shares.values() if host.ref[b] == 0} - host.reserved
        if fresh + len(taken) > host.num_allocatable():
            return None
        for b in shares.values():
            host.pin(b)
        new = iter(self._allocate(Tier.HOST, fresh) or [])
        self._drop_checkpoint(request_id, release=False)
        host.release(live(held[len(reuse) :]))
        out: list[int] = []
        copies: list[tuple[int, int]] = []
        full = self._full_blocks(request_id, num_tokens) if num_tokens is not None else 0
        for i in range(keep):
            if table[i] == RELEASED:  # NOTE: its mirror entry went with it
                out.append(RELEASED)
                continue
            if i < len(reuse):
                b = reuse[i]
                if i >= done and b not in free_ride:
                    copies.append((table[i], b))
            elif i in shares:
                b = shares[i]
            else:
                b = next(new)
                copies.append((table[i], b))
            name = device.name_of.get(table[i])
            if name is not None and i < full:
                host.name(b, name)
            out.append(b)
        device.release(live(table[::-1]))
        self._tables[request_id] = (Tier.HOST, out)
        self._named.pop(request_id, None)
        return copies

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
        shared = self._ckpt_shared.setdefault(request_id, set())
        if want > len(mirror):
            host, device = self.pools[Tier.HOST], self.pools[Tier.DEVICE]
            # NOTE: a block the host tier already caches is a checkpoint for free: shared,
            # never copied over (another request may be reading it)
            shares: dict[int, int] = {}
            for i in range(len(mirror), want):
                name = device.name_of.get(table[i])
                hit = host.cached.get(name) if name is not None else None
                if hit is not None and hit not in mirror:
                    shares[i] = hit
            taken = {b for b in shares.values() if host.ref[b] == 0} - host.reserved
            gone = table[len(mirror) : want].count(RELEASED)
            fresh = want - len(mirror) - len(shares) - gone
            if fresh + len(taken) > host.num_allocatable():
                return None
            for b in shares.values():
                host.pin(b)
            new = iter(self._allocate(Tier.HOST, fresh) or [])
            mirror = mirror + [
                RELEASED if table[i] == RELEASED else shares[i] if i in shares else next(new)
                for i in range(len(mirror), want)
            ]
            shared.update(shares.values())
            self._ckpt[request_id] = mirror
        self._ckpt_pending[request_id] = num_tokens
        first = self._full_blocks(request_id, self._ckpt_tokens.get(request_id, 0))
        return [
            (table[i], mirror[i])
            for i in range(first, want)
            if mirror[i] not in shared and mirror[i] != RELEASED
        ]

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
        """Move the request's blocks host -> device; (host, device) pairs or ``None``.

        A named block the device still caches is shared there instead of copied, and the
        host blocks it leaves that are named stay cached, so swapping the request out again
        copies only what it computed since."""
        tier, table = self._tables[request_id]
        if tier is not Tier.HOST:
            raise RuntimeError(f"request {request_id} is in {tier.value}, not host")
        host, device = self.pools[Tier.HOST], self.pools[Tier.DEVICE]
        cached: dict[int, int] = {}  # table index -> device block that holds it
        if self.prefix_caching:
            for i, b in enumerate(table):
                name = host.name_of.get(b)
                hit = device.cached.get(name) if name is not None else None
                if hit is not None:
                    cached[i] = hit
        taken = {b for b in cached.values() if device.ref[b] == 0} - device.reserved
        need = len(live(table)) - len(cached)
        if need + len(taken) > device.num_allocatable():
            return None
        for b in cached.values():
            device.pin(b)
        fresh = iter(self._allocate(Tier.DEVICE, need) or [])
        self._drop_checkpoint(request_id)
        new, copies = [], []
        for i, src in enumerate(table):
            if src == RELEASED:
                new.append(RELEASED)
                continue
            dst = cached[i] if i in cached else next(fresh)
            if i not in cached:
                copies.append((src, dst))
            name = host.name_of.get(src)
            if name is not None:
                device.name(dst, name)
            new.append(dst)
        host.release(live(table[::-1]))
        self._tables[request_id] = (Tier.DEVICE, new)
        named = 0
        while named < len(new) and (new[named] == RELEASED or new[named] in device.name_of):
            named += 1
        self._named[request_id] = named
        return copies

    def free(self, request_id: str) -> int:
        """Drop the request's references to its blocks (its checkpoint's too); the number of
        table blocks it held. Shared blocks stay with their other holders, and named ones
        stay cached."""
        entry = self._tables.pop(request_id, None)
        self._kinds.pop(request_id, None)
        self._named.pop(request_id, None)
        if self._hits.pop(request_id, None) is not None:
            self._hit_changed(request_id)
        self._memo.drop(request_id)
        self._drop_checkpoint(request_id)
        if entry is None:
            return 0
        tier, table = entry
        held = live(table[::-1])
        self.pools[tier].release(held)
        return len(held)

    def release_behind_window(self, request_id: str, num_tokens: int) -> int:
        """The request's first ``num_tokens`` tokens are committed: give its blocks that no
        later token's window reaches back to the pool (and its checkpoint's copies of them);
        how many device blocks. Only a K/V cache on the device has any, and only with a
        window. Named blocks stay in the prefix cache, free, as a finished request's do."""
        entry = self._tables.get(request_id)
        if not self.sliding_window or entry is None or entry[0] is not Tier.DEVICE:
            return 0
        if self._kinds[request_id] is not CacheKind.KV:
            return 0
        table = entry[1]
        behind = min(len(table), blocks_behind(num_tokens, self.sliding_window, self.block_size))
        first = first_held(table)
        if first >= behind:
            return 0
        gone = table[first:behind]
        table[first:behind] = [RELEASED] * len(gone)
        self.pools[Tier.DEVICE].release(gone[::-1])
        mirror = self._ckpt.get(request_id)
        if mirror:
            start, upto = first_held(mirror), min(behind, len(mirror))
            copies = mirror[start:upto]
            mirror[start:upto] = [RELEASED] * len(copies)
            self._ckpt_shared.get(request_id, set()).difference_update(copies)
            self.pools[Tier.HOST].release(copies[::-1])
        return len(gone)

    def _allocate(self, tier: Tier, n: int) -> list[int] | None:
        """Take ``n`` blocks of ``tier``; a device block evicted from the prefix cache is
        copied to the host first when the host has room and lacks it."""
        on_evict = self._offload if tier is Tier.DEVICE and self.prefix_caching else None
        return self.pools[tier].allocate(n, on_evict)

    def _offload(self, block: int, name: bytes) -> None:
        host = self.pools[Tier.HOST]
        # NOTE: one copy per host block per step: the step's copies run as one batch
        if name in host.cached or host.num_allocatable(self._offload_dst) == 0:
            return
        (dst,) = host.allocate(1, skip=self._offload_dst) or ()
        self._offload_dst.add(dst)
        host.name(dst, name)
        host.release([dst])  # free, but cached: the host tier keeps it until it needs room
        self._offloads.append((block, dst))

    def _full_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens fill completely."""
        hidden = self._kinds.get(request_id) is CacheKind.HIDDEN
        return num_tokens // (self.block_size * (HIDDEN_TOKENS_PER_BLOCK if hidden else 1))

    def _drop_checkpoint(self, request_id: str, release: bool = True) -> None:
        self._ckpt_shared.pop(request_id, None)
        mirror = self._ckpt.pop(request_id, None)
        self._ckpt_tokens.pop(request_id, None)
        self._ckpt_pending.pop(request_id, None)
        if mirror and release:
            self.pools[Tier.HOST].release(live(mirror[::-1]))

    # -- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block's reference count is exactly the number of
        tables and checkpoints that name it, and it is free exactly when that is zero."""
        if set(self._kinds) != set(self._tables):
            raise AssertionError("a request has a cache kind without blocks, or blocks without one")
        for rid in self._ckpt:
            if self.tier_of(rid) is not Tier.DEVICE:
                raise AssertionError(f"{rid} has a checkpoint but its KV is not on the device")
            if len(self._ckpt[rid]) > self.table_length(rid):
                raise AssertionError(f"{rid}'s checkpoint has more blocks than its table")
        for tier, pool in self.pools.items():
            owners: Counter[int] = Counter()
            for t, table in self._tables.values():
                if t is tier:
                    held = live(table)
                    if len(set(held)) != len(held):
                        raise AssertionError(f"{tier.value}: a table names a block twice")
                    owners.update(held)
            if tier is Tier.HOST:
                for mirror in self._ckpt.values():
                    owners.update(live(mirror))
            pool.check(owners)
        for rid, (_, table) in self._tables.items():
            gone = table.count(RELEASED)
            if gone and (not self.sliding_window or table[:gone] != [RELEASED] * gone):
                raise AssertionError(f"{rid}: released blocks are not its table's first ones")
        for rid, (tier, table) in self._tables.items():
            if self._kinds[rid] is CacheKind.HIDDEN and any(
                b in self.pools[tier].name_of for b in table
            ):
                raise AssertionError(f"{rid}: a hidden-state block is in the prefix cache")

    def all_free(self) -> bool:
        pools_full = all(p.num_free == p.num_blocks for p in self.pools.values())
        return not (self._tables or self._kinds or self._ckpt) and pools_full
