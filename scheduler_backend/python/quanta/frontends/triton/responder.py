"""In-flight requests and the response thread that sends their outputs to Triton.

Why a thread: ``response_sender.send`` is a blocking IPC round trip to the Triton process, and
the engine loop calls each request's sink on its own thread. Sinks only put into a queue; this
thread drains it, turns deltas into responses, polls cancellation, and always ends a request
with the final flag. It is the single owner of the per-request accumulators, so they need no
lock; the table of live requests is shared with ``execute()`` and is locked.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from quanta.core.errors import QuantaError
from quanta.core.output import TokenLogprob
from quanta.core.stream import RequestOutput
from quanta.frontends.triton.tensors import output_arrays

log = logging.getLogger(__name__)


class Sender(Protocol):
    """The parts of Triton's ``InferenceResponseSender`` the responder uses."""

    def send(self, response: Any = None, flags: int = 0) -> None: ...

    def is_cancelled(self) -> bool: ...


class ResponseFactory(Protocol):
    """Builds Triton responses; the backend implements it with ``pb_utils``."""

    final_flag: int

    def response(self, arrays: dict[str, Any]) -> Any: ...

    def error(self, code: str, message: str) -> Any: ...


@dataclass(slots=True, eq=False)
class InflightRequest:
    """One request between ``execute()`` and its final response."""

    request_id: str
    sender: Sender
    stream: bool
    tenant: str = "default"
    priority_class: str = "online"
    text: list[str] = field(default_factory=list)  # accumulated when not streaming
    token_ids: list[int] = field(default_factory=list)
    # exclude_input_in_output=false: the non-streamed answer starts with the prompt
    echo_text: str = ""
    echo_ids: tuple[int, ...] = ()
    return_log_probs: bool = False
    top_log_probs: int = 0
    return_prompt_log_probs: bool = False
    # when asked, sent with the first response that carries tokens (held until then)
    prompt_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # accumulated when not streaming
    cumulative_logprob: float = 0.0
    sequence_index: int | None = None  # one of num_return_sequences: said in every response
    embedding: bool = False  # an embedding request: its final response carries the vector
    num_prompt_tokens: int = 0
    prefilled: bool = False  # its first token came out (``on_prefilled`` was called)
    cancelled: bool = False
    last_cancel_check: float = 0.0


class SequenceGroupSender:
    """The sender of one Triton request that runs as ``n`` sequences: each sequence's final
    response goes out as a plain one, and only the last sequence to end sends the final flag.
    Used from the responder thread only, so the count needs no lock."""

    def __init__(self, sender: Sender, n: int, final_flag: int) -> None:
        self._sender = sender
        self._open = n
        self._final = final_flag

    def send(self, response: Any = None, flags: int = 0) -> None:
        if flags & self._final:
            self._open -= 1
            if self._open > 0:
                flags &= ~self._final
        self._sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


@dataclass(frozen=True, slots=True)
class Reply:
    """The one final response of a request the engine answers at once, without generating
    (a control request such as a prefix-cache reset); ``arrays`` are its output tensors."""

    arrays: dict[str, Any] = field(default_factory=dict)


Finished = Callable[[InflightRequest, RequestOutput], None]
_STOP = object()


