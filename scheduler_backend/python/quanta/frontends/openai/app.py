"""The FastAPI application: OpenAI routes over ``TritonGrpc`` streams.

Every request is validated here first (so the common mistakes get a precise 400 without a round
trip), then forwarded as one Triton request. The first Triton response is awaited before any
HTTP header is sent, so errors the engine finds (prompt too long, throttled) still get their
status code; after that a streamed response reports errors inside the stream, as OpenAI does.
A client that disconnects — while waiting, streaming or not — cancels its Triton request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from quanta.config.models import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_REQUEST_BYTES
from quanta.core.pooling import PoolingParams
from quanta.core.request import SamplingParams
from quanta.frontends.openai.auth import (
    DEFAULT_TENANT,
    NO_RESERVATION,
    ApiKeys,
    AuthMiddleware,
    KeyPolicy,
    Principal,
    Reservation,
    principal_of,
)
from quanta.frontends.openai.batch_routes import BatchService
from quanta.frontends.openai.body_limit import BodyLimit, BodyTooLarge
from quanta.frontends.openai.embeddings import Embeddings
from quanta.frontends.openai.errors import OpenAIError, classify, invalid, unknown_model
from quanta.frontends.openai.limits import prompt_limit, token_counter, too_large
from quanta.frontends.openai.logprobs import output_logprobs, prompt_logprobs
from quanta.frontends.openai.metrics import GatewayMetrics, MetricsMiddleware, engine_metrics
from quanta.frontends.openai.page import router as chat_page
from quanta.frontends.openai.protocol import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    TokenLogprobs,
    Usage,
    chat_body,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    usage,
)
from quanta.frontends.openai.responses import Responses
from quanta.frontends.openai.router import ReplicaRouter, RoutedStream, make_upstream
from quanta.frontends.openai.sse import DisconnectWatcher, event_stream, interleave
from quanta.frontends.openai.tokenize import TokenizerRoutes
from quanta.frontends.openai.tool_parsers import default_parser
from quanta.frontends.openai.tools import ToolPlan, ToolStream, tool_plan
from quanta.frontends.openai.upstream import GenerationStream, TritonGrpc, UpstreamError
from quanta.frontends.triton.inputs import request_inputs
from quanta.frontends.triton.supervisor_state import metrics_text as supervisor_metrics_text
from quanta.text.chat_template import ChatTemplate, ChatTemplateError

Body = CompletionRequest | ChatCompletionRequest
Prompt = str | list[int]  # a text, or token ids
Stream = GenerationStream | RoutedStream
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


class GatewaySettings(BaseModel):
    """What the gateway serves and where it forwards to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    triton_grpc_url: str
    model_name: str = "quanta"  # the name clients ask for
    triton_model: str | None = None  # the model's name in Triton (default: model_name)
    default_max_tokens: int = Field(16, ge=1)  # completions, as OpenAI's default
    default_chat_max_tokens: int = Field(256, ge=1)  # chat has no OpenAI default that fits
    request_timeout_s: float | None = Field(None, gt=0)
    state_dir: Path = Path("quanta-state")  # Batch API files and batches (relative: to the cwd)
    batch_concurrency: int = Field(64, ge=1)  # batch lines in flight at once, all batches
    # Several Triton replicas (``router.py``): when given, they replace ``triton_grpc_url``.
    upstreams: tuple[str, ...] = ()
    router: Literal["least-outstanding", "round-robin", "prefix-affinity"] = "least-outstanding"
    # Who may call (``auth.py``): API key -> tenant, weight, class, limits; empty: anyone.
    api_keys: dict[str, KeyPolicy] = Field(default_factory=dict, repr=False)
    # Size limits (``limits.py``): request bodies, uploaded files, prompts.
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1)
    max_file_bytes: int = Field(DEFAULT_MAX_FILE_BYTES, ge=1)
    max_model_len: int | None = Field(None, ge=1)  # default: the checkpoint's
    max_prompt_bytes: int | None = Field(None, ge=1)  # default: derived (limits.py)
    # How /v1/embeddings pools the model's hidden states (vLLM's --pooler-config).
    pooler_config: PoolingParams = PoolingParams()
    # Host header values served (Starlette's TrustedHostMiddleware); empty: any host.
    allowed_hosts: tuple[str, ...] = ()
    # Triton's /metrics, carried on the gateway's (``quanta serve``: one port to scrape)
    engine_metrics_url: str | None = None
    # How tool calls are read from an answer (``tool_parsers.py``); None: from the template.
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None


