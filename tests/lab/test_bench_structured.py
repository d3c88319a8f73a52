"""``quanta bench structured``'s pure pieces: the TPOT window and what counts as a valid call
(no model; the command itself runs in tests/project/test_documented_commands.py)."""

from __future__ import annotations

import json

import pytest
from quanta_lab.bench.structured import (
    ANSWERS,
    REQUESTS,
    TOOL_CALL,
    called_tool,
    contains_valid_call,
    full_batch_steps,
    full_batch_tpot,
    is_valid_call,
    paired_tpots,
)


def test_tpot_counts_only_the_steps_the_whole_batch_decodes():
    # Token times are step ends. Request a's prefill ends at 1.0, b's (a longer prompt, its
    # step also decodes a) at 1.5; the steps both decode end at 1.7, 1.8 and 1.9, when a
    # ends. a's gap 1.0 -> 1.5 (b's prefill) and b's 1.9 -> 3.0 (b alone) are left out.
    a = [1.0, 1.5, 1.7, 1.8, 1.9]
    b = [1.5, 1.7, 1.8, 1.9, 3.0]
    assert full_batch_steps([a, b]) == pytest.approx([0.2, 0.1, 0.1])
    assert full_batch_tpot([a, b]) == pytest.approx((0.2 + 0.1 + 0.1) / 3)


def test_tpot_of_one_request_is_all_its_gaps():
    assert full_batch_tpot([[0.0, 0.1, 0.3, 0.6]]) == pytest.approx(0.2)


def test_tpot_without_a_common_window_falls_back_to_every_gap():
    # b starts after a ended: no step decoded both.
    assert full_batch_tpot([[0.0, 0.1, 0.2], [0.5, 0.9]]) == pytest.approx(0.2)


def test_paired_tpots_compare_the_same_steps_of_every_run():
    # The free answer stops after two steps; the guided one goes on, its later steps slower
    # (more context): over all of them it would look 2.25x slower, over the same two, equal.
    free = [[0.0, 0.1, 0.2]]
    guided = [[0.0, 0.1, 0.2, 0.5, 0.9]]
    assert full_batch_tpot(guided) == pytest.approx(0.225)
    tpots, steps = paired_tpots([free, guided])
    assert steps == 2
    assert tpots == pytest.approx([0.1, 0.1])


def test_paired_tpots_without_a_common_step_fall_back_to_each_run():
    disjoint = [[0.0, 0.1, 0.2], [0.5, 0.9]]
    tpots, steps = paired_tpots([disjoint, [[0.0, 0.3]]])
    assert steps == 0
    assert tpots == pytest.approx([0.2, 0.3])


def test_tpot_of_no_tokens_is_zero():
    assert full_batch_tpot([]) == 0.0
    assert full_batch_tpot([[], [1.0]]) == 0.0


def test_the_example_answers_are_valid_calls_of_each_tool():
    assert [called_tool(a) for a in ANSWERS] == ["get_weather", "search_flights", "book_hotel"]
    assert {tool for _, tool in REQUESTS} == {"get_weather", "search_flights", "book_hotel"}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # a required argument missing
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}',
        '{"name": "book_hotel", "arguments": {"city": "Rome", "nights": "3"}}',  # not strict
        '{"name": "book_hotel", "arguments": {"city": "Rome", "nights": 0}}',  # out of range
        '{"name": "search_flights", "arguments": {"origin": "A", "destination": "B", '
        '"date": "3 May"}}',
        '{"name": "book_hotel", "arguments": {"city": "Rome", "nights": 3, "pets": true}}',
        '{"name": "send_email", "arguments": {}}',
        '```json\n{"name": "book_hotel", "arguments": {"city": "Rome", "nights": 3}}\n```',
        '{"name": "book_hotel", "arguments": {"city": "Rome", "nights": 3}',  # cut short
        "The weather in Paris is mild.",
    ],
)
def test_only_a_whole_well_typed_call_is_valid(text):
    assert not is_valid_call(text)
    assert called_tool(text) is None


def test_a_call_inside_prose_is_found_but_not_valid():
    call = ANSWERS[2]
    for text in (f"Sure:\n```json\n{call}\n```", f"The answer is: {call} Enjoy!"):
        assert contains_valid_call(text) and not is_valid_call(text)
    assert contains_valid_call(call) and is_valid_call(call)
    assert not contains_valid_call('Here: {"name": "book_hotel"} and {"a": {')


def test_the_guide_is_the_validating_union_without_a_oneof():
    schema = TOOL_CALL.json_schema()
    assert "oneOf" not in json.dumps(schema)  # the grammar library approximates oneOf
    assert len(schema["anyOf"]) == 3
    assert all(d.get("additionalProperties") is False for d in schema["$defs"].values())
