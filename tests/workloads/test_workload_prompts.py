"""Shared prompt prefixes in workloads: the prefix keys of a row and the JSONL format, the
token ids a row becomes (``quanta.workloads.prompts``), and the tools that send those ids:
the simulator's requests and the benchmark client's payloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.bench.client import ClientRequest, Target, prompt_value, to_client_requests
from quanta.sim import build_requests
from quanta.workloads import (
    DEFAULT_ID_RANGE,
    PromptIds,
    WorkloadError,
    WorkloadRequest,
    fit_to_model,
    load_workload,
    prompt_ids,
    save_workload,
    scale_tokens,
    with_io_ratio,
)


def row(rid: str, n: int, group: str | None = None, prefix: int = 0, **kw) -> WorkloadRequest:
    return WorkloadRequest(0.0, n, 4, rid, prefix_group=group, prefix_tokens=prefix, **kw)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# --- the id scheme ----------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    n_a=st.integers(1, 300),
    n_b=st.integers(1, 300),
    data=st.data(),
)
def test_two_requests_of_a_group_share_exactly_the_shorter_prefix(n_a, n_b, data):
    p_a, p_b = data.draw(st.integers(0, n_a)), data.draw(st.integers(0, n_b))
    ids = PromptIds()
    a, b = ids.of(row("a", n_a, "g", p_a)), ids.of(row("b", n_b, "g", p_b))
    shared = min(p_a, p_b)
    assert a[:shared] == b[:shared]
    # NOTE: past the prefix the streams differ; a chance match at the very next id is
    # 1 in 32k, and the seeds are fixed, so the examples are deterministic.
    if shared < min(n_a, n_b):
        assert common_prefix(a, b) == shared


def test_ids_are_deterministic_and_within_the_range():
    r = row("r7", 500, "g", 200)
    first = prompt_ids(r)
    assert first == prompt_ids(r) == PromptIds().of(r)
    assert len(first) == 500 and all(DEFAULT_ID_RANGE[0] <= t < DEFAULT_ID_RANGE[1] for t in first)
    small = prompt_ids(r, id_range=(10, 20))
    assert set(small) <= set(range(10, 20)) and len(set(small)) == 10
    assert prompt_ids(r, seed=1) != first  # the seed salts every stream
    # the memo changes nothing: a group drawn short, then long, is one stream
    memo = PromptIds()
    memo.of(row("x", 10, "g", 10))
    assert memo.of(r) == first
    tiny = PromptIds(max_groups=1)
    tiny.of(row("x", 10, "other", 10))  # evicts "g", which is drawn again alike
    assert tiny.of(r) == first


def test_unrelated_requests_share_nothing():
    ids = PromptIds()
    prompts = [ids.of(row(f"r{i}", 64), i) for i in range(50)]
    prompts += [ids.of(row(f"g{i}", 64, f"group{i}", 32)) for i in range(50)]
    heads = {tuple(p[:4]) for p in prompts}
    assert len(heads) == len(prompts)
    # a row without an id is keyed by its index
    assert ids.of(row("", 16), 3) != ids.of(row("", 16), 4)
    assert ids.of(row("", 16), 3) == PromptIds().of(row("", 16), 3)


def test_explicit_ids_are_sent_as_they_are():
    r = WorkloadRequest(0.0, 3, 2, "r", prompt_token_ids=(1, 99999, 0))
    assert prompt_ids(r, id_range=(10, 20)) == [1, 99999, 0]
    assert WorkloadRequest(0.0, 2, 1, prompt_token_ids=[5, 6]).prompt_token_ids == (5, 6)
    with pytest.raises(WorkloadError, match="has 2 ids but prompt_tokens is 3"):
        WorkloadRequest(0.0, 3, 1, prompt_token_ids=(5, 6))


def test_a_child_group_starts_with_its_parents_system_prompt():
    ids = PromptIds()
    app = ids.of(row("call", 100, "app", 40))
    turn = ids.of(row("t0", 300, "app/c1", 300, system_tokens=60))
    other = ids.of(row("t1", 300, "app/c2", 300, system_tokens=60))
    assert turn[:60] == other[:60] and turn[:40] == app[:40]
    assert common_prefix(turn, other) == 60
    assert common_prefix(turn, ids.of(row("t2", 300, "elsewhere/c1", 300, system_tokens=60))) == 0
    # without a system prompt a child group shares nothing with its parent
    assert common_prefix(ids.of(row("t3", 50, "app/c1", 50)), app) == 0
    # output ids continue the group: what the next turn of a conversation repeats
    first = row("t0", 100, "app/c9", 100, system_tokens=30)
    longer = ids.of(row("t1", 150, "app/c9", 150, system_tokens=30))
    assert ids.of(first) + ids.output_ids(first) == longer[:104]
    with pytest.raises(WorkloadError, match="no prefix_group"):
        ids.output_ids(row("x", 5))


def test_ids_are_fast_enough_for_long_traces():
    """Millions of tokens a second on a laptop (not timed here: a shared machine varies);
    this only makes sure a long trace's worth of ids is made at all, and made compactly."""
    ids = PromptIds()
    rows = [row(f"r{i}", 1000, f"g{i % 20}", 600) for i in range(400)]
    total = sum(len(ids.of(r)) for r in rows)
    assert total == 400_000
    objects: dict[int, int] = {}
    for t in ids.of(rows[0]) + ids.of(rows[1]):  # one object per id: a pointer per token
        assert objects.setdefault(t, id(t)) == id(t)