class Responder:
    """Drains engine outputs into Triton responses on one thread; see the module docstring."""

    def __init__(
        self,
        factory: ResponseFactory,
        cancel: Callable[[str], None],
        *,
        on_finished: Finished | None = None,
        on_prefilled: Callable[[InflightRequest], None] | None = None,
        cancel_check_interval: float = 0.02,
    ) -> None:
        self._factory = factory
        self._cancel = cancel
        self._on_finished = on_finished
        self._on_prefilled = on_prefilled
        self._interval = cancel_check_interval
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, InflightRequest] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="quanta-responder", daemon=True)

    # -- any thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def track(self, inflight: InflightRequest) -> Callable[[RequestOutput], None]:
        """Register a request before it is submitted; returns its (cheap) engine sink."""
        with self._lock:
            self._live[inflight.request_id] = inflight
        return lambda out: self._queue.put((inflight, out))

    def reject(self, inflight: InflightRequest, error: QuantaError) -> None:
        """End a request that never reached the engine (invalid input, shutting down)."""
        with self._lock:
            self._live.pop(inflight.request_id, None)
        self._queue.put((inflight, error))

    def reply(self, inflight: InflightRequest, reply: Reply) -> None:
        """End a request that needs no generation with ``reply``; sent by the response thread
        like every other response, after what was queued before it."""
        self._queue.put((inflight, reply))

    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    def fail_all(self, error: QuantaError) -> int:
        """End every request still in flight with ``error``, whatever the engine does: for an
        engine that died or is stuck, which will never end them. Returns how many."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for inflight in live:
            self._queue.put((inflight, error))
        return len(live)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far was sent (True), or ``timeout`` s passed."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Send what is queued (the engine must have failed its requests first), then stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- responder thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._interval)
            except queue.Empty:
                self._sweep()
                continue
            batch = [item]
            while True:  # whatever else is queued: sent together, one response per request
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(entry is _STOP for entry in batch)
            flushed = [e for e in batch if isinstance(e, threading.Event)]
            batch = [e for e in batch if e is not _STOP and not isinstance(e, threading.Event)]
            for inflight, payload in _coalesce(batch):
                try:
                    if isinstance(payload, QuantaError):
                        self._send_final(inflight, self._error(payload))
                        if self._on_finished is not None:
                            rejected = RequestOutput(
                                inflight.request_id, (), "", True, None, payload
                            )
                            self._on_finished(inflight, rejected)
                    elif isinstance(payload, Reply):
                        self._send_final(inflight, self._factory.response(payload.arrays))
                    else:
                        self._handle(inflight, payload)
                except Exception:  # one broken request must not stop everyone's responses
                    log.exception("responding to %s failed", inflight.request_id)
            for event in flushed:
                event.set()
            if stop:
                return
            self._sweep()

    def _handle(self, inflight: InflightRequest, out: RequestOutput) -> None:
        if out.new_token_ids and not inflight.prefilled:
            inflight.prefilled = True
            if self._on_prefilled is not None:
                self._on_prefilled(inflight)
        new_logprobs = list(out.logprobs)
        inflight.cumulative_logprob += sum(lp.logprob for lp in new_logprobs)
        want, top = inflight.return_log_probs, inflight.top_log_probs
        if inflight.return_prompt_log_probs and out.prompt_token_ids:
            inflight.prompt_ids = out.prompt_token_ids
            inflight.prompt_logprobs = out.prompt_logprobs
        if not out.finished:
            # NOTE: asked at every batch of a stream's deltas (one per responder round, as
            # they are merged), so a disconnect is seen within a step or two at any load.
            if self._poll_cancelled(inflight, force=inflight.stream):
                return
            if inflight.stream:
                arrays = output_arrays(
                    out.new_text,
                    out.new_token_ids,
                    logprobs=new_logprobs if want else None,
                    top=top,
                    sequence_index=inflight.sequence_index,
                    **_take_prompt(inflight),
                )
                self._send(inflight, self._factory.response(arrays))
            else:
                inflight.text.append(out.new_text)
                inflight.token_ids.extend(out.new_token_ids)
                inflight.logprobs.extend(new_logprobs)
            return
        with self._lock:
            self._live.pop(inflight.request_id, None)
        text, ids, logprobs = out.new_text, list(out.new_token_ids), new_logprobs
        if not inflight.stream:  # the one response carries everything
            text = "".join([inflight.echo_text, *inflight.text, text])
            ids = [*inflight.echo_ids, *inflight.token_ids, *ids]
            logprobs = [*inflight.logprobs, *logprobs]
        if out.error is not None:
            response = self._error(out.error)
        else:
            arrays = output_arrays(
                text,
                ids,
                finish_reason=out.finish_reason,
                metrics=out.metrics,
                logprobs=logprobs if want else None,
                top=top,
                cumulative_logprob=inflight.cumulative_logprob if want else None,
                sequence_index=inflight.sequence_index,
                embedding=out.embedding if inflight.embedding else None,
                **_take_prompt(inflight),
            )
            response = self._factory.response(arrays)
        self._send_final(inflight, response)
        if self._on_finished is not None:
            self._on_finished(inflight, out)

    def _error(self, error: QuantaError) -> Any:
        return self._factory.error(error.code, str(error))

    def _send(self, inflight: InflightRequest, response: Any) -> None:
        try:
            inflight.sender.send(response)
        except Exception as exc:  # the client went away: stop spending compute on it
            log.info("dropping %s: send failed: %s", inflight.request_id, exc)
            self._cancel_request(inflight)

    def _send_final(self, inflight: InflightRequest, response: Any) -> None:
        try:
            inflight.sender.send(response, flags=self._factory.final_flag)
        except Exception as exc:
            log.info("final response of %s not delivered: %s", inflight.request_id, exc)

    def _poll_cancelled(self, inflight: InflightRequest, *, force: bool = False) -> bool:
        """Ask Triton (an IPC) whether the client cancelled; at most once per interval."""
        if inflight.cancelled:
            return True
        now = time.monotonic()
        if not force and now - inflight.last_cancel_check < self._interval:
            return False
        inflight.last_cancel_check = now
        try:
            cancelled = inflight.sender.is_cancelled()
        except Exception:
            cancelled = True
        if cancelled:
            self._cancel_request(inflight)
        return cancelled

    def _cancel_request(self, inflight: InflightRequest) -> None:
        # NOTE: the engine answers with a final "cancelled" output, which ends the request here.
        if not inflight.cancelled:
            inflight.cancelled = True
            self._cancel(inflight.request_id)

    def _sweep(self) -> None:
        """Poll requests that produced nothing lately (waiting, swapped, non-streaming)."""
        with self._lock:
            live = list(self._live.values())
        for inflight in live:
            self._poll_cancelled(inflight)


def _take_prompt(inflight: InflightRequest) -> dict[str, Any]:
    """The prompt's ids and logprobs for the response being built, once."""
    if inflight.prompt_logprobs is None:
        return {}
    extras = {"prompt_ids": inflight.prompt_ids, "prompt_logprobs": inflight.prompt_logprobs}
    inflight.prompt_logprobs = None
    return extras


