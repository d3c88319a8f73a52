"""Checks a policy's ``Decision`` against the block pools, then carries it out.

Validation happens on counts before anything changes, so an infeasible decision raises
``PolicyError`` and leaves every request and block exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

from quanta.core.blocks import BlockManager, Tier
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.errors import PolicyError
from quanta.core.faults import FaultPlan
from quanta.core.output import (
    LogitsProcessing,
    PoolingAsk,
    PromptLogprobsAsk,
    ScheduledSeq,
    SchedulerOutput,
)
from quanta.core.plan import PoolView, StepPlan
from quanta.core.request import CacheKind, Request, RequestStatus


class DecisionApplier:
    """The only code that changes block tables and request residency."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.prefix_queries = 0  # tokens of requests that started with K/V, cache asked
        self.prefix_hits = 0  # of them, tokens found cached
        self.faults: FaultPlan | None = None  # tests only (``core/faults.py``)
        # requests whose scheduling raised in the latest ``apply``: left out of its step,
        # still holding their blocks until the loop fails them after the step
        self.failed: dict[str, Exception] = {}

    def validate(self, d: Decision, live: Mapping[str, Request]) -> StepPlan:
        """Raise ``PolicyError`` unless ``d`` can be applied as a whole; the plan it makes.

        Replays ``d`` on a fresh ``StepPlan`` in the order ``apply`` carries it out, so the
        policies' packers and this check share one ledger, and the starts whose prefix hit
        this order cuts short (``StepPlan.trimmed``) are the ones ``apply`` cuts.
        """
        plan = StepPlan(PoolView(self.blocks))
        for p in _preempt_order(d, live):
            plan.preempt_req(_get(live, p.request_id), p.mode)
        for rid in d.swap_in:
            plan.swap_in_req(_get(live, rid))
        for rid, n in d.run:
            plan.run_req(_get(live, rid), n, _kind(d, rid))
        for rid in d.checkpoint:
            plan.checkpoint_req(_get(live, rid))
        if not d.hidden <= plan.chosen:
            stray = sorted(d.hidden - plan.chosen)
            raise PolicyError(f"hidden cache for requests that do not run: {stray}")
        return plan

    def apply(self, d: Decision, live: Mapping[str, Request], now: float) -> SchedulerOutput:
        """Validate, then update blocks and statuses and describe the step for the runner.

        NOTE: the order matters with prefix caching. Host blocks this step copies from (prefix
        hits, swap-ins) are kept from reuse for the whole step: the copies run after every
        allocation is made. The cached device blocks prefix hits share are taken right after
        the preemptions (which may free them), before anything else allocates (which may
        evict them)."""
        trimmed = self.validate(d, live).trimmed
        bm = self.blocks
        self.failed = {}
        for rid, kept in trimmed.items():
            live[rid].num_cached_tokens = bm.trim_hit(rid, kept)
        # NOTE: in run order (a dict, not a set of ids): block tables are made in this order,
        # and a string set's order changes from one process to the next
        starting = {
            rid: None for rid, _ in d.run if self._starts_with_hit(live[rid], _kind(d, rid))
        }
        for rid in starting:
            hit = bm.prefix_hit(rid)
            assert hit is not None
            bm.reserve(Tier.HOST, hit.of(Tier.HOST))
        for rid in d.swap_in:  # NOTE: a plan never credits what a swap-in frees on the host
            bm.reserve(Tier.HOST, bm.held_blocks(rid))
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        try:
            for p in _preempt_order(d, live):
                swap_out.extend(self._preempt(live[p.request_id], p.mode))
            for rid in starting:
                bm.pin_prefix(rid)
            for rid in d.swap_in:
                pairs = bm.swap_in(rid)
                assert pairs is not None
                swap_in.extend(pairs)
                live[rid].set_status(RequestStatus.RUNNING)
            seqs = []
            for rid, n in d.run:
                r = live[rid]
                if rid in starting:
                    loads = bm.load_prefix(rid)
                    assert loads is not None
                    swap_in.extend(loads)
                    r.num_computed_tokens = r.num_cached_tokens
                    if r.first_scheduled_time is None:
                        r.num_cached_prompt_tokens = min(r.num_cached_tokens, r.num_prompt_tokens)
                try:
                    seqs.append(self._schedule(r, n, now, _kind(d, rid)))
                except Exception as exc:  # NOTE: this request's own; the others still run
                    self.failed[rid] = exc
            ran = dict(d.run)
            checkpoint: list[tuple[int, int]] = []
            for rid in d.checkpoint:
                if rid in self.failed:
                    continue
                r = live[rid]
                pairs = bm.checkpoint(rid, r.num_computed_tokens + r.real_tokens(ran.get(rid, 0)))
                assert pairs is not None
                checkpoint.extend(pairs)
        finally:
            bm.end_reservations()
        swap_out.extend(bm.take_offloads())
        return SchedulerOutput(tuple(seqs), tuple(swap_out), tuple(swap_in), tuple(checkpoint))

    def _starts_with_hit(self, r: Request, kind: CacheKind) -> bool:
        """``r`` starts now with K/V and the cache holds a prefix of it (counted either way)."""
        if r.status is not RequestStatus.WAITING or self.blocks.kind_of(r.request_id):
            return False
        if kind is not CacheKind.KV or not self.blocks.prefix_caching:
            r.num_cached_tokens = 0
            return False
        hit = self.blocks.prefix_hit(r.request_id)
        self.prefix_queries += r.num_tokens
        if hit is None:
            return False
        if hit.num_tokens != r.num_cached_tokens:
            raise PolicyError(f"{r.request_id}: cached prefix changed since the lookup")
        self.prefix_hits += hit.num_tokens
        return True

    def _preempt(self, r: Request, mode: PreemptMode) -> list[tuple[int, int]]:
        """Preempt ``r``; the (device, host) copies a swap-out makes."""
        r.num_preemptions += 1
        r.draft_token_ids = ()
        r.num_lookahead_tokens = 0
        if mode is PreemptMode.SWAP:
            pairs = self.blocks.swap_out(r.request_id, r.num_computed_tokens)
            assert pairs is not None  # NOTE: validated above
            r.num_swap_outs += 1
            r.num_swapped_blocks += len(pairs)  # copies: a checkpoint saves some
            r.set_status(RequestStatus.SWAPPED)
            return pairs
        self.blocks.free(r.request_id)
        r.num_recomputed_tokens += r.num_computed_tokens
        r.num_computed_tokens = 0
        r.set_status(RequestStatus.WAITING)
        return []

    def _schedule(self, r: Request, n: int, now: float, kind: CacheKind) -> ScheduledSeq:
        start = r.num_computed_tokens
        new = self.blocks.allocate_slots(r.request_id, start + r.slots_for(n), kind)
        assert new is not None
        if self.faults is not None:
            self.faults.check("apply", r)
        r.num_cached_tokens = 0
        if r.status is RequestStatus.WAITING:
            r.set_status(RequestStatus.RUNNING)
        if r.first_scheduled_time is None:
            r.first_scheduled_time = now
        p = r.params
        sample = start + n >= r.num_tokens and r.pooling is None  # NOTE: pooled, never sampled
        drafts = start + n - r.num_tokens if sample else 0  # the optional tail: proposals
        tokens = r.all_token_ids[start : start + n]
        if drafts:
            tokens = tokens + list(r.draft_token_ids[:drafts])
        return ScheduledSeq(
            request_id=r.request_id,
            token_ids=tuple(tokens),
            start_pos=start,
            block_table=self.blocks.block_table(r.request_id),
            sample=sample,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=r.seed,
            output_index=r.num_output_tokens,
            processing=_processing(r) if sample else None,
            prompt_logprobs=_prompt_logprobs(r, start, n),
            pooling=_pooling(r, start, n),
            hidden=kind is CacheKind.HIDDEN,
            num_draft_tokens=drafts,
            num_proposals=r.num_lookahead_tokens if sample else 0,
            min_p=p.min_p,
            num_prompt_tokens=r.num_prompt_tokens,
        )


