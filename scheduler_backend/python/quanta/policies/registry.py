"""Scheduling systems by name, their typed options, and stacks of them.

A *system* (``fcfs``, ``sj-mlfq``, ...) contributes stages to the pipeline of
``quanta.policies.stages``. ``--policy`` names one system or a ``+``-joined stack
(``fair+conserve``); every slot a stack leaves empty takes FCFS's stage, and two systems that
fill the same slot are refused (observers add up instead). Options are one flat
``KEY=VALUE`` dict, as ``--policy-option`` and ``policy_options=`` give them: each key goes
to every system of the stack whose options model has that field, and is validated there by
pydantic once, when the spec is parsed, so a typo or a bad value is a clear ``ValueError``
before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import ValidationError

from quanta.core.config import SchedulerConfig
from quanta.policies.fcfs import ArrivalOrder, ReactivePreemption
from quanta.policies.packers import InOrderPacker
from quanta.policies.stages import (
    STAGES,
    Admission,
    Lanes,
    Ordering,
    Packer,
    Placement,
    Stage,
    StagedPolicy,
)
from quanta.policies.systems import PriorityOptions, System, SystemOptions, builtin

S = TypeVar("S", bound=Stage)

_SYSTEMS: dict[str, System] = {}


def register_system(system: System) -> None:
    """Make a system available to ``--policy`` (names are unique; slots must be known)."""
    unknown = set(system.slots) - set(STAGES)
    if unknown:
        raise ValueError(f"system {system.name!r} fills unknown stages {sorted(unknown)}")
    if system.name in _SYSTEMS or "+" in system.name:
        raise ValueError(f"system name {system.name!r} is taken or contains '+'")
    _SYSTEMS[system.name] = system


def available_policies() -> list[str]:
    return sorted(_SYSTEMS)


@dataclass(frozen=True)
class Part:
    """One system of a stack, its validated options and the keys the caller chose."""

    system: System
    options: SystemOptions
    chosen: frozenset[str]


@dataclass(frozen=True)
class PolicySpec:
    """A parsed ``--policy`` value with each system's validated options."""

    name: str
    parts: tuple[Part, ...]

    def accepts(self, key: str) -> bool:
        """Some system of the stack has an option called ``key``."""
        return any(key in p.system.options.model_fields for p in self.parts)

    def with_defaults(self, **values: Any) -> PolicySpec:
        """Set options the caller did not choose (the simulator's cost profile, say)."""
        parts = []
        for p in self.parts:
            fields = p.system.options.model_fields
            mine = {k: v for k, v in values.items() if k in fields and k not in p.chosen}
            if mine:
                merged = {k: getattr(p.options, k) for k in p.options.model_fields_set} | mine
                p = replace(p, options=_validate(self.name, p.system, merged))
            parts.append(p)
        return replace(self, parts=tuple(parts))

    def options(self) -> dict[str, Any]:
        """The options the caller set, merged over the stack (for reports)."""
        out: dict[str, Any] = {}
        for p in self.parts:
            out |= {k: getattr(p.options, k) for k in p.chosen}
        return out

    def build(self, config: SchedulerConfig) -> StagedPolicy:
        slots: dict[str, Stage] = {}
        observers: list[Stage] = []
        for p in self.parts:
            stages = p.system.build(config, p.options)
            for slot, stage in stages.items():
                if slot == "observer":
                    observers.append(stage)  # NOTE: any stage may observe
                else:
                    slots[slot] = stage
        costs = [p.options.cost() for p in self.parts if isinstance(p.options, PriorityOptions)]
        return StagedPolicy(
            self.name,
            config,
            admission=_slot(slots, "admission", Admission, Admission()),
            ordering=_slot(
                slots, "ordering", Ordering, ArrivalOrder(config, next(iter(costs), None))
            ),
            lanes=_slot(slots, "lanes", Lanes, Lanes()),
            packer=_slot(slots, "packer", Packer, InOrderPacker(config)),
            placement=_slot(slots, "placement", Placement, ReactivePreemption()),
            observers=observers,
        )


def _slot(slots: Mapping[str, Stage], name: str, kind: type[S], default: S) -> S:
    """The stage a system put in slot ``name`` (checked to be a ``kind``), or FCFS's."""
    stage = slots.get(name, default)
    if not isinstance(stage, kind):
        raise TypeError(f"the {name} stage must be a {kind.__name__}, got {type(stage).__name__}")
    return stage


def parse_policy(name: str, options: Mapping[str, Any] | None = None) -> PolicySpec:
    """Parse ``name`` (a system or a ``+`` stack) and distribute and validate ``options``."""
    names = [n.strip() for n in name.split("+")]
    chosen: list[System] = []
    for n in names:
        system = _SYSTEMS.get(n)
        if system is None:
            known = ", ".join(available_policies())
            raise ValueError(f"unknown policy {n!r}; available: {known} (stack them with '+')")
        chosen.append(system)
    _refuse_clashes(name, chosen)
    options = dict(options or {})
    known_keys = {k for s in chosen for k in s.options.model_fields}
    unknown = sorted(set(options) - known_keys)
    if unknown:
        raise ValueError(
            f"bad options for policy {name!r}: unknown {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known_keys)) or 'none'}"
        )
    parts = []
    for s in chosen:
        mine = {k: v for k, v in options.items() if k in s.options.model_fields}
        defaults = {k: v for k, v in s.defaults.items() if k not in mine}
        parts.append(Part(s, _validate(name, s, {**defaults, **mine}), frozenset(mine)))
    return PolicySpec("+".join(names), tuple(parts))


def make_policy(name: str, config: SchedulerConfig, **options: Any) -> StagedPolicy:
    """Build a policy; an unknown name, a clashing stack or a bad option is a ``ValueError``."""
    return parse_policy(name, options).build(config)


def _validate(name: str, system: System, values: Mapping[str, Any]) -> SystemOptions:
    try:
        return system.options.model_validate(dict(values))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"bad options for policy {name!r}: {problems}") from None


def _refuse_clashes(name: str, chosen: list[System]) -> None:
    owner: dict[str, str] = {}
    for s in chosen:
        for slot in s.slots - {"observer"}:
            if slot in owner:
                raise ValueError(
                    f"policy {name!r}: {owner[slot]} and {s.name} both supply the {slot} stage; "
                    "a stack takes each stage from one system"
                )
            owner[slot] = s.name


for _system in builtin():
    register_system(_system)
