"""Apt-Serve's adaptive scheduling with a hybrid KV / hidden cache (§4.2-4.3, §5), as a packer.

Each step is a prefill step or a decode step: the queue whose requests have waited longer in
total goes (``Request.pending_time``: since the last token, else since arrival). Waiting and
swapped requests form the prefill queue W; residents (decoding, or part-way through a chunked
prefill) form the decode queue R. Running candidate i is worth

    g_i = p_i - beta_i * (|W| + |R|) * rho * m_i

with p_i its pending time, m_i its cache in KV blocks (context plus this step's tokens) and
beta_i = 1 when the cache holds hidden states instead: half the blocks, but rho * m_i seconds
more per step while K and V are recomputed, a delay every live request shares. The step takes
the candidates that maximise the sum of g within memory M (prefill: the free device blocks;
decode: the whole pool), by ``greedy_knapsack``; the ordering stage's ranking only breaks ties.
A request past its SLO (TTFT before its first token, else time-between-tokens on its pending
time) has its p_i replaced by a near-zero constant, or multiplied by ``decay``; the penalty it
would put on the others stays. If the chosen kind of step runs nothing, the other is tried.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.output import RunnerCapabilities
from quanta.core.plan import StepPlan
from quanta.core.request import CacheKind, Request
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.packers import chunk
from quanta.policies.stages import Lane, Packer, Placement, Ranking

CacheMode = Literal["hybrid", "kv", "hidden"]
Fallback = Literal["zero", "decay"]

# Seconds: what a request past its SLO is worth with fallback "zero", and the least any option
# is worth, so that work which fits is never left idle.
NEAR_ZERO = 1e-9


@dataclass(frozen=True, slots=True)
class Item:
    """One knapsack candidate: what running it is worth and what each kind of cache costs."""

    value: float  # p: the pending seconds its run clears (after the SLO fallback)
    kv_blocks: int  # m >= 1: its cache as K and V, the KV option's weight
    hidden_blocks: int  # >= 1: its cache as hidden states (about m / 2), the hidden option's
    kv: bool = True  # the KV option is open to it
    hidden: bool = True  # the hidden option is open to it
    tokens: int = 1  # this step's tokens of it


def options(item: Item, factor: float, memory: int) -> list[tuple[CacheKind, int, float]]:
    """The item's useful options as (kind, blocks, value), lightest first.

    Hidden is worth ``value - factor * kv_blocks``; options heavier than ``memory`` are gone,
    and so is hidden when it is worth nothing while KV is open. Beside KV, hidden stays only
    when its value per block is at least what the upgrade to KV adds per block (the options'
    upper hull): with exactly half the blocks, hidden worth at least half of KV, Apt-Serve's
    public rule. The greedy then takes hidden before the upgrade and is the LP relaxation's
    greedy, which the factor-2 bound rests on.
    """
    value = max(item.value, NEAR_ZERO)
    hidden_value = item.value - factor * item.kv_blocks
    w_h, w_k = item.hidden_blocks, item.kv_blocks
    kv = item.kv and w_k <= memory
    hidden = item.hidden and w_h <= memory and (hidden_value > 0 or not item.kv)
    if kv and hidden:
        hidden = w_h < w_k and hidden_value * (w_k - w_h) >= (value - hidden_value) * w_h
    out: list[tuple[CacheKind, int, float]] = []
    if hidden:
        out.append((CacheKind.HIDDEN, w_h, max(hidden_value, NEAR_ZERO)))
    if kv:
        out.append((CacheKind.KV, w_k, value))
    return out


def greedy_knapsack(
    items: Sequence[Item],
    memory: int,
    factor: float,
    *,
    seats: int | None = None,
    tokens: int | None = None,
    chunked: bool = False,
) -> dict[int, CacheKind]:
    """Apt-Serve's greedy: the chosen items (indices) and their cache, in the order taken.

    Each item's options become increments (hidden: 0 -> hidden blocks; upgrade: hidden -> KV
    blocks; or 0 -> KV alone), taken by value gained per block, highest first, items earlier
    in ``items`` first on ties; one that does not fit is skipped and the walk goes on. When one
    option alone is worth more than the whole walk it is taken instead, so the result is worth
    at least half the optimum of  max sum g  s.t. sum blocks <= ``memory``. ``seats`` and
    ``tokens`` (the step's limits) are kept too, without that bound; with ``chunked`` an item
    may take fewer tokens than it asks. ``factor`` is (|W| + |R|) * rho.
    """
    opts = [options(it, factor, memory) for it in items]
    alone = [_has_room(it, seats, tokens, chunked) for it in items]
    steps: list[tuple[float, int, int, int, float]] = []
    for i, choices in enumerate(opts):
        prev_w, prev_v = 0, 0.0
        for stage, (_, w, v) in enumerate(choices):
            steps.append((-(v - prev_v) / (w - prev_w), i, stage, w - prev_w, v - prev_v))
            prev_w, prev_v = w, v
    steps.sort()
    chosen: dict[int, CacheKind] = {}
    total = 0.0
    for _, i, stage, dw, dv in steps:
        if dw > memory:
            continue
        if stage == 0:
            if not _has_room(items[i], seats, tokens, chunked):
                continue
            seats = None if seats is None else seats - 1
            tokens = None if tokens is None else tokens - min(items[i].tokens, tokens)
        elif i not in chosen:
            continue
        chosen[i] = opts[i][stage][0]
        memory -= dw
        total += dv
    best: tuple[float, int, CacheKind] | None = None
    for i, choices in enumerate(opts):
        for kind, _, v in choices:
            if alone[i] and (best is None or v > best[0]):
                best = (v, i, kind)
    if best is not None and best[0] > total:
        return {best[1]: best[2]}
    return chosen


def _has_room(item: Item, seats: int | None, tokens: int | None, chunked: bool) -> bool:
    """A seat is left, and the item's tokens (or, chunked, some of them)."""
    seat = seats is None or seats > 0
    return seat and (tokens is None or item.tokens <= tokens or (chunked and tokens > 0))


class AdaptivePacker(Packer):
    """Apt-Serve's step: the prefill or decode queue, packed by ``greedy_knapsack``.

    ``cache``: ``hybrid`` offers both kinds, ``kv`` only K and V (the paper's KV-only
    ablation; needs no hidden-cache runner), ``hidden`` only hidden states. A request that
    holds a cache keeps its kind (the ledger's rule), so only a request that starts, or
    restarts after a recompute, chooses.

    Decode steps fill the whole pool: residents the greedy leaves out are evicted, lowest
    value per block first, only as far as the chosen ones need their blocks, in the
    placement's mode (Apt-Serve discards them for recompute; ``allow_swap`` sends them to the
    host when it has room). Prefill steps use only free blocks and evict nothing.

    Switching: in a decode step a KV resident is offered hidden too, and the greedy may choose
    it there (it would fit in half the blocks). The switch (a recompute-preemption now, a
    restart pinned to hidden later) is made only when the request cannot run with its KV this
    step: its blocks are taken for a higher-valued request, or its KV cannot grow in what is
    left. A switch therefore only ever replaces an eviction the step needs anyway, and adds
    no recompute; otherwise the request runs on with its KV, which serves the greedy's choice
    at no cost. A hidden resident is never switched back in place: converting costs a full
    recompute to save rho per block per step, a trade the step-local value cannot weigh; it
    chooses again, freely, whenever it restarts.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost: CostModel,
        *,
        cache: CacheMode = "hybrid",
        ttft_slo_s: float | None = 1.0,
        tbt_slo_s: float | None = 1.0,
        fallback: Fallback = "zero",
        decay: float = 0.4,
        rho: float | None = None,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.config, self.cost, self.cache = config, cost, cache
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.fallback, self.decay, self.rho = fallback, decay, rho
        self.requires = RunnerCapabilities(hidden_cache=cache != "kv")
        self._pinned: set[str] = set()  # switched to hidden: they restart hidden

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        waiting = [
            r for r in lane.order if not plan.is_resident(r) and r.request_id not in plan.moved
        ]
        running = [r for r in lane.order if plan.is_resident(r) and r.request_id not in plan.chosen]
        live = len(view.waiting) + len(view.swapped) + len(view.running)
        rho = self.rho if self.rho is not None else self.cost.rho(view.block_size)
        step = _Step(view, plan, lane.max_tokens, live * rho, self.config.enable_chunked_prefill)
        prefill_first = bool(waiting) and _pending(waiting, view.now) >= _pending(running, view.now)
        phases = [(self._prefill, waiting), (self._decode, running)]
        for phase, queue in phases if prefill_first else phases[::-1]:
            before = len(plan.run)
            phase(queue, step, placement)
            if len(plan.run) > before:
                return

    def on_finish(self, request: Request) -> None:
        self._pinned.discard(request.request_id)

    # -- the two kinds of step ---------------------------------------------------------
    def _prefill(self, queue: list[Request], step: _Step, placement: Placement) -> None:
        """Start or resume requests in the free blocks."""
        reqs, items = self._items(queue, step, switchable=False)
        plan = step.plan
        for i, kind in step.greedy(items, plan.free_device).items():
            req = reqs[i]
            n = step.chunk(req)
            if n and plan.has_room(n) and plan.blocks_to_grow(req, n, kind) <= plan.free_device:
                plan.take(req, n, kind)
                step.spend(n)
                self._pinned.discard(req.request_id)

    def _decode(self, queue: list[Request], step: _Step, placement: Placement) -> None:
        """Continue residents within the whole pool, evicting and switching as needed."""
        reqs, items = self._items(queue, step, switchable=self.cache == "hybrid")
        plan = step.plan
        chosen = step.greedy(items, step.view.total_device_blocks)
        held = [plan.cache_kind(r) for r in reqs]
        keep = [i for i, kind in chosen.items() if kind is held[i]]
        switch = [i for i, kind in chosen.items() if kind is not held[i]]
        left_out = sorted(
            (i for i in range(len(reqs)) if i not in chosen),
            key=lambda i: (items[i].value / items[i].kv_blocks, -i),
        )
        victims, switching = deque(left_out + switch[::-1]), set(switch)
        for i in keep:
            req, n = reqs[i], step.chunk(reqs[i])
            while n and plan.blocks_to_grow(req, n) > plan.free_device and victims:
                v = victims.popleft()
                if reqs[v].request_id not in plan.moved:
                    self._evict(reqs[v], plan, placement, switched=v in switching)
            self._run(req, n, step)
        for i in switch:
            req, n = reqs[i], step.chunk(reqs[i])
            if req.request_id in plan.moved:
                continue
            if not self._run(req, n, step):
                self._evict(req, plan, placement, switched=True)

    # -- helpers -------------------------------------------------------------------------
    def _items(
        self, queue: list[Request], step: _Step, *, switchable: bool
    ) -> tuple[list[Request], list[Item]]:
        reqs: list[Request] = []
        items: list[Item] = []
        pool, now = step.view.pool, step.view.now
        for req in queue:
            n = step.chunk(req)
            if n == 0:
                continue
            total = req.num_computed_tokens + n
            kv, hidden = self._open_kinds(req, step.plan.cache_kind(req), switchable)
            m, half = pool.blocks_for(total), pool.blocks_for(total, CacheKind.HIDDEN)
            items.append(Item(self.value(req, now), m, half, kv, hidden, n))
            reqs.append(req)
        return reqs, items

    def _open_kinds(
        self, req: Request, held: CacheKind | None, switchable: bool
    ) -> tuple[bool, bool]:
        """(KV open, hidden open) for ``req``, which holds ``held``."""
        if held is CacheKind.KV:
            return True, switchable
        if held is CacheKind.HIDDEN or req.request_id in self._pinned or self.cache == "hidden":
            return False, True
        return True, self.cache == "hybrid"

    def value(self, req: Request, now: float) -> float:
        """p_i after the SLO fallback: past the TTFT SLO before its first token, or past the
        time-between-tokens SLO since its last one (its own, else the default), it is worth
        ``NEAR_ZERO`` or ``decay`` times its pending time."""
        p = req.pending_time(now)
        md = req.metadata
        if req.last_token_time is None:
            slo = md.ttft_slo_ms / 1e3 if md.ttft_slo_ms is not None else self.ttft_slo_s
        else:
            slo = md.tpot_slo_ms / 1e3 if md.tpot_slo_ms is not None else self.tbt_slo_s
        if slo is None or p <= slo:
            return p
        return NEAR_ZERO if self.fallback == "zero" else self.decay * p

    def _evict(self, req: Request, plan: StepPlan, placement: Placement, *, switched: bool) -> None:
        if switched:
            plan.preempt_req(req, PreemptMode.RECOMPUTE)
            self._pinned.add(req.request_id)
        else:
            plan.evict(req, placement.evict_mode)

    @staticmethod
    def _run(req: Request, n: int, step: _Step) -> bool:
        """Run ``req`` with the cache it holds when it fits; whether it did."""
        plan = step.plan
        if not n or not plan.has_room(n) or plan.blocks_to_grow(req, n) > plan.free_device:
            return False
        plan.run_req(req, n)
        step.spend(n)
        return True


@dataclass
class _Step:
    """One step's shared state: the ledger, the tokens left to the lane, the factor."""

    view: SchedulerView
    plan: StepPlan
    cap: int | None  # the lane's tokens left (None: only the step's budget)
    factor: float  # (|W| + |R|) * rho
    chunked: bool

    def tokens(self) -> int | None:
        limits = [x for x in (self.plan.budget, self.cap) if x is not None]
        return min(limits) if limits else None

    def chunk(self, req: Request) -> int:
        left = self.tokens()
        return chunk(req, req.num_uncomputed_tokens if left is None else left, self.chunked)

    def spend(self, n: int) -> None:
        if self.cap is not None:
            self.cap -= n

    def greedy(self, items: list[Item], memory: int) -> dict[int, CacheKind]:
        seats, tokens = self.plan.seats, self.tokens()
        return greedy_knapsack(
            items, memory, self.factor, seats=seats, tokens=tokens, chunked=self.chunked
        )


def _pending(queue: list[Request], now: float) -> float:
    return sum(r.pending_time(now) for r in queue)