def _processing(r: Request) -> LogitsProcessing | None:
    """The row's logits processing, or None for a plain request (nothing extra to ship)."""
    p = r.params
    early = r.num_output_tokens < p.min_tokens
    if not (
        p.penalized or early or p.logit_bias or p.logprobs is not None or r.constraint is not None
    ):
        return None
    suppress: tuple[int, ...] = ()
    if early:
        eos = () if p.ignore_eos else r.eos_token_ids
        suppress = tuple(dict.fromkeys((*eos, *p.stop_token_ids)))
    return LogitsProcessing(
        history=tuple(r.all_token_ids) if p.penalized else (),
        num_prompt_tokens=r.num_prompt_tokens,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        suppress=suppress,
        bad_words_ids=p.bad_words_ids,
        logit_bias=tuple((p.logit_bias or {}).items()),
        logprobs=p.logprobs,
        constraint=r.constraint,
    )


def _prompt_logprobs(r: Request, start: int, n: int) -> PromptLogprobsAsk | None:
    """The rows of positions ``[start, start + n)`` that predict a prompt token not yet
    reported (row q predicts token q + 1), or None."""
    top = r.params.prompt_logprobs
    if top is None:
        return None
    first = max(start, len(r.prompt_logprobs))
    end = min(start + n, r.num_prompt_tokens - 1)
    if first >= end:
        return None
    return PromptLogprobsAsk(first, tuple(r.prompt_token_ids[first + 1 : end + 1]), top)


def _pooling(r: Request, start: int, n: int) -> PoolingAsk | None:
    """The rows of positions ``[start, start + n)`` an embedding request pools: the last
    prompt token's (``LAST``), or every prompt token's not pooled yet (``MEAN``)."""
    if r.pooling is None:
        return None
    end = min(start + n, r.num_prompt_tokens)
    if r.pooling.pooling_type == "LAST":
        return PoolingAsk(end - 1, 1) if end == r.num_prompt_tokens else None
    first = max(start, r.num_pooled_rows)
    return PoolingAsk(first, end - first) if first < end else None


def _preempt_order(d: Decision, live: Mapping[str, Request]) -> list[Preemption]:
    """The decision's preemptions, those that free host blocks (recomputes of swapped
    requests) first: every host block a swap-out takes is then taken after every one freed,
    so a plan that fits in total fits at each point."""
    frees_host = [
        p
        for p in d.preempt
        if p.mode is PreemptMode.RECOMPUTE
        and p.request_id in live
        and live[p.request_id].status is RequestStatus.SWAPPED
    ]
    return frees_host + [p for p in d.preempt if p not in frees_host]


def _kind(d: Decision, rid: str) -> CacheKind:
    return CacheKind.HIDDEN if rid in d.hidden else CacheKind.KV


def _get(live: Mapping[str, Request], rid: str) -> Request:
    r = live.get(rid)
    if r is None:
        raise PolicyError(f"{rid}: unknown or finished")
    return r
