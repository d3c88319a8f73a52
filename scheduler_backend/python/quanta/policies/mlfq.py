"""FastServe's skip-join MLFQ (§4.1, Algorithm 1) and the baselines of its Fig. 14, as
ordering stages.

All four are preemptive priority orders at token granularity; they share the packer
(``PriorityPacker``) and the KV placement (``mlfq_memory``):

- ``sj-mlfq``: queues Q1..Qn with quanta q1 < q2 = 2 q1 < ...; q1 is the cost model's minimum
  iteration time. A new job *skip-joins* the highest queue whose quantum covers its predicted
  prefill, is demoted once its attained service in a queue uses that queue's quantum (to the
  queue matching its next iteration), and is promoted to Q1 after waiting ``starve_limit``.
  With a load signal (``overload_after_s``, ``overload_after_runs``: the system's default)
  the order is first come, first served until the queue stops draining.
- ``mlfq``: naive MLFQ, every job starts in Q1.
- ``fixed-priority``: shorter input first, never changes (the paper's strawman).
- ``srpt``: shortest remaining processing time from the *true* output length, an oracle that
  only the simulator can provide (requests with ``ignore_eos`` run exactly ``max_tokens``).

Attained service (``service``): ``own`` (default) charges each job its own share of a step by
the cost model (``CostModel.shares``): a decode token that rode along with a 2,000-token
prefill costs what a decode token costs, not the whole step. ``step`` charges every job the
whole step's time, as the public FastServe code does; there a job that has prefilled sinks
below the arrivals that have not and its last few tokens wait behind their prefills.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, Literal

from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision
from quanta.core.output import RunnerOutput
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.mlfq_memory import Enst, execute_times
from quanta.policies.stages import Admission, Ordering, Ranking, Turns

# NOTE: quantum comparisons tolerate float rounding of accumulated step times.
_EPS = 1e-9
# The adaptive load signal scales from the runs of this many latest finished jobs.
_RUNS_KEPT = 100

ServiceMode = Literal["own", "step"]

_by_arrival = attrgetter("arrival")
_by_queue = attrgetter("level", "ticket")
_level = attrgetter("level")
_request_id = attrgetter("request.request_id")
_request = attrgetter("request")
_rid = attrgetter("request_id")
_first, _second = itemgetter(0), itemgetter(1)
# Keys read from a job's fields alone: they change only where the ordering changes them
_FIELD_KEYS = (_by_arrival, _by_queue)


@dataclass(slots=True)
class Job:
    """The ordering's own state of one live request."""

    request: Request
    level: int = 0
    service: float = 0.0  # attained in the current queue, seconds
    ticket: int = 0  # FIFO position within its queue
    last_run: float = 0.0  # last scheduled, joined or promoted: the starvation clock
    arrival: int = 0  # join order: the first-come-first-served rank
    seated_at: float | None = None  # when it first ran: the start of its run


