"""Scheduling as a pipeline of small stages, and the one policy that runs them in order.

Each scheduling system (FCFS, FastServe, and the ones to come) contributes some of these
stages; ``StagedPolicy`` runs admission, then ordering, lanes, the packer and placement, and
forwards every event to every stage so the ones that learn (service counters, quanta) can:

- admission: accept or refuse a new request, with a reason the client sees;
- ordering: rank the live requests, highest priority first, with each one's estimated next
  scheduled time (FastServe's ENST; placement moves KV by it);
- reorder: refine that ranking (cache affinity: waiting requests with the longest cached
  prefix first), whichever system ranked;
- lanes: split the ranking into classes, each with its own limits (a token budget, a step
  time), so the packer reads everything it needs from the lane it is packing;
- packer: fill the step from the lanes within the token budget, the seats and the blocks,
  evicting residents in the order placement gives and the way it says each one leaves;
- placement: how evicted KV leaves (swap or recompute) and the moves made around the batch
  (proactive swap-out to keep a reserve, prefetch);
- observer: anything else that learns from each step.

All of it is pure Python and reads only the ``SchedulerView``; the ``StepPlan`` it fills is
the ledger the applier checks the decision with.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, PreemptMode
from quanta.core.output import RunnerCapabilities, RunnerOutput
from quanta.core.plan import StepPlan
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.policies.common import on_device

_request_id = attrgetter("request_id")


def _positions(order: Sequence[Request]) -> dict[str, int]:
    return dict(zip(map(_request_id, order), range(len(order)), strict=True))


class Stage:
    """Base of every stage: the events a stage may learn from (all no-ops here)."""

    #: Runner capabilities the stage cannot work without.
    requires: RunnerCapabilities = RunnerCapabilities()

    def on_admit(self, request: Request, view: SchedulerView) -> None:
        """A request was accepted (every stage hears it, after admission)."""

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        """A step ran; requests' computed-token counts already include it."""

    def on_finish(self, request: Request) -> None:
        """A request left the engine, whatever way."""

    def on_abort(self, decision: Decision) -> None:
        """A step was stopped at a layer safepoint: nothing of ``decision``'s runs happened
        (its preemptions and swap-ins did)."""


@dataclass(frozen=True)
class Ranking:
    """Live requests, highest priority first, and when each is next expected to run."""

    order: list[Request]
    next_turn: Mapping[str, float]
    # ``order`` is ``arrival_order`` of the view: a packer may then know a request's place
    # from the request alone (``arrival_key``), without the list
    by_arrival: bool = False

    def position(self) -> Mapping[str, int]:
        """Each request's index in ``order`` (read only: several stages of a step share it)."""
        return self._position

    @cached_property
    def _position(self) -> dict[str, int]:
        return _positions(self.order)


