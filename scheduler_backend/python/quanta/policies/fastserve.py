"""FastServe as systems: skip-join MLFQ and the baselines of its Fig. 14-15, each an ordering
of ``mlfq`` with ``PriorityPacker`` and a KV placement of ``mlfq_memory``.

Every system here fills the ordering, packer and placement slots (``srpt`` admission too);
the variants differ in the ordering, or only in their default ``memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field

from quanta.core.config import SchedulerConfig
from quanta.costmodel import CostModel
from quanta.policies.mlfq import (
    SRPT,
    FixedPriority,
    NaiveMLFQ,
    OracleAdmission,
    PriorityOrder,
    SkipJoinMLFQ,
)
from quanta.policies.mlfq_memory import ProactiveSwap, ReactiveSwap, Recompute
from quanta.policies.packers import PriorityPacker
from quanta.policies.stages import Placement
from quanta.policies.systems import Builder, ProfileOptions, Stages, System


class PriorityOptions(ProfileOptions):
    """The FastServe family: a cost model, the packer and the KV placement."""

    service: Literal["own", "step"] = Field(
        "own", description="attained service: the job's own share of a step, or the whole step"
    )
    memory: Literal["proactive", "reactive", "recompute"] = "proactive"
    reserve_window: float = Field(1.0, ge=0, description="seconds of arrivals the reserve holds")
    min_reserve_blocks: int | None = Field(None, ge=0, description="default: MaxBatchSize")
    max_reserve_fraction: float = Field(0.25, ge=0, le=1)
    evict_to_start: bool = Field(
        False, description="a job that is not resident may evict residents (the paper's reading)"
    )
    headroom: float = Field(
        0.05, ge=0, lt=1, description="pool fraction a starting job must leave free for growth"
    )
    decode_first: bool = Field(
        False, description="spend the step's tokens on chosen decodes before chosen prefills"
    )


class SkipJoinOptions(PriorityOptions):
    base_quantum: float | None = Field(None, gt=0, description="q1; default: min iteration time")
    quantum_ratio: float = Field(2.0, gt=1)
    num_queues: int = Field(16, ge=1)
    starve_limit: float = Field(3.0, gt=0, description="seconds without running before Q1")
    starve_check_every: int = Field(1000, ge=1, description="iterations between checks")
    patience_s: float = Field(
        0.0,
        ge=0,
        description="a new job takes a running job's seat only after waiting this long "
        "(0: at once, FastServe's rule)",
    )
    overload_after_s: float = Field(
        0.0,
        ge=0,
        description="first come, first served until a job has waited this long without a "
        "seat, then skip-join MLFQ until the queue drains (0: the adaptive threshold decides)",
    )
    overload_after_runs: float = Field(
        0.0,
        ge=0,
        description="the load signal's adaptive threshold: first come, first served until a "
        "job has waited this many times the mean run (first seat to finish) of the latest "
        "finished jobs (sj-mlfq's default: 2; overload_after_s, when set, wins; both 0: "
        "always MLFQ, FastServe's rule)",
    )


OrderMaker = Callable[[SchedulerConfig, Any, CostModel], PriorityOrder]


def _placement(config: SchedulerConfig, o: PriorityOptions, cost: CostModel) -> Placement:
    if o.memory == "proactive":
        return ProactiveSwap(
            max_batch_size=config.max_num_seqs,
            cost=cost,
            reserve_window=o.reserve_window,
            min_reserve_blocks=o.min_reserve_blocks,
            max_reserve_fraction=o.max_reserve_fraction,
        )
    return Recompute() if o.memory == "recompute" else ReactiveSwap()


def _priority(order: OrderMaker) -> Builder:
    """A builder of the family's stages around the ordering ``order`` makes."""

    def build(config: SchedulerConfig, o: PriorityOptions) -> Stages:
        cost = o.cost()
        return Stages(
            ordering=order(config, o, cost),
            packer=PriorityPacker(
                config,
                evict_to_start=o.evict_to_start,
                headroom=o.headroom,
                decode_first=o.decode_first,
            ),
            placement=_placement(config, o, cost),
        )

    return build


def _skip_join(kind: type[SkipJoinMLFQ]) -> OrderMaker:
    def make(config: SchedulerConfig, o: SkipJoinOptions, cost: CostModel) -> PriorityOrder:
        return kind(
            config,
            cost,
            service=o.service,
            base_quantum=o.base_quantum,
            quantum_ratio=o.quantum_ratio,
            num_queues=o.num_queues,
            starve_limit=o.starve_limit,
            starve_check_every=o.starve_check_every,
            patience_s=o.patience_s,
            overload_after_s=o.overload_after_s,
            overload_after_runs=o.overload_after_runs,
        )

    return make


def _simple(kind: type[PriorityOrder]) -> OrderMaker:
    return lambda config, o, cost: kind(config, cost, o.service)


def _srpt(config: SchedulerConfig, o: PriorityOptions) -> Stages:
    return replace(_priority(_simple(SRPT))(config, o), admission=OracleAdmission())


_sj = _priority(_skip_join(SkipJoinMLFQ))

# FastServe's systems start with the adaptive load signal: below capacity they run first
# come, first served, so switching to them loses nothing there (docs/results/fastserve.md). Naive
# MLFQ stays the paper's baseline as it is.
OVERLOAD_AFTER_RUNS = 2.0
_LOAD_SIGNAL = {"overload_after_runs": OVERLOAD_AFTER_RUNS}
# The options that give FastServe's own rule back: skip-join MLFQ at every load.
FASTSERVE_RULE: dict[str, Any] = {"overload_after_runs": 0.0}

SYSTEMS = [
    System("sj-mlfq", SkipJoinOptions, _sj, _LOAD_SIGNAL, doc="FastServe"),
    System(
        "sj-mlfq-reactive",
        SkipJoinOptions,
        _sj,
        {"memory": "reactive", **_LOAD_SIGNAL},
        doc="FastServe with reactive swapping (Fig. 15)",
    ),
    System(
        "sj-mlfq-recompute",
        SkipJoinOptions,
        _sj,
        {"memory": "recompute", **_LOAD_SIGNAL},
        doc="FastServe with recompute (Fig. 15)",
    ),
    System("mlfq", SkipJoinOptions, _priority(_skip_join(NaiveMLFQ)), doc="naive MLFQ (Fig. 14)"),
    System(
        "fixed-priority",
        PriorityOptions,
        _priority(_simple(FixedPriority)),
        doc="shorter input first (Fig. 14)",
    ),
    System("srpt", PriorityOptions, _srpt, doc="shortest remaining time, oracle (simulator only)"),
]
