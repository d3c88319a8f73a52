"""OpenAI request models, their translation to Quanta's sampling settings, and response bodies.

Requests are pydantic models that forbid unknown fields, so a typo is a 400 naming the field
rather than a silently ignored setting. OpenAI fields that Quanta cannot honour (``best_of``,
``logit_bias``, tools, ...) are rejected with a message that says so. Scheduling metadata are
extra top-level fields (``tenant``, ``app``, ``interaction_id``, ``interaction_stage``,
``interaction_last``, ``system_tokens``, ``priority_class``, ``ttft_slo_ms``,
``tpot_slo_ms``); OpenAI's ``user`` is the tenant unless ``tenant`` is given. Sampling values
are validated by Quanta's own ``SamplingParams``, so the gateway's messages are the backend's.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.structured import StructuredOutput
from quanta.frontends.openai.auth import Principal
from quanta.frontends.openai.errors import OpenAIError, invalid
from quanta.frontends.triton.inputs import validation_message

# Triton finish reasons -> OpenAI's; anything else ("abort", "error") arrives as an error.
FINISH_REASONS = {"stop": "stop", "length": "length"}

# Integers travel to Triton as INT32 (counts) and UINT64 (seed) tensors: a larger value would
# wrap or overflow there, so it is refused here, naming the field, before any narrowing.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]


class _Checked(BaseModel):
    """Unknown fields forbidden, types strict, and every string encodable as UTF-8: a lone
    surrogate (``"\\ud800"`` in the JSON) is a 400 naming the field, not a failure further
    down. Strict as OpenAI is: ``"stream": "yes"`` or ``"max_tokens": "16"`` is a 400 naming
    the field, not a guess; a JSON integer is still a number where a float is expected."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        _check_utf8(value)
        return value


