"""``skip-fit``: a step takes the top calls of the ranking that fit, skipping one that does not.

Why a system of its own: the default packer (vLLM's FCFS shape, and the admission loop of
FairServe's Algorithm 1 and VTC's: take the next request while one more can be added) stops
at the first call that does not fit. One large call at the head of the ranking then holds
back every smaller call behind it until the pool drains enough for it, however high those
rank. Under a flood that wait falls on the users a fair order puts first (docs/results/fairserve.md,
"Packing past a call that does not fit"). Stacked under an ordering that fills no packer
(``fair+skip-fit``, ``vtc+skip-fit``), steps are packed by FastServe's priority packer without
``evict_to_start``: residents continue in rank order as before, and a call that is not
resident starts only in free blocks, so nobody is evicted for a newcomer. A large call can
wait longer while smaller ones pass it; the ordering's counters still rank it first for the
blocks that come free.
"""

from __future__ import annotations

from quanta.core.config import SchedulerConfig
from quanta.policies.packers import PriorityPacker
from quanta.policies.systems import Stages, System, SystemOptions


class SkipFitOptions(SystemOptions):
    """No options: the ordering it is stacked under decides the ranking it packs."""


def _skip_fit(config: SchedulerConfig, o: SkipFitOptions) -> Stages:
    return Stages(packer=PriorityPacker(config))


SYSTEMS = [
    System(
        "skip-fit",
        SkipFitOptions,
        _skip_fit,
        doc="pack the ranking's top calls that fit, skipping one that does not; stacks "
        "under an ordering (fair+skip-fit)",
    )
]
