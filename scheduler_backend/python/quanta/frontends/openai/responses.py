"""``POST /v1/responses``: OpenAI's Responses API for text, over the chat completions route.

A request becomes one chat completion (``instructions`` as the system message, the input
items as messages, ``max_output_tokens`` as ``max_tokens``), answered by the gateway's own
chat route, so its validation, scheduling metadata, rate limits and disconnect handling are
chat's. Its answer (or its stream of chunks) is rewritten as a ``response`` object (or as the
Responses API's typed events). Nothing is stored: ``store: true``, ``previous_response_id``
and the other fields that need a stored response, tools or reasoning are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from quanta.frontends.openai.errors import invalid
from quanta.frontends.openai.protocol import ChatCompletionRequest, NullsAreDefaults

if TYPE_CHECKING:
    from quanta.frontends.openai.app import Gateway

# Fields of OpenAI's request this gateway cannot honour, and why; given at their neutral
# value (None, false, an empty list) they are accepted.
_REFUSED = {
    "previous_response_id": "responses are not stored",
    "conversation": "conversations are not stored",
    "tools": "tools are not supported on /v1/responses (use /v1/chat/completions)",
    "tool_choice": "tools are not supported on /v1/responses (use /v1/chat/completions)",
    "reasoning": "reasoning options are not supported",
    "include": "no extra output can be included",
    "background": "background responses are not supported (they need a stored response)",
    "prompt": "stored prompts are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses",
    "max_tool_calls": "tools are not supported on /v1/responses",
}
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Fields that mean on chat completions what they mean here: OpenAI's, the sampling fields
# vLLM's Responses API adds (``vllm bench serve`` sends ``ignore_eos``), and Quanta's own.
_PASSED = (
    "temperature",
    "top_p",
    "user",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "logit_bias",
    "chat_template_kwargs",
    "tenant",
    "app",
    "priority_class",
)


class InputPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an earlier response's output_text carries them


class InputMessage(BaseModel):
    """One message item of ``input``; the other item kinds (calls, images, files) are not
    taken."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None  # an earlier response's item, sent back as input
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponsesRequest(NullsAreDefaults):
    """The fields of OpenAI's ``/v1/responses`` request that Quanta reads; the ones in
    ``_REFUSED`` are declared so that a refusal can name them, and any other is a 400."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    # refused unless neutral (``_REFUSED``)
    previous_response_id: str | None = None
    conversation: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None
    include: list[Any] | None = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # vLLM's sampling and template fields, passed to chat as they are (``_PASSED``)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Quanta's scheduling fields, as on chat completions
    tenant: str | None = None
    app: str | None = None
    priority_class: str | None = None

    def refused(self) -> None:
        """Raise a 400 naming the first field given that this gateway cannot honour."""
        for name, why in _REFUSED.items():
            value = getattr(self, name)
            neutral = value in (None, False, []) or (
                name == "tool_choice" and value in ("none", "auto")
            )
            if not neutral:
                raise invalid(f"{name} is not supported: {why}", name)
        if self.store:
            raise invalid("store: true is not supported: responses are not stored", "store")

    def chat(self) -> dict[str, Any]:
        """The chat completion request this response is made by."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": m.role, "content": m.text()} for m in self.input]
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        given = {
            "max_tokens": self.max_output_tokens,
            "response_format": _response_format(self.text),
        } | {name: getattr(self, name) for name in _PASSED}
        return chat | {key: value for key, value in given.items() if value is not None}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` (``text``, ``json_object``, ``json_schema`` with its schema beside the
    type) as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


class Responses:
    """The route; it answers through the gateway's chat completions route."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.router = APIRouter()
        self.router.post("/v1/responses", response_model=None)(self.responses)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        body.refused()
        try:
            chat = ChatCompletionRequest.model_validate(body.chat())
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            param = {"max_tokens": "max_output_tokens", "messages": "input"}.get(loc, loc)
            raise invalid(f"{param}: {err['msg']}", param) from None
        shell = _Shell(body)
        answer = await self.gateway.chat_completions(chat, request)
        if isinstance(answer, StreamingResponse):
            events = shell.events(answer.body_iterator)  # type: ignore[arg-type]
            return StreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)
        completion = json.loads(bytes(answer.body))  # type: ignore[arg-type]
        choice = completion["choices"][0]
        text = choice["message"].get("content") or ""
        return JSONResponse(shell.response(text, choice["finish_reason"], completion["usage"]))


class _Shell:
    """The ``response`` object of one request, at each stage of its life."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def response(
        self, text: str | None, finish: str | None, use: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The object with ``text`` as its output (None: still in progress)."""
        b = self.body
        status = "in_progress" if text is None else "completed"
        incomplete = None
        if finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        output = [] if text is None else [self.item(text, "completed")]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": b.model,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": b.temperature,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": None if use is None else _usage(use),
            "user": b.user,
            "metadata": b.metadata or {},
        }

    def item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [_part(text)]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        """The Responses API's events, from the chat route's server-sent chunks."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self.response(None, None, None))
        yield event("response.in_progress", response=self.response(None, None, None))
        yield event("response.output_item.added", output_index=0, item=self.item("", "in_progress"))
        yield event("response.content_part.added", **where, part=_part(""))
        text: list[str] = []
        finish, use = None, None
        try:
            async for chunk in _sse_data(chunks):
                if "error" in chunk:
                    error = chunk["error"]
                    yield event(
                        "error",
                        code=error.get("code"),
                        message=error.get("message"),
                        param=error.get("param"),
                    )
                    return
                use = chunk.get("usage") or use
                for choice in chunk.get("choices", ()):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
                    finish = choice.get("finish_reason") or finish
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        whole = "".join(text)
        yield event("response.output_text.done", **where, text=whole, logprobs=[])
        yield event("response.content_part.done", **where, part=_part(whole))
        yield event("response.output_item.done", output_index=0, item=self.item(whole, "completed"))
        final = self.response(whole, finish, use)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(use: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage under the Responses API's names."""
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": use["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": use["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": use["total_tokens"],
    }


async def _sse_data(chunks: AsyncIterator[str | bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of server-sent events (``data: ...``), up to ``[DONE]``."""
    buffer = ""
    async for piece in chunks:
        buffer += piece.decode() if isinstance(piece, bytes) else piece
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            for line in message.splitlines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return
                yield json.loads(data)
