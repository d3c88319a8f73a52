"""Tool calling without a server: the parsers, the streamed deltas, the plan each
``tool_choice`` makes, and the tools and tool turns in the chat prompt."""

from __future__ import annotations

import json

import pytest
from quanta.frontends.openai.errors import OpenAIError
from quanta.frontends.openai.tool_parsers import (
    ParsedCall,
    default_parser,
    forced,
    hermes,
    llama3_json,
)
from quanta.frontends.openai.tools import Tool, ToolPlan, tool_plan
from quanta.text.chat_template import ChatTemplate, Turn

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [Tool.model_validate(WEATHER)]
HERMES_ANSWER = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>[{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]</tool_call>'
)


def streamed(plan: ToolPlan, text: str, step: int) -> tuple[list[dict], str | None]:
    """The deltas of ``text`` fed ``step`` characters at a time, and the finish reason."""
    reader = plan.stream()
    deltas = [d for i in range(0, len(text), step) for d in reader.feed(text[i : i + step])]
    return deltas + reader.close(), reader.finish_reason("stop")


def accumulated(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """What the OpenAI SDK builds of the deltas: the content and each call by its index."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                assert call["id"].startswith("call_") and call["type"] == "function"
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"].get("arguments", "")
    content = "".join(d.get("content", "") for d in deltas)
    return content, [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def test_hermes_reads_blocks_lists_and_string_arguments():
    parsed = hermes(HERMES_ANSWER, final=True)
    assert parsed.calls == (
        ParsedCall("get_weather", '{"city": "Paris"}'),
        ParsedCall("get_weather", '{"city": "Rome"}'),
    )
    assert parsed.content.strip() == "Let me look."


def test_hermes_takes_a_last_call_left_unclosed_at_the_end():
    text = '<tool_call>\n{"name": "f", "arguments": {}}'
    assert hermes(text, final=False).calls == ()
    assert hermes(text, final=True).calls == (ParsedCall("f", "{}"),)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "<tool_call>not json",
    ],
)
def test_malformed_calls_stay_plain_content(text):
    assert hermes(text, final=True).calls == ()
    assert hermes(text, final=True).content == text


def test_hermes_holds_back_what_may_become_a_tag():
    assert hermes("Hi <tool_", final=False).content == "Hi "
    assert hermes("Hi <tool_", final=True).content == "Hi <tool_"
    assert hermes("Hi <b>", final=False).content == "Hi <b>"


def test_llama3_json_reads_calls_after_the_python_tag():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert llama3_json(text, final=True).calls == (
        ParsedCall("f", '{"a": 1}'),
        ParsedCall("g", "{}"),
    )
    assert llama3_json('The answer is {"a": 1}', final=True).content.startswith("The answer")
    assert llama3_json('{"name": "f", "parameters": {"a"', final=True).calls == ()
    assert llama3_json("<|python", final=False).content == ""


def test_forced_array_keeps_the_calls_it_finished():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param'
    assert forced(text, final=True).calls == (ParsedCall("f", '{"a": 1}'),)


def test_default_parser_follows_the_template():
    assert default_parser(None) == "hermes"
    assert default_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_parser("{% for m in messages %}{% endfor %}") == "hermes"


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_stream_accumulates_to_the_whole_answer(step):
    plan = tool_plan(TOOLS, "auto", None, "hermes")
    assert plan is not None
    message, finish = plan.message(HERMES_ANSWER, "stop")
    deltas, streamed_finish = streamed(plan, HERMES_ANSWER, step)
    content, calls = accumulated(deltas)
    assert finish == streamed_finish == "tool_calls"
    assert content == message["content"] == "Let me look."
    assert calls == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    first = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert (
        set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
    )


def test_an_answer_without_calls_is_content_with_its_own_finish():
    plan = tool_plan(TOOLS, "auto", None, "hermes")
    assert plan is not None
    message, finish = plan.message("  Just text.  ", "length")
    assert message == {"role": "assistant", "content": "Just text."} and finish == "length"
    deltas, _ = streamed(plan, "  Just text.  ", 2)
    assert accumulated(deltas) == ("Just text.", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = tool_plan(TOOLS, "auto", False, "hermes")
    assert plan is not None
    message, _ = plan.message(HERMES_ANSWER, "stop")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']


def test_required_is_an_array_of_calls_under_each_functions_schema():
    plan = tool_plan(TOOLS, "required", False, "hermes")
    assert plan is not None and plan.guide is not None
    schema = json.loads(plan.guide.json_schema or "")
    assert schema["minItems"] == schema["maxItems"] == 1
    item = schema["items"]
    assert item["properties"]["name"]["enum"] == ["get_weather"]
    assert item["properties"]["parameters"] == WEATHER["function"]["parameters"]
    answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    message, finish = plan.message(answer, "stop")
    assert message["content"] is None and finish == "tool_calls"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_a_named_function_streams_its_arguments_as_they_come():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = tool_plan(TOOLS, choice, None, "hermes")
    assert plan is not None and plan.guide is not None
    assert json.loads(plan.guide.json_schema or "") == WEATHER["function"]["parameters"]
    deltas, finish = streamed(plan, '{"city": "Oslo"}', 4)
    assert finish == "tool_calls"
    assert accumulated(deltas) == ("", [("get_weather", '{"city": "Oslo"}')])
    assert len(deltas) == 5  # the call's first delta, then four fragments


def test_tool_choice_none_reads_no_calls():
    plan = tool_plan(TOOLS, "none", None, "hermes")
    assert plan is not None and not plan.reads_calls and plan.guide is None
    assert plan.message(HERMES_ANSWER, "stop") == (
        {"role": "assistant", "content": HERMES_ANSWER},
        "stop",
    )


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (None, "auto", "tool_choice needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (TOOLS, {"type": "function"}, "tool_choice is none, auto, required"),
    ],
)
def test_a_bad_choice_is_a_400_naming_tool_choice(tools, choice, message):
    with pytest.raises(OpenAIError, match=message) as info:
        tool_plan(tools, choice, None, "hermes")
    assert info.value.status == 400 and info.value.param == "tool_choice"


def test_a_schema_the_grammar_cannot_enforce_is_refused_when_forced():
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "null"}}}}
    )
    with pytest.raises(OpenAIError, match="cannot be enforced") as info:
        tool_plan([tool], "required", None, "hermes")
    assert info.value.param == "tools"
    assert tool_plan([tool], "auto", None, "hermes") is not None  # nothing is enforced


# -- the prompt ---------------------------------------------------------------------------------
class Message(Turn):
    """A turn with the tool fields the gateway's messages carry."""

    def __init__(self, role: str, content: str, calls=None, tool_call_id=None) -> None:
        super().__init__(role, content)
        object.__setattr__(self, "calls", calls)
        object.__setattr__(self, "tool_call_id", tool_call_id)


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    Message("system", "Be brief."),
    Message("user", "Weather in Paris?"),
    Message("assistant", "", calls=[CALL]),
    Message("tool", '{"temp": 21}', tool_call_id="call_1"),
    Message("tool", '{"wind": 3}', tool_call_id="call_1"),
]


