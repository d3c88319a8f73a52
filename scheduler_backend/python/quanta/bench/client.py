"""Replay a request list against a live endpoint with real timing (asyncio, streaming).

Three transports: Triton gRPC streaming (one stream per request, as the OpenAI gateway does),
Triton HTTP ``generate_stream`` (SSE), and an OpenAI-compatible ``/v1/completions`` endpoint
(Quanta's gateway, or vLLM's OpenAI server as the peer). Every request is sent at its arrival
offset (or as soon as a slot frees under ``concurrency_limit``) — a later call of a multi-call
interaction only once the call before it finished, plus its think time, and never after one
failed (``quanta.workloads.dependencies``) — and the client stamps the send,
every streamed chunk that carries tokens, and the end, on one monotonic clock — the numbers a
user sees, network and queueing included.

A prompt is text, a trace's token ids, or a length in tokens sent as synthetic token ids
(``input_ids`` to Triton, a token array to ``/v1/completions``) so lengths are exact on any
tokenizer; synthetic ids are a function of the request id, and of its prefix group for the
leading tokens it shares (``quanta.workloads.prompts``, as in the simulator). Scheduling
metadata (tenant, app, interaction, class, SLOs) travel as the Triton metadata tensors or
the gateway's extra fields; ``priority`` is vLLM's per-request
integer (lower runs first under ``--scheduling-policy priority``), sent only when set because
vLLM refuses it under FCFS and Quanta's gateway has no such field. Workloads come from
``quanta.workloads`` (``to_client_requests`` adapts them) and summaries from
``quanta.metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from quanta.workloads.dependencies import ABANDONED, Call, Interactions
from quanta.workloads.prompts import PromptIds

if TYPE_CHECKING:
    from quanta.workloads import WorkloadRequest

Transport = Literal["grpc", "http", "openai"]
_JSON = {"Content-Type": "application/json"}
TRANSPORTS: tuple[Transport, ...] = ("grpc", "http", "openai")
THROTTLED = "[resource_exhausted]"  # how every protocol's error message names a throttle


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One request of a workload."""

    request_id: str
    arrival_s: float  # offset from the start of the replay
    prompt: str | int | tuple[int, ...]  # text, a prompt length in tokens, or token ids
    max_tokens: int
    tenant: str = "default"
    priority_class: str | None = None  # None: the server's default ("online")
    ignore_eos: bool = True  # so the output length is the workload's, not the model's whim
    app: str = "default"
    interaction_id: str | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    priority: int | None = None  # vLLM's request priority (lower first); None: not sent
    # NOTE: when to send, not metadata: a staged call waits for the previous stage to finish.
    interaction_stage: int | None = None
    think_time_s: float = 0.0
    # NOTE: what synthetic prompt ids share (``quanta.workloads.prompts``), not metadata.
    prefix_group: str | None = None
    prefix_tokens: int = 0
    system_tokens: int = 0

    def metadata(self) -> dict[str, Any]:
        """The scheduling metadata to send: everything that is not the server's default."""
        fields: dict[str, Any] = {"tenant": self.tenant}
        if self.app != "default":
            fields["app"] = self.app
        for name in ("priority_class", "interaction_id", "ttft_slo_ms", "tpot_slo_ms"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields


def to_client_requests(
    requests: Sequence[WorkloadRequest],
    *,
    ignore_eos: bool = True,
    priority: Callable[[WorkloadRequest], int] | None = None,
) -> list[ClientRequest]:
    """``ClientRequest`` s for ``replay`` from workload rows: text or token ids when the row
    has them, else a token count turned into seeded token ids (sharing the row's prefix
    group); all scheduling metadata, and ``priority(row)`` as vLLM's per-request priority
    when given."""
    return [
        ClientRequest(
            request_id=r.request_id,
            arrival_s=r.arrival_time,
            prompt=_prompt(r),
            max_tokens=r.output_tokens,
            tenant=r.tenant,
            priority_class=r.priority_class,
            ignore_eos=ignore_eos,
            app=r.app,
            interaction_id=r.interaction_id,
            ttft_slo_ms=r.ttft_slo_ms,
            tpot_slo_ms=r.tpot_slo_ms,
            priority=None if priority is None else priority(r),
            interaction_stage=r.interaction_stage,
            think_time_s=r.think_time_s,
            prefix_group=r.prefix_group,
            prefix_tokens=r.prefix_tokens,
            system_tokens=r.system_tokens,
        )
        for r in requests
    ]


def _prompt(row: WorkloadRequest) -> str | int | tuple[int, ...]:
    if row.prompt is not None:
        return row.prompt
    return row.prompt_token_ids if row.prompt_token_ids is not None else row.prompt_tokens


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send."""

    url: str  # host:port (gRPC), http://host:port (Triton HTTP, OpenAI; "/v1" optional)
    transport: Transport
    model: str = "quanta"
    temperature: float = 0.0
    timeout_s: float = 600.0
    token_id_range: tuple[int, int] = (10, 250)  # ids of length-only prompts, [lo, hi)
    send_metadata: bool = True  # tenant, app, class, SLOs (off for peers that reject them)


@dataclass(slots=True)
class ClientResult:
    """What one request did; times are seconds since the replay started. ``scheduled_s`` is
    when it was due: its arrival offset, or for a later call of an interaction
    max(arrival, previous call's end + think time). An abandoned call was never sent: its
    ``error`` starts with ``ABANDONED`` and its send and end times are NaN."""

    request_id: str
    scheduled_s: float
    tenant: str
    priority_class: str | None
    send_s: float = math.nan
    chunk_s: list[float] = field(default_factory=list)  # chunks that carried >= 1 token
    end_s: float = math.nan
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def abandoned(self) -> bool:
        return self.error is not None and self.error.startswith(ABANDONED)

    @property
    def throttled(self) -> bool:
        """The server refused it under a policy's throttling (``[resource_exhausted]``)."""
        return self.error is not None and THROTTLED in self.error

    @property
    def ttft(self) -> float | None:
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for one-token outputs."""
        if self.ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Each gap between streamed chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_s)]

    @property
    def normalized_latency(self) -> float | None:
        return self.e2e / self.num_output_tokens if self.num_output_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Sender(Protocol):
    """One transport: ``prepare`` builds a request's payload before the clock starts."""

    def prepare(self, request: ClientRequest) -> Any: ...

    async def send(self, payload: Any, result: ClientResult, now: Clock) -> None: ...


Clock = Callable[[], float]


async def replay(
    requests: Sequence[ClientRequest],
    target: Target,
    *,
    concurrency_limit: int | None = None,
    on_result: Callable[[ClientResult], None] | None = None,
) -> list[ClientResult]:
    """Send every request at its arrival offset, a later call of an interaction once the call
    before it finished (module doc); results in the order of ``requests``.

    Failures are recorded in ``ClientResult.error``, never raised, so one bad request does not
    end a benchmark; the calls a failure abandons get a result too.
    """
    slots = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    start = math.nan
    plan = Interactions(_call(r) for r in requests)
    loop = asyncio.get_running_loop()
    released: dict[str, asyncio.Future[float | None]] = {
        r.request_id: loop.create_future() for r in requests if plan.waits(r.request_id)
    }

    def now() -> float:
        return time.perf_counter() - start

    async def one(sender: _Sender, request: ClientRequest, payload: Any) -> ClientResult:
        due: float | None = request.arrival_s
        if request.request_id in released:
            due = await released[request.request_id]
        result = ClientResult(
            request.request_id,
            request.arrival_s if due is None else due,
            request.tenant,
            request.priority_class,
        )
        if due is None:
            result.error = f"{ABANDONED}: an earlier call of {request.interaction_id} failed"
        else:
            await send(sender, payload, result, due)
        if on_result is not None:
            on_result(result)
        return result

    async def send(sender: _Sender, payload: Any, result: ClientResult, due: float) -> None:
        await asyncio.sleep(max(0.0, due - now()))
        async with slots or contextlib.nullcontext():
            result.send_s = now()
            try:
                await asyncio.wait_for(sender.send(payload, result, now), target.timeout_s)
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            result.end_s = now()
        for rid, when in plan.finished(result.request_id, result.end_s, result.ok).items():
            released[rid].set_result(when)

    async with _sender(target) as sender:
        payloads = [sender.prepare(r) for r in requests]
        start = time.perf_counter()
        return list(
            await asyncio.gather(
                *(one(sender, r, p) for r, p in zip(requests, payloads, strict=True))
            )
        )


def _call(request: ClientRequest) -> Call:
    return Call(
        request.request_id,
        request.arrival_s,
        request.interaction_id,
        request.interaction_stage,
        request.think_time_s,
    )


@contextlib.asynccontextmanager
async def _sender(target: Target) -> AsyncIterator[_Sender]:
    if target.transport == "grpc":
        from quanta.frontends.openai.upstream import TritonGrpc

        upstream = TritonGrpc(target.url)
        await upstream.is_model_ready(target.model)  # connect before the clock starts
        try:
            yield _GrpcSender(target, upstream)
        finally:
            await upstream.close()
        return
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=target.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # NOTE: no client-side cap unless asked for
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if target.transport == "http":
            yield _TritonHttpSender(target, session)
        elif target.transport == "openai":
            yield _OpenAISender(target, session)
        else:
            raise ValueError(f"unknown transport {target.transport!r}; use one of {TRANSPORTS}")


def prompt_value(
    request: ClientRequest, target: Target, ids: PromptIds | None = None
) -> str | list[int]:
    """The text or the given ids, else ``prompt`` synthetic ids in the target's
    ``token_id_range`` (``quanta.workloads.prompts``); pass one ``ids`` for a whole replay so
    that a shared prefix is drawn once."""
    if isinstance(request.prompt, str):
        return request.prompt
    if isinstance(request.prompt, tuple):
        return list(request.prompt)
    ids = ids or PromptIds(target.token_id_range)
    return ids.ids(
        request.prompt,
        request.request_id,
        prefix_group=request.prefix_group,
        prefix_tokens=request.prefix_tokens,
        system_tokens=request.system_tokens,
    )


def triton_inputs(
    request: ClientRequest, target: Target, ids: PromptIds | None = None
) -> dict[str, Any]:
    """The Triton model inputs of ``request`` (streaming), metadata included unless the target
    says not to; JSON-able, so also the body of an HTTP ``generate_stream`` call. ``ids``:
    as in ``prompt_value``."""
    from quanta.core.request import RequestMetadata, SamplingParams
    from quanta.frontends.triton.inputs import request_inputs

    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=target.temperature,
        ignore_eos=request.ignore_eos,
    )
    metadata = RequestMetadata(**request.metadata()) if target.send_metadata else None
    prompt = prompt_value(request, target, ids)
    return request_inputs(prompt, params, stream=True, metadata=metadata)


def _record_triton(event: dict[str, Any], result: ClientResult, now: Clock) -> None:
    from quanta.frontends.triton.client import output_ids

    n = len(output_ids(event))
    if n:
        result.chunk_s.append(now())
        result.num_output_tokens += n
    if "finish_reason" in event:
        result.finish_reason = event["finish_reason"]
        result.num_prompt_tokens = event.get("num_prompt_tokens")


class _GrpcSender:
    def __init__(self, target: Target, upstream: Any) -> None:
        self._target, self._upstream = target, upstream
        self._ids = PromptIds(target.token_id_range)

    def prepare(self, request: ClientRequest) -> Any:
        return triton_inputs(request, self._target, self._ids)

    async def send(self, payload: Any, result: ClientResult, now: Clock) -> None:
        stream = self._upstream.stream(self._target.model, payload)
        try:
            async for event in stream:
                _record_triton(event, result, now)
        finally:
            await stream.aclose()


class _TritonHttpSender:
    def __init__(self, target: Target, session: Any) -> None:
        base = target.url if "://" in target.url else f"http://{target.url}"
        self._url = f"{base.rstrip('/')}/v2/models/{target.model}/generate_stream"
        self._target, self._session = target, session
        self._ids = PromptIds(target.token_id_range)

    def prepare(self, request: ClientRequest) -> Any:
        return json.dumps(triton_inputs(request, self._target, self._ids))

    async def send(self, payload: Any, result: ClientResult, now: Clock) -> None:
        async with self._session.post(self._url, data=payload, headers=_JSON) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for data in _sse_data(resp):
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                _record_triton(event, result, now)
        if result.finish_reason is None:
            raise RuntimeError("the stream ended before its final response")


class _OpenAISender:
    def __init__(self, target: Target, session: Any) -> None:
        base = target.url if "://" in target.url else f"http://{target.url}"
        base = base.rstrip("/")
        self._url = f"{base if base.endswith('/v1') else base + '/v1'}/completions"
        self._target, self._session = target, session
        self._ids = PromptIds(target.token_id_range)

    def prepare(self, request: ClientRequest) -> Any:
        body: dict[str, Any] = {
            "model": self._target.model,
            "prompt": prompt_value(request, self._target, self._ids),
            "max_tokens": request.max_tokens,
            "temperature": self._target.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.ignore_eos:
            body["ignore_eos"] = True  # a Quanta and vLLM extension
        if self._target.send_metadata:
            meta = request.metadata()
            body["user"] = meta.pop("tenant")  # OpenAI's user is the gateway's tenant
            body |= meta
        if request.priority is not None:
            body["priority"] = request.priority
        return json.dumps(body)

    async def send(self, payload: Any, result: ClientResult, now: Clock) -> None:
        async with self._session.post(self._url, data=payload, headers=_JSON) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            done = False
            async for data in _sse_data(resp):
                if data == "[DONE]":
                    done = True
                    break
                self._record(json.loads(data), result, now)
        if not done:
            raise RuntimeError("the stream ended without data: [DONE]")

    @staticmethod
    def _record(chunk: dict[str, Any], result: ClientResult, now: Clock) -> None:
        if "error" in chunk:
            raise RuntimeError(str(chunk["error"].get("message", chunk["error"])))
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                result.chunk_s.append(now())
                result.num_output_tokens += 1  # corrected by usage, when the server sends it
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            result.num_output_tokens = chunk["usage"]["completion_tokens"]
            result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]


async def _sse_data(resp: Any) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield line[len("data:") :].strip()
