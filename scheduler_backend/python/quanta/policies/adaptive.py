"""Apt-Serve's adaptive scheduling with a hybrid KV / hidden cache (§4.2-4.3, §5), as a packer.

Each step is a prefill step or a decode step: the queue whose requests have waited longer in
total goes (``Request.pending_time``: since the last token, else since arrival). Waiting and
swapped requests form the prefill queue W; residents (decoding, or part-way through a chunked
prefill) form the decode queue R. Running candidate i is worth

    g_i = p_i - beta_i * (|W| + |R|) * rho * m_i

with p_i its pending time, m_i its cache in KV blocks (context plus this step's tokens) and
beta_i = 1 when the cache holds hidden states instead: half the blocks, but rho * m_i seconds
more per step while K and V are recomputed, a delay every live request shares. Where hidden
is a choice (a request that starts, or a KV resident offered the switch) the penalty is
charged for every step the choice binds it to, ``steps_ahead``: a hidden cache is kept until
the request finishes or is evicted, so charging one step would price a cost paid on each of
its remaining decode steps as if it were paid once. The step takes
the candidates that maximise the sum of g within memory M (prefill: the free device blocks;
decode: the whole pool), by ``greedy_knapsack``; the ordering stage's ranking only breaks ties.
A request past its SLO (TTFT before its first token, else time-between-tokens on its pending
time) has its p_i replaced by a near-zero constant, or multiplied by ``decay``; the penalty it
would put on the others stays. If the chosen kind of step runs nothing, the other is tried.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from operator import methodcaller
from typing import Literal, TypeVar

from pydantic import Field

from quanta.core.blocks import PrefixHit
from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.output import RunnerCapabilities
from quanta.core.plan import StepPlan
from quanta.core.request import CacheKind, Request, blocks_for
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.adaptive_queue import (
    PrefillQueue,
    Pricing,
    QueueKey,
    ResidentQueue,
    Shape,
)
from quanta.policies.common import outside, pending_since, residents, total_pending
from quanta.policies.fcfs import ReactivePreemption
from quanta.policies.knapsack import NEAR_ZERO, Item, greedy_knapsack, greedy_walk, lightest
from quanta.policies.packers import chunk
from quanta.policies.stages import Lane, Packer, Placement, Ranking
from quanta.policies.systems import ProfileOptions, Stages, System

CacheMode = Literal["hybrid", "kv", "hidden"]
_Shape = Shape  # what an item weighs (``adaptive_queue.Shape``)
# The knapsack's candidates: the requests, their items, and ``item_bounds`` of the items
_Candidates = tuple[list[Request], list[Item], tuple[list[float], list[float]]]
Fallback = Literal["zero", "decay"]
K = TypeVar("K")  # what names a candidate to the greedy: an index, or a kept queue's key
Q = TypeVar("Q", PrefillQueue, ResidentQueue)


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
        # each request's latest ``_shape``, with what it was worked out from
        self._shapes: dict[str, tuple[tuple[object, ...], _Shape]] = {}
        # the prefill queue and the residents, kept when the lane allows
        self._queue, self._residents = PrefillQueue(), ResidentQueue()
        self._finished = self._finished_tokens = 0  # requests that ended by length or stop

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        live = len(view.waiting) + len(view.swapped) + len(view.running)
        rho = self.rho if self.rho is not None else self.cost.rho(view.block_size)
        step = _Step(view, plan, lane, live * rho, self.config.enable_chunked_prefill)
        # NOTE: the queues' totals of pending time pick the kind of step (``fsum``: the same
        # total in whatever order a queue is read)
        prefill: Callable[[_Step, Placement], None]
        decode: Callable[[_Step, Placement], None]
        if ranking.by_arrival and lane.order is ranking.order and not plan.moved and not plan.run:
            # NOTE: the lane in arrival order and nothing planned: the prefill queue is the
            # view's swapped and waiting requests, which the kept queue follows
            queue = self._sync(self._queue, step, switchable=False)
            starts, waited, prefill = len(queue), queue.total_pending(view.now), self._prefill_kept
            # NOTE: nothing planned: the residents are the view's running requests, which
            # the kept residents follow when the decode phase comes to be walked
            ran = total_pending(pending_since(view.running), view.now)
            decode = self._decode_residents
        else:
            # NOTE: each request's pending time, read once: the totals, and the knapsack's
            # values of the requests
            pending = methodcaller("pending_time", view.now)
            waiting = list(outside(lane.order, plan))
            waits = list(map(pending, waiting))
            starts, waited = len(waiting), math.fsum(waits)
            prefill = partial(self._prefill, waiting, waits)
            running = residents(lane.order, plan)
            runs = list(map(pending, running))
            ran, decode = math.fsum(runs), partial(self._decode, running, runs)
        for phase in (prefill, decode) if starts and waited >= ran else (decode, prefill):
            before = len(plan.run)
            phase(step, placement)
            if len(plan.run) > before:
                return

    def on_finish(self, request: Request) -> None:
        self._pinned.discard(request.request_id)
        self._shapes.pop(request.request_id, None)
        self._queue.forget(request)
        self._residents.forget(request)
        if request.status.completed:
            self._finished += 1
            self._finished_tokens += request.num_output_tokens

    # -- the two kinds of step ---------------------------------------------------------
    def _prefill(
        self, queue: list[Request], pending: list[float], step: _Step, placement: Placement
    ) -> None:
        """Start or resume requests in the free blocks."""
        reqs, items, bounds = self._items(queue, pending, step, switchable=False)
        chosen = step.greedy(items, step.plan.free_device, bounds)
        self._start(((reqs[i], kind) for i, kind in chosen.items()), step)

    def _prefill_kept(self, step: _Step, placement: Placement) -> None:
        """``_prefill`` over the kept queue: its items read only as far as the greedy goes."""
        chosen, _ = self._kept_greedy(self._queue, step.plan.free_device, step)
        request = self._queue.request
        self._start(((request(key), kind) for key, kind in chosen.items()), step)

    def _start(self, chosen: Iterable[tuple[Request, CacheKind]], step: _Step) -> None:
        """Start the greedy's choices, in the order it took them, as far as they fit."""
        plan = step.plan
        for req, kind in chosen:
            n = step.chunk(req)
            if n and plan.take_if_fits(req, n, kind):
                self._pinned.discard(req.request_id)

    def _sync(self, queue: Q, step: _Step, *, switchable: bool) -> Q:
        """``queue`` brought up to ``step`` (``switchable``: a KV resident may be offered
        hidden)."""
        left, size, chunked = step.tokens(), step.view.block_size, step.chunked

        def shape(req: Request, held: CacheKind | None, hit: PrefixHit | None) -> _Shape:
            return self._shape(req, held, hit, left, switchable, size, chunked)

        queue.sync(step.view, step.plan, shape, basis=(left, chunked),
                   by_place=self.fallback == "zero",
                   own_steps=self._mean_output() is None)  # fmt: skip
        return queue

    def _kept_greedy(
        self, queue: PrefillQueue | ResidentQueue, memory: int, step: _Step
    ) -> tuple[dict[QueueKey, CacheKind], Pricing]:
        """The greedy over a kept ``queue`` within ``memory``, and the pricing it read."""
        pricing = Pricing(step.factor, self._mean_output(), self.fallback == "zero", self.decay)
        source, least, most, alone = queue.walk(step.view.now, pricing, step.chunked)
        chosen = greedy_walk(source, memory, step.factor, seats=step.plan.seats,
                             tokens=step.tokens(), chunked=step.chunked, least=least,
                             most=most, alone=alone)  # fmt: skip
        return chosen, pricing

    def _decode_residents(self, step: _Step, placement: Placement) -> None:
        """``_decode`` over the kept residents: their items read only as far as the greedy
        goes, and those it leaves out ordered only as far as the runs need their blocks."""
        queue = self._sync(self._residents, step, switchable=self.cache == "hybrid")
        chosen, pricing = self._kept_greedy(queue, step.view.total_device_blocks, step)
        left_out = queue.left_out(step.view.now, pricing, chosen)
        self._continue(chosen, queue.request, left_out, step, placement)

    def _decode(
        self, queue: list[Request], pending: list[float], step: _Step, placement: Placement
    ) -> None:
        """Continue residents within the whole pool, evicting and switching as needed."""
        reqs, items, bounds = self._items(queue, pending, step, switchable=self.cache == "hybrid")
        chosen = step.greedy(items, step.view.total_device_blocks, bounds)
        self._continue(chosen, reqs.__getitem__, _left_out(items, chosen), step, placement)

    def _continue(
        self,
        chosen: dict[K, CacheKind],
        request: Callable[[K], Request],
        left_out: Iterator[K],
        step: _Step,
        placement: Placement,
    ) -> None:
        """Run the decode greedy's ``chosen`` residents (``request`` of each key), evicting
        those it ``left_out`` in that order as the runs need their blocks, then those it
        chose to switch, the last chosen first."""
        plan = step.plan
        held = {k: plan.cache_kind(request(k)) for k in chosen}
        keep = [k for k, kind in chosen.items() if kind is held[k]]
        switch = [k for k, kind in chosen.items() if kind is not held[k]]
        victims, switching = itertools.chain(left_out, reversed(switch)), set(switch)
        for k in keep:
            req = request(k)
            n = step.chunk(req)
            while n and plan.blocks_to_grow(req, n) > plan.free_device:
                v = next(victims, None)
                if v is None:
                    break
                victim = request(v)
                if victim.request_id not in plan.moved:
                    self._evict(victim, plan, placement, switched=v in switching)
            self._run(req, n, step)
        for k in switch:
            req = request(k)
            if req.request_id in plan.moved:
                continue
            if not self._run(req, step.chunk(req), step):
                self._evict(req, plan, placement, switched=True)

    # -- helpers -------------------------------------------------------------------------
    def _items(
        self, queue: list[Request], pending: list[float], step: _Step, *, switchable: bool
    ) -> _Candidates:
        """The knapsack's candidates: those of ``queue`` (pending for ``pending`` seconds)
        with tokens to run in what is left of the step, with their ``item_bounds``."""
        reqs: list[Request] = []
        items: list[Item] = []
        worth: list[float] = []
        bounds: list[float] = []
        plan, size, factor = step.plan, step.view.block_size, step.factor
        left, chunked = step.tokens(), step.chunked  # NOTE: the plan does not change here
        mean = self._mean_output()  # ``steps_ahead`` of every request once one has finished
        shapes, pinned = self._shapes, self._pinned
        zero, decay = self.fallback == "zero", self.decay
        # NOTE: with a long queue this loop runs over every waiting request at every step,
        # and most of them are as they were the step before: what a request's item weighs
        # is kept with everything it was worked out from, and worked out again only when one
        # of those changed; only the value (its pending time) is new each step. So the loop
        # calls nothing per request: the plan reads what each holds in one pass, the value
        # (``_worth``) and the greedy's bound (``item_bounds``) are written out here, and the
        # item is made as its class makes it, without the call of its ``__new__``.
        make = tuple.__new__
        kinds, hits = plan.start_states(queue)
        for req, p, held, hit in zip(queue, pending, kinds, hits, strict=True):
            rid = req.request_id
            key = (hit, held, req.num_computed_tokens, req.num_cached_tokens,
                   len(req.all_token_ids), len(req.draft_token_ids), left,
                   rid in pinned, switchable, req.metadata)  # fmt: skip
            known = shapes.get(rid)
            if known is None or known[0] != key:
                shape = self._shape(req, held, hit, left, switchable, size, chunked)
                known = shapes[rid] = (key, shape)
            n, m, half, kv, hidden, own_steps, light, ttft, tbt = known[1]
            if n == 0:
                continue
            slo = ttft if req.last_token_time is None else tbt
            value = p if slo is None or p <= slo else NEAR_ZERO if zero else decay * p
            steps = 1.0
            if kv and hidden:  # NOTE: steps_ahead, with the mean read once
                steps = mean if mean is not None else own_steps
            hidden_value = value - factor * m * steps
            most = value if value >= hidden_value else hidden_value
            if most < NEAR_ZERO:
                most = NEAR_ZERO
            if kv and hidden_value <= 0:  # NOTE: hidden is no option: KV is its one increment
                light = m
            items.append(make(Item, (value, m, half, kv, hidden, n, steps)))
            reqs.append(req)
            worth.append(most)
            bounds.append(-(most / light) if light > 0 else -math.inf)
        return reqs, items, (worth, bounds)

    def _shape(
        self,
        req: Request,
        held: CacheKind | None,
        hit: PrefixHit | None,
        left: int | None,
        switchable: bool,
        size: int,
        chunked: bool,
    ) -> _Shape:
        """What ``req``'s item weighs, from the cache it holds (``held``) or its prefix
        ``hit`` and the tokens ``left`` in the step."""
        n = chunk(req, req.num_uncomputed_tokens if left is None else left, chunked)
        kv, hidden = self._open_kinds(req, held, switchable)
        # NOTE: a cached prefix's blocks are shared, so its K/V costs the pool only the
        # rest; hidden states are never shared (a hidden start computes from token 0).
        # Only a request that holds no cache has a hit.
        m = blocks_for(req.num_context_tokens + n, size) - (0 if hit is None else hit.num_device)
        half = blocks_for(req.num_computed_tokens + n, size, CacheKind.HIDDEN)
        ttft, tbt = self._slos(req)
        light = lightest(m, half, kv, hidden)
        return n, m, half, kv, hidden, _tokens_left(req), light, ttft, tbt

    def _open_kinds(
        self, req: Request, held: CacheKind | None, switchable: bool
    ) -> tuple[bool, bool]:
        """(KV open, hidden open) for ``req``, which holds ``held``."""
        if held is CacheKind.KV:
            return True, switchable
        if held is CacheKind.HIDDEN or req.request_id in self._pinned or self.cache == "hidden":
            return False, True
        return True, self.cache == "hybrid"

    def steps_ahead(self, req: Request) -> float:
        """The decode steps a hidden cache chosen now is expected to be paid for: the mean
        output of the requests finished so far, or, before any has, the tokens ``req`` may
        still generate (an upper bound).

        NOTE: a hidden cache is kept until the request finishes or is evicted, so choosing
        it over KV costs rho * m per step for all of those steps, not for this one only."""
        mean = self._mean_output()
        return mean if mean is not None else _tokens_left(req)

    def _mean_output(self) -> float | None:
        """The mean output of the requests finished so far (None: none has)."""
        return self._finished_tokens / self._finished if self._finished else None

    def value(self, req: Request, now: float) -> float:
        """p_i after the SLO fallback: past the TTFT SLO before its first token, or past the
        time-between-tokens SLO since its last one (its own, else the default), it is worth
        ``NEAR_ZERO`` or ``decay`` times its pending time."""
        return self._worth(req, req.pending_time(now))

    def _worth(self, req: Request, p: float) -> float:
        """``value`` of ``req`` pending for ``p`` seconds."""
        ttft, tbt = self._slos(req)
        slo = ttft if req.last_token_time is None else tbt
        if slo is None or p <= slo:
            return p
        return NEAR_ZERO if self.fallback == "zero" else self.decay * p

    def _slos(self, req: Request) -> tuple[float | None, float | None]:
        """``req``'s (TTFT, time-between-tokens) SLOs in seconds: its own, else the
        defaults (None: none)."""
        md = req.metadata
        ttft = md.ttft_slo_ms / 1e3 if md.ttft_slo_ms is not None else self.ttft_slo_s
        tbt = md.tpot_slo_ms / 1e3 if md.tpot_slo_ms is not None else self.tbt_slo_s
        return ttft, tbt

    def _evict(self, req: Request, plan: StepPlan, placement: Placement, *, switched: bool) -> None:
        if switched:
            plan.preempt_req(req, PreemptMode.RECOMPUTE)
            self._pinned.add(req.request_id)
        else:
            plan.evict(req, placement.yield_mode(req, plan))

    @staticmethod
    def _run(req: Request, n: int, step: _Step) -> bool:
        """Run ``req`` with the cache it holds when it fits; whether it did."""
        plan = step.plan
        if not n or not plan.has_room(n) or plan.blocks_to_grow(req, n) > plan.free_device:
            return False
        plan.run_req(req, n)
        return True


