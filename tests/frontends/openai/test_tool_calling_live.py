"""Tool calling through the gateway with the official ``openai`` client, over the shared
server's random-weight checkpoint: only the structured-output grammar can make its forced calls
valid, so every call checked here was made valid by construction.

The checkpoint's context is 512 tokens of a tokenizer that spends about one per character, so
each request offers one small function (the tools and their instructions take ~350 tokens).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

MODEL = "quanta"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
SCHEMAS = {"weather": WEATHER, "time": TIME}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
TIME_TOOLS = [{"type": "function", "function": {"name": "time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(triton):
    url = triton.openai_url("quanta-roomy", MODEL)
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def calls_of(client, stream: bool, **request) -> tuple[list[tuple[str, str]], str | None]:
    """The (name, arguments) of each call and the finish reason, whole or as the SDK
    accumulates a stream."""
    request = {"model": MODEL, "messages": ASK, "max_tokens": 96, "temperature": 0} | request
    if stream:
        with client.chat.completions.stream(**request) as events:
            for _ in events:
                pass
            answer = events.current_completion_snapshot  # NOTE: final; kept when cut at length
    else:
        answer = client.chat.completions.create(**request)
    choice = answer.choices[0]
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
    return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason


def check_valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize(
    ("tools", "choice"),
    [(TOOLS, "required"), (TIME_TOOLS, {"type": "function", "function": {"name": "time"}})],
    ids=["required", "named"],
)
def test_forced_calls_parse_and_validate_whole_and_streamed(client, tools, choice):
    whole, finish = calls_of(client, False, tools=tools, tool_choice=choice)
    # NOTE: random weights may go on adding calls to the array until max_tokens
    assert whole and finish in ("tool_calls", "length")
    check_valid(whole)
    if isinstance(choice, dict):
        assert [name for name, _ in whole] == ["time"]
    streamed, streamed_finish = calls_of(client, True, tools=tools, tool_choice=choice)
    assert streamed == whole and streamed_finish == finish


def test_parallel_tool_calls_false_makes_one_call(client):
    calls, finish = calls_of(
        client, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert len(calls) == 1 and finish == "tool_calls"
    check_valid(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_lets_the_model_choose(client, stream):
    calls, finish = calls_of(client, stream, tools=TOOLS, max_tokens=24)
    assert finish in ("stop", "length", "tool_calls")
    assert (finish == "tool_calls") == bool(calls)


def test_tool_choice_none_answers_in_text(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tool_results_go_back_into_the_prompt(client):
    calls, _ = calls_of(client, False, tools=TOOLS, tool_choice="required")
    name, arguments = calls[0]
    messages = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=1
    )
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, request_, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4} | request_
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