def create_app(
    settings: GatewaySettings,
    chat_template: ChatTemplate | None = None,
    *,
    upstream: TritonGrpc | None = None,
) -> FastAPI:
    """The gateway as an ASGI app; its gRPC channel opens on first use and closes on shutdown.

    Batches left unfinished by an earlier run resume at startup. ``upstream`` replaces the
    Triton client (tests give one that fails on purpose).
    """
    gateway = Gateway(settings, chat_template or ChatTemplate(), upstream)
    batches = BatchService(
        settings.state_dir,
        gateway.answer,
        concurrency=settings.batch_concurrency,
        scoped=gateway.keys is not None,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await batches.start()
        yield
        await batches.stop()
        await gateway.upstream.close()

    app = FastAPI(title="Quanta OpenAI-compatible gateway", lifespan=lifespan)
    app.include_router(batches.router)
    app.include_router(chat_page)
    tokenizer_routes = TokenizerRoutes(
        settings.model_name, gateway.template, gateway.prompt_limit.max_ids, gateway.health
    )
    app.include_router(tokenizer_routes.router)
    app.include_router(Embeddings(gateway, settings.pooler_config).router)
    app.include_router(Responses(gateway).router)
    app.post("/v1/completions", response_model=None)(gateway.completions)
    app.post("/v1/chat/completions", response_model=None)(gateway.chat_completions)
    app.get("/v1/models")(gateway.models)
    app.get("/v1/models/{model}")(gateway.model)
    app.get("/health", response_model=None)(gateway.health)
    app.post("/reset_prefix_cache", response_model=None)(gateway.reset_prefix_cache)
    app.get("/metrics", response_model=None)(gateway.metrics)
    app.exception_handler(OpenAIError)(_openai_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(HTTPException)(_http_error)
    app.exception_handler(Exception)(_internal_error)
    # NOTE: added last is outermost: the Host check, the key, the body's size, the routes
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_request_bytes,
        routes={"/v1/files": settings.max_file_bytes},
    )
    if gateway.keys is not None:
        app.add_middleware(AuthMiddleware, keys=gateway.keys)
    if settings.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts))
    app.add_middleware(MetricsMiddleware, metrics=gateway.observed)  # NOTE: counts every answer
    return app


