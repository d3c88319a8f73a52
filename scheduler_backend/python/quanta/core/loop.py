"""EngineLoop: ingest -> admit -> schedule -> apply -> execute -> commit, one step at a time.

The only place where policy, blocks and runner meet. It runs either synchronously (offline
API, simulator: call ``step`` until idle) or on its own thread (servers: ``start``), with
thread-safe ``submit`` and ``cancel``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager, Tier
from quanta.core.clock import Clock
from quanta.core.commit import Committer
from quanta.core.decision import Decision, PreemptMode
from quanta.core.detokenize import Decode
from quanta.core.errors import (
    CapacityError,
    EngineStepError,
    InvalidRequestError,
    QuantaError,
    RequestAbortedError,
    ThrottledError,
    WorkerLostError,
)
from quanta.core.output import Runner, SchedulerOutput
from quanta.core.plan import PoolView
from quanta.core.policy import Policy, check_capabilities
from quanta.core.prefix import block_hashes
from quanta.core.request import CacheKind, Request, RequestStatus, validate_prompt
from quanta.core.safepoint import AbortRule, AbortSignal, StepAborted
from quanta.core.speculative import Proposer, SpeculativeConfig
from quanta.core.stream import RequestStream, Sink
from quanta.core.view import SchedulerView

log = logging.getLogger(__name__)


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
        self._stats = self._snapshot()

    # -- client side (any thread) ---------------------------------------------------------
    def submit(self, request: Request, sink: Sink | None = None) -> RequestStream | None:
        """Queue a request; raises a typed ``InvalidRequestError`` if it can never run.

        Without a ``sink`` a ``RequestStream`` is returned for the caller to iterate.
        """
        self.validate(request)
        stream = RequestStream(request.request_id) if sink is None else None
        with self._cv:
            if self._stopping:
                raise RequestAbortedError("the engine is shutting down")
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
        need = self.blocks.blocks_for(request.num_prompt_tokens + request.params.max_tokens)
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

    # -- one iteration (loop thread) -------------------------------------------------------
    def step(self) -> bool:
        """Run one iteration; False when there was nothing to do."""
        self._ingest()
        if not self._live:
            self._stats = self._snapshot()
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
            return True
        if sched.is_empty:
            return bool(decision.preempt)
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
            out = self.runner.execute(sched)
        except StepAborted:
            self._aborted(decision)
            return True
        except WorkerLostError as exc:
            # NOTE: every request's KV (and every cached prefix) had a shard on the lost rank
            self.blocks.drop_pending_checkpoints()
            log.error("%s", exc)
            self._fail(list(self._live.values()), str(exc), WorkerLostError)
            self.blocks.reset_prefix_cache()
            return True
        except Exception as exc:
            self.blocks.drop_pending_checkpoints()
            log.exception("engine step failed")
            self._fail_step(decision, sched, exc)
            return True
        finally:
            self._abort_rule = None
        self.blocks.confirm_checkpoints()
        self._counts["ckpt_copies"] += len(sched.checkpoint)
        step_time = self.clock.now() - now
        self._counts["steps"] += 1
        done = self._committer.commit(sched, out, self._live, step_time)
        self.policy.on_step(decision, out, step_time)
        for r in done:
            del self._live[r.request_id]
            self.policy.on_finish(r)
        self._stats = self._snapshot()
        return True

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
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._ingest()
        self._fail(list(self._live.values()), reason, error)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._stopping or self._inbox or self._cancels or self._live or self._resets
                ):
                    self._cv.wait()
                if self._stopping:
                    return
            if not self.step() and self._live:
                self._stall_check()
                with self._cv:  # nothing runnable now: wait for news instead of spinning
                    self._cv.wait(timeout=0.005)

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
        """The snapshot taken at the end of the latest step; safe from any thread."""
        return self._stats

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
