"""Structured output that is always valid JSON: an answer the grammar ends parses with a strict
JSON parser (no raw control character inside a string) and validates against its schema.

Random weights pick whatever the mask leaves, so only the constraint can make an answer valid:
the engine tests sample many seeds at temperature 1 through the offline API and the gateway,
and the grammar tests walk the masks at random with hypothesis drawing the seeds and the
schemas' names and values. A schema using a keyword the grammar cannot enforce is refused
where it enters, naming the keyword and where it sits.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import quanta
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from quanta import SamplingParams, StructuredOutput

jsonschema = pytest.importorskip("jsonschema")

# Shapes a random-weight model must fill: free text, bounded text, enums (with characters a
# JSON string escapes), numbers and integers with bounds, nested objects, arrays, optional
# fields, unions, formats and patterns.
SCHEMAS: dict[str, dict] = {
    "free_text": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "note": {"type": "string"}},
        "required": ["name"],
    },
    "bounded": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 12},
            "kind": {"enum": ["a", "b c", 'd"e', "f\ng", "\u00e9\t"]},
            "score": {"type": "number", "minimum": -5, "maximum": 5},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 30},
            "inner": {
                "type": "object",
                "properties": {"flag": {"type": "boolean"}, "tag": {"type": "string"}},
                "required": ["flag"],
            },
            "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "opt": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["title", "kind", "score", "count", "inner", "items"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "tag": {"type": "string", "maxLength": 6},
            },
            "required": ["id", "tag"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    "unions": {
        "type": "object",
        "properties": {
            "any": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "integer"}]},
            "one": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                        "required": ["kind", "x"],
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}},
                        "required": ["kind", "y"],
                    },
                ]
            },
            "typed": {"type": "string", "enum": ["s", 1, None]},
        },
        "required": ["any", "one", "typed"],
    },
    "formats_and_patterns": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "ip": {"type": "string", "format": "ipv4"},
            "mail": {"type": "string", "format": "email"},
            "when": {"type": "string", "format": "date-time"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "word": {"type": "string", "pattern": "^[^ ]{1,6}$"},
        },
        "required": ["id", "ip", "mail", "when", "code", "word"],
    },
}
SEEDS = range(24)
PROMPT = "Answer in JSON:"


def check_answer(text: str, schema: dict | None) -> None:
    """Parse strictly and validate (formats too, where ``jsonschema`` can check them);
    ``schema`` None is json_object: any JSON object."""
    value = json.loads(text)  # strict: a raw control character in a string raises
    if schema is None:
        if not isinstance(value, dict):
            raise ValueError(f"not a JSON object: {text}")
        return
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    ).validate(value)


def invalid_answers(llm: quanta.LLM, seeds=SEEDS, max_tokens: int = 320):
    """Every shape's answers over ``seeds`` at temperature 1: the ones that ended by the
    grammar yet do not parse or fit (``(shape, seed, text, why)``), and how many ended."""
    shapes = [(name, schema) for name, schema in SCHEMAS.items()] + [("json_object", None)]
    prompts, params, keys = [], [], []
    for name, schema in shapes:
        spec = (
            StructuredOutput(json_object=True)
            if schema is None
            else StructuredOutput(json_schema=schema)
        )
        for seed in seeds:
            prompts.append(PROMPT)
            params.append(
                SamplingParams(
                    max_tokens=max_tokens, temperature=1.0, seed=seed, structured_output=spec
                )
            )
            keys.append((name, schema, seed))
    bad, stopped = [], 0
    for (name, schema, seed), out in zip(keys, llm.generate(prompts, params), strict=True):
        if out.finish_reason != "stop":
            continue
        stopped += 1
        try:
            check_answer(out.text, schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append((name, seed, out.text, str(exc).splitlines()[0]))
    return bad, stopped


# -- on the engine: many seeds, random weights, temperature 1 -----------------------------------
@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny"])
def llm(request, tiny_checkpoint):
    return quanta.LLM(str(tiny_checkpoint(request.param)))


@pytest.mark.engine
def test_every_answer_the_grammar_ends_parses_strictly_and_fits_its_schema(llm):
    bad, stopped = invalid_answers(llm)
    total = len(SEEDS) * (len(SCHEMAS) + 1)
    assert stopped >= total // 2, f"only {stopped} of {total} answers ended by the grammar"
    assert not bad, f"{len(bad)} of {stopped} answers are invalid:\n" + "\n".join(
        f"{name} seed {seed}: {why}: {text!r:.160}" for name, seed, text, why in bad
    )


@pytest.mark.engine
def test_the_answers_are_random_text_only_the_grammar_shapes(llm):
    """The free-text fields hold what a random model writes (so the grammar, not the model,
    made the answers valid): characters from all over the vocabulary, non-ASCII included."""
    spec = StructuredOutput(json_schema=SCHEMAS["free_text"])
    outs = llm.generate(
        [PROMPT] * 8,
        [
            SamplingParams(max_tokens=320, temperature=1.0, seed=s, structured_output=spec)
            for s in range(8)
        ],
    )
    names = [json.loads(o.text)["name"] for o in outs if o.finish_reason == "stop"]
    assert names and any(not n.isascii() for n in names), names
    plain = llm.generate([PROMPT] * 8, SamplingParams(max_tokens=32, temperature=1.0, seed=1))
    assert not any(o.text.startswith('{"name": "') for o in plain)


# -- through the gateway, with the official client ----------------------------------------------
def test_response_format_answers_through_the_gateway_parse_and_fit(triton):
    openai = pytest.importorskip("openai")
    schema = SCHEMAS["array_of_objects"]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "items", "schema": schema, "strict": True},
    }

    def ask(seed: int, format_: dict) -> tuple[str | None, str | None]:
        out = client.chat.completions.create(
            model="quanta",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=256,
            temperature=1.0,
            seed=seed,
            response_format=format_,  # type: ignore[arg-type]
        )
        return out.choices[0].finish_reason, out.choices[0].message.content

    with openai.OpenAI(
        base_url=triton.openai_url(), api_key="unused", max_retries=0, timeout=120
    ) as client:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda s: (ask(s, response_format), schema), range(12)))
            answers += list(
                pool.map(lambda s: (ask(s, {"type": "json_object"}), None), range(12, 20))
            )
        with pytest.raises(openai.BadRequestError, match="'uniqueItems' at /") as info:
            client.chat.completions.create(
                model="quanta",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=8,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "u", "schema": {**schema, "uniqueItems": True}},
                },  # type: ignore[arg-type]
            )
        assert info.value.status_code == 400
    ended = [(text, s) for (reason, text), s in answers if reason == "stop"]
    assert len(ended) >= 10, answers
    for text, s in ended:
        check_answer(text or "", s)


# -- the grammar alone: random walks through its masks ------------------------------------------
@pytest.fixture(scope="module")
def grammars(tiny_checkpoint):
    from quanta.structured import Grammars
    from quanta.text.tokenizer import load_tokenizer

    model_dir = tiny_checkpoint("opt-tiny")
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = load_tokenizer(model_dir)
    built = Grammars(tokenizer, config["vocab_size"], [config["eos_token_id"]])
    built.tokenizer = tokenizer  # type: ignore[attr-defined]
    built.eos = config["eos_token_id"]  # type: ignore[attr-defined]
    built.vocab = config["vocab_size"]  # type: ignore[attr-defined]
    return built


def walk(grammars, spec: StructuredOutput, seed: int, steps: int = 400) -> str | None:
    """The text of a random walk through ``spec``'s masks (each step a token the mask allows,
    its end as soon as allowed half the time), or None when it did not end in ``steps``."""
    import torch
    import xgrammar as xgr
    from quanta.structured.masks import mask_bias

    rng = random.Random(seed)
    constraint = grammars(spec)
    bitmask = xgr.allocate_token_bitmask(1, grammars.vocab)
    ids: list[int] = []
    for _ in range(steps):
        constraint.fill_mask(bitmask, 0)
        allowed = torch.nonzero(mask_bias(bitmask, grammars.vocab)[0] == 0).flatten().tolist()
        end = grammars.eos in allowed and rng.random() < 0.5
        token = grammars.eos if end else rng.choice(allowed)
        assert constraint.accept(token)
        if constraint.terminated:
            return grammars.tokenizer.decode(ids)
        ids.append(token)
    return None


names = st.text(min_size=1, max_size=6)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-99, 99), st.text(max_size=5))
drawn_schemas = st.builds(
    lambda props, values, length: {
        "type": "object",
        "properties": {
            **{p: {"type": "string", "maxLength": length} for p in props[:2]},
            **{p: {"enum": values} for p in props[2:3]},
            **{p: {"type": "array", "items": {"const": values[0]}} for p in props[3:]},
        },
        "required": props[:2],
    },
    st.lists(names, min_size=1, max_size=4, unique=True),
    st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps),
    st.integers(0, 6),
)


@settings(max_examples=40)
@given(schema=drawn_schemas, seed=st.integers(0, 2**32))
def test_random_walks_through_drawn_schemas_give_valid_json(grammars, schema, seed):
    """Property names and enum values with quotes, backslashes and control characters are
    escaped, and bounded strings hold no raw control character."""
    text = walk(grammars, StructuredOutput(json_schema=schema), seed)
    if text is not None:
        check_answer(text, schema)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "minLength": 2},
        {"type": "string", "pattern": "^a.{1,3}$"},
        {"type": "string", "format": "ipv4"},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
        {"type": "string", "enum": ["x", 2, None]},
        {"type": "string", "format": "hostname"},
    ],
    ids=["minLength", "pattern", "ipv4", "required-elsewhere", "typed-enum", "hostname"],
)
def test_random_walks_fit_what_the_library_alone_got_wrong(grammars, schema, seed):
    for s in range(seed * 8, seed * 8 + 8):
        text = walk(grammars, StructuredOutput(json_schema=schema), s)
        if text is not None:
            check_answer(text, schema)


def test_a_bounded_string_refuses_a_raw_control_character(grammars):
    constraint = grammars(StructuredOutput(json_schema={"type": "string", "maxLength": 5}))
    quote, control = (_token_of(grammars, b) for b in (b'"', b"\x01"))
    assert constraint.accept(quote)
    assert not constraint.accept(control)


def test_no_token_after_a_lead_byte_makes_a_surrogate(grammars):
    """ED A0 starts a UTF-16 surrogate (invalid UTF-8, decoded as U+FFFD): xgrammar alone
    allows it in a JSON string, the mask does not; ED 80 (U+D000) stays allowed."""
    import xgrammar as xgr

    constraint = grammars(StructuredOutput(json_schema={"type": "string"}))
    for data in (b'"', b"\xed"):
        assert constraint.accept(_token_of(grammars, data))
    alone = xgr.allocate_token_bitmask(1, grammars.vocab)
    constraint.matcher.fill_next_token_bitmask(alone, 0)
    guarded = xgr.allocate_token_bitmask(1, grammars.vocab)
    constraint.fill_mask(guarded, 0)
    surrogate, fine = _token_of(grammars, b"\xa0"), _token_of(grammars, b"\x80")
    assert _allows(alone, surrogate) and not _allows(guarded, surrogate)
    assert _allows(alone, fine) and _allows(guarded, fine)


def test_each_tokens_bytes_are_what_decode_writes(grammars):
    decoded = grammars.token_bytes()
    for token, data in enumerate(decoded):
        try:
            text = data.decode()
        except UnicodeDecodeError:  # part of a character: checked in sequences below
            continue
        assert grammars.tokenizer.decode([token]) == text, token
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(decoded)) for _ in range(rng.randrange(1, 12))]
        data = b"".join(decoded[i] for i in ids)
        assert grammars.tokenizer.decode(ids) == data.decode(errors="replace")


def test_added_tokens_are_what_decode_writes_and_special_ones_never_allowed(tiny_checkpoint):
    from quanta.structured import Grammars
    from quanta.text.tokenizer import Tokenizer, load_tokenizer

    base = load_tokenizer(tiny_checkpoint("opt-tiny"))
    backend = base.backend
    backend.add_tokens(["\u00e9<x>", "a b\n"])  # not special
    tokenizer = Tokenizer(backend, bos_token_id=base.bos_token_id, eos_token_id=2)
    added = [backend.token_to_id(t) for t in ("\u00e9<x>", "a b\n")]
    decoded = Grammars(tokenizer, max(added) + 1, [2]).token_bytes()
    for token in added:
        assert decoded[token] and decoded[token].decode("utf-8", "replace") == tokenizer.decode(
            [token]
        )
    specials = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
    assert specials and all(decoded[i] == b"" for i in specials)


def _token_of(grammars, data: bytes) -> int:
    return grammars.token_bytes().index(data)


def _allows(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


# -- schemas the grammar cannot enforce: refused where they enter --------------------------------
ITEMS = {"type": "array", "items": {"type": "integer"}}


@pytest.mark.parametrize(
    ("schema", "keyword", "where"),
    [
        ({**ITEMS, "uniqueItems": True}, "uniqueItems", "/"),
        ({**ITEMS, "contains": {"const": 1}}, "contains", "/"),
        ({"properties": {"a": {"not": {"type": "string"}}}}, "not", "/properties/a"),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "if", "/"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "/"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf", "/"),
        ({"type": "string", "format": "json-pointer"}, "format", "/"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", "/"),
        ({"type": "string", "format": "email", "minLength": 3}, "minLength", "/"),
        ({"type": "string", "pattern": '^a"b$'}, "pattern", "/"),
        ({"type": "string", "pattern": "^a\\nb$"}, "pattern", "/"),
        ({"type": "string", "pattern": "^[\\t\\n]+$"}, "pattern", "/"),
        ({"type": "string", "pattern": "(a"}, "pattern", "/"),
        ({"type": "object", "patternProperties": {'^"': {}}}, "patternProperties", "/"),
        ({"type": "string", "enum": ["abc"], "maxLength": 2}, "maxLength", "/"),
        ({"type": "integer", "const": "a"}, "const", "/"),
        (
            {"type": "object", "required": ["b"], "additionalProperties": False},
            "required",
            "/",
        ),
        ({"$defs": {"a/b": {"uniqueItems": True}}}, "uniqueItems", "/$defs/a~1b"),
        ({"items": {"items": {"not": {}}}}, "not", "/items/items"),
    ],
)
def test_a_schema_the_grammar_cannot_enforce_is_refused_naming_the_keyword(
    schema, keyword, where
):
    from quanta.core.errors import InvalidRequestError
    from quanta.frontends.openai.errors import OpenAIError
    from quanta.frontends.openai.protocol import ChatCompletionRequest
    from quanta.frontends.triton.inputs import parse_request

    named = f"'{keyword}' at {where} cannot be used"
    with pytest.raises(ValidationError, match=re.escape(named)):
        StructuredOutput(json_schema=schema)
    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    with pytest.raises(OpenAIError) as info:
        body.sampling_params(16)
    assert info.value.status == 400 and named in info.value.message
    inputs = {
        "text_input": "hi",
        "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": json.dumps(schema),
    }
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        parse_request(lambda name: _tensor(inputs.get(name)))


def _tensor(value):
    import numpy as np

    return None if value is None else np.array([value.encode()], dtype=object)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^[ -~]{1,6}$"},  # a class that also holds '"' and '\'
        {"type": "string", "pattern": "^[^\\t]+$"},
        {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "maxItems": 1},
        {"type": "integer", "multipleOf": 7},
        {"type": "integer", "format": "int32"},  # a format on a non-string: an annotation
        {"type": "string", "enum": ["a", "b"], "description": "x", "default": "a"},
    ],
)
def test_what_the_grammar_enforces_is_accepted(schema):
    StructuredOutput(json_schema=schema)


def test_a_pydantic_discriminated_union_is_accepted():
    """pydantic writes one as oneOf over $refs whose literal field tells the branches apart."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field, TypeAdapter

    class A(BaseModel):
        kind: Literal["a"]
        x: int

    class B(BaseModel):
        kind: Literal["b"]
        y: bool

    schema = TypeAdapter(Annotated[A | B, Field(discriminator="kind")]).json_schema()
    assert "oneOf" in schema
    StructuredOutput(json_schema=schema)
    overlapping = {**schema, "$defs": {**schema["$defs"], "B": schema["$defs"]["A"]}}
    with pytest.raises(ValidationError, match="'oneOf' at / cannot be used"):
        StructuredOutput(json_schema=overlapping)


def test_what_the_grammar_approximates_is_rewritten_into_what_it_means():
    from quanta.core.json_schema import enforced_schema

    assert enforced_schema({"type": "string", "enum": ["a", 1, None]}) == {
        "type": "string",
        "enum": ["a"],
    }
    assert enforced_schema({"type": ["integer", "null"], "enum": [1.0, 1.5, None, "x"]}) == {
        "type": ["integer", "null"],
        "enum": [1.0, None],
    }
    rewritten = enforced_schema(
        {"type": "object", "required": ["a", "b"], "additionalProperties": {"type": "integer"}}
    )
    assert rewritten["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    ipv4 = enforced_schema({"type": "string", "format": "ipv4"})
    assert "format" not in ipv4 and re.fullmatch(ipv4["pattern"].strip("^$"), "10.0.0.255")
    assert not re.fullmatch(ipv4["pattern"].strip("^$"), "10.0.010.1")
