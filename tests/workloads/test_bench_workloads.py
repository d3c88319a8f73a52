"""Workload generators (seeded statistics), trace replay parsing and the JSONL file format."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace

import pytest
from quanta.workloads import (
    DATASETS,
    App,
    RateSchedule,
    Tenant,
    UniformLengths,
    WorkloadError,
    WorkloadRequest,
    arrival_times,
    length_sampler,
    load_workload,
    make_workload,
    merge,
    offline_batch,
    on_off,
    ramp,
    save_workload,
    scale_to_rate,
    synthesize,
    tenant_mix,
    with_io_ratio,
)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def cv_of(xs: list[float]) -> float:
    return statistics.stdev(xs) / statistics.mean(xs)


# -- lengths -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_dataset_lengths_have_their_stated_means(name):
    dist = DATASETS[name]
    rng = random.Random(1)
    samples = [dist.sample(rng, 10**7) for _ in range(6000)]  # no max_len cut: unbiased
    assert statistics.mean(i for i, _ in samples) == pytest.approx(dist.mean_input, rel=0.06)
    assert statistics.mean(o for _, o in samples) == pytest.approx(dist.mean_output, rel=0.06)


def test_dataset_shapes_match_their_descriptions():
    rng = random.Random(0)
    share = [DATASETS["sharegpt"].sample(rng, 2048) for _ in range(3000)]
    human = [DATASETS["humaneval"].sample(rng, 2048) for _ in range(3000)]
    longb = [DATASETS["longbench"].sample(rng, 2048) for _ in range(3000)]
    assert all(i + o <= 2048 for i, o in share + human + longb)
    # HumanEval: low variance in both; LongBench: inputs ~10x ShareGPT's, clipped to fit.
    assert cv_of([i for i, _ in human]) < 0.5 < cv_of([i for i, _ in share])
    assert cv_of([o for _, o in human]) < 0.5 < cv_of([o for _, o in share])
    ratio = statistics.mean(i for i, _ in longb) / statistics.mean(i for i, _ in share)
    assert 7 < ratio < 10


def test_uniform_lengths_and_specs():
    u = length_sampler("uniform:64-128:32-64")
    assert u == UniformLengths((64, 128), (32, 64))
    rng = random.Random(0)
    samples = [u.sample(rng, 2048) for _ in range(4000)]
    assert min(i for i, _ in samples) == 64 and max(i for i, _ in samples) == 128
    assert statistics.mean(o for _, o in samples) == pytest.approx(48, rel=0.02)
    assert length_sampler("alpaca") is DATASETS["alpaca"]
    for bad in ("nope", "uniform:1-2", "uniform:5-2:1-2"):
        with pytest.raises(WorkloadError):
            length_sampler(bad)


# -- arrivals ------------------------------------------------------------------------------
@pytest.mark.parametrize(("rate", "cv"), [(4.0, 1.0), (2.0, 3.0), (10.0, 0.5)])
def test_renewal_arrivals_have_the_asked_rate_and_cv(rate, cv):
    g = gaps(arrival_times(20000, rate, random.Random(0), cv))
    assert statistics.mean(g) == pytest.approx(1 / rate, rel=0.05)
    assert cv_of(g) == pytest.approx(cv, rel=0.1)


def test_infinite_rate_and_bad_arguments():
    assert arrival_times(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    for rate, cv in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, random.Random(0), cv)


def test_rate_schedule_inverts_the_integrated_rate():
    s = RateSchedule(((0.0, 2.0), (10.0, 0.0), (20.0, 1.0)))
    assert s.time_at(10.0) == pytest.approx(5.0)
    assert s.time_at(25.0) == pytest.approx(25.0)  # 20 by t=10, nothing until 20, then 1/s
    p = RateSchedule(((0.0, 4.0), (1.0, 0.0)), period=3.0)  # 4 per cycle of 3 s
    assert p.time_at(2.0) == pytest.approx(0.5)
    assert p.time_at(10.0) == pytest.approx(6.5)  # two cycles (8) + 2 more: 6 + 0.5
    for steps, period in ((((1.0, 1.0),), None), (((0.0, 1.0), (1.0, 0.0)), None)):
        with pytest.raises(WorkloadError):
            RateSchedule(steps, period)


def test_on_off_phases():
    sched = on_off(on_rate=8.0, on_s=5.0, off_s=5.0)
    times = sched.times(8000, random.Random(3))
    assert all((t % 10.0) <= 5.0 + 1e-9 for t in times)  # nothing while OFF
    cycles = times[-1] / 10.0
    assert len(times) / (cycles * 5.0) == pytest.approx(8.0, rel=0.05)  # ON rate
    bursty = on_off(8.0, 5.0, 5.0, off_rate=1.0).times(20000, random.Random(1), cv=2.0)
    on = sum(1 for t in bursty if t % 10.0 < 5.0)
    assert on / (len(bursty) - on) == pytest.approx(8.0, rel=0.1)


def test_ramp_changes_the_rate_over_time():
    sched = ramp(1.0, 9.0, duration_s=100.0, steps=4)
    assert sched.steps == ((0.0, 1.0), (25.0, 3.0), (50.0, 5.0), (75.0, 7.0), (100.0, 9.0))
    times = sched.times(3000, random.Random(0))
    first = sum(1 for t in times if t < 25)
    third = sum(1 for t in times if 50 <= t < 75)
    assert first == pytest.approx(25, rel=0.3) and third == pytest.approx(125, rel=0.2)


# -- tenants, apps, interactions -----------------------------------------------------------
def test_synthesize_is_seeded_and_rates_share_lengths():
    a = synthesize(200, arrivals=2.0, seed=4)
    assert a == synthesize(200, arrivals=2.0, seed=4)
    assert a != synthesize(200, arrivals=2.0, seed=5)
    b = synthesize(200, arrivals=8.0, seed=4)
    assert [(r.prompt_tokens, r.output_tokens) for r in a] == [
        (r.prompt_tokens, r.output_tokens) for r in b
    ]
    assert [r.request_id for r in a] == [f"r{i}" for i in range(200)]
    g = gaps([r.arrival_time for r in synthesize(8000, arrivals=4.0, cv=2.0, seed=1)])
    assert statistics.mean(g) == pytest.approx(0.25, rel=0.05)
    assert cv_of(g) == pytest.approx(2.0, rel=0.1)


def test_tenant_weights_make_an_abuser_send_more():
    tenants = [Tenant("alice"), Tenant("bob"), Tenant("abuser", weight=10.0)]
    reqs = synthesize(6000, arrivals=5.0, tenants=tenants, seed=0)
    share = sum(r.tenant == "abuser" for r in reqs) / len(reqs)
    assert share == pytest.approx(10 / 12, abs=0.02)
    assert tenant_mix("gold:1,abuser:20") == [Tenant("gold", 1.0), Tenant("abuser", 20.0)]
    with pytest.raises(WorkloadError):
        tenant_mix("gold:x")


def test_interactions_share_an_id_tenant_and_app():
    apps = [
        App("chat", "alpaca", calls=(2, 4), call_gap_s=0.5, ttft_slo_ms=500, tpot_slo_ms=50),
        App("summarize", "longbench"),
    ]
    tenants = [
        Tenant("u1", apps=("chat", "summarize")),
        Tenant("batch", 1, ("summarize",), "offline"),
    ]
    reqs = synthesize(400, arrivals=1.0, tenants=tenants, apps=apps, seed=2)
    assert len(reqs) == 400
    assert [r.arrival_time for r in reqs] == sorted(r.arrival_time for r in reqs)
    by_id: dict[str, list[WorkloadRequest]] = {}
    for r in reqs:
        assert (r.interaction_id is not None) == (r.app == "chat")
        if r.interaction_id:
            by_id.setdefault(r.interaction_id, []).append(r)
    assert by_id and all(len({(r.tenant, r.app) for r in rs}) == 1 for rs in by_id.values())
    assert max(len(rs) for rs in by_id.values()) == 4
    chat = [r for r in reqs if r.app == "chat"]
    assert all(r.ttft_slo_ms == 500 and r.tpot_slo_ms == 50 for r in chat)
    assert {r.priority_class for r in reqs if r.tenant == "batch"} == {"offline"}
    assert statistics.mean(r.prompt_tokens for r in chat) < 40  # alpaca-like, not longbench


def test_a_prefix_of_a_longer_workload_is_the_shorter_one():
    """No call of a not-yet-generated interaction may arrive before the n-th request."""
    apps = [App("agent", "alpaca", calls=(1, 6), call_gap_s=3.0)]
    tenants = [Tenant("t", apps=("agent",))]
    short = synthesize(150, arrivals=2.0, tenants=tenants, apps=apps, seed=9)
    long = synthesize(600, arrivals=2.0, tenants=tenants, apps=apps, seed=9)
    assert short == long[:150]
    assert synthesize(0, seed=1) == []
    burst = synthesize(5, arrivals=float("inf"), apps=[App(calls=(2, 2))], seed=0)
    assert len(burst) == 5 and burst[0].arrival_time == 0.0


def test_offline_batch_and_merge():
    online = synthesize(10, arrivals=1.0, lengths="alpaca", seed=0)
    batch = offline_batch(5, at=2.0, seed=0)
    both = merge(online, batch)
    assert len(both) == 15 and [r.arrival_time for r in both] == sorted(
        r.arrival_time for r in both
    )
    assert {r.priority_class for r in batch} == {"offline"} and batch[0].request_id == "b0"
    with pytest.raises(WorkloadError, match="twice"):
        merge(online, online)
    with pytest.raises(WorkloadError, match="unknown apps"):
        synthesize(3, tenants=[Tenant("x", apps=("nope",))])


def test_scale_to_rate_and_io_ratio():
    trace = synthesize(500, arrivals=1.0, seed=3)
    fast = scale_to_rate(trace, 10.0)
    assert fast[0].arrival_time == 0.0
    assert statistics.mean(gaps([r.arrival_time for r in fast])[1:]) == pytest.approx(0.1)
    base = make_workload("sharegpt", 3000, 1.0, seed=0)
    total = statistics.mean(r.input_len + r.output_len for r in base)
    for ratio in (0.25, 4.0):
        t = with_io_ratio(base, ratio, 2048)
        mean_in = statistics.mean(r.input_len for r in t)
        mean_out = statistics.mean(r.output_len for r in t)
        assert mean_in / mean_out == pytest.approx(ratio, rel=0.1)
        assert mean_in + mean_out == pytest.approx(total, rel=0.05)


@pytest.mark.parametrize(
    ("name", "head", "sum_in", "sum_out", "last"),
    [
        ("sharegpt", [(0.003031, 68, 290), (0.052311, 108, 56), (0.126938, 24, 115)],
         46969, 85724, 136.048393),
        ("alpaca", [(0.000009, 13, 53), (0.304222, 17, 12), (0.34538, 7, 23)],
         5732, 16730, 137.693843),
    ],
)  # fmt: skip
def test_make_workload_is_pinned(name, head, sum_in, sum_out, last):
    """The simulator's traces (and so docs/results/fastserve.md's numbers) must not drift: these are
    the values the published tables were generated from."""
    trace = make_workload(name, 300, 2.0, seed=7, cv=2.0)
    assert [(round(r.arrival_time, 6), r.input_len, r.output_len) for r in trace[:3]] == head
    assert sum(r.input_len for r in trace) == sum_in
    assert sum(r.output_len for r in trace) == sum_out
    assert round(trace[-1].arrival_time, 6) == last
    assert [r.request_id for r in trace[:2]] == ["r0", "r1"]


# -- the file format -----------------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
    apps = [App("chat", "sharegpt", calls=(1, 3), ttft_slo_ms=1000, tpot_slo_ms=100)]
    reqs = synthesize(50, arrivals=3.0, tenants=tenant_mix("a:1,b:5", apps=("chat",)), apps=apps)
    reqs[3] = replace(reqs[3], prompt='text with "quotes" and ünïcode\n', priority_class="offline")
    path = save_workload(tmp_path / "w" / "load.jsonl", reqs)
    assert load_workload(path) == reqs
    first = json.loads(path.read_text().splitlines()[0])
    assert {"request_id", "arrival_time", "prompt_tokens", "output_tokens"} <= set(first)
    plain = save_workload(tmp_path / "plain.jsonl", [WorkloadRequest(0.5, 3, 4, "x")])
    assert json.loads(plain.read_text()) == {
        "request_id": "x",
        "arrival_time": 0.5,
        "prompt_tokens": 3,
        "output_tokens": 4,
    }
    unnamed = [WorkloadRequest(0.5, 3, 4), WorkloadRequest(0.7, 3, 4)]
    loaded = load_workload(save_workload(tmp_path / "unnamed.jsonl", unnamed))
    assert [r.request_id for r in loaded] == ["r0", "r1"]


def test_user_traces_with_aliases_text_and_clocks(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"timestamp": 1700000010.5, "prompt": "hello world, how are you", "max_tokens": 8,'
        ' "user": "ann"}\n'
        "\n"
        '{"timestamp": 1700000010.0, "input_len": 12, "output_len": 3, "app": "code"}\n'
    )
    reqs = load_workload(path)
    assert [(r.arrival_time, r.tenant, r.app) for r in reqs] == [
        (0.0, "default", "code"),
        (0.5, "ann", "default"),
    ]
    assert reqs[1].prompt_tokens == 6 and reqs[1].prompt == "hello world, how are you"
    assert load_workload(path, count_tokens=lambda s: len(s.split()))[1].prompt_tokens == 5
    assert [r.request_id for r in reqs] == ["r1", "r0"]
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text('{"prompt_tokens": 5, "output_tokens": 7}\n' * 3)
    with pytest.raises(WorkloadError, match="give a rate"):
        load_workload(untimed)
    timed = load_workload(untimed, rate=2.0, seed=1)
    assert timed[0].arrival_time > 0 and len(timed) == 3
    assert make_workload(str(untimed), 10, 2.0, seed=1)[0].arrival_time == 0.0


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        (['{"prompt_tokens": 5, "output_tokens": 7}', "{oops"], 2, "not JSON"),
        (['{"prompt_tokens": 5}'], 1, "needs output_tokens"),
        (['{"output_tokens": 5}'], 1, "needs prompt_tokens or prompt"),
        (['{"prompt_tokens": -1, "output_tokens": 5}'], 1, "prompt_tokens must be an integer"),
        (['{"prompt_tokens": 2.5, "output_tokens": 5}'], 1, "prompt_tokens must be an integer"),
        (['{"prompt_tokens": 2, "output_tokens": "many"}'], 1, "output_tokens must be"),
        (['{"prompt_tokens": 2, "output_tokens": 5, "tenat": "x"}'], 1, "unknown field 'tenat'"),
        (['{"prompt_tokens": 2, "output_tokens": 5, "priority_class": "gold"}'], 1, "online"),
        (['{"prompt_tokens": 2, "output_tokens": 5, "arrival_time": -3}'], 1, "arrival_time"),
        (['{"prompt_tokens": 2, "output_tokens": 5, "ttft_slo_ms": 0}'], 1, "ttft_slo_ms"),
        (['{"prompt_tokens": 2, "output_tokens": 5, "prompt": ""}'], 1, "prompt must be"),
        (["[1, 2]"], 1, "expected a JSON object"),
        (
            ['{"prompt_tokens": 2, "output_tokens": 5, "timestamp": 1, "arrival_time": 1}'],
            1,
            "not both",
        ),
        (
            [
                '{"prompt_tokens": 2, "output_tokens": 5, "arrival_time": 1}',
                '{"prompt_tokens": 2, "output_tokens": 5}',
            ],
            2,
            "unlike other rows",
        ),
        (
            [
                '{"request_id": "a", "prompt_tokens": 2, "output_tokens": 5, "arrival_time": 1}',
                '{"request_id": "a", "prompt_tokens": 2, "output_tokens": 5, "arrival_time": 2}',
            ],
            2,
            "already used on line 1",
        ),
    ],
)
def test_bad_jsonl_rows_name_the_line(tmp_path, lines, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadError, match=rf"bad\.jsonl:{line}: .*{problem}"):
        load_workload(path, rate=1.0)


BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_burstgpt_trace(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        BURSTGPT_HEADER + "5.0,ChatGPT,100,20,120,Conversation log\n"
        "7.5,GPT-4,40,0,40,API log\n"  # a failed request: skipped
        "9.0,GPT-4,30,10,40,API log\n"
    )
    reqs = load_workload(path)
    assert [(r.arrival_time, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 100, 20),
        (4.0, 30, 10),
    ]
    assert (reqs[0].app, reqs[0].tenant) == ("ChatGPT", "Conversation log")
    assert (reqs[1].app, reqs[1].tenant) == ("GPT-4", "API log")
    with pytest.raises(WorkloadError, match=r"burst\.csv:2: request 'r0': 100 prompt \+ 20"):
        make_workload(str(path), 5, 1.0, max_len=100)  # too long for the model: say so
    assert make_workload(str(path), 5, 1.0, max_len=100, too_long="skip")[0].prompt_tokens == 30


@pytest.mark.parametrize(
    ("body", "line", "problem"),
    [
        ("5.0,ChatGPT,100,20,120,Conversation log\n6.0,ChatGPT,ten,20,30,API log\n", 3, "Request"),
        ("5.0,ChatGPT,100,20,120,Conversation log\n-1,ChatGPT,1,2,3,API log\n", 3, "Timestamp"),
        ("5.0,ChatGPT,100,20,999,Conversation log\n", 2, "Total tokens"),
        ("5.0,ChatGPT,100\n", 2, "wrong number of columns"),
        ("5.0,ChatGPT,100,20,120,Conversation log,extra\n", 2, "wrong number of columns"),
    ],
)
def test_bad_burstgpt_rows_name_the_line(tmp_path, body, line, problem):
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT_HEADER + body)
    with pytest.raises(WorkloadError, match=rf"burst\.csv:{line}: .*{problem}"):
        load_workload(path)
    (tmp_path / "hdr.csv").write_text("Time,Request tokens\n1,2\n")
    with pytest.raises(WorkloadError, match=r"hdr\.csv:1: BurstGPT header lacks"):
        load_workload(tmp_path / "hdr.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_workload(tmp_path / "empty.jsonl")


def test_to_client_requests():
    from quanta.bench.client import to_client_requests

    reqs = [
        WorkloadRequest(0.25, 12, 5, "a", tenant="t", priority_class="offline"),
        WorkloadRequest(0.5, 3, 2, "b", prompt="hi there"),
    ]
    a, b = to_client_requests(reqs)
    assert (a.request_id, a.arrival_s, a.prompt, a.max_tokens) == ("a", 0.25, 12, 5)
    assert (a.tenant, a.priority_class, a.ignore_eos) == ("t", "offline", True)
    assert b.prompt == "hi there"
    assert reqs[0].metadata()["priority_class"] == "offline"