@dataclass
class _Step:
    """One step's shared state: the ledger, the lane it packs, the factor."""

    view: SchedulerView
    plan: StepPlan
    lane: Lane
    factor: float  # (|W| + |R|) * rho
    chunked: bool

    def tokens(self) -> int | None:
        return self.lane.tokens_left(self.plan)

    def chunk(self, req: Request) -> int:
        left = self.tokens()
        return chunk(req, req.num_uncomputed_tokens if left is None else left, self.chunked)

    def greedy(
        self, items: list[Item], memory: int, bounds: tuple[list[float], list[float]]
    ) -> dict[int, CacheKind]:
        seats, tokens = self.plan.seats, self.tokens()
        return greedy_knapsack(
            items,
            memory,
            self.factor,
            seats=seats,
            tokens=tokens,
            chunked=self.chunked,
            bounds=bounds,
        )


def _left_out(items: list[Item], chosen: dict[int, CacheKind]) -> Iterator[int]:
    """The items the decode greedy left out, the first a step evicts first: lowest value
    per KV block, the later in the queue first on ties. Lazily: most steps evict nobody,
    and then the queue is never sorted."""
    left = [(it.value / it.kv_blocks, -i) for i, it in enumerate(items) if i not in chosen]
    heapq.heapify(left)
    while left:
        yield -heapq.heappop(left)[1]


