"""The one block ledger: what a step's decision costs in device blocks, host blocks, tokens
and batch seats.

Packers fill a ``StepPlan`` while they choose; the applier replays the finished ``Decision``
on a fresh plan before it changes anything. Both sides count with the same code, so a
decision a packer could build is one the applier accepts, and a bad one raises
``PolicyError`` with nothing changed.

NOTE: the applier carries a decision out in a fixed order: every preemption, then every
swap-in, then the runs, then the checkpoints (copied after the forward pass). A plan checks
each entry when it is recorded, against what is known to be free at that point, which is
never more than the applier will find free in its order.
The one thing the applier's order does not give back is host space freed by a swap-in: the
swap-outs have already happened by then, so a plan never credits it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import add, countOf

from quanta.core.blocks import BlockManager, PrefixHit, Tier
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.errors import PolicyError
from quanta.core.request import CacheKind, Request, RequestStatus, blocks_for
from quanta.core.safepoint import AbortRule


class PoolView:
    """Read-only view of the block pools: what a policy may know about memory."""

    __slots__ = ("_blocks", "kind_of", "prefix_hit")

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        # NOTE: the manager's own answers, bound once as its dicts' ``get`` (what its
        # ``kind_of`` and ``prefix_hit`` return; it keeps those dicts for its life): a packer
        # may ask them of every waiting request each step, and a call in C costs a third of
        # a method's.
        # What the request's blocks hold now; None while it holds none.
        self.kind_of: Callable[[str], CacheKind | None] = blocks.kinds.get
        # What this step's lookup found cached for a waiting request (None: nothing).
        self.prefix_hit: Callable[[str], PrefixHit | None] = blocks.hits.get

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    @property
    def free_device(self) -> int:
        return self._blocks.num_free(Tier.DEVICE)

    @property
    def free_host(self) -> int:
        return self._blocks.num_free(Tier.HOST)

    @property
    def total_device(self) -> int:
        return self._blocks.num_total(Tier.DEVICE)

    @property
    def total_host(self) -> int:
        return self._blocks.num_total(Tier.HOST)

    def hit_changes(self, since: int) -> tuple[int, list[str] | None]:
        """The requests whose ``prefix_hit`` changed after version ``since``, and the
        version now (``BlockManager.hit_changes``)."""
        return self._blocks.hit_changes(since)

    def num_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, in whichever tier its KV is."""
        return self._blocks.num_blocks(request_id)

    def blocks_for(self, num_tokens: int, kind: CacheKind = CacheKind.KV) -> int:
        return blocks_for(num_tokens, self.block_size, kind)

    def checkpointed_tokens(self, request_id: str) -> int:
        """Tokens whose KV the request's host checkpoint holds (0: none)."""
        return self._blocks.checkpointed_tokens(request_id)

    def checkpoint_blocks(self, request_id: str) -> int:
        return self._blocks.checkpoint_blocks(request_id)

    def checkpoint_need(self, request_id: str, num_tokens: int) -> int:
        return self._blocks.checkpoint_need(request_id, num_tokens)

    def swap_out_need(self, request_id: str, num_tokens: int) -> int:
        return self._blocks.swap_out_need(request_id, num_tokens)

    def swap_out_plan(self, request_id: str, num_tokens: int) -> tuple[list[int], list[int]]:
        return self._blocks.swap_out_plan(request_id, num_tokens)

    def table(self, request_id: str) -> tuple[int, ...]:
        """The blocks the request holds, in table order (none a sliding window released)."""
        return tuple(self._blocks.held_blocks(request_id))

    def table_length(self, request_id: str) -> int:
        """Blocks its table spans, released ones included: what its positions reach."""
        return self._blocks.table_length(request_id)

    def refs(self, tier: Tier, block: int) -> int:
        return self._blocks.refs(tier, block)

    def ref_counts(self, tier: Tier) -> Sequence[int]:
        """Every block's reference count in ``tier``, indexed by block (read only): the plan
        reads whole tables against it, a lookup per block being the step's hottest path."""
        return self._blocks.pools[tier].ref

    def num_cached(self, tier: Tier) -> int:
        return self._blocks.num_cached(tier)


