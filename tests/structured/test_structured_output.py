"""Structured output: guides validated where they enter (``SamplingParams``, Triton inputs,
the OpenAI gateway's fields), and outputs on the real engine that match them, the same
whether or not the request was preempted."""

from __future__ import annotations

import json
import re

import pytest
import quanta
from preemption import roomy_and_cramped
from pydantic import ValidationError
from quanta import SamplingParams, StructuredOutput
from quanta.core.errors import InvalidRequestError
from quanta.frontends.openai.errors import OpenAIError
from quanta.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest
from quanta.frontends.triton.client import request_inputs
from quanta.frontends.triton.inputs import parse_request
from quanta.structured.grammar import choice_regex

# Every output this schema allows is short (enums, a bounded integer, a boolean), so even a
# random-weight model reaches its end well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
# At most three items: finite too.
GRAMMAR = 'root ::= "(" item (", " item)? (", " item)? ")"\nitem ::= "a" | "b" | "c"'


def assert_matches_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["color", "size", "ok"]  # the schema's order, nothing else
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 99
    assert isinstance(value["ok"], bool)


# -- the guide, where it enters --------------------------------------------------------------
def test_a_guide_is_exactly_one_kind_and_a_schema_keeps_its_key_order():
    spec = StructuredOutput(json_schema=SCHEMA)
    assert spec.kind == "json_schema"
    assert list(json.loads(spec.guide)["properties"]) == ["color", "size", "ok"]
    assert StructuredOutput(json_schema=json.dumps(SCHEMA)) == spec
    for bad, message in (
        ({}, "got none"),
        ({"regex": "a+", "choice": ("x",)}, "got regex, choice"),
        ({"json_schema": "{not json"}, "json_schema is not JSON"),
        ({"json_schema": "[1]"}, "must be a JSON object"),
        ({"choice": ()}, "at least one non-empty string"),
        ({"regex": "  "}, "must not be empty"),
    ):
        with pytest.raises(ValidationError, match=re.escape(message)):
            StructuredOutput(**bad)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json_schema=SCHEMA),
        StructuredOutput(json_object=True),
        StructuredOutput(regex=r"[0-9]{3}"),
        StructuredOutput(choice=("yes", "no, thanks")),
        StructuredOutput(grammar=GRAMMAR),
    ],
    ids=lambda s: s.kind,
)
def test_triton_inputs_carry_every_guide_as_tensorrt_llm_names_them(spec):
    params = SamplingParams(max_tokens=8, structured_output=spec)
    inputs = request_inputs("hi", params, stream=False)
    assert inputs["guided_decoding_guide_type"] in (
        "json",
        "json_schema",
        "regex",
        "ebnf_grammar",
        "choice",
    )
    parsed = parse_request(lambda name: _tensor(inputs.get(name)))
    assert parsed.params.structured_output == spec


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"guided_decoding_guide_type": "yaml", "guided_decoding_guide": "x"}, "must be one of"),
        ({"guided_decoding_guide_type": "regex"}, "needs a guided_decoding_guide"),
        ({"guided_decoding_guide": "a+"}, "needs 'guided_decoding_guide_type'"),
        ({"guided_decoding_guide_type": "choice", "guided_decoding_guide": "yes"}, "JSON array"),
        ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{x"}, "not JSON"),
    ],
)
def test_malformed_triton_guides_are_refused_naming_the_input(inputs, message):
    inputs = {"text_input": "hi", **inputs}
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_request(lambda name: _tensor(inputs.get(name)))


def _tensor(value):
    import numpy as np

    if value is None:
        return None
    if isinstance(value, str):
        return np.array([value.encode()], dtype=object)
    if isinstance(value, bool):
        return np.array([value])
    if isinstance(value, int):
        return np.array([value], dtype=np.int32)
    if isinstance(value, float):
        return np.array([value], dtype=np.float32)
    return np.array(value)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput(json_schema=SCHEMA),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA)),
        ({"guided_regex": "[ab]+"}, StructuredOutput(regex="[ab]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"guided_grammar": GRAMMAR}, StructuredOutput(grammar=GRAMMAR)),
    ],
)
def test_openai_fields_become_one_guide(fields, expected):
    for body in (
        ChatCompletionRequest(**CHAT, **fields),
        CompletionRequest(model="m", prompt="hi", **fields),
    ):
        assert body.unsupported() is None
        assert body.sampling_params(16).structured_output == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "yaml"}}, "must be text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema"}}, "needs {'json_schema'"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "got guided_regex, guided_choice"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "got guided_regex, response_format",
        ),
        ({"guided_choice": []}, "guided_choice: choice must list at least one"),
    ],
)
def test_bad_openai_guides_are_a_400_naming_the_field(fields, message):
    with pytest.raises(OpenAIError) as info:
        ChatCompletionRequest(**CHAT, **fields).sampling_params(16)
    assert info.value.status == 400
    assert message in info.value.message


