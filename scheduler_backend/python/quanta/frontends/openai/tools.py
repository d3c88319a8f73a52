"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, the
guide that forces a call, and the answer rewritten as ``tool_calls``, whole or streamed.

What each ``tool_choice`` does (vLLM's behaviour):

- ``none``: the tools are in the prompt, the answer is plain content;
- ``auto`` (the default with tools): the model chooses; the gateway's parser
  (``--tool-call-parser``, ``tool_parsers.py``) finds the calls it wrote;
- ``required`` and ``{"type": "function", "function": {"name": ...}}``: the structured-output
  grammar forces the call, so even a model with random weights answers with arguments that
  parse and satisfy the function's ``parameters`` schema. A named function's answer is its
  arguments object; ``required``'s is a JSON array of ``{"name", "parameters"}`` objects, one
  per call, each with the schema of the function it names.

``parallel_tool_calls: false`` allows one call: the grammar's array holds one element under
``required``, and under ``auto`` the calls after the first are dropped, as vLLM does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from quanta.core.structured import StructuredOutput
from quanta.frontends.openai.errors import invalid
from quanta.frontends.openai.tool_parsers import PARSERS, Parsed, ParsedCall, ToolParser, forced


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow the schema; auto ones never do


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call of an earlier assistant turn, sent back in ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: what the prompt shows, the guide forcing a call (None
    under ``auto``), and how its answer is read (None under ``none``)."""

    tools: list[dict[str, Any]]
    guide: StructuredOutput | None
    parser: ToolParser | None
    named: str | None = None  # the function a named tool_choice forces
    single: bool = False  # parallel_tool_calls: false

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole answer and its finish reason."""
        if not self.reads_calls:
            return {"role": "assistant", "content": text}, finish
        stream = self.stream()
        deltas = [*stream.feed(text), *stream.close()]
        calls: list[dict[str, Any]] = []
        for delta in (d["tool_calls"][0] for d in deltas if "tool_calls" in d):
            if "id" in delta:
                calls.append({k: delta[k] for k in ("id", "type")} | {"function": {}})
                calls[-1]["function"] = {"name": delta["function"]["name"], "arguments": ""}
            calls[-1]["function"]["arguments"] += delta["function"].get("arguments", "")
        content = "".join(d.get("content", "") for d in deltas)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        return message, stream.finish_reason(finish)

    @property
    def reads_calls(self) -> bool:
        """False under ``tool_choice: none``: the answer is plain content."""
        return self.parser is not None or self.named is not None

    def stream(self) -> ToolStream:
        """A fresh reader of one choice's streamed text."""
        return ToolStream(self)


@dataclass
class ToolStream:
    """One choice's text in, chat deltas out: content as it settles, and each call as the
    OpenAI SDK accumulates it (a first delta with ``index``, ``id``, ``type`` and the name,
    then fragments of ``arguments``)."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    sent_calls: int = 0
    started: bool = False  # a named call's first delta went out

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self.plan.named is not None:
            return self._named(text)
        return list(self._settled(final=False))

    def close(self) -> list[dict[str, Any]]:
        if self.plan.named is not None:
            return self._named("")
        return list(self._settled(final=True))

    def finish_reason(self, finish: str | None) -> str | None:
        """``tool_calls`` when a call was made (``length`` stays: its call may be cut)."""
        made = self.sent_calls > 0 or self.started
        return "tool_calls" if made and finish == "stop" else finish

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.started:
            self.started = True
            deltas.append(_call_delta(0, ParsedCall(self.plan.named or "", "")))
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _settled(self, *, final: bool) -> Iterator[dict[str, Any]]:
        assert self.plan.parser is not None
        parsed: Parsed = self.plan.parser(self.text, final=final)
        # NOTE: the parser's content only grows; blanks go out once text follows them, and
        # leading blanks never do (so a streamed answer's content is the whole one's)
        content = parsed.content
        end = len(content.rstrip())
        start = self.sent_content or len(content) - len(content.lstrip())
        if end > start:
            yield {"content": content[start:end]}
            self.sent_content = end
        limit = 1 if self.plan.single else len(parsed.calls)
        for index in range(self.sent_calls, min(len(parsed.calls), limit)):
            call = parsed.calls[index]
            yield _call_delta(index, ParsedCall(call.name, ""))
            yield {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}
            self.sent_calls = index + 1


def _call_delta(index: int, call: ParsedCall) -> dict[str, Any]:
    return {
        "tool_calls": [
            {
                "index": index,
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ]
    }


def tool_plan(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    parser: str,
) -> ToolPlan | None:
    """The request's plan; None when it has no tools. Raises a 400 naming the field for a
    choice that names no tool given, or a schema the grammar cannot enforce."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    listed = [tool.model_dump(exclude_none=True) for tool in tools]
    single = parallel_tool_calls is False
    if tool_choice == "none":
        return ToolPlan(listed, None, None)
    if tool_choice in (None, "auto"):
        return ToolPlan(listed, None, PARSERS[parser], single=single)
    if tool_choice == "required":
        return ToolPlan(listed, _guide(_required_schema(tools, single)), forced, single=single)
    name = _named(tool_choice)
    chosen = next((t for t in tools if t.function.name == name), None)
    if chosen is None:
        raise invalid(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ToolPlan(listed, _guide(_parameters(chosen)), None, named=name, single=True)


def _named(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "tool_choice is none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return name


def _parameters(tool: Tool) -> dict[str, Any]:
    """A function's arguments schema; a function without one takes no arguments."""
    parameters = tool.function.parameters
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def _required_schema(tools: list[Tool], single: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if single:
        schema["maxItems"] = 1
    return schema


def _guide(schema: dict[str, Any]) -> StructuredOutput:
    try:
        return StructuredOutput(json_schema=schema)
    except ValidationError as exc:
        detail = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise invalid(
            f"tools: a function's parameters cannot be enforced: {detail}", "tools"
        ) from None


__all__ = ["Tool", "ToolCall", "ToolChoice", "ToolPlan", "ToolStream", "tool_plan"]
