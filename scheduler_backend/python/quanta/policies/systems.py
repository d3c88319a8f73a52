"""The built-in scheduling systems: which stages each fills, and its typed options.

Options are pydantic models (unknown keys and bad values are refused with the field's name);
a variant (``sj-mlfq-reactive``) is the same system with other defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.costmodel import PRESETS, CostModel, get_profile, load_profile
from quanta.policies.adaptive import AdaptivePacker, CacheMode, Fallback
from quanta.policies.coserve import ClassLanes, ClassOrder, OnlineOnlyLanes
from quanta.policies.coserve_packer import CoservePacker
from quanta.policies.coserve_placement import CoservePlacement
from quanta.policies.fair import VTCOrder, WSCOrder
from quanta.policies.fcfs import ArrivalOrder, ReactivePreemption
from quanta.policies.interactions import InteractionTracker
from quanta.policies.mlfq import (
    SRPT,
    FixedPriority,
    NaiveMLFQ,
    OracleAdmission,
    PriorityOrder,
    SkipJoinMLFQ,
)
from quanta.policies.mlfq_memory import ProactiveSwap, ReactiveSwap, Recompute
from quanta.policies.packers import InOrderPacker, PriorityPacker
from quanta.policies.stages import Stage
from quanta.policies.throttle import OITAdmission, RPMAdmission


class SystemOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class FCFSOptions(SystemOptions):
    allow_swap: bool = Field(True, description="evict to host when it has room (else recompute)")


class ProfileOptions(SystemOptions):
    """A system that predicts step times: its cost model (the simulator supplies its own)."""

    profile: str | CostModel | dict[str, Any] = Field(
        "a100-opt13b",
        description="cost-model preset, a profile JSON file (quanta profile), or its parsed JSON",
    )

    @field_validator("profile")
    @classmethod
    def _known_profile(
        cls, value: str | CostModel | dict[str, Any]
    ) -> str | CostModel | dict[str, Any]:
        """A preset name stays a name; a file is read once here, when the options are parsed
        (a served engine's own measured profile), so building the policy does no I/O."""
        if isinstance(value, str) and value not in PRESETS:
            return load_profile(value)
        return value

    def cost(self) -> CostModel:
        return get_profile(self.profile)  # type: ignore[arg-type]


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


class OnlineOnlyOptions(SystemOptions):
    allow_swap: bool = Field(True, description="evict to host when it has room (else recompute)")


class SkipJoinOptions(PriorityOptions):
    base_quantum: float | None = Field(None, gt=0, description="q1; default: min iteration time")
    quantum_ratio: float = Field(2.0, gt=1)
    num_queues: int = Field(16, ge=1)
    starve_limit: float = Field(3.0, gt=0, description="seconds without running before Q1")
    starve_check_every: int = Field(1000, ge=1, description="iterations between checks")


class VTCOptions(SystemOptions):
    input_weight: float = Field(1.0, ge=0, description="counter per prompt token at admission")
    output_weight: float = Field(2.0, ge=0, description="counter per generated token")
    weights: dict[str, float] = Field(default_factory=dict, description="tenant -> weight w")


class RPMOptions(SystemOptions):
    rpm_limit: int = Field(20, ge=1, description="requests per user per window")
    window_s: float = Field(60.0, gt=0)


class WSCOptions(SystemOptions):
    alpha: float = Field(1.0, ge=0, description="weight of input tokens")
    beta: float = Field(2.0, ge=0, description="weight of system-prompt tokens")
    gamma: float = Field(1.0, ge=0, description="weight of output tokens")
    priorities: dict[str, float] = Field(
        default_factory=dict, description="tenant -> priority factor E (default 1)"
    )
    prior_weight: float = Field(1000.0, gt=0, description="w_aj before any call finished")
    stage_weights: dict[str, list[float]] = Field(
        default_factory=dict, description="app -> w_aj per stage, used until history exists"
    )
    interaction_timeout_s: float = Field(
        30.0, gt=0, description="an interaction with no last call ends after this idle time"
    )


class FairOptions(WSCOptions):
    user_limit: int = Field(20, ge=1, description="requests per user per window, in overload")
    app_limit: int = Field(200, ge=1, description="requests per app per window, in overload")
    window_s: float = Field(60.0, gt=0)
    overload_watermark: float = Field(
        0.9, gt=0, le=1, description="device pool fraction in use that, with a queue, is overload"
    )


Builder = Callable[[SchedulerConfig, Any], dict[str, Stage]]


@dataclass(frozen=True)
class System:
    """One scheduling system: the stages it fills, built from its typed options."""

    name: str
    options: type[SystemOptions]
    build: Builder
    slots: frozenset[str]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    doc: str = ""


def _fcfs(config: SchedulerConfig, o: FCFSOptions) -> dict[str, Stage]:
    return {
        "ordering": ArrivalOrder(config),
        "packer": InOrderPacker(config),
        "placement": ReactivePreemption(allow_swap=o.allow_swap),
    }


def _placement(config: SchedulerConfig, o: PriorityOptions, cost: CostModel) -> Stage:
    if o.memory == "proactive":
        return ProactiveSwap(
            max_batch_size=config.max_num_seqs,
            cost=cost,
            reserve_window=o.reserve_window,
            min_reserve_blocks=o.min_reserve_blocks,
            max_reserve_fraction=o.max_reserve_fraction,
        )
    return Recompute() if o.memory == "recompute" else ReactiveSwap()


def _priority(order: Callable[[SchedulerConfig, Any, CostModel], PriorityOrder]) -> Builder:
    def build(config: SchedulerConfig, o: PriorityOptions) -> dict[str, Stage]:
        cost = o.cost()
        stages: dict[str, Stage] = {
            "ordering": order(config, o, cost),
            "packer": PriorityPacker(
                config,
                evict_to_start=o.evict_to_start,
                headroom=o.headroom,
                decode_first=o.decode_first,
            ),
            "placement": _placement(config, o, cost),
        }
        return stages

    return build


def _skip_join(kind: type[SkipJoinMLFQ]) -> Callable[..., PriorityOrder]:
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
        )

    return make


