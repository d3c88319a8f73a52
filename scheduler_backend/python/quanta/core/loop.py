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


@dataclass(frozen=True, slots=True)
class LoopHealth:
    """Whether the loop serves: its thread is alive and, with work in flight, it completed a
    step within the stall timeout. ``reason`` says why not (empty when healthy)."""

    healthy: bool
    reason: str = ""
    seconds_since_step: float = 0.0  # since the latest step ended; 0 while idle
    num_unfinished: int = 0  # requests submitted and not finished


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
    ) -> None:
        check_capabilities(policy, runner.capabilities, type(runner).__name__)
        self.runner, self.policy, self.blocks, self.clock = runner, policy, blocks, clock
        self.max_model_len = max_model_len
        self._applier = DecisionApplier(blocks)
        self._proposer = None if speculative is None else Proposer(speculative, max_model_len)
        self._committer = Committer(clock, blocks, decode)
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

        Containment: a request whose scheduling, row or commit raises ends alone with
        ``EngineStepError``; a step whose every request failed counts toward
        ``max_step_failures``, and an exception outside any one request's handling
        propagates (the thread driver then fails everything in flight: ``_die``)."""
        self._ingest()
        if not self._live:
            self._stats = self._snapshot()
            return False
        if self.faults is not None:
            self.faults.check_any("step", self._live.values())  # NOTE: uncontainable
            self.faults.stall(self._live.values())
            if self._stopping:
                return False
        now = self.clock.now()
        try:
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
            self._fail(list(self._live.values()), f"scheduler error: {exc}")
            self._step_failed(f"scheduler error: {exc}")
            return True
        failed: dict[str, Exception] = dict(self._applier.failed)
        if sched.is_empty:
            self._fail_each(failed)
            return bool(decision.preempt) or bool(failed)
        if decision.abort_when is not None and self._safepoints and sched.seqs:
            sched = replace(sched, abort=self._abort)
            with self._cv:
                self._abort.clear()
                self._abort_rule = decision.abort_when
                # NOTE: a request that came in while the policy decided was not checked
                # against this rule (there was none): it stops the step at its first check
                if any(self.would_abort(r, now) for r, _ in self._inbox):
                    self._abort.raise_at(self.clock.now())
        try:
            out = self._execute(sched)
        except StepAborted:
            self._aborted(decision)
            self._fail_each(failed)
            return True
        except WorkerLostError as exc:
            # NOTE: every request's KV (and every cached prefix) had a shard on the lost rank
            self.blocks.drop_pending_checkpoints()
            log.error("%s", exc)
            self._fail(list(self._live.values()), str(exc), WorkerLostError)
            self.blocks.reset_prefix_cache()
            self._step_failed(str(exc))
            return True
        except MalformedStepError as exc:
            # NOTE: nothing was copied or written: the step's requests (and those whose KV
            # was to move) end, the others never met it
            self.blocks.drop_pending_checkpoints()
            log.exception("the runner refused the step")
            self._fail_step(decision, sched, exc)
            self._fail_each(failed)
            self._step_failed(f"engine step failed: {exc}")
            return True
        except Exception as exc:
            self.blocks.drop_pending_checkpoints()
            log.exception("engine step failed; running its requests one at a time")
            isolated = self._isolate(sched, failed)
            if isolated is None:
                self._fail_step(decision, sched, exc)
                self._fail_each(failed)
                self._step_failed(f"engine step failed: {exc}")
                return True
            sched, out = isolated
        finally:
            self._abort_rule = None
        self.blocks.confirm_checkpoints()
        self._counts["ckpt_copies"] += len(sched.checkpoint)
        step_time = self.clock.now() - now
        self._counts["steps"] += 1
        self._step_tokens.append(sched.num_tokens)
        done = self._committer.commit(sched, out, self._live, step_time)
        if failed:  # NOTE: the policy learns only from the rows that ran
            ran = {s.request_id for s in sched.seqs}
            decision = replace(decision, run=tuple(p for p in decision.run if p[0] in ran))
        self.policy.on_step(decision, out, step_time)
        for r in done:
            del self._live[r.request_id]
            self.policy.on_finish(r)
        self._fail_each(failed)
        if len(sched.seqs) > sum(1 for r in done if r.error):
            self._failed_steps = 0  # NOTE: a row went through: the engine works
        elif failed or sched.seqs:
            self._step_failed("every request of the step failed")
        self._stats = self._snapshot()
        return True

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = self.runner.execute(sched)
        if self.faults is not None:
            self.faults.check_any("runner", (self._live[s.request_id] for s in sched.seqs))
        return out

    def _isolate(
        self, sched: SchedulerOutput, failed: dict[str, Exception]
    ) -> tuple[SchedulerOutput, RunnerOutput] | None:
        """After a step raised past its block copies: run each of its requests alone (no
        copies: they were made, and K/V written again is the same), so only the rows that
        raise again fail. None when none ran (the fault is not any one request's).

        The requests that raise are added to ``failed``."""
        if len(sched.seqs) < 2:
            return None
        good, outs = [], []
        for seq in sched.seqs:
            solo = replace(sched, seqs=(seq,), swap_out=(), swap_in=(), checkpoint=(), abort=None)
            try:
                outs.append(self._execute(solo))
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
        ids = {s.request_id for s in sched.seqs} | set(decision.swap_in)
        ids |= {p.request_id for p in decision.preempt if p.mode is PreemptMode.SWAP}
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