class PriorityOrder(Ordering):
    """A priority order over jobs; subclasses define it through ``_key``."""

    def __init__(self, config: SchedulerConfig, cost: CostModel, service: ServiceMode = "own"):
        self.config = config
        self.cost = cost
        self.service = service
        self.jobs: dict[str, Job] = {}
        self._tickets = itertools.count()
        self._now = 0.0
        # NOTE: with a key read from the job's fields (``_FIELD_KEYS``) the order is kept
        # across steps: a job is placed again only when its key changed (it joined, was
        # served or promoted), not every job sorted every step
        self._order: list[tuple[Any, Job]] = []  # (key, job), by key
        self._placed: dict[str, Any] = {}  # each job's key where it stands in ``_order``
        self._order_key: Callable[[Job], Any] | None = None  # what ``_order`` is sorted by
        self._rekey: set[str] = set()  # jobs whose key may have changed since

    # -- stage events ------------------------------------------------------------------------
    def on_admit(self, request: Request, view: SchedulerView) -> None:
        self._join(request, view.now)

    def rank(self, view: SchedulerView) -> Ranking:
        self._now = view.now
        candidates = view.candidates
        key = self._sort_key()
        if len(self.jobs) != len(candidates):
            for r in candidates:  # NOTE: requests the ordering did not hear arrive
                if r.request_id not in self.jobs:
                    self._join(r, view.now)
        if key in _FIELD_KEYS and len(self.jobs) == len(candidates):
            self._promote_starved(list(self.jobs.values()), view.now)
            jobs = self._kept_order(key)
        else:
            jobs = list(map(self.jobs.__getitem__, map(_rid, candidates)))
            self._promote_starved(jobs, view.now)
            jobs.sort(key=key)
            self._order_key = None  # NOTE: the kept order starts over when it is next used
            self._rekey.clear()
        return Ranking(list(map(_request, jobs)), self._enst(jobs, view.now))

    def _kept_order(self, key: Callable[[Job], Any]) -> list[Job]:
        """Every job by ``key``: the kept order, with the jobs whose key changed placed
        again (all of them when the key is not the one it was kept by)."""
        order, placed = self._order, self._placed
        if key is not self._order_key:
            jobs = self.jobs.values()
            order[:] = sorted(zip(map(key, jobs), jobs, strict=True), key=_first)
            placed.clear()
            placed.update(
                zip(map(_request_id, map(_second, order)), map(_first, order), strict=True)
            )
            self._order_key = key
        else:
            for rid in self._rekey:
                job = self.jobs.get(rid)
                if job is None:
                    continue
                old = placed.get(rid)
                new = key(job)
                if old == new:
                    continue
                if old is not None:
                    del order[bisect_left(order, old, key=_first)]
                insort(order, (new, job), key=_first)
                placed[rid] = new
        self._rekey.clear()
        return list(map(_second, order))

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        charges = self._charges(decision, step_time)
        for (rid, _), charge in zip(decision.run, charges, strict=True):
            job = self.jobs.get(rid)
            if job is not None:
                job.service += charge
                job.last_run = self._now
                if job.seated_at is None:
                    job.seated_at = self._now
                self._after_service(job)

    def on_finish(self, request: Request) -> None:
        rid = request.request_id
        self.jobs.pop(rid, None)
        self._rekey.discard(rid)
        old = self._placed.pop(rid, None)
        if old is not None:
            del self._order[bisect_left(self._order, old, key=_first)]

    # -- hooks -------------------------------------------------------------------------------
    def _initial_level(self, request: Request) -> int:
        return 0

    def _key(self, job: Job) -> tuple[float, ...]:
        raise NotImplementedError

    def _sort_key(self) -> Callable[[Job], Any]:
        """A key that orders jobs as ``_key`` does; an order that reads only fields of the
        job says so with one read in C (a Python call per job was much of a long queue's
        step)."""
        return self._key

    def _promote_starved(self, jobs: list[Job], now: float) -> None:
        return None

    def _after_service(self, job: Job) -> None:
        return None

    def _enst(
        self, jobs: Sequence[Job], now: float, of: Mapping[str, Job] | None = None
    ) -> Mapping[str, float]:
        """Without queues, the next turn of the i-th job is about i / B iterations away.
        ``of`` finds each of ``jobs`` by its request (None: the ordering's ``jobs`` do, for
        a ranking of every job)."""
        b, q = self.config.max_num_seqs, self.cost.min_iteration_time
        return Turns([j.request for j in jobs], b, q)

    # -- helpers -----------------------------------------------------------------------------
    def _charges(self, decision: Decision, step_time: float) -> list[float]:
        """Each run item's attained service for this step."""
        if self.service == "step":
            return [step_time] * len(decision.run)
        chunks = []
        for rid, n in decision.run:
            job = self.jobs.get(rid)
            start = job.request.num_computed_tokens - n if job is not None else 0
            chunks.append((n, max(0, start)))
        return self.cost.shares(chunks)

    def _join(self, request: Request, now: float) -> Job:
        ticket = next(self._tickets)
        job = Job(request, self._initial_level(request), 0.0, ticket, now, ticket)
        self.jobs[request.request_id] = job
        self._rekey.add(request.request_id)
        return job


