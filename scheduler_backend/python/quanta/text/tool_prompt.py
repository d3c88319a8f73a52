"""Tools and tool turns in a chat prompt, the way the model's template expects them.

A template that knows tools (it reads the ``tools`` variable, as HF's ``apply_chat_template``
passes it: Qwen2.5, Hermes, Llama 3.1, ...) gets the OpenAI ``tools`` list, assistant turns
with their ``tool_calls`` (arguments as objects, which those templates serialise themselves)
and ``tool`` turns as they are. A template that does not (SmolLM2's, the plain default) would
drop all of that silently, so the conversation is rewritten into turns every template takes,
in the Hermes format the ``hermes`` parser reads back:

- the tools become a system block (``hermes_system_block``), after the first system message's
  text or as a system message of its own;
- an assistant's calls become ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  lines of its content;
- tool results become a user turn of ``<tool_response>`` blocks (consecutive results one
  turn, so user and assistant still alternate for templates that insist).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quanta.text.chat_template import ChatTurn


def template_reads_tools(source: str | None) -> bool:
    """Whether a jinja2 chat template renders the ``tools`` it is given."""
    return source is not None and "tools" in source


def conversation(
    messages: Sequence[ChatTurn], tools: Sequence[dict[str, Any]] | None, *, native: bool
) -> list[dict[str, Any]]:
    """The messages as a template's ``messages`` variable; ``native``: the template reads
    tools itself (then ``tools`` is passed to it beside this list). A turn may carry
    ``calls`` (OpenAI's ``tool_calls`` as dicts) and ``tool_call_id`` beside ``ChatTurn``'s."""
    if native:
        return [_native_turn(m) for m in messages]
    turns: list[dict[str, Any]] = []
    for message in messages:
        turn = _plain_turn(message)
        if message.role == "tool" and turns and turns[-1].get("tool_results"):
            turns[-1]["content"] += "\n" + turn["content"]
            continue
        turns.append(turn)
    for turn in turns:
        turn.pop("tool_results", None)
    if tools:
        block = hermes_system_block(tools)
        if turns and turns[0]["role"] in ("system", "developer"):
            turns[0]["content"] = f"{turns[0]['content']}\n\n{block}".lstrip()
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


def hermes_system_block(tools: Sequence[dict[str, Any]]) -> str:
    """The Hermes function-calling system prompt (NousResearch's format, which Qwen2.5 and
    SmolLM2-1.7B were trained on), in few words: a small model's context is short."""
    signatures = "\n".join(
        json.dumps(tool, ensure_ascii=False, separators=(",", ":")) for tool in tools
    )
    return (
        "You may call one or more functions to assist with the user query. The functions "
        f"are within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n"
        "For each function call, return a json object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _native_turn(message: ChatTurn) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    calls = getattr(message, "calls", None)
    if calls:
        turn["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call)}}
            for call in calls
        ]
    call_id = getattr(message, "tool_call_id", None)
    if call_id is not None:
        turn["tool_call_id"] = call_id
    return turn


def _plain_turn(message: ChatTurn) -> dict[str, Any]:
    if message.role == "tool":
        body = f"<tool_response>\n{message.text()}\n</tool_response>"
        return {"role": "user", "content": body, "tool_results": True}
    text = message.text()
    for call in getattr(message, "calls", None) or ():
        payload = {"name": call["function"]["name"], "arguments": _arguments(call)}
        block = f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"
        text = f"{text}\n{block}" if text else block
    return {"role": message.role, "content": text}


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object (OpenAI sends them as a JSON string; templates and the
    Hermes format write an object); text that is not JSON stays text."""
    arguments = call["function"].get("arguments", "{}")
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