class StepPlan:
    """A decision under construction, with the counts it leaves free.

    ``budget`` and ``seats`` are the policy's own limits (tokens and sequences per step);
    ``None`` means unlimited, as when the applier validates.
    """

    def __init__(self, pool: PoolView, budget: int | None = None, seats: int | None = None):
        self.pool, self.budget, self.seats = pool, budget, seats
        self._block_size = pool.block_size
        self.free_device = pool.free_device
        self.free_host = pool.free_host
        self.run: list[tuple[str, int]] = []
        self.preempt: list[Preemption] = []
        self.swap_in: list[str] = []
        self.chosen: set[str] = set()  # runs this step
        self.moved: set[str] = set()  # preempted or swapped in this step
        self._swapped_in: dict[str, int] = {}  # device blocks brought back this step
        self._dropped: set[str] = set()  # recompute-preempted: they hold no cache any more
        self.hidden: set[str] = set()  # runs with a hidden cache
        self.checkpoint: list[str] = []  # KV copied to the host after the forward pass
        self.abort_when: AbortRule | None = None  # the step is preemptible at safepoints
        self._ran: dict[str, int] = {}  # tokens each run computes
        # NOTE: with prefix caching a block may be in several tables: the plan counts how
        # the decision changes each block's references (a ``Counter``, so that a start on a
        # long cached prefix adds one to each of its blocks in C), and a block is free when
        # its count reaches zero, not when one holder lets go.
        self._refs: dict[Tier, Counter[int]] = {Tier.DEVICE: Counter(), Tier.HOST: Counter()}
        self._reserved: set[int] = set()  # host blocks this step's prefix hits copy from
        # Starts whose hit is cut short (blocks kept): the host could not keep all its blocks.
        self.trimmed: dict[str, int] = {}

    # -- queries -------------------------------------------------------------------------
    def held(self, req: Request) -> int:
        """Blocks in ``req``'s table (what a swap-in of it takes on the device)."""
        return self.pool.num_blocks(req.request_id)

    def frees(self, req: Request) -> int:
        """Device blocks preempting resident ``req`` would free now: those of its table no
        other request shares."""
        table = self.pool.table(req.request_id)
        counts = self.pool.ref_counts(Tier.DEVICE)
        changed = self._refs[Tier.DEVICE]
        if not changed:  # NOTE: most calls come before the plan takes or drops a block
            return countOf(map(counts.__getitem__, table), 1)
        return sum(1 for b in table if counts[b] + changed.get(b, 0) == 1)

    def prefix_hit(self, req: Request, kind: CacheKind | None = None) -> PrefixHit | None:
        """The cached prefix ``req`` starts with if it runs now with a ``kind`` cache: only a
        waiting request that holds nothing, and only a K/V cache, attaches one."""
        if (kind or CacheKind.KV) is not CacheKind.KV or req.status is not RequestStatus.WAITING:
            return None
        if req.request_id in self.moved or self.cache_kind(req) is not None:
            return None
        return self.pool.prefix_hit(req.request_id)

    def start_states(
        self, reqs: Sequence[Request]
    ) -> tuple[list[CacheKind | None], list[PrefixHit | None]]:
        """``cache_kind(req)`` and ``prefix_hit(req)`` of each of ``reqs``, in one pass: a
        packer that weighs every waiting request each step reads both of each, and a call
        per request cost it more than the reading."""
        kind_of, hit_of = self.pool.kind_of, self.pool.prefix_hit
        dropped, moved, waiting = self._dropped, self.moved, RequestStatus.WAITING
        kinds: list[CacheKind | None] = []
        hits: list[PrefixHit | None] = []
        for req in reqs:
            rid = req.request_id
            kind = None if rid in dropped else kind_of(rid)
            kinds.append(kind)
            starts = kind is None and req.status is waiting and rid not in moved
            hits.append(hit_of(rid) if starts else None)
        return kinds, hits

    def is_resident(self, req: Request) -> bool:
        """Its KV is on the device after this plan's moves."""
        # NOTE: the status first: most of the requests a packer walks are waiting
        if req.status is RequestStatus.RUNNING and req.request_id not in self.moved:
            return True
        return req.request_id in self._swapped_in

    def cache_kind(self, req: Request) -> CacheKind | None:
        """The kind of cache ``req`` holds after this plan's moves (None: it holds none)."""
        if req.request_id in self._dropped:
            return None
        return self.pool.kind_of(req.request_id)

    def blocks_to_grow(self, req: Request, n: int, kind: CacheKind | None = None) -> int:
        """Device blocks ``req`` needs to compute ``n`` more tokens, counting a swap-in; a
        request that holds a cache grows its own kind, one that starts takes ``kind``."""
        kind = self.cache_kind(req) or kind or CacheKind.KV
        if req.status is RequestStatus.WAITING:  # NOTE: no other starts on a hit (prefix_hit)
            hit = self._start_hit(req, kind)
            if hit is not None:
                return self._hit_cost(hit, n)[0]
        return self._grow(req, n, kind)

    def _grow(self, req: Request, n: int, kind: CacheKind) -> int:
        """``blocks_to_grow`` of a request that starts on no prefix hit."""
        target = blocks_for(req.num_computed_tokens + req.slots_for(n), self._block_size, kind)
        # NOTE: a table's released entries count: new blocks extend it past its end
        spans = self.pool.table_length(req.request_id) if self.is_resident(req) else 0
        return max(0, target - spans)

    def _start_hit(self, req: Request, kind: CacheKind) -> PrefixHit | None:
        """The cached prefix ``req`` starts with now (``_kept`` of its lookup)."""
        return self._kept(self.prefix_hit(req, kind))

    def _kept(self, hit: PrefixHit | None) -> PrefixHit | None:
        """A lookup ``hit``, cut short before the first host block the host cannot keep
        (this step's swap-outs may have taken the room), so a start never fails for want of
        host blocks; it computes the rest instead."""
        if hit is None:
            return None
        if self._host_keep(hit) <= self.free_host:
            return hit
        kept: set[int] = set()
        cut = 0  # NOTE: the walk always stops at a block over: the whole hit does not fit
        for tier, b in hit.blocks:
            if tier is Tier.HOST and b not in kept and self._keeps(b):
                if len(kept) == self.free_host:
                    break
                kept.add(b)
            cut += 1
        return PrefixHit(hit.blocks[:cut], hit.block_size) if cut else None

    def _keeps(self, block: int) -> bool:
        """A start reading host ``block`` keeps it from eviction at a cost: it is free now."""
        return block not in self._reserved and self._ref(Tier.HOST, block) == 0

    def _host_keep(self, hit: PrefixHit) -> int:
        """Free host blocks a start with ``hit`` keeps from eviction until its copies run."""
        if hit.num_device == len(hit.blocks):  # NOTE: no host block
            return 0
        return sum(1 for b in set(hit.of(Tier.HOST)) if self._keeps(b))

    def _hit_cost(self, hit: PrefixHit, n: int) -> tuple[int, int]:
        """(device, host) blocks a start with ``hit`` and ``n`` new tokens takes: new device
        blocks for the rest and for the host blocks copied back, plus the cached device blocks
        it takes off the free list; the free cached host blocks it keeps from eviction."""
        device = hit.of(Tier.DEVICE)
        # NOTE: each block's ``_ref``, read in C: a start on a long shared prefix reads every
        # block of it, twice (the packer's check, then the run)
        refs = map(self.pool.ref_counts(Tier.DEVICE).__getitem__, device)
        changed = self._refs[Tier.DEVICE]
        if changed:
            refs = map(add, refs, map(changed.get, device, repeat(0)))
        pins = countOf(refs, 0)
        grow = self.pool.blocks_for(hit.num_tokens + n) - len(device)
        return grow + pins, self._host_keep(hit)

    def _ref(self, tier: Tier, block: int) -> int:
        return self.pool.refs(tier, block) + self._refs[tier].get(block, 0)

    def _drop(self, tier: Tier, blocks: tuple[int, ...] | list[int]) -> int:
        """One reference fewer to each of ``blocks``; how many that frees (a host block a
        prefix hit reads this step stays taken)."""
        freed = 0
        for b in blocks:
            left = self._ref(tier, b) - 1
            self._refs[tier][b] -= 1
            if left == 0 and not (tier is Tier.HOST and b in self._reserved):
                freed += 1
        return freed

    def _take(self, tier: Tier, block: int) -> int:
        """One reference more to a cached block; 1 when that takes it off the free list."""
        ref = self._ref(tier, block)
        self._refs[tier][block] += 1
        return int(ref == 0 and not (tier is Tier.HOST and block in self._reserved))

    def swap_out_need(self, req: Request) -> int:
        """Host blocks a swap-out of resident ``req`` takes now: copies into new blocks,
        and cached host blocks it shares that are free."""
        new, shared = self.pool.swap_out_plan(req.request_id, req.num_computed_tokens)
        free = {b for b in shared if self._ref(Tier.HOST, b) == 0 and b not in self._reserved}
        return len(new) + len(free)

    def is_checkpointed(self, req: Request) -> bool:
        """Its host checkpoint holds all its computed tokens: preempting it by swap frees its
        device blocks with no copy."""
        return (
            self.is_resident(req)
            and req.request_id not in self._swapped_in
            and req.num_computed_tokens > 0
            and self.pool.checkpointed_tokens(req.request_id) >= req.num_computed_tokens
        )

    def has_room(self, n: int = 1) -> bool:
        """The step has a seat and ``n`` tokens of budget left."""
        seats_ok = self.seats is None or self.seats > 0
        return seats_ok and (self.budget is None or self.budget >= n)

    # -- entries (each raises PolicyError when it cannot be carried out) ---------------
    def preempt_req(self, req: Request, mode: PreemptMode) -> int:
        """Preempt ``req``; returns the device blocks it frees."""
        self._touch(req)
        table = self.pool.table(req.request_id)
        running = req.status is RequestStatus.RUNNING
        n = 0
        if running and mode is PreemptMode.SWAP:
            need = self.swap_out_need(req)
            if need > self.free_host:
                raise PolicyError(f"swap-out of {req.request_id} needs {need} host blocks")
            _, shared = self.pool.swap_out_plan(req.request_id, req.num_computed_tokens)
            for b in shared:
                self._take(Tier.HOST, b)
            self.free_host -= need
            n = self._drop(Tier.DEVICE, table)
            self.free_device += n
        elif running and mode is PreemptMode.RECOMPUTE:
            n = self._drop(Tier.DEVICE, table)
            self.free_device += n
            self._dropped.add(req.request_id)
        elif req.status is RequestStatus.SWAPPED and mode is PreemptMode.RECOMPUTE:
            self.free_host += self._drop(Tier.HOST, table)
            self._dropped.add(req.request_id)
        else:
            raise PolicyError(f"cannot {mode.value}-preempt {req.request_id} ({req.status})")
        self.preempt.append(Preemption(req.request_id, mode))
        return n

    def evict(self, req: Request, mode: PreemptMode) -> int:
        """Preempt a resident; a swap falls back to recompute when the host is full, so
        eviction always succeeds. Returns the device blocks freed."""
        if mode is PreemptMode.SWAP and self.swap_out_need(req) > self.free_host:
            mode = PreemptMode.RECOMPUTE
        return self.preempt_req(req, mode)

    def swap_in_req(self, req: Request) -> None:
        """Bring a swapped request's KV back (to run now, or ahead of need)."""
        if req.status is not RequestStatus.SWAPPED:
            raise PolicyError(f"swap-in of {req.request_id}, which is {req.status.value}")
        self._touch(req)
        n = self.held(req)
        if n > self.free_device:
            raise PolicyError(f"swap-in of {req.request_id} needs {n} device blocks")
        self.free_device -= n
        self._drop(Tier.HOST, self.pool.table(req.request_id))  # NOTE: never credited
        self.swap_in.append(req.request_id)
        self._swapped_in[req.request_id] = n

    def run_req(self, req: Request, n: int, kind: CacheKind | None = None) -> None:
        """Compute ``n`` new tokens of ``req`` this step; it must be resident by now.

        ``kind`` is the cache a request that holds none starts with (KV when None); one that
        holds a cache keeps it, and naming the other kind is an error (switching is a
        recompute-preemption first)."""
        self._run(req, n, kind, fits_only=False)

    def take_if_fits(self, req: Request, n: int, kind: CacheKind | None = None) -> bool:
        """``take`` when the step has room for ``n`` tokens of ``req`` and the free blocks
        hold them; whether it did (nothing is recorded when not). The same as checking
        ``has_room`` and ``blocks_to_grow`` first, with the run's blocks worked out once: a
        start on a long cached prefix reads every block of it to count them."""
        if not self.has_room(n):
            return False
        if req.status is RequestStatus.SWAPPED and req.request_id not in self._swapped_in:
            if self.blocks_to_grow(req, n, kind) > self.free_device:
                return False
            self.take(req, n, kind)
            return True
        return self._run(req, n, kind, fits_only=True)

    def _run(self, req: Request, n: int, kind: CacheKind | None, *, fits_only: bool) -> bool:
        """``run_req``; with ``fits_only`` a run the step has no room or blocks for is not
        made (False) rather than an error."""
        rid = req.request_id
        if self.checkpoint:
            raise PolicyError(f"run of {rid} after a checkpoint entry: checkpoints come last")
        held = self.cache_kind(req)
        if held is not None and kind is not None and kind is not held:
            raise PolicyError(f"run of {rid} with a {kind.value} cache; it holds {held.value}")
        kind = held or kind or CacheKind.KV
        if rid in self.chosen or (rid in self.moved and rid not in self._swapped_in):
            raise PolicyError(f"run of {rid}: repeated or preempted this step")
        if req.status is RequestStatus.SWAPPED and rid not in self._swapped_in:
            raise PolicyError(f"run of swapped {rid} without a swap-in")
        if not 1 <= n <= req.num_uncomputed_tokens:
            raise PolicyError(f"run of {rid} with {n} tokens; {req.num_uncomputed_tokens} left")
        looked_up = self.prefix_hit(req, kind)
        hit = self._kept(looked_up)
        need, host = self._hit_cost(hit, n) if hit else (self._grow(req, n, kind), 0)
        if need > self.free_device:
            if fits_only:
                return False
            raise PolicyError(f"run of {rid} needs {need} device blocks, {self.free_device} free")
        if not self.has_room(n):
            if fits_only:
                return False
            raise PolicyError(f"run of {rid}: the step's token budget or seats are used up")
        if looked_up is not None and hit is not looked_up:
            self.trimmed[rid] = len(hit.blocks) if hit else 0
        if hit is not None:
            self._refs[Tier.DEVICE].update(hit.of(Tier.DEVICE))  # NOTE: ``_take`` of each
            self._reserved.update(hit.of(Tier.HOST))
        self.free_device -= need
        self.free_host -= host
        self.run.append((rid, n))
        self._ran[rid] = n
        self.chosen.add(rid)
        if kind is CacheKind.HIDDEN:
            self.hidden.add(rid)
        if self.budget is not None:
            self.budget -= n
        if self.seats is not None:
            self.seats -= 1
        return True

    def take(self, req: Request, n: int, kind: CacheKind | None = None) -> None:
        """Run ``req`` for ``n`` tokens, swapping it in first when its KV is on the host."""
        if req.status is RequestStatus.SWAPPED and req.request_id not in self._swapped_in:
            self.swap_in_req(req)
        self.run_req(req, n, kind)

    def checkpoint_req(self, req: Request) -> int:
        """Copy ``req``'s KV, up to its computed tokens after this step, to the host once the
        forward pass is done; it must be resident or run this step. Returns the host blocks it
        takes.

        Recorded after every run of the plan (the applier copies after the forward pass and
        counts this step's tokens of the request, so the entry must know them)."""
        rid = req.request_id
        if not (self.is_resident(req) or rid in self.chosen) or rid in self.checkpoint:
            raise PolicyError(f"checkpoint of {rid}: not resident, or repeated")
        upto = req.num_context_tokens + req.real_tokens(self._ran.get(rid, 0))
        if upto == 0:
            raise PolicyError(f"checkpoint of {rid}, which has no KV yet")
        kind = self.cache_kind(req) or (CacheKind.HIDDEN if rid in self.hidden else CacheKind.KV)
        have = 0 if rid in self._swapped_in else self.pool.checkpoint_blocks(rid)
        need = max(0, self.pool.blocks_for(upto, kind) - have)
        if need > self.free_host:
            raise PolicyError(f"checkpoint of {rid} needs {need} host blocks")
        self.free_host -= need
        self.checkpoint.append(rid)
        return need

    def decision(self) -> Decision:
        return Decision(
            tuple(self.run),
            tuple(self.preempt),
            tuple(self.swap_in),
            frozenset(self.hidden),
            tuple(self.checkpoint),
            self.abort_when,
        )

    def _touch(self, req: Request) -> None:
        if req.request_id in self.moved:
            raise PolicyError(f"{req.request_id} is preempted or swapped twice in one decision")
        self.moved.add(req.request_id)