def test_a_template_without_tools_gets_the_hermes_system_block_and_turns():
    prompt = ChatTemplate().render(CONVERSATION, [WEATHER])
    system, rest = prompt.split("\nuser: Weather in Paris?\n", 1)
    assert system.startswith("system: Be brief.\n\nYou may call one or more functions")
    assert json.dumps(WEATHER, separators=(",", ":")) in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        rest
    )
    # both results are one user turn, so user and assistant still alternate
    assert rest.count("user: <tool_response>") == 1 and rest.count("<tool_response>") == 2
    assert rest.endswith("</tool_response>\nassistant:")


def test_a_template_that_reads_tools_gets_them_as_hf_passes_them():
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.name }}:{{ c.function.arguments.city }})"
        "{% endfor %}{{ m.tool_call_id or '' }}{% endfor %}"
    )
    prompt = ChatTemplate(source).render(CONVERSATION, [WEATHER])
    assert prompt == (
        "[get_weather]<system>Be brief.<user>Weather in Paris?<assistant>(get_weather:Paris)"
        '<tool>{"temp": 21}call_1<tool>{"wind": 3}call_1'
    )


def test_no_tools_leave_the_prompt_as_it_was():
    turns = [Turn("system", "S"), Turn("user", "hi")]
    assert ChatTemplate().render(turns) == "system: S\nuser: hi\nassistant:"