class SkipJoinMLFQ(PriorityOrder):
    """FastServe's scheduler; see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        cost: CostModel,
        *,
        service: ServiceMode = "own",
        base_quantum: float | None = None,
        quantum_ratio: float = 2.0,
        num_queues: int = 16,
        starve_limit: float = 3.0,
        starve_check_every: int = 1000,
        patience_s: float = 0.0,
        overload_after_s: float = 0.0,
        overload_after_runs: float = 0.0,
    ) -> None:
        super().__init__(config, cost, service)
        # The load signal: with either threshold set the order is first-come-first-served
        # until a job has waited that long without a seat, then skip-join MLFQ until a step
        # runs every live job again (see ``_track_load``). ``overload_after_s`` is a fixed
        # wait; ``overload_after_runs`` a multiple of the mean run (first seat to finish) of
        # the latest finished jobs, which scales with the deployment; the fixed one wins.
        self.overload_after_s = overload_after_s
        self.overload_after_runs = overload_after_runs
        self._load_signal = overload_after_s > 0 or overload_after_runs > 0
        self.overloaded = not self._load_signal
        self.num_overload_periods = 0
        self._runs: deque[float] = deque(maxlen=_RUNS_KEPT)
        self._runs_total = 0.0  # NOTE: sum(self._runs), kept as runs come and go
        self._step_end = 0.0
        # A job that has not started yet ranks behind the running ones until it has waited
        # this long: below capacity a seat frees before then, so nobody is displaced for a
        # newcomer (FCFS's behaviour), while under overload waits pass it at once.
        self.patience_s = patience_s
        self._seated: set[str] = set()  # the jobs that ran in the latest step
        q1 = cost.min_iteration_time if base_quantum is None else base_quantum
        self.quanta = [q1 * quantum_ratio**k for k in range(num_queues)]
        # The paper tunes alpha from the SLO without giving a value, and checks
        # "periodically"; the defaults are the public code's: 3 s, every 1000 iterations.
        self.starve_limit = starve_limit
        self.starve_check_every = starve_check_every
        self.num_promotions = 0
        self._iterations = 0

    def level_for(self, iteration_time: float) -> int:
        """The highest-priority queue whose quantum covers one iteration of this length."""
        for k, q in enumerate(self.quanta):
            if q + _EPS >= iteration_time:
                return k
        return len(self.quanta) - 1

    def _fit_level(self, iteration_time: float) -> int:
        """Skip-join: where a job whose next iteration takes this long enters or lands."""
        return self.level_for(iteration_time)

    def _initial_level(self, request: Request) -> int:
        """Skip-join by the prefill the request needs: its uncached tokens, after the prefix
        the cache holds for it at arrival."""
        prefill = self.cost.prefill_time(request.num_uncomputed_tokens, request.num_context_tokens)
        return self._fit_level(prefill)

    def rank(self, view: SchedulerView) -> Ranking:
        if self._load_signal and not self.overloaded:
            self._track_load(view)
        return super().rank(view)

    @property
    def overload_wait_s(self) -> float | None:
        """How long a job may wait without a seat before the server counts as overloaded;
        None before the adaptive threshold has a finished run to scale from."""
        if self.overload_after_s > 0:
            return self.overload_after_s
        if self.overload_after_runs <= 0 or not self._runs:
            return None
        return self.overload_after_runs * self._runs_total / len(self._runs)

    def _track_load(self, view: SchedulerView) -> None:
        """Below capacity every job gets a seat soon after it arrives, and least attained
        service only reshuffles who waits: demoted long jobs yield their seats to a burst's
        newcomers, and their time per token doubles (docs/results/fastserve.md). So until a job
        has waited ``overload_wait_s`` without a seat, the order stays first come, first
        served; from then on (the queue is not draining) it is skip-join MLFQ, until a step
        seats every live job again (``on_step``)."""
        threshold = self.overload_wait_s
        if threshold is None:
            return
        for r in view.candidates:
            job = self.jobs.get(r.request_id)
            waited = view.now - (job.last_run if job is not None else view.now)
            if r.request_id not in self._seated and waited >= threshold:
                self.overloaded = True
                self.num_overload_periods += 1
                return

    def _key(self, job: Job) -> tuple[float, ...]:
        if not self.overloaded:
            return (job.arrival,)
        return (self._patient(job), job.level, job.ticket)

    def _sort_key(self) -> Callable[[Job], Any]:
        if not self.overloaded:
            return _by_arrival
        return _by_queue if self.patience_s <= 0 else self._key  # NOTE: no one is patient

    def _patient(self, job: Job) -> int:
        """1 for a job without a seat (it did not run in the latest step) that has waited
        less than its patience: it ranks behind the jobs that hold seats, so it takes only a
        free one; 0 otherwise (the queue order decides)."""
        if self.patience_s <= 0 or job.request.request_id in self._seated:
            return 0
        return int(self._now - job.last_run < self.patience_s)

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        super().on_step(decision, output, step_time)
        self._step_end = self._now + step_time
        if self.patience_s > 0 or self._load_signal:  # NOTE: only they read it
            self._seated = {rid for rid, _ in decision.run}
        if self._load_signal and self.overloaded and self._seated >= self.jobs.keys():
            self.overloaded = False  # every live job ran: the queue drained

    def on_finish(self, request: Request) -> None:
        job = self.jobs.get(request.request_id)
        if job is not None and job.seated_at is not None and request.status.completed:
            if len(self._runs) == self._runs.maxlen:
                self._runs_total -= self._runs[0]
            run = self._step_end - job.seated_at
            self._runs.append(run)
            self._runs_total += run
        super().on_finish(request)

    def _promote_starved(self, jobs: list[Job], now: float) -> None:
        self._iterations += 1
        if self._iterations % self.starve_check_every:
            return
        for job in jobs:
            if job.level > 0 and now - job.last_run >= self.starve_limit:
                job.level, job.service, job.last_run = 0, 0.0, now
                job.ticket = next(self._tickets)
                self._rekey.add(job.request.request_id)
                self.num_promotions += 1

    def _after_service(self, job: Job) -> None:
        """Demote once the queue's quantum is used, to the queue fitting the next iteration."""
        if job.service + _EPS < self.quanta[job.level]:
            return
        req = job.request
        left = req.num_uncomputed_tokens
        next_time = (
            self.cost.prefill_time(left, req.num_context_tokens)
            if left > 1
            else self.cost.min_iteration_time
        )
        job.level = min(max(job.level + 1, self._fit_level(next_time)), len(self.quanta) - 1)
        job.service = 0.0
        job.ticket = next(self._tickets)
        self._rekey.add(req.request_id)

    def _enst(
        self, jobs: Sequence[Job], now: float, of: Mapping[str, Job] | None = None
    ) -> Mapping[str, float]:
        if not self.overloaded:  # first come, first served: turns in arrival order
            return super()._enst(jobs, now, of)
        # T_promote: promotion happens at the first starvation check after the limit.
        next_check = (
            self.starve_check_every - self._iterations % self.starve_check_every
        ) * self.cost.min_iteration_time
        return Enst(
            jobs,
            self.jobs if of is None else of,
            execute_times(map(_level, jobs), self.quanta, self.config.max_num_seqs),
            next_check=next_check,
            limit=self.starve_limit,
            now=now,
            by_queue=self._sort_key() is _by_queue,
        )


