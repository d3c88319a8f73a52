"""Model output -> OpenAI ``tool_calls``: one parser per way a model family writes calls.

Every parser reads the text generated so far and says what of it is settled: the content
that can no longer turn into a call, and the calls whose JSON is complete. The same function
reads a whole answer (``final=True``) and a stream's prefix, so a streamed answer and a
whole one give the same calls, and a stream never takes back what it sent: a call goes out
once its JSON has closed, text once nothing can make it a call. Output that looks like a call
but is not one (JSON that does not parse, no ``name``) stays plain content.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the
  text (NousResearch Hermes, Qwen2.5, SmolLM2); a block may hold a list of calls, and the
  closing tag may be missing at the end of the answer.
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` objects (Llama
  3.1/3.2's JSON tool calling), optionally after ``<|python_tag|>``, separated by ``;``.
- ``forced``: what the structured-output grammar makes the model write under
  ``tool_choice: required``: a JSON array of ``{"name": ..., "parameters": {...}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a text holds so far: settled content and complete calls, in order."""

    content: str
    calls: tuple[ParsedCall, ...]


class ToolParser(Protocol):
    def __call__(self, text: str, *, final: bool) -> Parsed:
        """The settled part of ``text``; ``final``: the answer has ended, so nothing is held
        back (an unfinished call becomes content)."""
        ...


def hermes(text: str, *, final: bool) -> Parsed:
    content: list[str] = []
    calls: list[ParsedCall] = []
    position = 0
    while True:
        start = text.find(_OPEN, position)
        if start < 0:
            tail = text[position:]
            content.append(tail if final else tail[: len(tail) - _partial_tag(tail, _OPEN)])
            break
        content.append(text[position:start])
        body_start = start + len(_OPEN)
        end = text.find(_CLOSE, body_start)
        if end < 0 and not final:
            break  # the call may still be written
        body = text[body_start:] if end < 0 else text[body_start:end]
        found = _calls(body, ("arguments", "parameters"))
        if found is None:
            content.append(text[start:] if end < 0 else text[start : end + len(_CLOSE)])
        else:
            calls.extend(found)
        if end < 0:
            break
        position = end + len(_CLOSE)
    return Parsed("".join(content), tuple(calls))


def llama3_json(text: str, *, final: bool) -> Parsed:
    body = text.lstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    if not body:
        # NOTE: nothing decides yet, unless the whole answer was blank or only the tag
        return Parsed(text if final else "", ())
    if not body.startswith("{"):
        if not final and _PYTHON_TAG.startswith(body):
            return Parsed("", ())
        return Parsed(text, ())
    calls: list[ParsedCall] = []
    position = 0
    while position < len(body):
        try:
            value, end = _DECODER.raw_decode(body, position)
        except ValueError:
            break  # unfinished, or not JSON
        call = _call(value, ("parameters", "arguments"))
        if call is None:
            break
        calls.append(call)
        position = end
        while position < len(body) and (body[position].isspace() or body[position] == ";"):
            position += 1
    if not final or position >= len(body):
        return Parsed("", tuple(calls))
    return Parsed(body[position:], tuple(calls)) if calls else Parsed(text, ())


def forced(text: str, *, final: bool) -> Parsed:
    """The array ``tool_choice: required`` makes (the grammar has checked every element, so
    an element is whole or still being written; an array cut short by ``max_tokens`` keeps
    the calls it finished)."""
    calls: list[ParsedCall] = []
    body = text.lstrip()
    if not body.startswith("["):
        return Parsed(text if final else "", ())
    position = 1
    while position < len(body):
        while position < len(body) and (body[position].isspace() or body[position] == ","):
            position += 1
        try:
            value, position = _DECODER.raw_decode(body, position)
        except ValueError:
            break
        call = _call(value, ("parameters",))
        if call is None:
            break
        calls.append(call)
    return Parsed("", tuple(calls))


PARSERS: dict[str, ToolParser] = {"hermes": hermes, "llama3_json": llama3_json}


def default_parser(template_source: str | None) -> str:
    """The parser for a chat template when none is named: ``llama3_json`` for a Llama 3
    template (it writes ``<|python_tag|>`` or ``Environment: ipython``), else ``hermes``,
    the format ``text/tool_prompt.py`` teaches a model whose template knows no tools."""
    if template_source is not None and (
        _PYTHON_TAG in template_source or "Environment: ipython" in template_source
    ):
        return "llama3_json"
    return "hermes"


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _calls(body: str, keys: tuple[str, ...]) -> list[ParsedCall] | None:
    """The call(s) of one block: an object, or a list of objects; None: not calls."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [_call(v, keys) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _call(value: Any, keys: tuple[str, ...]) -> ParsedCall | None:
    """``{"name": ..., <key>: {...}}`` as a call (arguments given as a JSON string are taken
    as what they say); None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
