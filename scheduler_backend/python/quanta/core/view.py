"""The read-only snapshot a policy decides from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from quanta.core.plan import PoolView, StepPlan
from quanta.core.request import Request


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """Read-only snapshot handed to a policy. NOTE: policies must not mutate the requests.

    Memory is seen through ``pool`` (counts only); a policy builds its decision on a
    ``StepPlan`` from ``plan()``, the same ledger the applier checks it with.
    """

    now: float
    waiting: Sequence[Request]
    running: Sequence[Request]
    swapped: Sequence[Request]
    pool: PoolView = field(repr=False)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def free_device_blocks(self) -> int:
        return self.pool.free_device

    @property
    def free_host_blocks(self) -> int:
        return self.pool.free_host

    @property
    def total_device_blocks(self) -> int:
        return self.pool.total_device

    def plan(self, budget: int | None = None, seats: int | None = None) -> StepPlan:
        """A fresh ledger for this step's decision."""
        return StepPlan(self.pool, budget, seats)

    @property
    def candidates(self) -> list[Request]:
        """Every live request a policy may rank: running, swapped, then waiting."""
        return [*self.running, *self.swapped, *self.waiting]