def _tokens_left(req: Request) -> float:
    """The tokens ``req`` may still generate (at least one)."""
    return float(max(1, req.params.max_tokens - req.num_output_tokens))


class AptOptions(ProfileOptions):
    """Apt-Serve: the hybrid cache, the SLOs its values fall back past, and rho."""

    cache: CacheMode = Field(
        "hybrid", description="hybrid: KV or hidden per request; kv: KV only; hidden: hidden only"
    )
    rho: float | None = Field(
        None,
        ge=0,
        description="extra step seconds per KV block of a hidden request's context "
        "(default: the profile's)",
    )
    ttft_slo_s: float | None = Field(1.0, gt=0, description="default TTFT SLO (None: none)")
    tbt_slo_s: float | None = Field(
        1.0, gt=0, description="default time-between-tokens SLO (None: none)"
    )
    fallback: Fallback = Field(
        "zero", description="a request past its SLO: zero: worth ~0; decay: worth decay x"
    )
    decay: float = Field(0.4, gt=0, le=1)
    allow_swap: bool = Field(
        False, description="evict to host when it has room (else recompute, as Apt-Serve)"
    )


def _apt(config: SchedulerConfig, o: AptOptions) -> Stages:
    packer = AdaptivePacker(
        config,
        o.cost(),
        cache=o.cache,
        ttft_slo_s=o.ttft_slo_s,
        tbt_slo_s=o.tbt_slo_s,
        fallback=o.fallback,
        decay=o.decay,
        rho=o.rho,
    )
    return Stages(packer=packer, placement=ReactivePreemption(allow_swap=o.allow_swap))


SYSTEMS = [
    System(
        "apt",
        AptOptions,
        _apt,
        doc="Apt-Serve: adaptive scheduling with a hybrid KV / hidden cache",
    )
]
