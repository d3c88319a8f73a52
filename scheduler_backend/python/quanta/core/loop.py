"""EngineLoop: ingest -> admit -> schedule -> apply -> execute -> commit, one step at a time.

The only place where policy, blocks and runner meet. It runs either synchronously (offline
API, simulator: call ``step`` until idle) or on its own thread (servers: ``start``), with
thread-safe ``submit`` and ``cancel``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager, Tier
from quanta.core.clock import Clock
from quanta.core.commit import Committer
from quanta.core.decision import Decision, PreemptMode
from quanta.core.detokenize import Decode
from quanta.core.errors import (
    CapacityError,
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    QuantaError,
    RequestAbortedError,
    ThrottledError,
    WorkerLostError,
)
from quanta.core.faults import FaultPlan
from quanta.core.output import (
    MalformedStepError,
    Runner,
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from quanta.core.overlap import (
    InlineLauncher,
    Launcher,
    StepHandle,
    StepNotRun,
    ThreadedLauncher,
    ahead,
    settle,
)
from quanta.core.plan import PoolView
from quanta.core.policy import Policy, check_capabilities
from quanta.core.prefix import block_hashes
from quanta.core.request import CacheKind, Request, RequestStatus, validate_prompt
from quanta.core.safepoint import AbortRule, AbortSignal, StepAborted
from quanta.core.speculative import Proposer, SpeculativeConfig
from quanta.core.stream import RequestStream, Sink
from quanta.core.view import SchedulerView

log = logging.getLogger(__name__)

# Steps whose token counts wait for ``take_step_tokens``: the metrics thread takes them every
# half second; a driver that never takes them (offline, simulator) keeps only the latest.
STEP_TOKENS_KEPT = 65536


@dataclass(frozen=True, slots=True)
class LoopStats:
    """A consistent snapshot for metrics; counters are cumulative since start."""

    num_waiting: int
    num_running: int
    num_swapped: int
    device_blocks_used: int
    device_blocks_total: int
    host_blocks_used: int
    host_blocks_total: int
    num_steps: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_generated_tokens: int
    num_hidden_cache: int = 0  # requests whose device cache is hidden states (Apt-Serve)
    hidden_blocks_used: int = 0  # device blocks they hold
    num_preemptions_checkpoint: int = 0  # swaps that needed no copy: a complete checkpoint
    num_safepoint_aborts: int = 0  # steps stopped at a layer safepoint (ConServe)
    checkpoint_blocks_used: int = 0  # host blocks holding incremental checkpoints
    num_checkpoint_blocks_copied: int = 0  # block copies made by checkpoints
    prefix_cache_queries: int = 0  # tokens of requests that started, cache asked
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed)
    device_cached_blocks: int = 0  # named blocks: the prefix cache's content per tier
    host_cached_blocks: int = 0
    # speculative decoding: steps' seqs that verified drafts, their drafts, those accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    async_scheduling: bool = False  # steps scheduled while the one before runs
    num_overlapped_steps: int = 0  # steps launched while the one before was in flight


@dataclass(frozen=True, slots=True)
class LoopHealth:
    """Whether the loop serves: its thread is alive and, with work in flight, it completed a
    step within the stall timeout. ``reason`` says why not (empty when healthy)."""

    healthy: bool
    reason: str = ""
    seconds_since_step: float = 0.0  # since the latest step ended; 0 while idle
    num_unfinished: int = 0  # requests submitted and not finished


@dataclass(frozen=True, slots=True)
class _Step:
    """A launched step, until it is committed."""

    decision: Decision
    sched: SchedulerOutput
    handle: StepHandle
    failed: dict[str, Exception]  # requests whose scheduling raised: failed once it lands
    started: float  # clock time its scheduling began
    abortable: bool  # preemptible (ConServe): the abort rule is armed until it lands


class LoopFatalError(RuntimeError):
    """An error the loop cannot contain to one request: it stops serving (``EngineLoop``)."""


class EngineLoop:
    """Drives one model replica; see the module docstring for the step."""

    def __init__(
        self,
        *,
        runner: Runner,
        policy: Policy,
        blocks: BlockManager,
        clock: Clock,
        max_model_len: int,
        decode: Decode | None = None,
        speculative: SpeculativeConfig | None = None,
        max_step_failures: int = 5,
        async_scheduling: bool = False,
    ) -> None:
        """``async_scheduling``: schedule each step while the one before it runs (see
        ``step``; never with ``speculative``). A runner with a ``launch`` of its own
        (``core/overlap.py``'s ``Launcher``) is launched through it either way."""
        check_capabilities(policy, runner.capabilities, type(runner).__name__)
        self.runner, self.policy, self.blocks, self.clock = runner, policy, blocks, clock
        self.max_model_len = max_model_len
        self._applier = DecisionApplier(blocks)
        self._proposer = None if speculative is None else Proposer(speculative, max_model_len)
        self._committer = Committer(clock, blocks, decode)
        self.async_scheduling = async_scheduling and speculative is None
        self._launcher = _launcher_for(runner, self._execute, self.async_scheduling)
        self._inflight: _Step | None = None  # launched, not yet committed
        self._pool = PoolView(blocks)
        self._live: dict[str, Request] = {}  # NOTE: insertion order is arrival order
        self._inbox: list[tuple[Request, Sink]] = []
        self._cancels: list[str] = []
        self._resets: list[threading.Event] = []  # prefix-cache resets asked for
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counts = {
            "steps": 0,
            "swap": 0,
            "recompute": 0,
            "checkpoint": 0,
            "aborts": 0,
            "ckpt_copies": 0,
            "overlapped": 0,
        }
        self._dropped_names = 0  # by the latest reset
        self._abort = AbortSignal()  # raised by ``submit`` while a preemptible step runs
        self._abort_rule: AbortRule | None = None
        self._safepoints = runner.capabilities.layer_safepoints
        self.last_abort: tuple[float, float] | None = None  # (raised at, stopped at) clock times
        # Containment: steps in a row that committed nothing and failed; at this many the
        # loop gives up (``LoopFatalError``), since the fault is not any one request's.
        self.max_step_failures = max_step_failures
        self._failed_steps = 0
        self.faults: FaultPlan | None = None  # tests only: ``inject``
        # Called (on the loop thread) once the loop died, after every request in flight was
        # failed: the server ends, so its supervisor starts a fresh one.
        self.on_fatal: Callable[[str], None] | None = None
        self._dead: str | None = None  # why the loop died
        self._beat = time.monotonic()  # wall time the latest step ended (the watchdog's)
        self._idle = True  # the thread waits for work
        self._step_tokens: deque[int] = deque(maxlen=STEP_TOKENS_KEPT)  # tokens per step
        self._stats = self._snapshot()

    # -- client side (any thread) ---------------------------------------------------------
    def submit(self, request: Request, sink: Sink | None = None) -> RequestStream | None:
        """Queue a request; raises a typed ``InvalidRequestError`` if it can never run.

        Without a ``sink`` a ``RequestStream`` is returned for the caller to iterate.
        """
        self.validate(request)
        stream = RequestStream(request.request_id) if sink is None else None
        with self._cv:
            if self._dead is not None:
                raise EngineDeadError(f"the engine stopped serving: {self._dead}")
            if self._stopping:
                raise RequestAbortedError("the engine is shutting down")
            if self._idle:  # NOTE: the stall clock starts when work arrives, not at the last step
                self._beat = time.monotonic()
            self._inbox.append((request, sink or stream))  # type: ignore[arg-type]
            self._cv.notify()
            if self.would_abort(request, self.clock.now()):
                self._abort.raise_at(self.clock.now())
        return stream

    def would_abort(self, request: Request, now: float) -> bool:
        """Whether ``request``, arriving at ``now``, stops the step running now at a layer
        safepoint: the step is preemptible and its policy's rule says so. (The simulator asks
        this for arrivals that fall inside a step.)"""
        rule = self._abort_rule
        return rule is not None and not self._abort.is_set() and rule(request, now)

    def validate(self, request: Request) -> None:
        """Raise the typed error that makes ``request`` unservable by this engine, if any."""
        validate_prompt(request.prompt_token_ids, request.params, self.max_model_len)
        # NOTE: a prompt computed in one step holds all its blocks; the window frees only later
        need = max(
            self.blocks.blocks_for(request.num_prompt_tokens),
            self.blocks.peak_blocks(request.num_prompt_tokens + request.params.max_tokens),
        )
        if need > self.blocks.num_total(Tier.DEVICE):
            raise CapacityError(
                f"request needs {need} KV blocks but the device pool has only "
                f"{self.blocks.num_total(Tier.DEVICE)}: it could never complete"
            )
        if request.params.stop and self._committer.decode is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this engine has none")

    def cancel(self, request_id: str) -> None:
        """Abort a request at the next step boundary; unknown ids are ignored."""
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def reset_prefix_cache(self, wait: bool = True, timeout: float = 30.0) -> int | None:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), e.g. after new weights:
        requests that start later share nothing computed before. Blocks in use stay with their
        requests. Done at the next step boundary by the loop thread (at once when no thread
        runs the loop); with ``wait``, returns the names dropped once done."""
        if self._thread is None:
            return self.blocks.reset_prefix_cache()
        done = threading.Event()
        with self._cv:
            self._resets.append(done)
            self._cv.notify()
        if wait and not done.wait(timeout):
            raise TimeoutError("the prefix cache reset did not happen in time")
        return self._dropped_names if wait else None

    def has_unfinished(self) -> bool:
        with self._cv:
            return bool(self._live or self._inbox)

    def inject(self, faults: FaultPlan | None) -> None:
        """Arm the fault sites of ``faults`` (tests only; ``core/faults.py``)."""
        self.faults = faults
        self._applier.faults = faults
        self._committer.faults = faults

    def health(self, stall_timeout: float) -> LoopHealth:
        """Unhealthy once the loop died, or when work is in flight and no step ended for
        ``stall_timeout`` seconds (counted from when the work arrived if the loop was idle).
        Safe from any thread; meaningful while the loop runs on its own thread."""
        with self._cv:
            dead, idle, beat = self._dead, self._idle, self._beat
            unfinished = len(self._live) + len(self._inbox)
            thread = self._thread
            stopping = self._stopping
        if dead is not None:
            return LoopHealth(False, f"the engine loop died: {dead}", 0.0, unfinished)
        if thread is not None and not thread.is_alive() and not stopping:
            return LoopHealth(False, "the engine loop thread is gone", 0.0, unfinished)
        age = 0.0 if idle and not unfinished else time.monotonic() - beat
        if unfinished and age > stall_timeout:
            reason = (
                f"no engine step completed in {age:.0f} s while {unfinished} request(s) "
                f"waited or ran (stall timeout {stall_timeout:g} s)"
            )
            return LoopHealth(False, reason, age, unfinished)
        return LoopHealth(True, "", age, unfinished)

    # -- one iteration (loop thread) -------------------------------------------------------
    def step(self) -> bool:
        """Run one iteration; False when there was nothing to do.

        With ``async_scheduling`` the step launched here stays in flight while the next
        iteration schedules the one after it (``core/overlap.py``), and the step before it
        is committed once this one is launched. Steps run the old way (the step in flight
        committed before the next is scheduled, or this one committed at once) where the
        host needs what the device computes before it can schedule on:

        - a row of structured output that samples: its grammar advances with the committed
          token, and the next row's token mask is made from it;
        - speculative decoding (the whole engine): the proposals come from the committed
          tokens and the drafts accepted decide where the next step starts;
        - a preemptible step (layer safepoints): an abort discards it, and a step built on
          it would compute tokens that never were;
        - a step with checkpoint copies: they are confirmed or dropped with its outcome.

        Stop strings, EOS and lengths need no such wait: a request that finished at N
        costs one wasted row at N+1, whose output is dropped.

        Containment: a request whose scheduling, row or commit raises ends alone with
        ``EngineStepError``; a step whose every request failed counts toward
        ``max_step_failures``, and an exception outside any one request's handling
        propagates (the thread driver then fails everything in flight: ``_die``). A step
        launched on one that failed ran nothing (``StepNotRun``); it runs again once that
        failure is contained."""
        self._ingest()
        if not self._live:
            landed, self._inflight = self._inflight, None
            if landed is not None:
                self._land(landed)
            self._stats = self._snapshot()
            return landed is not None
        if self.faults is not None:
            self.faults.check_any("step", self._live.values())  # NOTE: uncontainable
            self.faults.stall(self._live.values())
            if self._stopping:
                return False
        prev, self._inflight = self._inflight, None
        if prev is not None and not self._may_overlap(prev):
            self._land(prev)
            prev = None
            if not self._live:
                return True
        now = self.clock.now()
        try:
            with ahead(None if prev is None else prev.sched, self._live):
                view = self._view(now)
                self.blocks.forget_lookups()
                self._look_up_prefixes(view.waiting)
                if self._proposer is not None:
                    self._proposer.propose(self._live.values(), len(view.running))
                decision = self.policy.schedule(view)
                self._count_preemptions(decision)
                sched = self._applier.apply(decision, self._live, now)
        except Exception as exc:  # a policy bug must not wedge every client
            log.exception("scheduling failed")
            if prev is not None:
                self._land(prev)
            self._fail(list(self._live.values()), f"scheduler error: {exc}")
            self._step_failed(f"scheduler error: {exc}")
            return True
        failed: dict[str, Exception] = dict(self._applier.failed)
        if sched.is_empty:
            if prev is not None:
                self._land(prev)
            self._fail_each(failed)
            return bool(decision.preempt) or bool(failed) or prev is not None
        abortable = decision.abort_when is not None and self._safepoints and bool(sched.seqs)
        if abortable:
            sched = replace(sched, abort=self._abort)
            with self._cv:
                self._abort.clear()
                self._abort_rule = decision.abort_when
                # NOTE: a request that came in while the policy decided was not checked
                # against this rule (there was none): it stops the step at its first check
                if any(self.would_abort(r, now) for r, _ in self._inbox):
                    self._abort.raise_at(self.clock.now())
        handle = self._launcher.launch(sched, None if prev is None else prev.handle)
        step = self._inflight = _Step(decision, sched, handle, failed, now, abortable)
        if prev is not None:  # NOTE: committed while the step launched after it runs
            self._counts["overlapped"] += 1
            if not self._land(prev):
                step = self._inflight = self._after_failure(step)
        if not (self.async_scheduling and not abortable and self._live):
            self._inflight = None
            self._land(step)
        return True

    def _may_overlap(self, step: _Step) -> bool:
        """Whether the next step may be scheduled while ``step`` runs (see ``step``)."""
        if step.sched.checkpoint:
            return False
        return not any(
            s.sample and s.processing is not None and s.processing.constraint is not None
            for s in step.sched.seqs
        )

    def _land(self, step: _Step) -> bool:
        """Wait for ``step``, contain what it raised and commit it; False when it failed as
        a whole (its rows then ran again one by one, or their requests failed)."""
        decision, sched, failed = step.decision, step.sched, step.failed
        try:
            out = step.handle.result()
        except StepAborted:
            self._aborted(decision)
            self._fail_each(failed)
            return False
        except WorkerLostError as exc:
            # NOTE: every request's KV (and every cached prefix) had a shard on the lost rank
            self._drop_checkpoints(sched)
            log.error("%s", exc)
            self._fail(list(self._live.values()), str(exc), WorkerLostError)
            self.blocks.reset_prefix_cache()
            self._step_failed(str(exc))
            return False
        except MalformedStepError as exc:
            # NOTE: nothing was copied or written: the step's requests (and those whose KV
            # was to move) end, the others never met it
            self._drop_checkpoints(sched)
            log.exception("the runner refused the step")
            self._fail_step(decision, sched, exc)
            self._fail_each(failed)
            self._step_failed(f"engine step failed: {exc}")
            return False
        except Exception as exc:
            self._drop_checkpoints(sched)
            log.exception("engine step failed; running its requests one at a time")
            isolated = self._isolate(sched, failed)
            if isolated is None:
                self._fail_step(decision, sched, exc)
                self._fail_each(failed)
                self._step_failed(f"engine step failed: {exc}")
                return False
            sched, out = isolated
            self._commit(step, sched, out)
            return False
        finally:
            if step.abortable:
                self._abort_rule = None
        if sched.checkpoint:
            self.blocks.confirm_checkpoints()
            self._counts["ckpt_copies"] += len(sched.checkpoint)
        self._commit(step, sched, out)
        return True

    def _commit(self, step: _Step, sched: SchedulerOutput, out: RunnerOutput) -> None:
        """Commit a step's rows whose requests are still live (a request that finished or
        was cancelled since the step was launched wasted its row), then tell the policy."""
        keep = [i for i, s in enumerate(sched.seqs) if s.request_id in self._live]
        if len(keep) < len(sched.seqs):
            sched, out = replace(sched, seqs=tuple(sched.seqs[i] for i in keep)), _rows(out, keep)
        step_time = self.clock.now() - step.started
        self._counts["steps"] += 1
        self._step_tokens.append(sched.num_tokens)
        done = self._committer.commit(sched, out, self._live, step_time)
        decision = step.decision
        if len(decision.run) != len(sched.seqs):  # NOTE: the policy learns only from rows run
            ran = {s.request_id for s in sched.seqs}
            decision = replace(decision, run=tuple(p for p in decision.run if p[0] in ran))
        self.policy.on_step(decision, out, step_time)
        for r in done:
            del self._live[r.request_id]
            self.policy.on_finish(r)
        self._fail_each(step.failed)
        if len(sched.seqs) > sum(1 for r in done if r.error):
            self._failed_steps = 0  # NOTE: a row went through: the engine works
        elif step.failed or sched.seqs:
            self._step_failed("every request of the step failed")
        self._stats = self._snapshot()

    def _after_failure(self, step: _Step) -> _Step:
        """``step`` was launched on a step that failed and was contained since: run it again
        (without the rows of requests that ended) if it ran nothing."""
        try:
            step.handle.result()
            return step
        except StepNotRun:
            pass
        except Exception:
            return step  # NOTE: its own failure, contained when it lands
        sched = settle(step.sched, self._live)
        return replace(step, sched=sched, handle=self._launcher.launch(sched, None))

    def _drain(self) -> None:
        """Wait for the step in flight and drop it (the loop stops or died)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            try:
                step.handle.result()
            except Exception:
                log.debug("the step in flight failed while the loop stopped", exc_info=True)

    def _drop_checkpoints(self, sched: SchedulerOutput) -> None:
        if sched.checkpoint:  # NOTE: only its own: the next step's may be pending already
            self.blocks.drop_pending_checkpoints()

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step on the runner (on the step thread when the loop overlaps)."""
        out = self.runner.execute(sched)
        if self.faults is not None:
            rows = (self._live.get(s.request_id) for s in sched.seqs)
            self.faults.check_any("runner", (r for r in rows if r is not None))
        return out

    def _isolate(
        self, sched: SchedulerOutput, failed: dict[str, Exception]
    ) -> tuple[SchedulerOutput, RunnerOutput] | None:
        """After a step raised past its block copies: run each of its requests alone (no
        copies: they were made, and K/V written again is the same), so only the rows that
        raise again fail. None when none ran (the fault is not any one request's).

        The requests that raise are added to ``failed``."""
        sched = settle(sched, self._live)  # NOTE: the step before it is committed
        if len(sched.seqs) < 2:
            return None
        good, outs = [], []
        for seq in sched.seqs:
            solo = replace(sched, seqs=(seq,), swap_out=(), swap_in=(), checkpoint=(), abort=None)
            try:
                outs.append(self._launcher.launch(solo, None).result())
                good.append(seq)
            except Exception as exc:
                log.warning("the row of %s failed alone too: %s", seq.request_id, exc)
                failed[seq.request_id] = exc
        if not good:
            for seq in sched.seqs:
                failed.pop(seq.request_id, None)
            return None
        return replace(sched, seqs=tuple(good), checkpoint=()), _merge_outputs(good, outs)

    def _fail_each(self, failed: dict[str, Exception]) -> None:
        """End each request whose own handling raised, with what it raised."""
        for rid, exc in failed.items():
            r = self._live.get(rid)
            if r is not None:
                self._fail([r], f"engine step failed for this request: {exc}")

    def _step_failed(self, why: str) -> None:
        """Count a step that failed as a whole; ``max_step_failures`` in a row is fatal."""
        self._failed_steps += 1
        if self._failed_steps >= self.max_step_failures:
            raise LoopFatalError(f"{self._failed_steps} engine steps in a row failed; last: {why}")

    def run_until_idle(self) -> None:
        """Step until every submitted request has finished (offline API, simulator)."""
        while self.has_unfinished():
            if not self.step() and self._live and not self._inbox:
                self._stall_check()

    # -- thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="quanta-loop", daemon=True)
        self._thread.start()

    def stop(
        self,
        reason: str = "the engine stopped",
        error: type[QuantaError] = RequestAbortedError,
    ) -> None:
        """Stop the thread and fail whatever is still in flight with ``error(reason)``."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self.faults is not None:
            self.faults.released.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drain()
        self._ingest()
        self._fail(list(self._live.values()), reason, error)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # NOTE: whatever it was, nobody may hang on this loop
            self._die(f"{type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._idle = True
                while not (
                    self._stopping or self._inbox or self._cancels or self._live or self._resets
                ):
                    self._cv.wait()
                self._idle = False
                if self._stopping:
                    return
            if not self.step() and self._live:
                self._stall_check()
                with self._cv:  # nothing runnable now: wait for news instead of spinning
                    self._cv.wait(timeout=0.005)
            self._beat = time.monotonic()

    def _die(self, reason: str) -> None:
        """The loop cannot go on: refuse new requests, fail every one in flight with
        ``EngineDeadError`` (each on its own, so one broken sink cannot stop the rest), then
        tell ``on_fatal``."""
        log.critical("the engine loop died: %s", reason, exc_info=True)
        self._inflight = None  # NOTE: not waited for: a hung step must not keep clients waiting
        with self._cv:
            self._dead = reason
            inbox, self._inbox = self._inbox, []
        error = EngineDeadError(f"the engine failed and stopped serving: {reason}")
        for request, sink in inbox:
            try:
                self._committer.track(request, sink)
            except Exception:
                log.exception("tracking %s failed", request.request_id)
            self._live.setdefault(request.request_id, request)
        for r in list(self._live.values()):
            try:
                self._committer.finish_with_error(r, error)
            except Exception:
                log.exception("failing %s failed", r.request_id)
        self._live.clear()
        self._stats = replace(self._stats, num_waiting=0, num_running=0, num_swapped=0)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    # -- helpers -----------------------------------------------------------------------------
    def _ingest(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            resets, self._resets = self._resets, []
        if resets:
            self._dropped_names = self.blocks.reset_prefix_cache()
            for done in resets:
                done.set()
        now = self.clock.now()
        for request, sink in inbox:
            self._committer.track(request, sink)
            self._live[request.request_id] = request
            self._look_up_prefixes([request])  # NOTE: admission sees what it will not compute
            reason = self.policy.admit(request, self._view(now))
            if reason is not None:
                self._fail([request], reason, ThrottledError)
        doomed = [self._live[rid] for rid in cancels if rid in self._live]
        self._fail(doomed, "request cancelled", RequestAbortedError)

    def _look_up_prefixes(self, waiting: list[Request]) -> None:
        """Find each waiting request's cached prefix for this step's decision: policies then
        count only the rest as work (``Request.num_uncomputed_tokens``)."""
        bm = self.blocks
        if not bm.prefix_caching:
            return
        size = bm.block_size
        for r in bm.stale_lookups(waiting):  # NOTE: the others' lookups still hold
            if bm.kind_of(r.request_id) is not None:
                r.num_cached_tokens = 0
                continue
            n = (len(r.all_token_ids) - 1) // size  # cacheable_blocks, inlined: per request
            if r.params.prompt_logprobs is not None:
                n = min(n, _reported_blocks(r, size))
            if r.pooling is not None and r.pooling.pooling_type == "MEAN":
                n = min(n, r.num_pooled_rows // size)  # NOTE: a cached row has no hidden state
            chain = r.block_hashes if len(r.block_hashes) >= n else block_hashes(r, size, n)
            r.num_cached_tokens = bm.lookup(r.request_id, chain, n)

    def _view(self, now: float) -> SchedulerView:
        by: dict[RequestStatus, list[Request]] = {s: [] for s in RequestStatus}
        for r in self._live.values():
            by[r.status].append(r)
        return SchedulerView(
            now,
            by[RequestStatus.WAITING],
            by[RequestStatus.RUNNING],
            by[RequestStatus.SWAPPED],
            self._pool,
        )

    def _fail(
        self, requests: list[Request], msg: str, kind: type[QuantaError] = EngineStepError
    ) -> None:
        for r in requests:
            self._committer.finish_with_error(r, kind(msg))
            if self._live.pop(r.request_id, None) is not None:
                self.policy.on_finish(r)

    def _fail_step(self, decision: Decision, sched: SchedulerOutput, exc: Exception) -> None:
        """Fail only the requests whose KV this step touched; the rest go on."""
        # NOTE: in the step's order (a dict, not a set of ids): the policy hears of each end
        # in turn, and a string set's order changes from one process to the next
        ids = dict.fromkeys(s.request_id for s in sched.seqs) | dict.fromkeys(decision.swap_in)
        ids |= dict.fromkeys(p.request_id for p in decision.preempt if p.mode is PreemptMode.SWAP)
        self._fail([self._live[i] for i in ids if i in self._live], f"engine step failed: {exc}")

    def _aborted(self, decision: Decision) -> None:
        """A preemptible step stopped at a safepoint: commit nothing, forget its checkpoint
        copies (they were to run after the forward pass) and tell the policy."""
        self.blocks.drop_pending_checkpoints()
        self._counts["aborts"] += 1
        raised = self._abort.raised_at
        if raised is not None:
            self.last_abort = (raised, self.clock.now())
        log.info("step of %d requests stopped at a safepoint", len(decision.run))
        self.policy.on_abort(decision)
        self._stats = self._snapshot()

    def _count_preemptions(self, decision: Decision) -> None:
        """Count before the decision is applied: a swap of a request whose checkpoint holds
        all its tokens is a checkpointed preemption (no copy)."""
        for p in decision.preempt:
            r = self._live.get(p.request_id)
            if p.mode is PreemptMode.RECOMPUTE:
                self._counts["recompute"] += 1
            elif (
                r is not None
                and r.status is RequestStatus.RUNNING
                and r.num_computed_tokens > 0
                and self.blocks.checkpointed_tokens(r.request_id) >= r.num_computed_tokens
            ):
                self._counts["checkpoint"] += 1
            else:
                self._counts["swap"] += 1

    def _stall_check(self) -> None:
        """A policy that schedules nothing while requests wait and no copies are pending."""
        if all(r.status is not RequestStatus.RUNNING for r in self._live.values()) and (
            self.blocks.num_free(Tier.DEVICE) == self.blocks.num_total(Tier.DEVICE)
        ):
            self._fail(list(self._live.values()), f"policy {self.policy.name} made no progress")

    def stats(self) -> LoopStats:
        """The snapshot taken at the end of the latest step, with the requests submitted
        since then counted as waiting (so a loop stuck in a step still shows its queue);
        safe from any thread."""
        s = self._stats
        with self._cv:
            unfinished = len(self._live) + len(self._inbox)
        waiting = max(s.num_waiting, unfinished - s.num_running - s.num_swapped)
        return s if waiting == s.num_waiting else replace(s, num_waiting=waiting)

    def take_step_tokens(self) -> list[int]:
        """The tokens each step computed since the last call, oldest first (a histogram's
        observations: a snapshot cannot carry them); safe from any thread."""
        taken = self._step_tokens
        return [taken.popleft() for _ in range(len(taken))]

    def _snapshot(self) -> LoopStats:
        view = self._view(self.clock.now())
        hidden = self.blocks.usage(CacheKind.HIDDEN)
        return LoopStats(
            num_waiting=len(view.waiting),
            num_running=len(view.running),
            num_swapped=len(view.swapped),
            device_blocks_used=self.blocks.num_total(Tier.DEVICE) - view.free_device_blocks,
            device_blocks_total=self.blocks.num_total(Tier.DEVICE),
            host_blocks_used=self.blocks.num_total(Tier.HOST) - view.free_host_blocks,
            host_blocks_total=self.blocks.num_total(Tier.HOST),
            num_steps=self._counts["steps"],
            num_preemptions_swap=self._counts["swap"],
            num_preemptions_recompute=self._counts["recompute"],
            num_generated_tokens=self._committer.num_generated_tokens,
            num_hidden_cache=hidden[0],
            hidden_blocks_used=hidden[1],
            num_preemptions_checkpoint=self._counts["checkpoint"],
            num_safepoint_aborts=self._counts["aborts"],
            checkpoint_blocks_used=self.blocks.num_checkpoint_blocks(),
            num_checkpoint_blocks_copied=self._counts["ckpt_copies"],
            prefix_cache_queries=self._applier.prefix_queries,
            prefix_cache_hits=self._applier.prefix_hits,
            device_cached_blocks=self.blocks.num_cached(Tier.DEVICE),
            host_cached_blocks=self.blocks.num_cached(Tier.HOST),
            spec_num_drafts=self._committer.num_drafts,
            spec_num_draft_tokens=self._committer.num_draft_tokens,
            spec_num_accepted_tokens=self._committer.num_accepted_tokens,
            async_scheduling=self.async_scheduling,
            num_overlapped_steps=self._counts["overlapped"],
        )


def _reported_blocks(r: Request, block_size: int) -> int:
    """How many leading blocks of a request that asks for prompt logprobs may come from the
    prefix cache: only those whose rows it has reported already.

    Why: a cached block holds K/V, not the logits its rows gave, so a row served from the
    cache has no logprob to report. vLLM gives such a request no cache hit at all; here the
    cap is the rows already reported, which is the same for a new request (none) but lets a
    request preempted by recompute take back the prefix it reported before, and one that
    reported its whole prompt hit as any other. Its own blocks are named and shared as usual.
    """
    reported = len(r.prompt_logprobs)
    if reported >= r.num_prompt_tokens - 1:
        return len(r.all_token_ids)  # NOTE: every row reported: no cap
    return reported // block_size


def _launcher_for(
    runner: Runner, execute: Callable[[SchedulerOutput], RunnerOutput], overlap: bool
) -> Launcher:
    """The runner's own ``launch`` where it has one, else ``execute`` inline, or on a step
    thread when steps overlap (bound to the runner's device by its ``bind_thread``)."""
    if callable(getattr(runner, "launch", None)):
        return runner  # type: ignore[return-value]
    if not overlap:
        return InlineLauncher(execute)
    return ThreadedLauncher(execute, getattr(runner, "bind_thread", None))


def _rows(out: RunnerOutput, keep: list[int]) -> RunnerOutput:
    """``out`` with only the rows at ``keep``."""

    def pick(values: tuple) -> tuple:
        return tuple(values[i] for i in keep) if values else ()

    return replace(
        out,
        request_ids=pick(out.request_ids),
        sampled_token_ids=pick(out.sampled_token_ids),
        logprobs=pick(out.logprobs),
        prompt_logprobs=pick(out.prompt_logprobs),
        pooled=pick(out.pooled),
        num_accepted=pick(out.num_accepted),
        proposals=pick(out.proposals),
    )


def _merge_outputs(seqs: list[ScheduledSeq], outs: list[RunnerOutput]) -> RunnerOutput:
    """One ``RunnerOutput`` for ``seqs`` from the outputs of running each alone."""
    logprobs = tuple(o.logprobs[0] if o.logprobs else None for o in outs)
    prompt = tuple(o.prompt_logprobs[0] if o.prompt_logprobs else () for o in outs)
    accepted = tuple(o.num_accepted[0] if o.num_accepted else 0 for o in outs)
    proposals = tuple(o.proposals[0] if o.proposals else () for o in outs)
    pooled = tuple(o.pooled[0] if o.pooled else () for o in outs)
    times = [o.step_time for o in outs if o.step_time is not None]
    return RunnerOutput(
        request_ids=tuple(s.request_id for s in seqs),
        sampled_token_ids=tuple(o.sampled_token_ids[0] for o in outs),
        step_time=sum(times) if times else None,
        logprobs=logprobs if any(lp is not None for lp in logprobs) else (),
        prompt_logprobs=prompt if any(prompt) else (),
        num_accepted=accepted if any(o.num_accepted for o in outs) else (),
        proposals=proposals if any(proposals) else (),
        pooled=pooled if any(pooled) else (),
    )