def test_choice_alternatives_are_taken_literally():
    pattern = choice_regex(["a.b", "(x)", "1+1", "c-d e"])
    assert re.fullmatch(pattern, "a.b") and re.fullmatch(pattern, "(x)")
    assert not re.fullmatch(pattern, "axb") and not re.fullmatch(pattern, "11")


@pytest.mark.parametrize("vocab", [64, 49_152, 50_001])
def test_the_mask_bias_forbids_exactly_what_xgrammars_apply_kernel_does(vocab):
    """The runner adds ``mask_bias`` to the logits instead of calling xgrammar's apply kernel
    (cheaper after the LM head); the two must agree on every token, the odd tail included."""
    import torch
    import xgrammar as xgr
    from quanta.structured.masks import mask_bias

    torch.manual_seed(vocab)
    bitmask = xgr.allocate_token_bitmask(5, vocab)
    bitmask.random_(-(2**31), 2**31 - 1)
    reference = torch.randn(5, vocab)
    ours = reference.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab)
    ours.index_add_(0, torch.arange(5), mask_bias(bitmask, vocab))
    assert torch.equal(ours, reference)


# -- on the engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny"])
def model_dir(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def llm(model_dir):
    return quanta.LLM(str(model_dir))


PROMPTS = ["The weather today is", "Describe a box:", "Once upon a time", "A list of"]


def guided(spec: StructuredOutput, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": 48, "temperature": 0.0, **kwargs}, structured_output=spec
    )


@pytest.mark.engine
def test_outputs_match_their_guide(llm):
    cases = [
        (StructuredOutput(json_schema=SCHEMA), assert_matches_schema),
        (
            StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) or pytest.fail(t),
        ),
        (
            StructuredOutput(choice=("yes", "no", "maybe")),
            lambda t: t in ("yes", "no", "maybe") or pytest.fail(t),
        ),
        (
            StructuredOutput(grammar=GRAMMAR),
            lambda t: re.fullmatch(r"\([abc](, [abc]){0,2}\)", t) or pytest.fail(t),
        ),
    ]
    for spec, check in cases:
        for seeded in (False, True):
            params = guided(spec, temperature=1.0, seed=7) if seeded else guided(spec)
            for out in llm.generate(PROMPTS, [params] * len(PROMPTS)):
                assert out.finish_reason == "stop", (spec.kind, out.text)
                check(out.text)


@pytest.mark.engine
def test_unconstrained_output_does_not_match_so_the_guide_did_the_work(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    assert not any(o.text.startswith('{"color": ') for o in outs)


@pytest.mark.engine
def test_the_grammars_end_stops_the_output_even_when_eos_is_ignored(llm):
    out = llm.generate(PROMPTS[0], guided(StructuredOutput(choice=("yes", "no")), ignore_eos=True))[
        0
    ]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.engine
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(regex="(ab"), "the regex cannot be compiled"),
        (StructuredOutput(grammar="root ::= missing_rule"), "the EBNF grammar cannot be compiled"),
        (
            StructuredOutput(
                json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}
            ),
            "the JSON schema cannot be compiled",
        ),
    ],
)
def test_a_guide_the_library_cannot_compile_is_refused_before_it_runs(llm, spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.generate("hi", guided(spec))
    assert (
        llm.generate("hi", guided(StructuredOutput(choice=("x",))))[0].text == "x"
    )  # still serving


@pytest.mark.engine
@pytest.mark.parametrize(("host_blocks", "kind"), [(64, "swap"), (0, "recompute")])
def test_guided_outputs_survive_preemption(model_dir, host_blocks, kind):
    specs = [StructuredOutput(json_schema=SCHEMA), StructuredOutput(grammar=GRAMMAR)]
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
    params = [
        SamplingParams(
            max_tokens=40, temperature=1.0 if i % 2 else 0.0, seed=i, structured_output=specs[i % 2]
        )
        for i in range(len(prompts))
    ]
    roomy, cramped = roomy_and_cramped(
        model_dir, prompts, params, host_blocks=host_blocks, device_blocks=16
    )
    for a, b in zip(roomy, cramped, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason == "stop"
