"""vLLM's sampling and chat fields through the gateway with the official ``openai`` client
(``extra_body`` for what OpenAI's API lacks): each reaches the engine as the offline API's
``SamplingParams`` or chat template takes it, and a bad value is a 400 naming the field."""

from __future__ import annotations

import json
import re

import pytest
import quanta
from quanta import SamplingParams

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.live

MODEL = "quanta"


@pytest.fixture(scope="module")
def client(triton):
    url = triton.openai_url("quanta-one-seq", MODEL)
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(triton):
    return quanta.LLM(str(triton.model_dir))


def test_logit_bias_and_min_p_sample_as_the_offline_api_does(client, llm):
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logit_bias={"13": 100}
    )
    params = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={13: 100.0})
    assert forced.choices[0].text == llm.generate(["Hello"], params)[0].text
    assert llm.generate(["Hello"], params)[0].token_ids == [13] * 5
    seeded = SamplingParams(max_tokens=12, temperature=1.3, seed=4, min_p=0.2, logit_bias={5: 2})
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, temperature=1.3, seed=4,
        logit_bias={"5": 2}, extra_body={"min_p": 0.2},
    )  # fmt: skip
    assert out.choices[0].text == llm.generate(["Hello"], seeded)[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_outputs_guide_the_answer(client, stream):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    guides = [{"choice": ["left", "right"]}, {"regex": "[0-9]{3}"}, {"json": schema}]
    texts = []
    for guide in guides:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Answer."}],
            max_tokens=24,
            temperature=0,
            stream=stream,
            extra_body={"structured_outputs": guide},
        )
        if stream:
            texts.append("".join(c.choices[0].delta.content or "" for c in out if c.choices))
        else:
            texts.append(out.choices[0].message.content)
    assert texts[0] in ("left", "right")
    assert re.fullmatch("[0-9]{3}", texts[1])
    assert json.loads(texts[2])["answer"] in ("yes", "no")


BAD = {
    "bias out of range": ({"logit_bias": {"5": 250}}, "logit_bias", "[-100, 100]"),
    "bias key not an id": ({"logit_bias": {"five": 1}}, "logit_bias", "valid integer"),
    "bias outside the vocabulary": (
        {"logit_bias": {"99999999": 1}},
        None,
        "logit_bias: token ids [99999999] are not in the vocabulary",
    ),
    "min_p above 1": ({"extra_body": {"min_p": 1.5}}, "min_p", "less than or equal to 1"),
    "two guides": (
        {"extra_body": {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}},
        None,
        "give one structured output guide, got guided_choice, structured_outputs",
    ),
    "two guides in one": (
        {"extra_body": {"structured_outputs": {"regex": "a+", "choice": ["a"]}}},
        "structured_outputs",
        "exactly one of",
    ),
    "a backend knob": (
        {"extra_body": {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}},
        "structured_outputs",
        "Extra inputs are not permitted",
    ),
    "usage stats without a stream": (
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        "stream_options",
        "only allowed when stream is true",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_sampling_field_is_400_naming_it(client, case):
    changes, param, message = BAD[case]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **changes)
    error = info.value.response.json()["error"]
    assert error["param"] == param, error
    assert message in error["message"], error


def test_chat_template_fields_shape_the_prompt(client, llm):
    """The default template (the checkpoint ships none): ``user: ...`` lines, then
    ``assistant:`` unless the prompt continues the final message or asks for no start."""
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    cases = [
        (
            {"continue_final_message": True},
            "user: Name a colour.\nassistant: My favourite colour is",
        ),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "user: Name a colour.\nassistant: My favourite colour is",
        ),
        ({"add_generation_prompt": False}, "user: Name a colour.\n"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "user: Name a colour.\nassistant:"),
    ]
    for extra, prompt in cases:
        turns = messages if extra.get("continue_final_message") else messages[:1]
        out = client.chat.completions.create(
            model=MODEL, messages=turns, max_tokens=6, temperature=0, extra_body=extra
        )
        assert out.choices[0].message.content == llm.generate([prompt], greedy)[0].text, extra
        assert out.usage.prompt_tokens == len(llm.tokenizer.encode(prompt)), extra


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "cannot both be true",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the server"),
    ],
)
def test_contradictory_chat_template_fields_are_400(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body=extra
        )
    error = info.value.response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = {"model": MODEL, "max_tokens": 10, "temperature": 0, "stream": True}
    request |= {"stream_options": options, "extra_body": {"ignore_eos": True}}
    if chat:
        chunks = list(
            client.chat.completions.create(
                messages=[{"role": "user", "content": "Count."}], **request
            )
        )
    else:
        chunks = list(client.completions.create(prompt="Count: one, two,", **request))
    *with_choices, last = chunks
    assert not last.choices and last.usage.completion_tokens == 10  # the final usage chunk
    assert with_choices and all(c.choices and c.usage is not None for c in with_choices)
    done = [c.usage.completion_tokens for c in with_choices]
    assert done == sorted(done) and done[-1] == 10 and done[0] <= 1
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)  # fmt: skip
    plain = list(
        client.completions.create(
            prompt="Count.", **(request | {"stream_options": {"include_usage": True}})
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None
