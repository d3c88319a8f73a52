"""OpenAI request models, their translation to Quanta's sampling settings, and response bodies.

Requests are pydantic models that forbid unknown fields, so a typo is a 400 naming the field
rather than a silently ignored setting. OpenAI fields that Quanta cannot honour (``best_of``,
``suffix``, ...) are rejected with a message that says so. Scheduling metadata are
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
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from quanta.core.request import RequestMetadata, SamplingParams
from quanta.core.structured import StructuredOutput
from quanta.frontends.openai.auth import Principal
from quanta.frontends.openai.errors import OpenAIError, invalid
from quanta.frontends.openai.tools import Tool, ToolCall, ToolChoice
from quanta.frontends.triton.inputs import validation_message
from quanta.text.chat_template import TEMPLATE_VARIABLES

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
    elif isinstance(value, BaseModel):  # a nested model of another module (``tools.py``)
        _check_utf8(value.model_dump())


class StreamOptions(_Checked):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (needs include_usage, as vLLM has it)
    continuous_usage_stats: bool = False


class StructuredOutputs(_Checked):
    """vLLM's ``structured_outputs`` (its current name for guided decoding): one of
    ``json`` (a schema), ``json_object``, ``regex``, ``choice``, ``grammar``. The backend knobs
    vLLM also takes there (``whitespace_pattern``, ``structural_tag``, ...) are refused."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def guide(self) -> StructuredOutput:
        given = {
            "json_schema": self.json_schema,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": None if self.choice is None else tuple(self.choice),
            "grammar": self.grammar,
        }
        return StructuredOutput(**{key: value for key, value in given.items() if value})


class NullsAreDefaults(BaseModel):
    """A request body whose ``null`` fields are taken as unset: clients send ``"n": null`` for
    what they leave out, and the default applies, as in OpenAI's and vLLM's servers."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class _Request(_Checked, NullsAreDefaults):
    """A request body checked as ``_Checked`` says, its nulls taken as unset."""


class _GenerationRequest(_Request):
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
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are text) -> bias
    min_p: float | None = None  # vLLM's extension
    response_format: dict[str, Any] | None = None
    # vLLM's guided decoding extensions (one guide per request, or a response_format)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's current name for them
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
        """The guide of ``response_format``, ``structured_outputs`` or one ``guided_*``
        field; a malformed or a second one is a 400 naming the field."""
        guides: dict[str, Any] = {
            name: value for name in _GUIDED_FIELDS if (value := getattr(self, name)) is not None
        }
        if self.structured_outputs is not None:
            guides["structured_outputs"] = self.structured_outputs
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
        try:
            if isinstance(value, StructuredOutputs):
                return value.guide()
            key = _GUIDED_FIELDS[name]
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

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


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
    "min_p",
    "logit_bias",
)
# Every scheduling field but ``tenant``, which ``user`` may give instead, and
# ``tenant_authenticated``, which only the server sets (from an API key), never a body.
_METADATA_FIELDS = tuple(
    name for name in RequestMetadata.model_fields if name not in ("tenant", "tenant_authenticated")
)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``; ``prompt`` is a text, a list of token ids, or a list of
    either (a batch)."""

    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _a_prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One message for a prompt of none of the four shapes, not one per shape it is not."""
        try:
            return handler(value)
        except ValidationError as exc:
            if any(error["type"] == "value_error" for error in exc.errors()):
                raise  # a prompt of the right shape with bad text (a lone surrogate)
            raise PydanticCustomError(
                "prompt",
                "give a text, a list of token ids (each 0 to 2147483647), or a list of texts "
                "or of token-id lists",
            ) from None

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

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request in order: one text or one list of token ids, or a
        batch of either (each prompt is its own request to the scheduler; its ``n`` choices
        are indexed after the previous prompt's, as OpenAI and vLLM index them)."""
        prompt = self.prompt
        batched = isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
        prompts: list[str | list[int]] = list(prompt) if batched else [prompt]  # type: ignore[arg-type]
        for i, one in enumerate(prompts):
            if not one:
                which = f"prompt {i}" if batched else "prompt"
                raise invalid(f"{which} is empty: it must contain at least one token", "prompt")
        return prompts


class ContentPart(_Checked):
    type: Literal["text"]
    text: str


class ChatMessage(_Checked):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (``tools.py``)
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        """Only an assistant turn may have no content, as OpenAI has it; calls are an
        assistant's, and a tool's answer names the call it answers."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (text or parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool_call_id: a tool message, and only one, names its call")
        return self

    @property
    def calls(self) -> list[dict[str, Any]] | None:
        """The calls as the chat template reads them (``text/tool_prompt.py``)."""
        return None if self.tool_calls is None else [c.model_dump() for c in self.tool_calls]

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
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template fields: more template variables, whether the prompt ends where
    # the assistant's reply starts, or inside the final message (a prefilled reply)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> OpenAIError | None:
        if self.top_logprobs is not None and not self.logprobs:
            return invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if not self.messages:
            return invalid("messages is empty", "messages")
        # NOTE: vLLM's rule; add_generation_prompt left at its default gives way
        explicit = "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and self.add_generation_prompt and explicit:
            return invalid(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            return invalid(
                f"chat_template_kwargs: {', '.join(taken)} are set by the server",
                "chat_template_kwargs",
            )
        return super().unsupported()

    def template_options(self) -> dict[str, Any]:
        """How the chat template renders this conversation (``ChatTemplate.render``)."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs,
        }

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
    delta: dict[str, Any] | None,
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
