"""FCFS as vLLM does it, as stages: arrival order and reactive preemption.

With ``InOrderPacker``: running requests (oldest first) continue — a decode token or the next
prefill chunk — within the token budget; when the device pool cannot grow one, the newest
running request is preempted (swapped to host when the host tier has room, else dropped for
recompute). Then swapped requests come back oldest first, then waiting ones are admitted in
arrival order; the first that does not fit blocks the queue (strict FCFS).
"""

from __future__ import annotations

from pydantic import Field

from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.common import ArrivalQueues
from quanta.policies.packers import InOrderPacker
from quanta.policies.stages import Ordering, Placement, Ranking, Turns
from quanta.policies.systems import Stages, System, SystemOptions


class ArrivalOrder(Ordering):
    """Running, then swapped, then waiting; each by arrival (vLLM's queues)."""

    def __init__(self, config: SchedulerConfig, cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost
        self._queues = ArrivalQueues()
        # NOTE: a turn's length, worked out once (the cost model is frozen)
        self._quantum = cost.min_iteration_time if cost is not None else 1.0

    def rank(self, view: SchedulerView) -> Ranking:
        order = self._queues.order(view)
        return Ranking(
            order, Turns(order, self.config.max_num_seqs, self._quantum), by_arrival=True
        )

    def on_finish(self, request: Request) -> None:
        self._queues.forget(request)


class ReactivePreemption(Placement):
    """Evict only when the batch needs blocks: to host when it has room, else recompute."""

    def __init__(self, *, allow_swap: bool = True) -> None:
        self.evict_mode = PreemptMode.SWAP if allow_swap else PreemptMode.RECOMPUTE


class FCFSOptions(SystemOptions):
    allow_swap: bool = Field(True, description="evict to host when it has room (else recompute)")


def fcfs_stages(config: SchedulerConfig, o: FCFSOptions) -> Stages:
    return Stages(
        ordering=ArrivalOrder(config),
        packer=InOrderPacker(config),
        placement=ReactivePreemption(allow_swap=o.allow_swap),
    )


SYSTEMS = [System("fcfs", FCFSOptions, fcfs_stages, doc="vLLM's FCFS")]
