"""The only messages between scheduler and runner: integers and lists, never tensors.

The runner is stateless apart from its KV tensors: every ``ScheduledSeq`` carries the tokens
it computes this step, where they start and the whole block table, so a request that was
swapped, recomputed or moved between blocks needs no extra bookkeeping in the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from quanta.core.safepoint import AbortSignal
from quanta.core.structured import TokenConstraint


class MalformedStepError(ValueError):
    """A runner refused a step before copying or writing anything (block ids out of range,
    a block table too short, a position past ``max_model_len``): the ledger and the runner
    disagree about that step, and its requests' K/V was never touched. Any other exception
    from ``Runner.execute`` may come after the step's block copies were made."""


@dataclass(frozen=True, slots=True)
class LogitsProcessing:
    """What the sampler does to one row's logits besides temperature/top-k/top-p; present
    only for requests that ask for it, so plain requests carry no history."""

    history: tuple[int, ...] = ()  # prompt + output so far (when a penalty needs it)
    num_prompt_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    suppress: tuple[int, ...] = ()  # token ids banned this step (EOS before min_tokens)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # top log-probabilities to return (0: the sampled token's)
    # Structured output: the runner masks every token the request's grammar forbids next. The
    # one live object here: its state is the request's as of this step (it only advances
    # when the step's token is committed), and a runner without logits ignores it.
    constraint: TokenConstraint | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a sampled token, and the most likely tokens' (raw distribution)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobsAsk:
    """Rows of a prefill chunk whose next prompt token's log-probability is wanted (prompt
    logprobs). Only rows not reported before are asked, so a recomputed prompt is not
    reported twice."""

    first: int  # position of the first row asked; it predicts the token at ``first + 1``
    targets: tuple[int, ...]  # the prompt tokens the asked rows predict, in order
    top: int = 0  # most likely tokens to return per row


@dataclass(frozen=True, slots=True)
class PoolingAsk:
    """Rows of a prefill chunk whose final hidden states (after the last norm) an embedding
    request pools (``core/pooling.py``): the runner returns their sum, in fp32. Only rows not
    pooled before are asked, so a recomputed prompt is not pooled twice."""

    first: int  # position of the first row asked
    num_rows: int


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step: a prefill chunk, a single decode token, or a decode
    token with drafts to verify."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool  # True when this chunk ends at the newest token: sample the next one
    temperature: float
    top_p: float
    top_k: int
    seed: int
    output_index: int  # index of the token to sample; seeds its random stream
    processing: LogitsProcessing | None = None
    prompt_logprobs: PromptLogprobsAsk | None = None
    pooling: PoolingAsk | None = None  # an embedding request's rows to pool (never samples)
    # The block table holds hidden states (``HIDDEN_TOKENS_PER_BLOCK`` x block_size tokens a
    # block), from which the runner recomputes this sequence's K and V every step.
    hidden: bool = False
    # Speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are proposals to
    # verify (only with ``sample``); the runner reports how many it accepts.
    num_draft_tokens: int = 0
    # Draft-model speculation: tokens the draft model proposes after this step's output,
    # through the lookahead slots the block table holds past ``token_ids`` (0: none).
    num_proposals: int = 0
    # Tokens less likely than min_p times the most likely one are not sampled (0: off).
    min_p: float = 0.0
    # The request's prompt length, unchanged by recompute (whose chunks re-run the generated
    # tokens too): some rotations depend on it (longrope). 0: not given; the runner then takes
    # what it can see, the context up to this chunk's end.
    num_prompt_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step must do: block copies first, then one forward pass over ``seqs``, then
    the checkpoint copies."""

    seqs: tuple[ScheduledSeq, ...]
    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block)
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block)
    # (device block, host block) copied AFTER the forward pass, when the step was not aborted:
    # incremental checkpoints of this step's KV
    checkpoint: tuple[tuple[int, int], ...] = ()
    # Set on a step of preemptible work run by an engine with layer safepoints: poll it every
    # few layers and raise ``StepAborted`` once it is raised (``core/safepoint.py``).
    abort: AbortSignal | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.swap_out or self.swap_in or self.checkpoint)


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """Sampled tokens in the order of ``SchedulerOutput.seqs``; None where nothing was sampled.
    A seq that verified drafts yields its accepted drafts, then the sampled token."""

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int | None, ...]
    step_time: float | None = None  # seconds the step took, when the runner knows better
    logprobs: tuple[TokenLogprob | None, ...] = ()  # per seq, where asked for (else empty)
    # per seq, one per row its ``prompt_logprobs`` asked for (else empty)
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # per seq, the sum of the hidden states its ``pooling`` asked for (else empty)
    pooled: tuple[tuple[float, ...], ...] = ()
    # per seq, the leading drafts accepted (else empty: none had drafts); its sampled token
    # follows them, so a seq yields ``accepted + 1`` tokens
    num_accepted: tuple[int, ...] = ()
    # per seq, the draft model's proposals to follow its newest token (else empty): the
    # drafts its next step verifies
    proposals: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class RunnerCapabilities:
    """What an engine offers; a policy asking for more is refused at start-up."""

    hidden_cache: bool = False
    layer_safepoints: bool = False
    async_swap: bool = False


class Runner(Protocol):
    """Executes steps; never decides what runs."""

    capabilities: RunnerCapabilities

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Perform the block copies, run the forward pass and sample, then the checkpoint
        copies.

        Promises: on an exception no request's computed tokens advance (the loop fails that
        step's requests and goes on). ``StepAborted`` (only from a runner that offers
        ``layer_safepoints``, only for a step with ``abort`` set) is not a failure: the loop
        commits nothing of the step and schedules again.
        """
        ...