def _srpt(config: SchedulerConfig, o: PriorityOptions) -> dict[str, Stage]:
    return {"admission": OracleAdmission(), **_priority(_simple(SRPT))(config, o)}


def _simple(kind: type[PriorityOrder]) -> Callable[..., PriorityOrder]:
    return lambda config, o, cost: kind(config, cost, o.service)


_PRIORITY_SLOTS = frozenset({"ordering", "packer", "placement"})


def _wsc(config: SchedulerConfig, o: WSCOptions) -> dict[str, Stage]:
    tracker = InteractionTracker(o.interaction_timeout_s)
    order = WSCOrder(
        config,
        tracker,
        alpha=o.alpha,
        beta=o.beta,
        gamma=o.gamma,
        priorities=o.priorities,
        prior_weight=o.prior_weight,
        stage_weights=o.stage_weights,
    )
    return {"ordering": order, "observer": tracker}


def _fair(config: SchedulerConfig, o: FairOptions) -> dict[str, Stage]:
    stages = _wsc(config, o)
    tracker = stages["observer"]
    assert isinstance(tracker, InteractionTracker)
    stages["admission"] = OITAdmission(
        tracker,
        user_limit=o.user_limit,
        app_limit=o.app_limit,
        window_s=o.window_s,
        watermark=o.overload_watermark,
    )
    return stages


def _vtc(config: SchedulerConfig, o: VTCOptions) -> dict[str, Stage]:
    order = VTCOrder(
        config, input_weight=o.input_weight, output_weight=o.output_weight, weights=o.weights
    )
    return {"ordering": order}


def _apt(config: SchedulerConfig, o: AptOptions) -> dict[str, Stage]:
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
    return {"packer": packer, "placement": ReactivePreemption(allow_swap=o.allow_swap)}


