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

from quanta.core.config import SchedulerConfig
from quanta.core.request import Request, RequestStatus
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.common import OFFLINE, ONLINE, arrival_key, is_online, largest
from quanta.policies.stages import Lane, Lanes, Ordering, Ranking


def tpot_slo(req: Request, default: float) -> float:
    """The request's own TPOT SLO in seconds, else ``default``."""
    ms = req.metadata.tpot_slo_ms
    return default if ms is None else ms / 1000


def slo_token_budget(
    cost: CostModel,
    decodes: Sequence[int],
    tpot_s: float,
    max_tokens: int,
    min_chunk: int = 1,
) -> int:
    """Tokens one step may hold so that its predicted time stays within ``tpot_s``: the
    ``decodes`` (contexts of the requests that decode in it) plus the largest prefill chunk
    that fits, found by bisection on the cost model (step time grows with the chunk).

    At least the decodes plus ``min_chunk`` (an online prompt always advances), at most
    ``max_tokens``. A cost model too slow for the SLO gets that floor: the SLO is then out of
    reach whatever the scheduler does, and online work still moves."""
    base = [(1, c) for c in decodes]
    floor = min(max_tokens, len(decodes) + min_chunk)
    if cost.step_time(base) > tpot_s:
        return floor
    hi = max(0, max_tokens - len(decodes))
    chunk = largest(hi, lambda n: cost.step_time([*base, (n, 0)]) <= tpot_s)
    return max(floor, len(decodes) + chunk)


class ClassOrder(Ordering):
    """Online before offline; within a class running, swapped, then waiting, each by arrival
    (vLLM's priority scheduling: the waiting queue sorted by priority)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def rank(self, view: SchedulerView) -> Ranking:
        order = sorted(view.candidates, key=lambda r: (not is_online(r), *arrival_key(r)))
        seats = self.config.max_num_seqs
        return Ranking(order, {r.request_id: float(i // seats) for i, r in enumerate(order)})


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

    def split(self, ranking: Ranking, view: SchedulerView) -> list[Lane]:
        online = [r for r in ranking.order if is_online(r)]
        offline = self.hold(online, [r for r in ranking.order if not is_online(r)])
        if not online or self.cost is None:
            return [Lane(ONLINE, online), Lane(OFFLINE, offline)]
        tpot = min(tpot_slo(r, self.tpot_slo_s) for r in online)
        # NOTE: before packing, the residents are exactly the running requests.
        decodes = [
            r.num_computed_tokens
            for r in online
            if r.status is RequestStatus.RUNNING and r.num_uncomputed_tokens == 1
        ]
        budget = slo_token_budget(
            self.cost,
            decodes,
            tpot,
            self.config.max_num_batched_tokens,
            min_chunk=view.block_size,
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
