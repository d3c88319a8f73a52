"""Scheduling one step ahead of the device (vLLM's async scheduling, SGLang's overlap
scheduler): while step N runs, the loop schedules step N+1 and commits N only once N+1 is
launched, so the host's scheduling and committing hide behind the device's step.

Three pieces, all torch-free:

- ``ahead``: the requests of the step in flight as if it had completed, for the time the
  policy decides and the applier applies the next step: their computed tokens advanced, and
  each row that samples holding a ``PLACEHOLDER`` for the token not known yet. The next step
  then decodes it like any known token (one token, a placeholder). Outside that window a
  request holds only committed state, so commits, policies' ``on_step`` and metrics see what
  they see without overlap.
- launchers: ``launch(sched, previous) -> StepHandle``, ``StepHandle.result() ->
  RunnerOutput``. A runner that launches on its own device (and keeps the sampled ids there)
  offers ``launch`` itself; for one with only ``execute`` the loop runs it inline (no
  overlap) or on one step thread (``ThreadedLauncher``: a real overlap wherever the step
  releases the GIL, as torch's operators do).
- ``fill`` / ``settle``: a step's placeholders replaced by the previous step's sampled ids
  (what a launcher does before the step runs) or, once that step is committed, by the
  requests' own tokens (what the loop does to run a step again after a failure).

A launched step runs after every step launched before it, in order (one device stream, one
step thread): block copies and K/V writes of step N+1 meet N's as they would in one step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol

from quanta.core.output import RunnerOutput, ScheduledSeq, SchedulerOutput
from quanta.core.request import Request

# The token of a row whose step is still running: never a vocabulary id.
PLACEHOLDER = -1


class StepNotRun(RuntimeError):
    """A step launched on top of one that failed: it ran nothing (no copy, no K/V written),
    since its placeholders had no tokens to take. The loop runs it again once the failure
    is contained (``settle``)."""


class StepHandle(Protocol):
    def result(self) -> RunnerOutput:
        """Wait for the step; its output, or the exception it raised (``StepNotRun`` when
        the step before it failed)."""
        ...


class Launcher(Protocol):
    def launch(self, sched: SchedulerOutput, previous: StepHandle | None) -> StepHandle:
        """Start ``sched`` after every step launched before it, without waiting for it. Its
        ``PLACEHOLDER`` tokens are ``previous``'s sampled ids for the same requests (read
        where they are: a device keeps them on the device); if ``previous`` fails, this
        step runs nothing and its handle raises ``StepNotRun``."""
        ...


class _Done:
    """The handle of a step that already ran."""

    __slots__ = ("_error", "_out")

    def __init__(self, out: RunnerOutput | None, error: BaseException | None) -> None:
        self._out, self._error = out, error

    def result(self) -> RunnerOutput:
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


class InlineLauncher:
    """Runs each step at launch, on the caller's thread: the loop without overlap."""

    def __init__(self, execute: Callable[[SchedulerOutput], RunnerOutput]) -> None:
        self._execute = execute

    def launch(self, sched: SchedulerOutput, previous: StepHandle | None) -> StepHandle:
        try:
            return _Done(self._execute(_after(sched, previous)), None)
        except Exception as exc:
            return _Done(None, exc)


class _Pending:
    __slots__ = ("_future",)

    def __init__(self, future: Future[RunnerOutput]) -> None:
        self._future = future

    def result(self) -> RunnerOutput:
        return self._future.result()


class ThreadedLauncher:
    """Runs steps in launch order on one step thread, so the loop thread schedules the next
    step while one runs. The placeholders are filled there, from the previous step's output,
    which that thread has just produced."""

    def __init__(
        self,
        execute: Callable[[SchedulerOutput], RunnerOutput],
        initializer: Callable[[], None] | None = None,
    ) -> None:
        """``initializer`` runs first on the step thread (a runner's ``bind_thread``)."""
        self._execute = execute
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="quanta-step", initializer=initializer
        )

    def launch(self, sched: SchedulerOutput, previous: StepHandle | None) -> StepHandle:
        return _Pending(self._thread.submit(lambda: self._execute(_after(sched, previous))))


def _after(sched: SchedulerOutput, previous: StepHandle | None) -> SchedulerOutput:
    """``sched`` with ``previous``'s tokens in its placeholders (``StepNotRun`` if it failed)."""
    if previous is None:
        return sched
    try:
        out = previous.result()
    except BaseException as exc:
        raise StepNotRun("the step before this one failed") from exc
    return fill(sched, sampled_ids(out))


def sampled_ids(out: RunnerOutput) -> dict[str, int]:
    """Each request's sampled token in ``out`` (rows that sampled nothing left out)."""
    return {
        rid: t
        for rid, t in zip(out.request_ids, out.sampled_token_ids, strict=True)
        if t is not None
    }


def fill(sched: SchedulerOutput, tokens: Mapping[str, int]) -> SchedulerOutput:
    """``sched`` with each row's placeholders (its inputs and its penalties' history) set to
    ``tokens[row's request]``; the same object when it holds none."""
    if not any(PLACEHOLDER in s.token_ids for s in sched.seqs):
        return sched
    seqs = []
    for s in sched.seqs:
        if PLACEHOLDER in s.token_ids:
            if s.request_id not in tokens:
                raise RuntimeError(f"{s.request_id}: no sampled token for its placeholder")
            s = _with_token(s, tokens[s.request_id])
        seqs.append(s)
    return replace(sched, seqs=tuple(seqs))


def _with_token(s: ScheduledSeq, token: int) -> ScheduledSeq:
    def put(ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(token if t == PLACEHOLDER else t for t in ids)

    p = s.processing
    if p is not None and PLACEHOLDER in p.history:
        p = replace(p, history=put(p.history))
    return replace(s, token_ids=put(s.token_ids), processing=p)


def settle(sched: SchedulerOutput, live: Mapping[str, Request]) -> SchedulerOutput:
    """``sched`` to run again once the step it was launched on is committed: the rows of
    requests that ended since left out, the others' placeholders set to the tokens the
    requests now hold at those positions. Its block copies stay: the ledger made them."""
    seqs = []
    for s in sched.seqs:
        r = live.get(s.request_id)
        if r is None or r.finished:
            continue
        if PLACEHOLDER in s.token_ids:
            token = r.all_token_ids[s.start_pos + s.token_ids.index(PLACEHOLDER)]
            s = _with_token(s, token)
        seqs.append(s)
    return replace(sched, seqs=tuple(seqs))


@contextmanager
def ahead(inflight: SchedulerOutput | None, live: Mapping[str, Request]) -> Iterator[None]:
    """Within: the live requests of ``inflight`` as if it had completed (computed tokens
    advanced; a row that samples holds a ``PLACEHOLDER``). On exit each gets its committed
    state back, except a request the applier preempted by recompute meanwhile, which keeps
    no computed tokens (its K/V is gone; its step's commit adds none)."""
    moved: list[tuple[Request, int, int, bool]] = []
    if inflight is not None:
        for s in inflight.seqs:
            r = live.get(s.request_id)
            if r is None or r.finished:
                continue
            n = s.num_new_tokens - s.num_draft_tokens
            before = r.num_computed_tokens
            r.num_computed_tokens += n
            if s.sample:
                r.output_token_ids.append(PLACEHOLDER)
                r.all_token_ids.append(PLACEHOLDER)
            moved.append((r, before, n, s.sample))
    try:
        yield
    finally:
        for r, before, n, sampled in moved:
            if sampled:
                r.output_token_ids.pop()
                r.all_token_ids.pop()
            if r.num_computed_tokens == before + n:
                r.num_computed_tokens = before
