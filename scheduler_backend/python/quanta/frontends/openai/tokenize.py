"""vLLM's tokenizer routes and its small service routes: ``/tokenize``, ``/detokenize``,
``/version`` and ``/ping``.

Why the gateway answers these itself: clients use them to line their own tokenizer up with the
server's (``vllm bench serve`` checks its prompt lengths this way; evaluation tools count and
cut prompts), so the answer must be the served checkpoint's tokenizer and chat template, the
ones the gateway already loads for chat and logprobs. Nothing goes to Triton but ``/ping``,
which is ``/health`` under the name vLLM (and SageMaker's probe) uses.

Shapes are vLLM's: ``/tokenize`` takes ``{"prompt"}`` or ``{"messages"}`` (with
``add_generation_prompt`` and ``add_special_tokens``, whose defaults differ between the two as
they do in vLLM: a chat template writes its own special tokens; messages also take
``continue_final_message``, ``chat_template_kwargs`` and ``tools`` as chat does) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``{"tokens"}``
and answers ``{"prompt"}``. ``model`` may be left out; when given it must be the served one.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import Response
from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from quanta.frontends.openai.errors import invalid, unknown_model
from quanta.frontends.openai.protocol import ChatMessage, _Checked
from quanta.text.chat_template import ChatTemplate, ChatTemplateError

if TYPE_CHECKING:
    from quanta.text.tokenizer import Tokenizer


class TokenizeCompletion(_Checked):
    """``POST /tokenize`` with a prompt: the ids the engine would give it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Checked):
    """``POST /tokenize`` with chat messages: the ids of the rendered conversation."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # NOTE: vLLM's default; the template writes its own
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChat:
        """The prompt ends either where a reply starts or inside the last message."""
        if self.continue_final_message and self.add_generation_prompt:
            raise PydanticCustomError(
                "ending",
                "continue_final_message and add_generation_prompt cannot both be true",
            )
        return self


class Detokenize(_Checked):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**31 - 1)]]


def version() -> str:
    """The installed Quanta's version (``/version``)."""
    try:
        return importlib.metadata.version("quanta")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class TokenizerRoutes:
    """The routes above for one served model; ``health`` is the gateway's ``/health``."""

    def __init__(
        self,
        model_name: str,
        template: ChatTemplate,
        max_model_len: int | None,
        health: Callable[[], Awaitable[Response]],
    ) -> None:
        self.model_name = model_name
        self.template = template
        self.max_model_len = max_model_len
        self.router = APIRouter()
        self.router.post("/tokenize")(self.tokenize)
        self.router.post("/detokenize")(self.detokenize)
        self.router.get("/version")(self.version)
        self.router.get("/ping", response_model=None)(health)
        self.router.post("/ping", response_model=None)(health)

    async def tokenize(self, payload: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        """The two request shapes told apart by ``messages``, as vLLM does, so a mistake is
        reported against the shape the client meant."""
        shape = TokenizeChat if "messages" in payload else TokenizeCompletion
        try:
            body = shape.model_validate(payload)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            param = str(error["loc"][0]) if error["loc"] else None
            raise invalid(f"{where}: {error['msg']}" if where else error["msg"], param) from None
        self._check_model(body.model)
        return await asyncio.to_thread(self._tokenize, body)

    async def detokenize(self, body: Detokenize) -> dict[str, str]:
        self._check_model(body.model)
        tokenizer = self._tokenizer("detokenize")
        if any(token >= tokenizer.vocab_size for token in body.tokens):
            raise invalid(
                f"tokens: the tokenizer has {tokenizer.vocab_size} ids (0 to "
                f"{tokenizer.vocab_size - 1})",
                "tokens",
            )
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    async def version(self) -> dict[str, str]:
        return {"version": version()}

    def _tokenize(self, body: TokenizeCompletion | TokenizeChat) -> dict[str, Any]:
        tokenizer = self._tokenizer("tokenize")
        if isinstance(body, TokenizeChat):
            try:
                text = self.template.render(
                    body.messages,
                    body.tools,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    template_kwargs=body.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise invalid(f"chat template: {exc}", "messages") from None
        else:
            text = body.prompt
        tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        answer: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            backend = tokenizer.backend
            answer["token_strs"] = [backend.id_to_token(token) or "" for token in tokens]
        return answer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise unknown_model(model)

    def _tokenizer(self, route: str) -> Tokenizer:
        """The checkpoint's tokenizer; a gateway started without one refuses as it refuses
        logprobs."""
        tokenizer = self.template.tokenizer
        if tokenizer is None:
            raise invalid(
                f"{route} needs the model's tokenizer: start the gateway with --model-dir"
            )
        return tokenizer
