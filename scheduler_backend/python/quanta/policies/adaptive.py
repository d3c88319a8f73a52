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

from collections import deque
from dataclasses import dataclass
from operator import countOf, itemgetter, methodcaller
from typing import Literal

from pydantic import Field

from quanta.core.blocks import Tier
from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.output import RunnerCapabilities
from quanta.core.plan import StepPlan
from quanta.core.request import CacheKind, Request, blocks_for
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.common import outside, residents
from quanta.policies.fcfs import ReactivePreemption
from quanta.policies.knapsack import NEAR_ZERO, Item, greedy_knapsack
from quanta.policies.packers import chunk
from quanta.policies.stages import Lane, Packer, Placement, Ranking
from quanta.policies.systems import ProfileOptions, Stages, System

_tier = itemgetter(0)

CacheMode = Literal["hybrid", "kv", "hidden"]
Fallback = Literal["zero", "decay"]


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
        self._finished = self._finished_tokens = 0  # requests that ended by length or stop

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        waiting = list(outside(lane.order, plan))
        running = residents(lane.order, plan)
        live = len(view.waiting) + len(view.swapped) + len(view.running)
        rho = self.rho if self.rho is not None else self.cost.rho(view.block_size)
        step = _Step(view, plan, lane, live * rho, self.config.enable_chunked_prefill)
        prefill_first = bool(waiting) and _pending(waiting, view.now) >= _pending(running, view.now)
        phases = [(self._prefill, waiting), (self._decode, running)]
        for phase, queue in phases if prefill_first else phases[::-1]:
            before = len(plan.run)
            phase(queue, step, placement)
            if len(plan.run) > before:
                return

    def on_finish(self, request: Request) -> None:
        self._pinned.discard(request.request_id)
        if request.status.completed:
            self._finished += 1
            self._finished_tokens += request.num_output_tokens

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
        plan, now, size = step.plan, step.view.now, step.view.block_size
        left, chunked = step.tokens(), step.chunked  # NOTE: the plan does not change here
        mean = self._mean_output()  # ``steps_ahead`` of every request once one has finished
        for req in queue:
            n = chunk(req, req.num_uncomputed_tokens if left is None else left, chunked)
            if n == 0:
                continue
            held = plan.cache_kind(req)
            kv, hidden = self._open_kinds(req, held, switchable)
            # NOTE: a cached prefix's blocks are shared, so its K/V costs the pool only the
            # rest; hidden states are never shared (a hidden start computes from token 0).
            # Only a request that holds no cache has a hit.
            hit = plan.prefix_hit(req) if held is None else None
            shared = countOf(map(_tier, hit.blocks), Tier.DEVICE) if hit is not None else 0
            m = blocks_for(req.num_context_tokens + n, size) - shared
            half = blocks_for(req.num_computed_tokens + n, size, CacheKind.HIDDEN)
            steps = 1.0
            if kv and hidden:
                steps = mean if mean is not None else self.steps_ahead(req)
            items.append(Item(self.value(req, now), m, half, kv, hidden, n, steps))
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

    def steps_ahead(self, req: Request) -> float:
        """The decode steps a hidden cache chosen now is expected to be paid for: the mean
        output of the requests finished so far, or, before any has, the tokens ``req`` may
        still generate (an upper bound).

        NOTE: a hidden cache is kept until the request finishes or is evicted, so choosing
        it over KV costs rho * m per step for all of those steps, not for this one only."""
        mean = self._mean_output()
        if mean is not None:
            return mean
        return float(max(1, req.params.max_tokens - req.num_output_tokens))

    def _mean_output(self) -> float | None:
        """The mean output of the requests finished so far (None: none has)."""
        return self._finished_tokens / self._finished if self._finished else None

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

    def greedy(self, items: list[Item], memory: int) -> dict[int, CacheKind]:
        seats, tokens = self.plan.seats, self.tokens()
        return greedy_knapsack(
            items, memory, self.factor, seats=seats, tokens=tokens, chunked=self.chunked
        )


def _pending(queue: list[Request], now: float) -> float:
    return sum(map(methodcaller("pending_time", now), queue))


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
