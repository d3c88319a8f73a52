"""How a scheduling system is declared: its typed options, and the stages its builder returns.

Each policy module declares its systems in a ``SYSTEMS`` list beside the stages they are
made of (``fcfs.py``, ``fastserve.py``, ``fair.py``, ...); the registry collects them. A
builder returns a ``Stages``: the slots it fills are the ones it sets, so they are written
once, where the stages are built. Options are pydantic models (unknown keys and bad values are
refused with the field's name); a variant (``sj-mlfq-reactive``) is the same system with other
defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.core.config import SchedulerConfig
from quanta.costmodel import PROFILES, CostModel, get_profile, load_profile
from quanta.policies.fair_state import check_state_url
from quanta.policies.stages import Admission, Lanes, Ordering, Packer, Placement, Reorder, Stage


class SystemOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def cost(self) -> CostModel | None:
        """The cost model these options define (None: the system predicts no step times).
        A stack's default ordering takes the first one, to state next turns in seconds."""
        return None


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
        if isinstance(value, str) and value not in PROFILES:
            return load_profile(value)
        return value

    def cost(self) -> CostModel:
        return get_profile(self.profile)  # type: ignore[arg-type]


class SharedStateOptions(SystemOptions):
    """A system whose fairness state (counters, windows, interactions) may live elsewhere
    (``fair_state.py``)."""

    state_url: str | None = Field(
        None,
        description="memory://NAME (shared in this process) or redis://HOST:PORT/DB (shared "
        "by every replica); none: this policy's own",
    )

    @field_validator("state_url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        return check_state_url(url)


@dataclass(frozen=True)
class Stages:
    """What a builder returns: the slots its system fills (None: left to another system of
    the stack, else FCFS's stage) and any stages that only observe (observers add up)."""

    admission: Admission | None = None
    ordering: Ordering | None = None
    lanes: Lanes | None = None
    packer: Packer | None = None
    placement: Placement | None = None
    observers: tuple[Stage, ...] = ()
    reorder: Reorder | None = None

    def filled(self) -> dict[str, Stage]:
        """The slots set here, by name (observers aside)."""
        slots: dict[str, Stage | None] = {
            "admission": self.admission,
            "ordering": self.ordering,
            "lanes": self.lanes,
            "packer": self.packer,
            "placement": self.placement,
            "reorder": self.reorder,
        }
        return {name: stage for name, stage in slots.items() if stage is not None}

    def slots(self) -> frozenset[str]:
        return frozenset(self.filled())


Builder = Callable[[SchedulerConfig, Any], Stages]


@dataclass(frozen=True)
class System:
    """One scheduling system: the stages it fills, built from its typed options."""

    name: str
    options: type[SystemOptions]
    build: Builder
    defaults: Mapping[str, Any] = field(default_factory=dict)
    doc: str = ""

    @cached_property
    def slots(self) -> frozenset[str]:
        """The slots its builder fills, learned once from building it with its default options
        (a stack's clashes are refused before anything is built for real). NOTE: a system
        fills the same slots whatever its options; ``PolicySpec.build`` holds it to that."""
        options = self.options.model_validate(dict(self.defaults))
        return self.build(SchedulerConfig(), options).slots()
