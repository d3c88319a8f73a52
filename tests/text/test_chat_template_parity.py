"""The families' own chat templates render here exactly as HF's ``apply_chat_template``
renders them (``transformers.utils.chat_template_utils``, the renderer it calls), and a
template this renderer cannot run is refused when it is loaded, naming where it came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from family_chat_templates import FAMILIES, GEMMA2, MISTRAL, QWEN2_5
from quanta.text.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateLoadError
from transformers.utils.chat_template_utils import render_jinja_template


@dataclass(frozen=True)
class Msg:
    """A message as the gateway hands it over: text, OpenAI tool calls, a tool call id."""

    role: str
    content: str
    calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        return self.content

    def as_hf(self) -> dict[str, Any]:
        """The same message as HF's documentation writes it (arguments as an object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in self.calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather for a city; <b>Fahrenheit</b> & "Celsius" — it\'s free',
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich <CH>"}'},
}
SYSTEM = Msg("system", "You are terse.")
ONE = [Msg("user", "Hi!")]
TWO = [Msg("user", "Hi!"), Msg("assistant", "  Hello, how can I help?  "), Msg("user", "2+2?")]
WITH_SYSTEM = [SYSTEM, *TWO]
THOUGHT = [
    Msg("user", "2+2?"),
    Msg("assistant", "<think>\nadd them\n</think>\n\n4"),
    Msg("user", "and 3+3?"),
]
TOOL_TURNS = [
    Msg("user", "Weather in Zürich?"),
    Msg("assistant", "", calls=[CALL]),
    Msg("tool", '{"temp": 21}', tool_call_id="call_1"),
    Msg("tool", '{"sky": "<clear>"}', tool_call_id="call_1"),
]

# The conversations each family's template accepts, with the tools it is given.
ACCEPTED: dict[str, list[tuple[list[Msg], list[dict[str, Any]] | None]]] = {
    "qwen2": [(ONE, None), (WITH_SYSTEM, None), (TWO, [WEATHER]), (TOOL_TURNS, [WEATHER])],
    "qwen3": [(ONE, None), (WITH_SYSTEM, None), (THOUGHT, None), (TOOL_TURNS, [WEATHER])],
    "mistral": [(ONE, None), (TWO, None), (WITH_SYSTEM, None)],
    "phi3": [(ONE, None), (TWO, None), (WITH_SYSTEM, None)],
    "gemma2": [(ONE, None), (TWO, None)],
}
CASES = [
    (family, i, prompt)
    for family, conversations in ACCEPTED.items()
    for i in range(len(conversations))
    for prompt in (True, False)
]


def hf_render(source: str, bos: str, eos: str, messages: list[Msg], **kwargs: Any) -> str:
    rendered, _ = render_jinja_template(
        conversations=[[m.as_hf() for m in messages]],
        chat_template=source,
        bos_token=bos,
        eos_token=eos,
        **kwargs,
    )
    return rendered[0]


@pytest.mark.parametrize(("family", "index", "generation_prompt"), CASES)
def test_family_template_renders_as_hf_apply_chat_template(family, index, generation_prompt):
    source, bos, eos = FAMILIES[family]
    messages, tools = ACCEPTED[family][index]
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos).render(
        messages, tools, add_generation_prompt=generation_prompt
    )
    theirs = hf_render(
        source, bos, eos, messages, tools=tools, add_generation_prompt=generation_prompt
    )
    assert ours == theirs


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_enable_thinking_from_chat_template_kwargs_as_hf(thinking):
    source, bos, eos = FAMILIES["qwen3"]
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos).render(
        THOUGHT, template_kwargs={"enable_thinking": thinking}
    )
    theirs = hf_render(
        source, bos, eos, THOUGHT, add_generation_prompt=True, enable_thinking=thinking
    )
    assert ours == theirs
    assert ours.endswith("<think>\n\n</think>\n\n") == (not thinking)


def test_tools_are_written_as_hf_writes_them_not_html_escaped():
    """jinja's own ``tojson`` would write ``<`` as ``\\u003c`` and ``'`` as ``\\u0027``."""
    ours = ChatTemplate(QWEN2_5).render(ONE, [WEATHER])
    assert '<b>Fahrenheit</b> & \\"Celsius\\" — it\'s free' in ours
    assert '"e.g. Zürich"' in ours


@pytest.mark.parametrize(
    ("source", "bos", "messages", "refusal"),
    [
        (GEMMA2, "<bos>", [SYSTEM, *ONE], "System role not supported"),
        (GEMMA2, "<bos>", [Msg("assistant", "Hi"), *ONE], "roles must alternate"),
        (MISTRAL, "<s>", [*ONE, *ONE], "roles must alternate"),
    ],
)
def test_a_refused_conversation_is_refused_as_hf_refuses_it(source, bos, messages, refusal):
    template = ChatTemplate(source, bos_token=bos)  # the template itself loads
    with pytest.raises(ChatTemplateError, match=refusal):
        template.render(messages)
    with pytest.raises(Exception, match=refusal):
        hf_render(source, bos, "", messages, add_generation_prompt=True)


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        "{{ strftime_now('%Y') | length }}{{ messages | tojson(indent=2) }}",
    ],
)
def test_what_hfs_environment_adds_renders_as_there(source):
    """``{% continue %}``, ``{% generation %}``, ``strftime_now`` and ``tojson(indent=...)``
    are HF's additions to jinja that Hub templates use."""
    assert ChatTemplate(source).render(TWO) == hf_render(source, "", "", TWO)


@pytest.mark.parametrize(
    ("source", "jinja_error"),
    [
        ("{% for m in messages %}{{ m.content }}", "Unexpected end of template"),
        ("{{ messages | no_such_filter }}", "No filter named 'no_such_filter'"),
        ("{% do messages.append(1) %}", "Encountered unknown tag 'do'"),
        ("{% if messages is no_such_test %}x{% endif %}", "No test named 'no_such_test'"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ messages.append(1) }}", "SecurityError"),
    ],
)
def test_a_template_the_renderer_cannot_run_fails_at_load_naming_it(tmp_path, source, jinja_error):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": source}))
    with pytest.raises(ChatTemplateLoadError) as info:
        ChatTemplate.from_model_dir(tmp_path)
    assert str(config) in str(info.value)
    assert jinja_error in str(info.value)
    jinja_file = tmp_path / "template.jinja"
    jinja_file.write_text(source)
    with pytest.raises(ChatTemplateLoadError, match=str(jinja_file)):
        ChatTemplate.from_file(jinja_file)