class Turns(Mapping[str, float]):
    """Next turns by position in ``order``: the i-th request is ``i // seats`` steps of
    ``quantum`` seconds away. Read lazily: most steps read no turn at all, and building a
    dict of every waiting request's turn each step cost as much as the ranking."""

    __slots__ = ("_order", "_pos", "_quantum", "_seats")

    def __init__(self, order: Sequence[Request], seats: int, quantum: float = 1.0) -> None:
        self._order, self._seats, self._quantum = order, seats, quantum
        self._pos: dict[str, int] | None = None

    def __getitem__(self, request_id: str) -> float:
        if self._pos is None:
            self._pos = _positions(self._order)
        return (self._pos[request_id] // self._seats) * self._quantum

    def __iter__(self) -> Iterator[str]:
        return map(_request_id, self._order)

    def __len__(self) -> int:
        return len(self._order)


@dataclass(frozen=True, slots=True)
class Lane:
    """One class of requests packed together, with the limits the lanes stage sets for it.

    ``max_tokens`` is the step's token budget while this lane packs: the lane adds tokens only
    as far as the step's total (every lane's so far) stays within it; None leaves the
    configured budget. ``max_step_time`` is the predicted step time the lane's runs must keep
    the step within (None: no limit); only packers that predict step times can honour it.
    Both are the lane's own, so a packer needs to remember nothing from one lane to the next.
    """

    name: str
    order: list[Request]
    max_tokens: int | None = None
    max_step_time: float | None = None

    def tokens_left(self, plan: StepPlan) -> int | None:
        """The tokens this lane may still add to ``plan`` (None: no limit at all)."""
        if self.max_tokens is None:
            return plan.budget
        mine = max(0, self.max_tokens - sum(n for _, n in plan.run))
        return mine if plan.budget is None else min(plan.budget, mine)


class Admission(Stage):
    """Accepts everything; a system that throttles overrides ``admit``."""

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        """None to accept, or the reason for refusing."""
        return None


class Ordering(Stage):
    def rank(self, view: SchedulerView) -> Ranking:
        """Every live request of ``view``, highest priority first, with its next turn."""
        raise NotImplementedError


class Reorder(Stage):
    """Refines the ordering's ranking (none here: it is kept as it is). A slot of its own, so
    a refinement such as cache affinity stacks with whichever system ranks."""

    def reorder(self, ranking: Ranking, view: SchedulerView) -> Ranking:
        return ranking


class Lanes(Stage):
    def split(self, ranking: Ranking, view: SchedulerView) -> list[Lane]:
        """One lane with everything: no classes."""
        return [Lane("all", ranking.order)]


class Placement(Stage):
    """Where evicted KV goes and what moves around the batch."""

    evict_mode: PreemptMode = PreemptMode.SWAP

    def victims(self, ranking: Ranking, plan: StepPlan) -> list[Request]:
        """Residents in the order a packer may evict them: lowest priority first."""
        return on_device(reversed(ranking.order), plan)

    def yield_mode(self, req: Request, plan: StepPlan) -> PreemptMode:
        """How ``req`` leaves when a packer evicts it (the placement's mode, unless the
        placement knows a cheaper way for this request)."""
        return self.evict_mode

    def after_batch(self, view: SchedulerView, plan: StepPlan, ranking: Ranking) -> None:
        """Moves made once the batch is chosen (none: purely reactive)."""


class Packer(Stage):
    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        """Add ``lane``'s share of the step to ``plan``: runs, and the evictions they need
        (in ``placement``'s order and mode). Promises only entries the plan accepted."""
        raise NotImplementedError


class Observer(Stage):
    """A stage that only learns."""


@dataclass
class StagedPolicy:
    """One policy from one stage per slot (observers may be several); see the module doc."""

    name: str
    config: SchedulerConfig
    admission: Admission
    ordering: Ordering
    lanes: Lanes
    packer: Packer
    placement: Placement
    observers: Sequence[Stage] = ()
    reorder: Reorder = field(default_factory=Reorder)
    requires: RunnerCapabilities = field(init=False)

    def __post_init__(self) -> None:
        stages = self.stages()
        self.requires = RunnerCapabilities(
            **{
                cap: any(getattr(s.requires, cap) for s in stages)
                for cap in RunnerCapabilities.__dataclass_fields__
            }
        )

    def stages(self) -> list[Stage]:
        """Each stage object once, in pipeline order (one object may fill several slots)."""
        seen: dict[int, Stage] = {}
        for s in (
            self.admission,
            self.ordering,
            self.reorder,
            self.lanes,
            self.packer,
            self.placement,
            *self.observers,
        ):
            seen.setdefault(id(s), s)
        return list(seen.values())

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        reason = self.admission.admit(request, view)
        if reason is None:
            for s in self.stages():
                s.on_admit(request, view)
        return reason

    def schedule(self, view: SchedulerView) -> Decision:
        ranking = self.reorder.reorder(self.ordering.rank(view), view)
        plan = view.plan(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        for lane in self.lanes.split(ranking, view):
            self.packer.pack(lane, view, plan, ranking, self.placement)
        self.placement.after_batch(view, plan, ranking)
        return plan.decision()

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        for s in self.stages():
            s.on_step(decision, output, step_time)

    def on_finish(self, request: Request) -> None:
        for s in self.stages():
            s.on_finish(request)

    def on_abort(self, decision: Decision) -> None:
        for s in self.stages():
            s.on_abort(decision)