def _conserve(config: SchedulerConfig, o: ConserveOptions) -> dict[str, Stage]:
    cost = o.cost()
    return {
        "lanes": ClassLanes(config, cost, tpot_slo_s=o.tpot_slo_s),
        "packer": CoservePacker(config, cost),
        "placement": CoservePlacement(
            cost,
            evict_mode=PreemptMode.SWAP if o.allow_swap else PreemptMode.RECOMPUTE,
            ttft_slo_s=o.ttft_slo_s,
            safepoints=o.safepoints,
            checkpoint=o.checkpoint,
            checkpoint_threshold=o.checkpoint_threshold,
            prefetch=o.prefetch,
            prefetch_blocks=o.prefetch_blocks,
        ),
    }


def _online_only(config: SchedulerConfig, o: OnlineOnlyOptions) -> dict[str, Stage]:
    mode = PreemptMode.SWAP if o.allow_swap else PreemptMode.RECOMPUTE
    return {
        "lanes": OnlineOnlyLanes(config),
        "packer": CoservePacker(config, None),
        "placement": CoservePlacement(None, evict_mode=mode),
    }


def _class_priority(config: SchedulerConfig, o: FCFSOptions) -> dict[str, Stage]:
    return {**_fcfs(config, o), "ordering": ClassOrder(config)}


def _rpm(config: SchedulerConfig, o: RPMOptions) -> dict[str, Stage]:
    return {"admission": RPMAdmission(limit=o.rpm_limit, window_s=o.window_s)}


def builtin() -> list[System]:
    sj = _priority(_skip_join(SkipJoinMLFQ))
    return [
        System("fcfs", FCFSOptions, _fcfs, _PRIORITY_SLOTS, doc="vLLM's FCFS"),
        System("sj-mlfq", SkipJoinOptions, sj, _PRIORITY_SLOTS, doc="FastServe"),
        System(
            "sj-mlfq-reactive",
            SkipJoinOptions,
            sj,
            _PRIORITY_SLOTS,
            {"memory": "reactive"},
            doc="FastServe with reactive swapping (Fig. 15)",
        ),
        System(
            "sj-mlfq-recompute",
            SkipJoinOptions,
            sj,
            _PRIORITY_SLOTS,
            {"memory": "recompute"},
            doc="FastServe with recompute (Fig. 15)",
        ),
        System(
            "mlfq",
            SkipJoinOptions,
            _priority(_skip_join(NaiveMLFQ)),
            _PRIORITY_SLOTS,
            doc="naive MLFQ (Fig. 14)",
        ),
        System(
            "fixed-priority",
            PriorityOptions,
            _priority(_simple(FixedPriority)),
            _PRIORITY_SLOTS,
            doc="shorter input first (Fig. 14)",
        ),
        System(
            "srpt",
            PriorityOptions,
            _srpt,
            _PRIORITY_SLOTS | {"admission"},
            doc="shortest remaining time, oracle (simulator only)",
        ),
        System(
            "fair",
            FairOptions,
            _fair,
            frozenset({"admission", "ordering", "observer"}),
            doc="FairServe: WSC ordering and OIT throttling",
        ),
        System(
            "wsc",
            WSCOptions,
            _wsc,
            frozenset({"ordering", "observer"}),
            doc="FairServe without throttling (the paper's FS (W))",
        ),
        System("vtc", VTCOptions, _vtc, frozenset({"ordering"}), doc="virtual token counter"),
        System("rpm", RPMOptions, _rpm, frozenset({"admission"}), doc="requests per minute"),
        System(
            "apt",
            AptOptions,
            _apt,
            frozenset({"packer", "placement"}),
            doc="Apt-Serve: adaptive scheduling with a hybrid KV / hidden cache",
        ),
        System(
            "conserve",
            ConserveOptions,
            _conserve,
            frozenset({"lanes", "packer", "placement"}),
            doc="ConServe: online under an SLO budget, preemptible offline work",
        ),
        System(
            "online-only",
            OnlineOnlyOptions,
            _online_only,
            frozenset({"lanes", "packer", "placement"}),
            doc="offline work held back while online work is in flight",
        ),
        System(
            "priority",
            FCFSOptions,
            _class_priority,
            _PRIORITY_SLOTS,
            doc="online first in the queue, no preemption for newcomers (vLLM's priority)",
        ),
    ]
