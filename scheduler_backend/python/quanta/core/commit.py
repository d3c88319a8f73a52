"""After a step: advance computed tokens, append samples, detect stops, stream deltas.

Owns the per-request sinks and detokenizers, so every request ends with exactly one final
delta and its blocks returned, whatever way it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from quanta.core.blocks import BlockManager
from quanta.core.clock import Clock
from quanta.core.detokenize import Decode, Detokenizer
from quanta.core.errors import EngineStepError, QuantaError
from quanta.core.faults import FaultPlan
from quanta.core.output import RunnerOutput, ScheduledSeq, SchedulerOutput, TokenLogprob
from quanta.core.pooling import pooled_vector
from quanta.core.prefix import block_hashes
from quanta.core.request import Request, RequestStatus
from quanta.core.speculative import learn
from quanta.core.stream import RequestMetrics, RequestOutput, Sink

log = logging.getLogger(__name__)


class Committer:
    """Turns runner outputs into request progress and client deltas."""

    def __init__(self, clock: Clock, blocks: BlockManager, decode: Decode | None) -> None:
        self.clock, self.blocks, self.decode = clock, blocks, decode
        self._sinks: dict[str, Sink] = {}
        self._detok: dict[str, Detokenizer] = {}
        self.num_generated_tokens = 0
        # Speculative decoding (vLLM's spec_decode counters): seqs that verified drafts, the
        # drafts they verified, and those the runner accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.faults: FaultPlan | None = None  # tests only (``core/faults.py``)

    def track(self, r: Request, sink: Sink) -> None:
        self._sinks[r.request_id] = sink
        if self.decode is not None:
            self._detok[r.request_id] = Detokenizer(self.decode, r.params.stop)

    def commit(
        self,
        sched: SchedulerOutput,
        out: RunnerOutput,
        live: Mapping[str, Request],
        step_time: float,
    ) -> list[Request]:
        """Apply one step's results; returns the requests that finished.

        A request whose commit raises (a bug in its detokenizer, its constraint, its prompt
        logprobs) ends with ``EngineStepError`` and is among those returned; the others'
        commits go on."""
        now = self.clock.now()
        done: list[Request] = []
        logprobs = out.logprobs or (None,) * len(sched.seqs)
        prompt_logprobs = out.prompt_logprobs or ((),) * len(sched.seqs)
        accepted = out.num_accepted or (0,) * len(sched.seqs)
        proposals = out.proposals or ((),) * len(sched.seqs)
        pooled = out.pooled or ((),) * len(sched.seqs)
        for seq, token, lp, plp, num_accepted, proposed, vector in zip(
            sched.seqs,
            out.sampled_token_ids,
            logprobs,
            prompt_logprobs,
            accepted,
            proposals,
            pooled,
            strict=True,
        ):
            r = live[seq.request_id]
            try:
                if r.pooling is not None:
                    finished = self._commit_pooled(r, seq, vector, step_time)
                else:
                    finished = self._commit_seq(
                        r, seq, token, lp, plp, num_accepted, proposed, now, step_time
                    )
                if finished:
                    done.append(r)
            except Exception as exc:
                log.exception("committing the step of %s failed", r.request_id)
                if not r.status.finished:
                    self.finish_with_error(r, EngineStepError(f"engine step failed: {exc}"))
                done.append(r)
        return done

    def _commit_seq(
        self,
        r: Request,
        seq: ScheduledSeq,
        token: int | None,
        lp: TokenLogprob | None,
        plp: tuple[TokenLogprob, ...],
        num_accepted: int,
        proposed: tuple[int, ...],
        now: float,
        step_time: float,
    ) -> bool:
        """Commit one request's share of the step; True when it finished."""
        if self.faults is not None:
            self.faults.check("commit", r)
        drafts = r.draft_token_ids[: seq.num_draft_tokens]
        r.draft_token_ids = ()
        if not 0 <= num_accepted <= len(drafts):
            raise RuntimeError(f"{r.request_id}: {num_accepted} of {len(drafts)} drafts accepted")
        # NOTE: the K/V of rejected drafts lies past the computed tokens: written over
        # next step, never named, and its spare blocks go back below
        self._advance(r, seq, seq.num_new_tokens - len(drafts) + num_accepted)
        r.attained_service += step_time
        if seq.prompt_logprobs is not None:
            _record_prompt_logprobs(r, seq.prompt_logprobs.first, plp)
        if token is None:
            return False
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += num_accepted
            learn(r, len(drafts), num_accepted)
        for i, t in enumerate((*drafts[:num_accepted], token)):
            if self._append(r, t, lp if i == num_accepted else None, now):
                return True
        if drafts or seq.num_proposals:
            self.blocks.trim_slots(r.request_id, r.num_tokens)
        r.draft_token_ids = proposed  # the draft model's, verified next step
        if num_accepted and not seq.hidden:
            # NOTE: the accepted drafts' tokens are in the request only now; a request
            # that finished on them leaves those blocks unnamed (they are its last)
            self._name_blocks(r)
        return False

    def _commit_pooled(
        self, r: Request, seq: ScheduledSeq, vector: tuple[float, ...], step_time: float
    ) -> bool:
        """Commit an embedding request's chunk: pool its rows, and end it with its embedding
        once the whole prompt is computed; True when it finished."""
        if self.faults is not None:
            self.faults.check("commit", r)
        self._advance(r, seq, seq.num_new_tokens)
        r.attained_service += step_time
        if seq.pooling is not None and vector:  # NOTE: a runner without tensors pools nothing
            if seq.pooling.first < r.num_pooled_rows:
                raise RuntimeError(f"{r.request_id}: rows from {seq.pooling.first} pooled twice")
            r.pooled_sum = (
                [a + b for a, b in zip(r.pooled_sum, vector, strict=True)]
                if r.pooled_sum
                else list(vector)
            )
            r.num_pooled_rows = seq.pooling.first + seq.pooling.num_rows
        if r.num_computed_tokens < r.num_prompt_tokens:
            return False
        assert r.pooling is not None
        rows = 1 if r.pooling.pooling_type == "LAST" else r.num_pooled_rows
        embedding = pooled_vector(r.pooled_sum, rows, r.pooling)
        self._finish(r, RequestStatus.FINISHED_STOPPED, (), "", embedding=embedding)
        return True

    def _advance(self, r: Request, seq: ScheduledSeq, n: int) -> None:
        """Count the ``n`` tokens ``seq`` computed, and name the blocks they filled.

        A request preempted after its step was launched (the loop schedules the next step
        while one runs: ``core/overlap.py``) kept no K/V by recompute, so it gains no
        computed tokens; a swapped one's copy held them, and its blocks are named once it
        runs again."""
        if r.status is RequestStatus.WAITING:
            return
        r.num_computed_tokens += n
        if r.status is RequestStatus.RUNNING and not seq.hidden:
            self._name_blocks(r)

    def _name_blocks(self, r: Request) -> None:
        """Name the full blocks of ``r``'s computed tokens for the prefix cache, then give
        back those a sliding window has left behind (named first, so they stay cached)."""
        if self.blocks.prefix_caching:
            full = r.num_computed_tokens // self.blocks.block_size
            self.blocks.name_blocks(
                r.request_id, block_hashes(r, self.blocks.block_size, full)[:full]
            )
        self.blocks.release_behind_window(r.request_id, r.num_computed_tokens)

    def _append(self, r: Request, token: int, lp: TokenLogprob | None, now: float) -> bool:
        """Append one sampled (or accepted) token and stream it; True when ``r`` finished."""
        r.append_token(token, now)
        new_logprobs = () if lp is None else (lp,)
        if lp is not None:
            r.cumulative_logprob += lp.logprob
        self.num_generated_tokens += 1
        status = self._stop_status(r, token)
        if status is None and r.constraint is not None:
            if not r.constraint.accept(token):
                self.finish_with_error(r, _forbidden(r, token))
                return True
            if r.constraint.terminated:  # the grammar's stop token, under ignore_eos
                status = RequestStatus.FINISHED_STOPPED
        text, hit_stop = self._text(r, final=status is not None)
        if hit_stop:
            status = RequestStatus.FINISHED_STOPPED
        prompt = _prompt_extras(r)
        if status is None:
            self._emit(
                r, RequestOutput(r.request_id, (token,), text, logprobs=new_logprobs, **prompt)
            )
            return False
        self._finish(r, status, (token,), text, logprobs=new_logprobs, **prompt)
        return True

    def finish_with_error(self, r: Request, error: QuantaError) -> None:
        """End a request early (cancel, throttle, failed step) with a final error delta."""
        r.error = str(error)
        status = (
            RequestStatus.FINISHED_ABORTED
            if error.code == "cancelled"
            else RequestStatus.FINISHED_ERROR
        )
        self._finish(r, status, (), "", error)

    def _stop_status(self, r: Request, token: int) -> RequestStatus | None:
        p = r.params
        if (not p.ignore_eos and token in r.eos_token_ids) or token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _text(self, r: Request, final: bool) -> tuple[str, bool]:
        if self.faults is not None:
            self.faults.check("detokenize", r)
        detok = self._detok.get(r.request_id)
        if detok is None:
            return "", False
        return detok.update(r.output_token_ids, final)

    def _finish(
        self,
        r: Request,
        status: RequestStatus,
        tokens: tuple[int, ...],
        text: str,
        error: QuantaError | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_token_ids: tuple[int, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
        embedding: tuple[float, ...] = (),
    ) -> None:
        r.set_status(status)
        r.finish_time = self.clock.now()
        self.blocks.free(r.request_id)
        self._detok.pop(r.request_id, None)
        out = RequestOutput(
            r.request_id,
            tokens,
            text,
            True,
            r.finish_reason,
            error,
            RequestMetrics.of(r),
            logprobs,
            prompt_token_ids,
            prompt_logprobs,
            embedding,
        )
        self._emit(r, out)
        self._sinks.pop(r.request_id, None)

    def _emit(self, r: Request, out: RequestOutput) -> None:
        sink = self._sinks.get(r.request_id)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:  # a broken client must not take the loop down
            log.exception("sink of %s failed", r.request_id)


def _forbidden(r: Request, token: int) -> QuantaError:
    """A sampled token the grammar forbids: only when every token it allows was banned too
    (``min_tokens`` holding back the stop token the grammar asks for, or bad words)."""
    return EngineStepError(
        f"structured output: token {token} at output position {r.num_output_tokens - 1} is "
        "not allowed by the request's grammar (min_tokens or bad_words banned every token "
        "the grammar allows there)"
    )


def _record_prompt_logprobs(r: Request, first: int, values: tuple[TokenLogprob, ...]) -> None:
    """Append a step's prompt logprobs; the applier asked from the first unreported row.
    A runner that computes no logprobs (the simulator's) returns none."""
    if not values:
        return
    if first != len(r.prompt_logprobs):
        raise RuntimeError(f"{r.request_id}: prompt logprobs from row {first} out of order")
    r.prompt_logprobs.extend(values)


def _prompt_extras(r: Request) -> dict[str, tuple]:
    """The prompt's ids and logprobs, sent once with the first output token when asked."""
    if r.params.prompt_logprobs is None or r.num_output_tokens != 1:
        return {}
    return {
        "prompt_token_ids": tuple(r.prompt_token_ids),
        "prompt_logprobs": tuple(r.prompt_logprobs),
    }