Payload = RequestOutput | QuantaError | Reply


def _coalesce(
    items: list[tuple[InflightRequest, Payload]],
) -> list[tuple[InflightRequest, Payload]]:
    """One entry per request, in order of first appearance: its deltas merged into one.

    Why: every response is a blocking IPC to Triton, and an engine step makes one delta per
    running request. At high concurrency the responder fell behind the engine, so streams
    lagged and a client's disconnect was noticed only once its backlog was sent (about 100
    tokens late at 50 streams); merging what queued up meanwhile bounds the IPCs per step.
    """
    merged: dict[str, tuple[InflightRequest, list[Payload]]] = {}
    for inflight, payload in items:
        merged.setdefault(inflight.request_id, (inflight, []))[1].append(payload)
    out: list[tuple[InflightRequest, Payload]] = []
    for inflight, payloads in merged.values():
        deltas = [p for p in payloads if isinstance(p, RequestOutput)]
        out.extend((inflight, p) for p in payloads if not isinstance(p, RequestOutput))
        if deltas:
            out.append((inflight, _merge(deltas)))
    return out


def _merge(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one (the last one says whether it finished)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return RequestOutput(
        last.request_id,
        tuple(t for d in deltas for t in d.new_token_ids),
        "".join(d.new_text for d in deltas),
        last.finished,
        last.finish_reason,
        last.error,
        last.metrics,
        tuple(lp for d in deltas for lp in d.logprobs),
        tuple(t for d in deltas for t in d.prompt_token_ids),
        tuple(lp for d in deltas for lp in d.prompt_logprobs),
        last.embedding,
    )
