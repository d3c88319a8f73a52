"""ConServe: online and offline work in one batch, the offline part always ready to yield.

Online requests (``priority_class="online"``: streaming, latency-critical) are packed first,
within a per-step token budget that the cost model says keeps their TPOT within its SLO; the
offline lane (batch work, measured by throughput) fills what is left, as far as the predicted
step time stays within that SLO. A step with no online work ignores the budget ("offline
batching mode"). The lanes stage here sets both limits on the lanes; the packer
(``coserve_packer``) fills them, and offline work yields to online work by the placement
(``coserve_placement``): evicted checkpointed-first, stopped mid-step at a layer safepoint,
checkpointed incrementally, prefetched back in online idle time.

The two baselines of the paper's experiments share the lanes:

- ``OnlineOnlyLanes``: offline requests are held back (not refused) while any online request
  is in flight: an engine that serves offline work only in online idle time;
- ``ClassOrder`` with FCFS's packer: online first in the queue, running offline work is never
  preempted for a newcomer (vLLM's priority scheduling, the paper's vLLM++).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pydantic import Field

from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.calibration import CalibratedCost
from quanta.policies.common import OFFLINE, ONLINE, ArrivalQueues, by_class, largest
from quanta.policies.coserve_packer import CoservePacker
from quanta.policies.coserve_placement import CoservePlacement
from quanta.policies.fcfs import FCFSOptions, fcfs_stages
from quanta.policies.stages import Lane, Lanes, Ordering, Ranking, Turns
from quanta.policies.systems import ProfileOptions, Stages, System, SystemOptions


def _tpot(ms: float | None, default: float) -> float:
    """A request's own TPOT SLO (``ms``, None when it has none) in seconds, else
    ``default``."""
    return default if ms is None else ms / 1000


def slo_token_budget(
    cost: CostModel,
    decodes: Sequence[int],
    tpot_s: float,
    max_tokens: int,
    min_chunk: int = 1,
    guess: int | None = None,
) -> int:
    """Tokens one step may hold so that its predicted time stays within ``tpot_s``: the
    ``decodes`` (contexts of the requests that decode in it) plus the largest prefill chunk
    that fits, found by bisection on the cost model (step time grows with the chunk).

    At least the decodes plus ``min_chunk`` (an online prompt always advances), at most
    ``max_tokens``. A cost model too slow for the SLO gets that floor: the SLO is then out of
    reach whatever the scheduler does, and online work still moves. ``guess``: a budget to
    try first (``largest``); it changes how fast the answer is found, not the answer."""
    base = [(1, c) for c in decodes]
    floor = min(max_tokens, len(decodes) + min_chunk)
    if cost.step_time(base) > tpot_s:
        return floor
    hi = max(0, max_tokens - len(decodes))
    first = None if guess is None else guess - len(decodes)
    chunk = largest(hi, lambda n: cost.step_time([*base, (n, 0)]) <= tpot_s, first)
    return max(floor, len(decodes) + chunk)


class ClassOrder(Ordering):
    """Online before offline; within a class running, swapped, then waiting, each by arrival
    (vLLM's priority scheduling: the waiting queue sorted by priority)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queues = ArrivalQueues()

    def rank(self, view: SchedulerView) -> Ranking:
        online, offline = by_class(self._queues.order(view))
        order = online + offline
        return Ranking(order, Turns(order, self.config.max_num_seqs))

    def on_finish(self, request: Request) -> None:
        self._queues.forget(request)


class ClassLanes(Lanes):
    """The ranking split by class, order kept: the online lane, then the offline lane.

    With a cost model and online work live, both lanes carry the step's SLO token budget
    (``slo_token_budget`` for the online decodes, at the strictest TPOT SLO among the online
    requests), and the offline lane that SLO as its step-time limit; otherwise neither has a
    limit of its own.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost: CostModel | None = None,
        *,
        tpot_slo_s: float = 0.11,
    ) -> None:
        self.config = config
        self.cost = cost
        self.tpot_slo_s = tpot_slo_s
        self._budget: int | None = None  # the latest step's, which the next mostly repeats

    def split(self, ranking: Ranking, view: SchedulerView) -> list[Lane]:
        online, offline = by_class(ranking.order)
        offline = self.hold(online, offline)
        if not online or self.cost is None:
            return [Lane(ONLINE, online), Lane(OFFLINE, offline)]
        # NOTE: each SLO once: most requests carry none of their own
        tpot = min(_tpot(ms, self.tpot_slo_s) for ms in {r.metadata.tpot_slo_ms for r in online})
        # NOTE: before packing, the residents are exactly the running requests.
        decodes = [
            r.num_computed_tokens
            for r in online
            if r.status is RequestStatus.RUNNING and r.decoding
        ]
        budget = self._budget = slo_token_budget(
            self.cost,
            decodes,
            tpot,
            self.config.max_num_batched_tokens,
            min_chunk=view.block_size,
            guess=self._budget,
        )
        return [
            Lane(ONLINE, online, max_tokens=budget),
            Lane(OFFLINE, offline, max_tokens=budget, max_step_time=tpot),
        ]

    def hold(self, online: list[Request], offline: list[Request]) -> list[Request]:
        """The offline requests that may run this step."""
        return offline


class OnlineOnlyLanes(ClassLanes):
    """No offline work while any online request is in flight (held back, not refused)."""

    def hold(self, online: list[Request], offline: list[Request]) -> list[Request]:
        return [] if online else offline


# -- the systems ---------------------------------------------------------------------------
class ConserveOptions(ProfileOptions):
    """ConServe: the SLOs the online budget keeps, and the ways offline work yields."""

    ttft_slo_s: float = Field(1.5, gt=0, description="default online TTFT SLO (P99, seconds)")
    tpot_slo_s: float = Field(0.11, gt=0, description="default online TPOT SLO (seconds)")
    safepoints: bool = Field(
        True, description="stop offline-only steps at layer safepoints for online arrivals"
    )
    checkpoint: bool = Field(True, description="copy offline KV to host incrementally")
    checkpoint_threshold: float = Field(
        0.5, gt=0, le=1, description="free device fraction below which checkpointing starts"
    )
    prefetch: bool = Field(True, description="swap preempted offline work back in, ahead")
    prefetch_blocks: int | None = Field(
        None, ge=1, description="blocks prefetched per step (default: an eighth of the pool)"
    )
    allow_swap: bool = Field(
        True, description="offline work without a full checkpoint yields by swap (else recompute)"
    )
    calibrate: bool = Field(
        True,
        description="scale the profile's step times by what steps really take (P90 of the "
        "last 64), so the TPOT budget holds on a machine slower than the profile's",
    )


class OnlineOnlyOptions(SystemOptions):
    allow_swap: bool = Field(True, description="evict to host when it has room (else recompute)")


def _mode(allow_swap: bool) -> PreemptMode:
    return PreemptMode.SWAP if allow_swap else PreemptMode.RECOMPUTE


def _conserve(config: SchedulerConfig, o: ConserveOptions) -> Stages:
    cost: CostModel = o.cost()
    observers: tuple[CalibratedCost, ...] = ()
    if o.calibrate:
        calibrated = CalibratedCost(cost)
        cost, observers = calibrated, (calibrated,)  # type: ignore[assignment]
    return Stages(
        observers=observers,
        lanes=ClassLanes(config, cost, tpot_slo_s=o.tpot_slo_s),
        packer=CoservePacker(config, cost),
        placement=CoservePlacement(
            cost,
            evict_mode=_mode(o.allow_swap),
            ttft_slo_s=o.ttft_slo_s,
            safepoints=o.safepoints,
            checkpoint=o.checkpoint,
            checkpoint_threshold=o.checkpoint_threshold,
            prefetch=o.prefetch,
            prefetch_blocks=o.prefetch_blocks,
        ),
    )


def _online_only(config: SchedulerConfig, o: OnlineOnlyOptions) -> Stages:
    return Stages(
        lanes=OnlineOnlyLanes(config),
        packer=CoservePacker(config, None),
        placement=CoservePlacement(None, evict_mode=_mode(o.allow_swap)),
    )


def _class_priority(config: SchedulerConfig, o: FCFSOptions) -> Stages:
    return replace(fcfs_stages(config, o), ordering=ClassOrder(config))


SYSTEMS = [
    System(
        "conserve",
        ConserveOptions,
        _conserve,
        doc="ConServe: online under an SLO budget, preemptible offline work",
    ),
    System(
        "online-only",
        OnlineOnlyOptions,
        _online_only,
        doc="offline work held back while online work is in flight",
    ),
    System(
        "priority",
        FCFSOptions,
        _class_priority,
        doc="online first in the queue, no preemption for newcomers (vLLM's priority)",
    ),
]
