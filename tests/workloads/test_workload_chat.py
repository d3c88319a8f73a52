"""The multi-turn chat workload: conversations whose every turn resends the conversation so
far, their lengths (the Azure trace's answers), think times, prefix groups and the CLIs."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.cli import app
from quanta.costmodel import PROFILES
from quanta.sim import SimSetup, simulate
from quanta.workloads import (
    AZURE_CONV_OUTPUT,
    ChatApp,
    LogNormalCount,
    PromptIds,
    QuantileCount,
    WorkloadError,
    WorkloadRequest,
    chat,
    chat_apps,
    load_workload,
    make_workload,
)
from typer.testing import CliRunner

WIDE = {"COLUMNS": "1000"}


def conversations(rows: list[WorkloadRequest]) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in rows:
        assert r.interaction_id is not None
        out[r.interaction_id].append(r)
    for turns in out.values():
        turns.sort(key=lambda r: r.interaction_stage or 0)
    return out


def test_chat_is_seeded_sized_and_ordered():
    rows = chat(300, 4.0, seed=3)
    assert len(rows) == 300 and rows == chat(300, 4.0, seed=3) and rows != chat(300, 4.0, seed=4)
    assert [r.request_id for r in rows] == [f"r{k}" for k in range(300)]
    assert [r.arrival_time for r in rows] == sorted(r.arrival_time for r in rows)
    assert chat(0, 1.0) == []
    # the same conversations at any rate: only the times change
    fast = chat(300, 8.0, seed=3)
    assert sorted((r.prompt_tokens, r.output_tokens) for r in fast) == sorted(
        (r.prompt_tokens, r.output_tokens) for r in rows
    )


def test_each_turn_resends_the_conversation_so_far():
    rows = chat(400, 4.0, seed=1, max_len=4096)
    apps = {a.name: a for a in chat_apps(seed=1)}
    convs = conversations(rows)
    assert any(len(turns) >= 3 for turns in convs.values())
    for conv, turns in convs.items():
        assert [t.interaction_stage for t in turns] == list(range(len(turns)))
        assert [t.interaction_last for t in turns] == [False] * (len(turns) - 1) + [True]
        first = turns[0]
        assert first.think_time_s == 0 and first.prompt_tokens > apps[first.app].system_tokens
        for t in turns:
            assert t.prefix_group == f"{t.app}/{conv}" and t.prefix_tokens == t.prompt_tokens
            assert t.system_tokens == apps[t.app].system_tokens and t.app == first.app
        for before, after in itertools.pairwise(turns):
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
            assert after.think_time_s > 0
            assert after.arrival_time == pytest.approx(before.arrival_time + after.think_time_s)


def test_a_turn_starts_with_the_previous_turns_prompt_and_synthetic_answer():
    rows = chat(200, 4.0, seed=2, max_len=4096)
    ids = PromptIds()
    convs = conversations(rows)
    for turns in convs.values():
        for before, after in itertools.pairwise(turns):
            repeated = before.prompt_tokens + before.output_tokens
            assert ids.of(after)[:repeated] == ids.of(before) + ids.output_ids(before)
    # conversations of one app share exactly its system prompt; of two apps, nothing
    firsts = [turns[0] for turns in convs.values()]
    for a, b in itertools.combinations(firsts[:30], 2):
        shared = a.system_tokens if a.app == b.app else 0
        pa, pb = ids.of(a), ids.of(b)
        assert pa[:shared] == pb[:shared] and pa[shared : shared + 4] != pb[shared : shared + 4]


def test_conversations_end_when_the_next_turn_would_not_fit():
    small = chat(500, 4.0, seed=0, max_len=1024, mean_turns=20)
    big = chat(500, 4.0, seed=0, max_len=8192, mean_turns=20)
    assert all(r.prompt_tokens + r.output_tokens <= 1024 for r in small)
    turns = [len(c) for c in conversations(small).values()]
    assert statistics.mean(turns) < statistics.mean(len(c) for c in conversations(big).values())
    # a first turn that cannot fit is shrunk, never dropped
    tiny = chat(40, 4.0, seed=0, max_len=24, apps=[ChatApp("a", 10)])
    assert all(r.prompt_tokens + r.output_tokens <= 24 for r in tiny)
    assert all(r.interaction_stage == 0 and r.interaction_last for r in tiny)


def test_the_rate_is_turns_per_second_and_think_times_have_their_mean():
    rows = chat(4000, 10.0, seed=5, think_time_s=2.0)
    assert len(rows) / rows[-1].arrival_time == pytest.approx(10.0, rel=0.2)
    for dist in ("lognormal", "exponential"):
        thinks = [r.think_time_s for r in chat(3000, 10.0, think_dist=dist) if r.interaction_stage]
        assert statistics.mean(thinks) == pytest.approx(5.0, rel=0.2)
    eager = chat(50, 1.0, think_time_s=0.0)
    for turns in conversations(eager).values():
        assert len({t.arrival_time for t in turns}) == 1


def test_answers_follow_the_azure_conversation_trace():
    rng = random.Random(0)
    answers = [AZURE_CONV_OUTPUT.sample(rng) for _ in range(20000)]
    assert min(answers) >= 7 and max(answers) <= 1000
    assert statistics.median(answers) == pytest.approx(129, abs=5)  # the trace's P50
    assert statistics.mean(answers) == pytest.approx(211, rel=0.05)  # and its mean
    rows = chat(3000, 4.0, mean_turns=1.0, max_len=100_000)
    assert statistics.median(r.output_tokens for r in rows) == pytest.approx(129, abs=10)
    with pytest.raises(WorkloadError, match="from probability 0 to 1"):
        QuantileCount(((0.0, 1), (0.5, 2)))
    with pytest.raises(WorkloadError, match="increasing"):
        QuantileCount(((0.0, 5), (1.0, 2)))
    assert LogNormalCount(50, 0.0).sample(rng) == 50


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"num_requests": -1}, "num_requests >= 0"),
        ({"apps": []}, "at least one app"),
        ({"rate": 0.0}, "rate > 0"),
        ({"mean_turns": 0.5}, "mean_turns >= 1"),
        ({"think_time_s": -1.0}, "think_time_s >= 0"),
        ({"think_dist": "gamma"}, "think_dist"),
        ({"apps": [ChatApp("a", 100)], "max_len": 101}, "no room for a turn"),
    ],
)
def test_bad_arguments_are_refused(kwargs, problem):
    args = {"num_requests": 5, "rate": 1.0} | kwargs
    with pytest.raises(WorkloadError, match=problem):
        chat(**args)


def test_app_names_cannot_split_a_group():
    with pytest.raises(WorkloadError, match="without '/'"):
        ChatApp("a/b")


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    max_len=st.integers(300, 3000),
    mean_turns=st.floats(1.0, 8.0),
    system=st.integers(0, 250),
)
def test_any_chat_fits_the_model_and_keeps_its_turns_consistent(seed, max_len, mean_turns, system):
    rows = chat(
        30, 2.0, seed=seed, max_len=max_len, mean_turns=mean_turns, apps=[ChatApp("a", system)]
    )
    assert len(rows) == 30 and all(r.prompt_tokens + r.output_tokens <= max_len for r in rows)
    for turns in conversations(rows).values():
        assert turns[0].prompt_tokens > system
        for before, after in itertools.pairwise(turns):
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens


def test_chat_by_name_and_in_the_simulator():
    rows = make_workload("chat", 60, 3.0, seed=1, max_len=2048)
    assert rows == chat(60, 3.0, seed=1, max_len=2048)
    with pytest.raises(WorkloadError, match="agents"):
        make_workload("chat", 5, 1.0, num_users=3)
    result = simulate(rows, SimSetup("fcfs", PROFILES["a100-opt13b"]))
    finished = {r.request_id: r for r in result.requests}
    for turns in conversations(rows).values():
        for before, after in itertools.pairwise(turns):
            done = finished[before.request_id].finish_time
            assert done is not None
            assert finished[after.request_id].arrival_time >= done + after.think_time_s - 1e-9


def test_cli_writes_a_chat_workload(tmp_path: Path):
    out = tmp_path / "chat.jsonl"
    args = ["bench", "workload", str(out), "--dataset", "chat", "--num-requests", "30"]
    res = CliRunner().invoke(app, [*args, "--rate", "2", "--max-len", "1024"])
    assert res.exit_code == 0, res.output
    rows = load_workload(out)
    assert len(rows) == 30 and all(r.prefix_group for r in rows)
    assert rows[0].request_id.startswith("s0-r")
    first = json.loads(out.read_text().splitlines()[0])
    assert first["prefix_tokens"] == first["prompt_tokens"]
    bad = CliRunner().invoke(app, [*args, "--tenants", "a:1"], env=WIDE)
    assert bad.exit_code == 2 and "--dataset chat" in bad.output
    report = tmp_path / "r.json"
    sim = ["simulate", "--workload", "chat", "--num-requests", "20", "--policy", "fcfs"]
    res = CliRunner().invoke(app, [*sim, "--output", str(report)])
    assert res.exit_code == 0, res.output
    assert json.loads(report.read_text())["workload"]["name"] == "chat"
