"""Scheduling systems by name, their typed options, and stacks of them.

A *system* (``fcfs``, ``sj-mlfq``, ...) contributes stages to the pipeline of
``quanta.policies.stages``; each policy module declares its own in a ``SYSTEMS`` list, which
this module collects (tests and plug-ins add more with ``register_system``). ``--policy``
names one system or a ``+``-joined stack (``fair+conserve``); every slot a stack leaves
empty takes FCFS's stage, and two systems that fill the same slot are refused (observers add
up instead). Options are one flat
``KEY=VALUE`` dict, as ``--policy-option`` and ``policy_options=`` give them: each key goes
to every system of the stack whose options model has that field, and is validated there by
pydantic once, when the spec is parsed, so a typo or a bad value is a clear ``ValueError``
before anything runs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from quanta.core.config import SchedulerConfig
from quanta.policies.fcfs import ArrivalOrder, ReactivePreemption
from quanta.policies.packers import InOrderPacker
from quanta.policies.stages import Admission, Lanes, Reorder, Stage, StagedPolicy
from quanta.policies.systems import Stages, System, SystemOptions

S = TypeVar("S", bound=Stage)
T = TypeVar("T")

_SYSTEMS: dict[str, System] = {}


def register_system(system: System) -> None:
    """Make a system available to ``--policy`` (names are unique and contain no '+')."""
    if system.name in _SYSTEMS or "+" in system.name:
        raise ValueError(f"system name {system.name!r} is taken or contains '+'")
    _SYSTEMS[system.name] = system


def builtin() -> list[System]:
    """The systems the modules of ``quanta.policies`` declare in their ``SYSTEMS`` lists.

    They are found by scanning the package, so a further system is a module beside
    ``fcfs.py`` (or an entry in one); nothing here changes."""
    found: list[System] = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name == "registry" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        found.extend(getattr(module, "SYSTEMS", ()))
    return found


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
        """Build every system's stages and stack them; FCFS's fill the slots none takes."""
        stack = Stages()
        for p in self.parts:
            stages = p.system.build(config, p.options)
            if stages.slots() != p.system.slots:
                raise ValueError(
                    f"system {p.system.name!r} fills {sorted(stages.slots())} with these "
                    f"options but {sorted(p.system.slots)} by default; a system's slots "
                    "must not depend on its options"
                )
            stack = _stack(stack, stages)
        costs = [p.options.cost() for p in self.parts]
        cost = next((c for c in costs if c is not None), None)
        return StagedPolicy(
            self.name,
            config,
            admission=_or(stack.admission, Admission()),
            ordering=_or(stack.ordering, ArrivalOrder(config, cost)),
            lanes=_or(stack.lanes, Lanes()),
            packer=_or(stack.packer, InOrderPacker(config)),
            placement=_or(stack.placement, ReactivePreemption()),
            observers=stack.observers,
            reorder=_or(stack.reorder, Reorder()),
        )


def _stack(below: Stages, above: Stages) -> Stages:
    """``below`` with the slots ``above`` fills, and the observers of both. NOTE: the two
    fill different slots (``parse_policy`` refused the stack otherwise)."""
    return Stages(
        _or(above.admission, below.admission),
        _or(above.ordering, below.ordering),
        _or(above.lanes, below.lanes),
        _or(above.packer, below.packer),
        _or(above.placement, below.placement),
        below.observers + above.observers,
        _or(above.reorder, below.reorder),
    )


def _or(stage: S | None, other: T) -> S | T:
    """The stage a system put in a slot, else ``other`` (another system's, or FCFS's)."""
    return other if stage is None else stage


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
        for slot in s.slots:
            if slot in owner:
                raise ValueError(
                    f"policy {name!r}: {owner[slot]} and {s.name} both supply the {slot} stage; "
                    "a stack takes each stage from one system"
                )
            owner[slot] = s.name


for _system in builtin():
    register_system(_system)
