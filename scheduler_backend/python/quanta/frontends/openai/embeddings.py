"""``POST /v1/embeddings``: the served decoder model's pooled final hidden states.

As vLLM serves a decoder model for embeddings: each input is a prompt whose last token's (or,
with ``--pooler-config '{"pooling_type": "MEAN"}'``, every token's mean) final hidden state,
after the model's last norm, comes back L2-normalized. Each input is one Triton request
(``pooling`` input, ``embedding`` output) and so one prefill-only request to the same
scheduler, policies and tenant accounting as generation (``core/pooling.py``).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import field_validator, model_validator

from quanta.core.pooling import PoolingParams
from quanta.core.request import RequestMetadata, SamplingParams
from quanta.frontends.openai.auth import NO_RESERVATION, principal_of
from quanta.frontends.openai.errors import OpenAIError, classify, invalid, unknown_model
from quanta.frontends.openai.protocol import Int32, _Request
from quanta.frontends.openai.router import RoutedStream
from quanta.frontends.openai.sse import DisconnectWatcher
from quanta.frontends.openai.upstream import GenerationStream, UpstreamError
from quanta.frontends.triton.inputs import request_inputs

if TYPE_CHECKING:
    from quanta.frontends.openai.app import Gateway

Prompt = str | list[int]
# The embedding request asks for one token it never samples (``core/pooling.py``).
_PARAMS = SamplingParams(max_tokens=1)


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, with vLLM's ``normalize`` and Quanta's scheduling fields.
    ``dimensions`` is refused: the model's hidden size is the only size it has."""

    model: str
    input: str | list[str] | list[Int32] | list[list[Int32]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's: override the server's pooler config
    use_activation: bool | None = None  # vLLM 0.32's name for ``normalize``
    # vLLM's; -1, "up to the model's context" (what ``vllm bench serve`` sends), is the only
    # limit taken: a longer prompt is refused by the prompt limit, never cut
    truncate_prompt_tokens: int | None = None
    tenant: str | None = None
    app: str | None = None
    priority_class: str | None = None

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError(
                "not supported: this model's embeddings have its hidden size (leave it out)"
            )
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _only_the_context(cls, value: int | None) -> int | None:
        if value not in (None, -1):
            raise ValueError(
                "only -1 (the model's context) is supported: a prompt is never cut, and one "
                "longer than the context is refused"
            )
        return value

    @model_validator(mode="after")
    def _one_normalize(self) -> EmbeddingRequest:
        """``use_activation`` is ``normalize`` under vLLM's newer name: one of them, or both
        saying the same."""
        if self.use_activation is not None:
            if self.normalize not in (None, self.use_activation):
                raise ValueError("normalize and use_activation disagree: give one of them")
            self.normalize = self.use_activation
        return self

    def prompts(self) -> list[Prompt]:
        """The inputs in order: one text or token-id list, or a list of either."""
        given = self.input
        batched = isinstance(given, list) and given and isinstance(given[0], str | list)
        prompts: list[Prompt] = list(given) if batched else [given]  # type: ignore[arg-type]
        if not prompts:
            raise invalid("input is empty: give a text, token ids or a list of either", "input")
        for i, one in enumerate(prompts):
            if not one:
                which = f"input {i}" if batched else "input"
                raise invalid(f"{which} is empty: it must contain at least one token", "input")
        return prompts

    def metadata(self, tenant: str | None, authenticated: bool) -> RequestMetadata:
        fields: dict[str, Any] = {
            "app": self.app,
            "priority_class": self.priority_class,
            "tenant": tenant if authenticated else (self.tenant or self.user),
        }
        fields = {key: value for key, value in fields.items() if value is not None}
        try:
            return RequestMetadata(**fields, tenant_authenticated=authenticated)
        except ValueError as exc:
            raise invalid(f"scheduling metadata: {exc}") from None


class Embeddings:
    """The route; it forwards through the gateway's Triton channel."""

    def __init__(self, gateway: Gateway, pooling: PoolingParams) -> None:
        self.gateway = gateway
        self.pooling = pooling
        self.router = APIRouter()
        self.router.post("/v1/embeddings", response_model=None)(self.embeddings)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        gateway = self.gateway
        if body.model != gateway.settings.model_name:
            raise unknown_model(body.model)
        prompts = body.prompts()
        for prompt in prompts:
            if isinstance(prompt, str):
                gateway.prompt_limit.check(prompt, "input")
        principal = principal_of(request.scope)
        if principal is not None and principal.priority_class == "offline":
            body = body.model_copy(update={"priority_class": "offline"})
        metadata = body.metadata(
            principal.tenant if principal is not None else None, principal is not None
        )
        pooling = self.pooling
        if body.normalize is not None:
            pooling = pooling.model_copy(update={"normalize": body.normalize})
        reservation = NO_RESERVATION
        if principal is not None:
            reservation = principal.admit(sum(_estimate(p) for p in prompts))
        streams = [
            gateway.upstream.stream(
                gateway.triton_model,
                request_inputs(p, _PARAMS, stream=False, metadata=metadata, pooling=pooling),
            )
            for p in prompts
        ]

        def cancel() -> None:
            for stream in streams:
                stream.cancel()

        watcher = DisconnectWatcher(request, cancel)
        try:
            finals = await asyncio.gather(*(_final(stream) for stream in streams))
        finally:
            watcher.stop()
            cancel()
        prompt_tokens = sum(int(event.get("num_prompt_tokens", 0)) for event in finals)
        reservation.settle(prompt_tokens)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(event.get("embedding"), body.encoding_format),
            }
            for i, event in enumerate(finals)
        ]
        rid = streams[0].request_id
        return JSONResponse(
            {
                "id": f"embd-{rid}",
                "object": "list",
                "created": int(time.time()),
                "model": body.model,
                "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )


async def _final(stream: GenerationStream | RoutedStream) -> dict[str, Any]:
    """The request's final response (an embedding request sends only that one)."""
    event: dict[str, Any] = {}
    try:
        while not stream.done:
            event = await stream.__anext__()
    except UpstreamError as exc:
        if exc.unavailable:
            raise OpenAIError(503, exc.message, retry_after=exc.retry_after) from None
        raise classify(exc.message) from None
    if "embedding" not in event:
        raise OpenAIError(
            500, "the model returned no embedding: its Triton model predates embeddings"
        )
    return event


def _encoded(vector: Any, encoding_format: str) -> list[float] | str:
    """``float``: a JSON list; ``base64``: the little-endian float32 bytes, as OpenAI sends
    them (the openai SDK asks for this by default and decodes it with numpy)."""
    array = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array.tolist()


def _estimate(prompt: Prompt) -> int:
    """Tokens a prompt is expected to take, for a rate limit's reservation."""
    return len(prompt) if isinstance(prompt, list) else len(prompt) // 4 + 1