def test_bad_ranges_are_refused():
    with pytest.raises(WorkloadError, match="0 <= lo < hi"):
        PromptIds((5, 5))
    with pytest.raises(WorkloadError, match="max_groups"):
        PromptIds(max_groups=0)


# --- the row and the file format --------------------------------------------------------


def test_prefix_fields_are_checked_on_the_row():
    with pytest.raises(WorkloadError, match="prefix_tokens needs a prefix_group"):
        WorkloadRequest(0.0, 10, 1, prefix_tokens=3)
    with pytest.raises(WorkloadError, match=r"prefix_tokens \(11\) must be in"):
        WorkloadRequest(0.0, 10, 1, prefix_group="g", prefix_tokens=11)


def test_jsonl_round_trips_the_prefix_keys(tmp_path: Path):
    rows = [
        row("a", 10, "app/c1", 10, system_tokens=4),
        WorkloadRequest(1.0, 3, 2, "b", prompt_token_ids=(7, 8, 9)),
        WorkloadRequest(2.0, 5, 4, "c"),
    ]
    path = save_workload(tmp_path / "w.jsonl", rows)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["prefix_group"] == "app/c1" and lines[0]["prefix_tokens"] == 10
    assert lines[1]["prompt_token_ids"] == [7, 8, 9]
    assert not {"prefix_group", "prefix_tokens", "prompt_token_ids"} & set(lines[2])
    assert load_workload(path) == rows


def test_jsonl_ids_give_the_prompt_length(tmp_path: Path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"arrival_time": 0, "prompt_token_ids": [3, 4, 5, 6], "output_tokens": 2}\n')
    (r,) = load_workload(path)
    assert r.prompt_tokens == 4 and r.prompt_token_ids == (3, 4, 5, 6)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"prefix_group": 3}, "prefix_group must be a non-empty string"),
        ({"prefix_group": ""}, "prefix_group must be a non-empty string"),
        ({"prefix_tokens": 2}, "prefix_tokens needs a prefix_group"),
        ({"prefix_group": "g", "prefix_tokens": -1}, "prefix_tokens must be an integer >= 0"),
        (
            {"prefix_group": "g", "prefix_tokens": 9},
            r"prefix_tokens \(9\) must be in \[0, prompt_tokens \(4\)\]",
        ),
        ({"prompt_token_ids": []}, "prompt_token_ids must be a non-empty list"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids must be a non-empty list"),
        ({"prompt_token_ids": [1, -2, 3, 4]}, r"prompt_token_ids\[1\] must be an integer >= 0"),
        ({"prompt_token_ids": [1, True, 3, 4]}, r"prompt_token_ids\[1\] must be an integer"),
        ({"prompt_token_ids": [1, 2]}, "has 2 ids but prompt_tokens is 4"),
        ({"prompt_token_ids": [1, 2, 3, 4], "prompt": "hi"}, "prompt or prompt_token_ids"),
    ],
)
def test_bad_prefix_keys_name_the_line(tmp_path: Path, fields, problem):
    good = {"arrival_time": 0, "prompt_tokens": 4, "output_tokens": 2}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good | fields) + "\n")
    with pytest.raises(WorkloadError, match=rf"bad\.jsonl:2: .*{problem}"):
        load_workload(path)