def _check_utf8(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    elif isinstance(value, list | tuple):
        for item in value:
            _check_utf8(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_utf8(key)
            _check_utf8(item)


class StreamOptions(_Checked):
    include_usage: bool = False


class _GenerationRequest(_Checked):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=16)  # choices: one Triton request each
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension (HF's penalty)
    min_tokens: Int32 | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's guided decoding extensions (one guide per request, or a response_format)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Quanta extensions
    top_k: Int32 | None = None
    ignore_eos: bool = False
    tenant: str | None = None
    app: str | None = None
    interaction_id: str | None = None
    interaction_stage: Int32 | None = None
    interaction_last: bool | None = None
    system_tokens: Int32 | None = None
    priority_class: str | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send ``null`` for fields they leave unset (``"n": null``): take the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        """Options of a stream on a request that does not stream are a client's mistake (a
        usage it would never see): refused as OpenAI and vLLM refuse them. ``stream`` is
        declared first, so it is validated by now."""
        if value is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return value

    def unsupported(self) -> OpenAIError | None:
        """The first requested feature Quanta does not offer, as a 400."""
        if self.logit_bias:
            return invalid("logit_bias is not supported", "logit_bias")
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Quanta's sampling settings; a bad value raises a 400 naming the OpenAI field."""
        fields: dict[str, Any] = {
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "ignore_eos": self.ignore_eos,
        }
        for name in _SAMPLING_FIELDS:
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop is not None:
            fields["stop"] = self.stop
        guide = self.structured_output()
        if guide is not None:
            fields["structured_output"] = guide
        wanted = self.top_logprobs_wanted
        if wanted is not None:
            fields["logprobs"] = wanted
            if self.prompt_logprobs_wanted:
                fields["prompt_logprobs"] = wanted
        return _validated(SamplingParams, fields)

    def structured_output(self) -> StructuredOutput | None:
        """The guide of ``response_format`` or of one ``guided_*`` field; a malformed or a
        second one is a 400 naming the field."""
        guides = {
            name: value for name in _GUIDED_FIELDS if (value := getattr(self, name)) is not None
        }
        response = _response_format_guide(self.response_format)
        if response is not None:
            guides["response_format"] = response
        if len(guides) > 1:
            raise invalid(f"give one structured output guide, got {', '.join(guides)}")
        if not guides:
            return None
        ((name, value),) = guides.items()
        if isinstance(value, StructuredOutput):
            return value
        key = _GUIDED_FIELDS[name]
        try:
            return StructuredOutput(**{key: tuple(value) if key == "choice" else value})
        except ValidationError as exc:
            detail = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise invalid(f"{name}: {detail}", name) from None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return None

    @property
    def prompt_logprobs_wanted(self) -> bool:
        """Whether the prompt's tokens are reported with logprobs too (completions' echo)."""
        return False

    def metadata(
        self, system_tokens: int | None = None, principal: Principal | None = None
    ) -> RequestMetadata:
        """Scheduling metadata; ``tenant`` wins over OpenAI's ``user``, and an explicit
        ``system_tokens`` over the count the gateway made of the system messages.

        With an API key (``principal``) the tenant is the key's whatever the body says, and
        a key whose class is ``offline`` sends offline work only (``auth.py``)."""
        fields = {
            name: getattr(self, name)
            for name in _METADATA_FIELDS
            if getattr(self, name) is not None
        }
        if system_tokens is not None:
            fields.setdefault("system_tokens", system_tokens)
        tenant = self.tenant if self.tenant is not None else self.user
        if principal is not None:
            tenant = principal.tenant
            fields["tenant_authenticated"] = True
            if principal.priority_class == "offline":
                fields["priority_class"] = "offline"
        if tenant is not None:
            fields["tenant"] = tenant
        return _validated(RequestMetadata, fields)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


_GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format_guide(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text`` (no guide), ``json_object`` or
    ``json_schema`` (``{"json_schema": {"name": ..., "schema": {...}, "strict": ...}}``; the
    schema is enforced whatever ``strict`` says)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise invalid(
            "response_format type must be text, json_object or json_schema", "response_format"
        )
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid(
            "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
            "response_format",
        )
    try:
        return StructuredOutput(json_schema=schema)
    except ValidationError as exc:
        detail = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise invalid(f"response_format: {detail}", "response_format") from None


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)
# Every scheduling field but ``tenant``, which ``user`` may give instead, and
# ``tenant_authenticated``, which only the server sets (from an API key), never a body.
_METADATA_FIELDS = tuple(
    name for name in RequestMetadata.model_fields if name not in ("tenant", "tenant_authenticated")
)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``; ``prompt`` is one text or one list of token ids."""

    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Logprobs asked for: None (none), else how many alternatives per token."""
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> bool:
        return self.echo and self.logprobs is not None

    def unsupported(self) -> OpenAIError | None:
        if self.suffix:
            return invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            return invalid("best_of is not supported (only 1)", "best_of")
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (OpenAI allows a batch; Quanta takes one)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise invalid("give one prompt per request (batched prompts are not supported)")
            prompt = prompt[0]
        if not prompt:
            raise invalid("prompt is empty: it must contain at least one token", "prompt")
        return prompt  # type: ignore[return-value]


class ContentPart(_Checked):
    type: Literal["text"]
    text: str


class ChatMessage(_Checked):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        """Only an assistant turn may have no content, as OpenAI has it."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (text or parts)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> OpenAIError | None:
        if self.top_logprobs is not None and not self.logprobs:
            return invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            return invalid("tools are not supported", "tools")
        if not self.messages:
            return invalid("messages is empty", "messages")
        return super().unsupported()

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``max_completion_tokens`` (OpenAI's newer name) stands in for ``max_tokens``."""
        if self.max_tokens is None and self.max_completion_tokens is not None:
            default_max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def _validated(model: type[Any], fields: dict[str, Any]) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]["loc"]
        raise invalid(validation_message(exc), str(first[0]) if first else None) from None


# -- response bodies ----------------------------------------------------------------------------
Usage = dict[str, Any]
"""OpenAI's ``usage`` object: token counts, and the prompt's cached share in its details."""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """``cached_tokens``: prompt tokens the prefix cache held, so not computed again; OpenAI
    reports it in ``prompt_tokens_details`` whether or not anything was cached."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


TokenLogprobs = list[tuple[str, float | None, list[tuple[str, float]] | None]]
"""Per token: its text, its log-probability, and the alternatives asked for (None for both:
the prompt's first token, which nothing predicts)."""


def completion_logprobs(tokens: TokenLogprobs, top: int, offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters already sent."""
    offsets = []
    for text, _, _ in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [t for t, _, _ in tokens],
        "token_logprobs": [lp for _, lp, _ in tokens],
        "top_logprobs": [None if alts is None else dict(alts) for _, _, alts in tokens]
        if top
        else None,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: TokenLogprobs) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content``: one entry per token, with its bytes)."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            entry(t, lp) | {"top_logprobs": [entry(a, v) for a, v in alts]}
            for t, lp, alts in tokens
        ]
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: Usage | None,
    *,
    chunk: bool,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object, whole or as one streamed chunk."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice] if text or finish or logprobs or not chunk else [],
    }
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: Usage | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, str] | None,
    finish: str | None = None,
    use: Usage | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` is the usage-only chunk (no choices)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
    if use is not None:
        body["usage"] = use
    return body
