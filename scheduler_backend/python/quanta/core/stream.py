"""What the loop tells the outside world: per-request deltas and a blocking stream of them."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from quanta.core.errors import QuantaError
from quanta.core.output import TokenLogprob
from quanta.core.request import Request


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timestamps (loop clock seconds) and counters of a finished request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    token_times: tuple[float, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    num_swapped_blocks: int
    num_recomputed_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first start

    @classmethod
    def of(cls, r: Request) -> RequestMetrics:
        return cls(
            arrival_time=r.arrival_time,
            first_scheduled_time=r.first_scheduled_time,
            first_token_time=r.first_token_time,
            finish_time=r.finish_time,
            token_times=tuple(r.token_times),
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_preemptions=r.num_preemptions,
            num_swapped_blocks=r.num_swapped_blocks,
            num_recomputed_tokens=r.num_recomputed_tokens,
            num_cached_tokens=r.num_cached_prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One delta of one request; the last one has ``finished`` set and carries metrics."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    error: QuantaError | None = None
    metrics: RequestMetrics | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of new_token_ids, when the request asked
    # with the first token, when prompt logprobs were asked: the prompt, and the logprobs of
    # its tokens after the first (one fewer than the prompt's ids)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    embedding: tuple[float, ...] = ()  # an embedding request's, on its final delta


Sink = Callable[[RequestOutput], None]


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    """A whole generation, assembled from its deltas."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    error: QuantaError | None
    metrics: RequestMetrics | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., when asked
    embedding: tuple[float, ...] = ()  # an embedding request's

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


class RequestStream:
    """A sink that a client thread iterates; thread-safe, ends after the final delta."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[RequestOutput] = queue.Queue()

    def __call__(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._queue.get()
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> CompletedRequest:
        """Block until the request ends and return it whole (errors are in ``.error``)."""
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob] = []
        while True:
            out = self._queue.get(timeout=timeout)
            text.append(out.new_text)
            ids.extend(out.new_token_ids)
            logprobs.extend(out.logprobs)
            prompt_logprobs.extend(out.prompt_logprobs)
            if out.finished:
                return CompletedRequest(
                    self.request_id,
                    "".join(text),
                    tuple(ids),
                    out.finish_reason,
                    out.error,
                    out.metrics,
                    tuple(logprobs),
                    tuple(prompt_logprobs),
                    out.embedding,
                )