def test_transforms_keep_the_prefix_within_the_prompt():
    r = row("a", 100, "g", 80, system_tokens=40)
    (half,) = scale_tokens([r], 0.5)
    assert (half.prompt_tokens, half.prefix_tokens, half.system_tokens) == (50, 40, 20)
    clipped = fit_to_model(r, 64, "clip")
    assert clipped is not None and clipped.prefix_tokens == clipped.prompt_tokens == 60
    ids = WorkloadRequest(0.0, 6, 2, "b", prompt_token_ids=(1, 2, 3, 4, 5, 6))
    (shorter,) = scale_tokens([ids], 0.5)
    assert shorter.prompt_token_ids == (1, 2, 3)
    (longer,) = scale_tokens([ids], 2.0)
    assert longer.prompt_token_ids is None and longer.prompt_tokens == 12
    assert all(x.prefix_tokens <= x.prompt_tokens for x in with_io_ratio([r, ids], 0.2, 200))


# --- the tools that send the ids --------------------------------------------------------


def test_simulated_prompts_are_distinct_unless_a_group_shares_them():
    trace = [row(f"r{i}", 40) for i in range(20)] + [row("g0", 40, "g", 32), row("g1", 48, "g", 32)]
    requests = build_requests(trace)
    prompts = [r.prompt_token_ids for r in requests]
    assert len({tuple(p[:8]) for p in prompts[:20]}) == 20  # not one constant token any more
    assert prompts[20][:32] == prompts[21][:32] and prompts[20][32] != prompts[21][32]
    assert prompts == [r.prompt_token_ids for r in build_requests(trace)]
    real = build_requests(trace, vocab_size=100, seed=3)
    assert all(4 <= t < 100 for r in real for t in r.prompt_token_ids)
    assert real[20].prompt_token_ids[:32] == real[21].prompt_token_ids[:32]
    # a warm-up with another seed shares nothing with the run it warms
    assert build_requests(trace, seed=1)[0].prompt_token_ids != prompts[0]


def test_simulated_trace_ids_must_fit_the_vocabulary():
    trace = [WorkloadRequest(0.0, 2, 1, "x", prompt_token_ids=(3, 500))]
    assert build_requests(trace)[0].prompt_token_ids == [3, 500]
    with pytest.raises(ValueError, match="outside the model's vocabulary of 100"):
        build_requests(trace, vocab_size=100)


def test_the_client_sends_the_ids_the_simulator_uses():
    rows = [
        row("a", 30, "app/c1", 30, system_tokens=10),
        row("b", 20, "app/c2", 20, system_tokens=10),
        WorkloadRequest(0.0, 2, 1, "c", prompt_token_ids=(5, 6)),
    ]
    a, b, c = to_client_requests(rows)
    assert (a.prefix_group, a.prefix_tokens, a.system_tokens) == ("app/c1", 30, 10)
    assert c.prompt == (5, 6)
    target = Target(url="x:1", transport="grpc", token_id_range=(10, 250))
    ids = PromptIds(target.token_id_range)
    assert prompt_value(a, target) == prompt_value(a, target, ids) == ids.of(rows[0])
    assert prompt_value(a, target)[:10] == prompt_value(b, target)[:10]
    assert prompt_value(c, target) == [5, 6]
    plain = ClientRequest("plain", 0.0, 12, 3)
    assert len(prompt_value(plain, target)) == 12