def auth_warning(settings: GatewaySettings, host: str) -> str | None:
    """What the log says when the gateway serves without keys (None: it has keys)."""
    if settings.api_keys:
        return None
    if _loopback(host):
        return (
            f"no API key: the gateway on {host} serves every local client unauthenticated, "
            "as any tenant they name (--api-key / --api-key-file to require keys)"
        )
    return (
        f"no API key and bound to {host}: ANYONE WHO CAN REACH THIS PORT is served, as any "
        "tenant they name, and may use the Batch API and /reset_prefix_cache; give "
        "--api-key or --api-key-file, or bind 127.0.0.1 behind an authenticating proxy"
    )


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Gateway:
    """The route handlers; one instance per app."""

    def __init__(
        self,
        settings: GatewaySettings,
        chat_template: ChatTemplate,
        upstream: TritonGrpc | ReplicaRouter | None = None,
    ) -> None:
        self.settings = settings
        self.template = chat_template
        self.upstream = upstream or make_upstream(
            settings.triton_grpc_url,
            settings.upstreams,
            settings.router,
            settings.request_timeout_s,
        )
        self.triton_model = settings.triton_model or settings.model_name
        self.created = int(time.time())
        self.keys = ApiKeys(settings.api_keys) if settings.api_keys else None
        self.prompt_limit = prompt_limit(
            chat_template.model_dir,
            chat_template.tokenizer,
            max_model_len=settings.max_model_len,
            max_prompt_bytes=settings.max_prompt_bytes,
        )
        self.count_tokens = token_counter(chat_template.tokenizer)
        self.tool_parser = settings.tool_call_parser or default_parser(chat_template.source)
        self.observed = GatewayMetrics()

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._respond(request, body)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._respond(request, body)

    async def answer(
        self, path: str, payload: dict[str, Any], owner: str | None = None
    ) -> dict[str, Any]:
        """The whole response body the route at ``path`` gives ``payload``, not streamed, for
        callers with no HTTP request of their own (the Batch API). Errors raise the
        ``OpenAIError`` the route would have answered with. With keys configured the request
        runs as tenant ``owner`` (the tenant of the key that created the batch)."""
        model = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
        try:
            body = model.model_validate({**payload, "stream": False})
        except ValidationError as exc:
            raise _invalid_fields(exc.errors()) from None
        principal = None
        if self.keys is not None:
            principal = self.keys.owner(owner) or Principal(owner or DEFAULT_TENANT)
        prepared = await self._prepared(body)
        result = await self._generate(None, body, *prepared, principal=principal)
        assert isinstance(result, dict)  # not streamed
        return result

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str) -> dict[str, Any]:
        if model != self.settings.model_name:
            raise unknown_model(model)
        return self._model_card()

    async def health(self) -> Response:
        """200 when Triton has the model ready and its engine serves, else 503 with the
        reason (for load balancers, the image's HEALTHCHECK and Kubernetes probes).

        The engine is asked with a health-check request (the input ``health_check``):
        Triton 2.51 keeps a model "ready" whatever its Python backend's engine does."""
        if not await self.upstream.is_model_ready(self.triton_model):
            raise OpenAIError(503, f"model '{self.triton_model}' is not ready in Triton")
        stream = self.upstream.stream(self.triton_model, {"health_check": True})

        async def answered() -> None:
            while not stream.done:
                await _next(stream)

        try:
            await asyncio.wait_for(answered(), _HEALTH_TIMEOUT_S)
        except TimeoutError:
            raise OpenAIError(
                503, f"the engine did not answer a health check in {_HEALTH_TIMEOUT_S:g} s"
            ) from None
        except OpenAIError as exc:
            if "health_check" in exc.message and "unexpected" in exc.message.lower():
                return JSONResponse({"status": "ok"})  # NOTE: a backend without the check
            raise OpenAIError(503, exc.message) from None
        finally:
            stream.cancel()
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        """Prometheus text: the gateway's requests and whether its engine serves
        (``metrics.py``), the engine's own metrics when it runs beside it, each replica's
        load and state when routing to several, and the state of each tritonserver
        supervised in this process (``quanta serve``)."""
        text = await self.observed.exposition(
            lambda: self.upstream.is_model_ready(self.triton_model)
        )
        if self.settings.engine_metrics_url is not None:
            text += await engine_metrics(self.settings.engine_metrics_url)
        if isinstance(self.upstream, ReplicaRouter):
            text += self.upstream.metrics_text()
        text += supervisor_metrics_text()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def reset_prefix_cache(self) -> Response:
        """vLLM's route: the model forgets every cached prefix, so requests sent after the
        answer compute their prompts in full (before timing a run, after new weights).

        The gateway holds no engine, so the reset is a request to Triton like any other (the
        input ``reset_prefix_cache``); the model's engine takes it before anything sent later.
        """
        stream = self.upstream.stream(self.triton_model, {"reset_prefix_cache": True})
        try:
            while not stream.done:
                await _next(stream)
        finally:
            stream.cancel()
        return JSONResponse({"status": "ok", "model": self.settings.model_name})

    # -- helpers -----------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        """OpenAI's model object with vLLM's additions: ``vllm bench serve`` reads ``root``
        (the name it sends to ``/tokenize``, which must be the served one) when it is not told
        the model, and clients size prompts by ``max_model_len``."""
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "quanta",
            "root": self.settings.model_name,
            "parent": None,
            "max_model_len": self.prompt_limit.max_ids,
        }

    async def _prepared(self, body: Body) -> tuple[list[Prompt], SamplingParams, int | None]:
        """The prompts, sampling settings and system-prompt length of a checked ``body``.

        The size checks run first, on the event loop (they only count); rendering the chat
        template and counting tokens run on a worker thread, so a large prompt never stalls
        the requests the loop is streaming."""
        if isinstance(body, ChatCompletionRequest):
            self.prompt_limit.check("".join(m.text() for m in body.messages), "messages")
        else:
            for prompt in body.prompts():
                self.prompt_limit.check(prompt, "prompt")
        return await asyncio.to_thread(self._prepare, body)

    def _prepare(self, body: Body) -> tuple[list[Prompt], SamplingParams, int | None]:
        self._check(body)
        count = self.count_tokens
        if isinstance(body, ChatCompletionRequest):
            params = body.sampling_params(self.settings.default_chat_max_tokens)
            tools = self._tools(body)
            if tools is not None and tools.guide is not None:
                if params.structured_output is not None:
                    raise invalid(
                        "a forced tool call is the answer's structured output: leave out "
                        "response_format and guided_*",
                        "tool_choice",
                    )
                params = params.model_copy(update={"structured_output": tools.guide})
            shown = None if tools is None else tools.tools
            try:
                prompt = self.template.render(body.messages, shown, **body.template_options())
            except ChatTemplateError as exc:
                raise invalid(f"chat template: {exc}", "messages") from None
            self.prompt_limit.check_tokens(prompt, count, "messages")
            return [prompt], params, self.template.system_tokens(body.messages)
        prompts = body.prompts()
        for one in prompts:
            if isinstance(one, str):
                self.prompt_limit.check_tokens(one, count, "prompt")
        return prompts, body.sampling_params(self.settings.default_max_tokens), None

    def _tools(self, body: Body) -> ToolPlan | None:
        """How a chat request uses its tools (None: it has none); a 400 for a bad choice."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        return tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser)

    async def _respond(self, request: Request, body: Body) -> Response:
        principal = principal_of(request.scope)
        prepared = await self._prepared(body)
        result = await self._generate(request, body, *prepared, principal=principal)
        return JSONResponse(result) if isinstance(result, dict) else result

    def _check(self, body: Body) -> None:
        if body.model != self.settings.model_name:
            raise unknown_model(body.model)
        error = body.unsupported()
        if error is not None:
            raise error
        if body.top_logprobs_wanted is not None and self.template.token_text is None:
            raise invalid(
                "logprobs need the model's tokenizer: start the gateway with --model-dir",
                "logprobs",
            )
        if body.continuous_usage and self.template.count_tokens is None:
            raise invalid(
                "continuous_usage_stats needs the model's tokenizer: start the gateway with "
                "--model-dir",
                "stream_options",
            )
        if (
            isinstance(body, CompletionRequest)
            and body.echo
            and any(not isinstance(prompt, str) for prompt in body.prompts())
            and self.template.decode is None
        ):
            raise invalid(
                "echo of a prompt given as token ids needs the model's tokenizer: start the "
                "gateway with --model-dir",
                "echo",
            )

    async def _generate(
        self,
        request: Request | None,
        body: Body,
        prompts: list[Prompt],
        params: SamplingParams,
        system_tokens: int | None = None,
        *,
        principal: Principal | None = None,
    ) -> dict[str, Any] | StreamingResponse:
        """One Triton request per prompt and choice (``n``): choice j of a prompt samples with
        seed ``seed + j``, and is choice ``prompt_index * n + j`` of the response.

        A whole response is returned as its body; without an HTTP ``request`` nothing watches
        for a disconnect (the caller cancels the task instead). ``principal``: the API key's
        tenant, class and rate limits (None: no keys)."""
        metadata = body.metadata(system_tokens, principal)
        reservation = NO_RESERVATION
        if principal is not None:
            expected = sum(_prompt_estimate(p) + params.max_tokens * body.n for p in prompts)
            reservation = principal.admit(expected)
        streams = [
            self.upstream.stream(
                self.triton_model,
                request_inputs(
                    prompt, params.for_sequence(j), stream=body.stream, metadata=metadata
                ),
            )
            for prompt in prompts
            for j in range(body.n)
        ]
        echoes = [self._echo(body, prompt) for prompt in prompts for _ in range(body.n)]
        chat = isinstance(body, ChatCompletionRequest)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{streams[0].request_id}"

        def cancel() -> None:
            for stream in streams:
                stream.cancel()

        watcher = None if request is None else DisconnectWatcher(request, cancel)
        owned = True  # NOTE: False once the SSE generator owns the streams and the watcher
        try:
            firsts = [await _next(stream) for stream in streams]  # errors before any header
            if body.stream and watcher is not None:
                counts = None
                if body.continuous_usage:
                    counts = await asyncio.to_thread(self._prompt_counts, prompts, body.n)
                chunks = self._all_chunks(
                    rid, body, firsts, streams, echoes, reservation, prompt_counts=counts
                )
                sse = event_stream(chunks, cancel, watcher)
                owned = False
                return StreamingResponse(sse, media_type="text/event-stream", headers=_SSE_HEADERS)
            runs = [
                [first, *[e async for e in _mapped(stream)]]
                for first, stream in zip(firsts, streams, strict=True)
            ]
        finally:
            if owned:
                if watcher is not None:
                    watcher.stop()
                cancel()
        top = body.top_logprobs_wanted
        choices = []
        for index, events in enumerate(runs):
            text = echoes[index] + "".join(e.get("text_output", "") for e in events)
            finish = _finish(events[-1])
            tokens = (
                None
                if top is None
                else [t for e in events for t in prompt_logprobs(e, top, self._token_text())]
                + [t for e in events for t in output_logprobs(e, top, self._token_text())]
            )
            if chat:
                logprobs = None if tokens is None else chat_logprobs(tokens)
                choice = chat_body(rid, body.model, text, finish, None, logprobs)["choices"][0]
                tools = self._tools(body)
                if tools is not None:
                    message, reason = tools.message(text, finish)
                    choice |= {"message": message, "finish_reason": reason}
            else:
                logprobs = None if tokens is None else completion_logprobs(tokens, top or 0)
                choice = completion_body(
                    rid, body.model, text, finish, None, chunk=False, logprobs=logprobs
                )["choices"][0]
            choices.append(choice | {"index": index})
        use = _usage(runs, body.n)
        reservation.settle(use["total_tokens"])
        whole = (chat_body if chat else _completion_whole)(rid, body.model, "", None, use)
        return whole | {"choices": choices}

    async def _all_chunks(
        self,
        rid: str,
        body: Body,
        firsts: list[dict[str, Any]],
        streams: list[Stream],
        echoes: list[str],
        reservation: Reservation = NO_RESERVATION,
        *,
        prompt_counts: list[int] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Every choice's chunks as they come, then the usage chunk if asked; the tokens used
        settle the rate limit's reservation (a stream cut short keeps what was reserved).
        With ``prompt_counts`` (each choice's prompt tokens) every chunk carries its choice's
        usage so far, as vLLM's ``continuous_usage_stats`` has it."""
        finals: list[dict[str, Any]] = list(firsts)
        generated = [0] * len(streams)  # output tokens each choice has streamed

        def note(index: int, event: dict[str, Any]) -> None:
            finals[index] = event
            generated[index] += len(event.get("output_ids", ()))

        def so_far(index: int) -> Usage:
            assert prompt_counts is not None
            final = finals[index]  # the engine's own counts, once it has finished
            prompt = final.get("num_prompt_tokens", prompt_counts[index])
            return usage(prompt, generated[index], final.get("num_cached_tokens", 0))

        per_choice = [
            self._chunks(rid, body, first, stream, index, note, echo)
            for index, (first, stream, echo) in enumerate(zip(firsts, streams, echoes, strict=True))
        ]
        if prompt_counts is not None:
            # NOTE: added in each choice's own generator, right after its ``note``: the
            # interleaving runs the choices ahead of the chunks it has yet to yield
            per_choice = [
                _with_usage(chunks, partial(so_far, index))
                for index, chunks in enumerate(per_choice)
            ]
        async for chunk in interleave(per_choice):
            yield chunk
        use = _usage([[event] for event in finals], body.n)
        reservation.settle(use["total_tokens"])
        if body.include_usage:
            if isinstance(body, ChatCompletionRequest):
                yield chat_chunk(rid, body.model, None, use=use)
            else:
                yield completion_body(rid, body.model, "", None, use, chunk=True)

    def _prompt_counts(self, prompts: list[Prompt], n: int) -> list[int]:
        """Each choice's prompt tokens, as the engine will count them (its tokenizer)."""
        count = self.template.count_tokens
        assert count is not None  # checked in _check
        return [len(p) if isinstance(p, list) else count(p) for p in prompts for _ in range(n)]

    def _echo(self, body: Body, prompt: Prompt) -> str:
        """The prompt a completion with ``echo`` repeats before its text; token ids are
        decoded (scoring clients such as lm-evaluation-harness send their prompts as ids)."""
        if not (isinstance(body, CompletionRequest) and body.echo):
            return ""
        if isinstance(prompt, str):
            return prompt
        assert self.template.decode is not None  # checked in _check
        return self.template.decode(prompt)

    def _token_text(self) -> Callable[[int], str]:
        text = self.template.token_text
        assert text is not None  # checked in _check
        return text

    async def _chunks(
        self,
        rid: str,
        body: Body,
        first: dict[str, Any],
        stream: Stream,
        index: int,
        note: Callable[[int, dict[str, Any]], None],
        echo: str = "",
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of one choice; ``note`` learns each event (the last has the usage)."""
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            yield _indexed(chat_chunk(rid, body.model, {"role": "assistant", "content": ""}), index)
        tools = self._tools(body)
        reader = tools.stream() if tools is not None and tools.reads_calls else None
        top = body.top_logprobs_wanted
        offset = 0
        if isinstance(body, CompletionRequest) and body.echo and (echo or top is not None):
            prompt = None if top is None else prompt_logprobs(first, top, self._token_text())
            logprobs = None if prompt is None else completion_logprobs(prompt, top or 0)
            chunk = completion_body(
                rid, body.model, echo, None, None, chunk=True, logprobs=logprobs
            )
            yield _indexed(chunk, index)
            offset = sum(len(t) for t, _, _ in prompt or ())
        event = first
        pending: TokenLogprobs = []  # tokens whose text the detokenizer still holds back
        while True:
            note(index, event)
            text, finish = event.get("text_output", ""), _finish(event)
            if top is not None:
                pending += output_logprobs(event, top, self._token_text())
            if text or finish:
                tokens, pending = (None if top is None else pending), []
                if chat:
                    logprobs = None if tokens is None else chat_logprobs(tokens)
                    for chunk in _chat_chunks(rid, body.model, reader, text, finish, logprobs):
                        yield _indexed(chunk, index)
                else:
                    logprobs = None if tokens is None else completion_logprobs(tokens, top, offset)
                    chunk = completion_body(
                        rid, body.model, text, finish, None, chunk=True, logprobs=logprobs
                    )
                    yield _indexed(chunk, index)
                # NOTE: offsets count token texts, as a whole response's do (a token that is
                # part of a multi-byte character has a text of its own)
                offset += sum(len(t) for t, _, _ in tokens or ())
            if stream.done:
                break
            event = await _next(stream)


def _chat_chunks(
    rid: str,
    model: str,
    reader: ToolStream | None,
    text: str,
    finish: str | None,
    logprobs: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """One event's chunks: its text as content, or what the tool-call reader makes of it
    (nothing, while a call is still being written); the last carries the finish reason."""
    if reader is None:
        delta = {"content": text} if text else {}
        return [chat_chunk(rid, model, delta, finish, logprobs=logprobs)]
    deltas = reader.feed(text) + (reader.close() if finish else [])
    finish = reader.finish_reason(finish)
    if not deltas and (finish or logprobs):
        deltas = [{}]
    last = len(deltas) - 1
    return [
        chat_chunk(
            rid, model, delta, finish if k == last else None, logprobs=logprobs if k == 0 else None
        )
        for k, delta in enumerate(deltas)
    ]


async def _with_usage(
    chunks: AsyncIterator[dict[str, Any]], so_far: Callable[[], Usage]
) -> AsyncIterator[dict[str, Any]]:
    """``chunks`` with the usage so far on each one that has a choice."""
    async for chunk in chunks:
        if chunk["choices"]:
            chunk["usage"] = so_far()
        yield chunk


def _prompt_estimate(prompt: Prompt) -> int:
    """Tokens a prompt is expected to take, for a rate limit's reservation: its ids, or a
    quarter of its characters (what English text averages); the actual count settles it."""
    return len(prompt) if isinstance(prompt, list) else len(prompt) // 4 + 1


def _usage(runs: list[list[dict[str, Any]]], n: int) -> Usage:
    """Every prompt once, every choice's completion tokens (``runs``: the prompts' ``n``
    choices in turn); a prompt's tokens and cached tokens are its first choice's (choice
    j > 0 may find what choice 0 computed)."""
    firsts = [events[-1] for events in runs[::n]]
    prompt = sum(final.get("num_prompt_tokens", 0) for final in firsts)
    cached = sum(final.get("num_cached_tokens", 0) for final in firsts)
    completion = sum(events[-1].get("num_output_tokens", 0) for events in runs)
    return usage(prompt, completion, cached)


def _completion_whole(
    rid: str, model: str, text: str, finish: str | None, use: Usage | None
) -> dict[str, Any]:
    return completion_body(rid, model, text, finish, use, chunk=False)


def _indexed(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    for choice in chunk["choices"]:
        choice["index"] = index
    return chunk


async def _next(stream: Stream) -> dict[str, Any]:
    try:
        return await stream.__anext__()
    except UpstreamError as exc:
        raise _upstream_error(exc) from None


async def _mapped(stream: Stream) -> AsyncIterator[dict[str, Any]]:
    while not stream.done:
        yield await _next(stream)


def _finish(event: dict[str, Any]) -> str | None:
    reason = event.get("finish_reason")
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def _upstream_error(exc: UpstreamError) -> OpenAIError:
    if exc.unavailable:  # down or restarting: 503 with when to try again
        return OpenAIError(503, exc.message, retry_after=exc.retry_after)
    return classify(exc.message)


_HEALTH_TIMEOUT_S = 3.0  # under the 5 s a Docker HEALTHCHECK or a probe waits


# -- exception handlers: every error leaves in OpenAI's shape ----------------------------------
async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return await _openai_error(request, _invalid_fields(exc.errors()))


def _invalid_fields(errors: Any) -> OpenAIError:
    """One 400 for pydantic's ``errors``, naming the first field that is wrong."""
    parts, param = [], None
    for err in errors:
        if err["type"] == "json_invalid":
            return invalid(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        loc = [str(p) for p in err["loc"] if p != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc)}: {err['msg']}" if loc else str(err["msg"]))
    return invalid("; ".join(parts), param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if isinstance(exc, BodyTooLarge):  # found while the body was being read (limits.py)
        return await _openai_error(request, too_large(exc.limit))
    return await _openai_error(request, OpenAIError(exc.status_code, str(exc.detail)))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return await _openai_error(request, OpenAIError(500, f"internal error: {exc}"))