class NaiveMLFQ(SkipJoinMLFQ):
    """Classic MLFQ: every job enters Q1 and sinks one queue per used quantum."""

    def _fit_level(self, iteration_time: float) -> int:
        return 0


class FixedPriority(PriorityOrder):
    """Shorter input first, for the whole life of the job (FastServe §4.1 strawman)."""

    def _key(self, job: Job) -> tuple[float, ...]:
        return (job.request.num_prompt_tokens, job.ticket)


class SRPT(PriorityOrder):
    """Shortest remaining processing time with the true output length: the oracle bound."""

    def _key(self, job: Job) -> tuple[float, ...]:
        req = job.request
        left = req.num_uncomputed_tokens
        decodes = req.params.max_tokens - req.num_output_tokens
        prefill = 0.0
        if left > 1:  # the prefill samples one token itself
            prefill, decodes = self.cost.prefill_time(left, req.num_context_tokens), decodes - 1
        return (prefill + decodes * self.cost.min_iteration_time, job.ticket)


class OracleAdmission(Admission):
    """SRPT needs each request's true output length; only simulated requests carry it."""

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        if request.params.ignore_eos:
            return None
        return (
            "policy 'srpt' is an oracle that needs each request's true output length; only "
            "the simulator provides it (requests with ignore_eos=True run exactly max_tokens)"
        )
