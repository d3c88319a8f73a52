"""The simulator: workloads, the cost-model runner's timeline, determinism, metrics, the CLI."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from unittest.mock import patch

import pytest
from quanta.cli import app
from quanta.core.clock import VirtualClock
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.core.request import Request, SamplingParams
from quanta.costmodel import PROFILES
from quanta.policies import StagedPolicy, make_policy
from quanta.policies.stages import Admission
from quanta.sim import (
    SimRunner,
    SimSetup,
    build_requests,
    simulate,
    summarize,
)
from quanta.sim.metrics import percentile, request_metrics
from quanta.workloads import (
    WorkloadRequest,
    arrival_times,
    load_workload,
    make_workload,
    save_workload,
)
from quanta_lab.sim.report import write_sections
from typer.testing import CliRunner

COST = PROFILES["a100-opt13b"]


# -- workloads -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "mean_in", "mean_out"), [("sharegpt", 161, 338), ("alpaca", 19, 58)]
)
def test_synthetic_lengths_have_the_quoted_means(name, mean_in, mean_out):
    trace = make_workload(name, 4000, 1.0, seed=1)
    assert statistics.mean(r.input_len for r in trace) == pytest.approx(mean_in, rel=0.1)
    assert statistics.mean(r.output_len for r in trace) == pytest.approx(mean_out, rel=0.1)
    assert all(r.input_len + r.output_len <= 2048 and r.output_len >= 1 for r in trace)


def test_workloads_are_seeded():
    assert make_workload("sharegpt", 50, 2.0, seed=3) == make_workload("sharegpt", 50, 2.0, seed=3)
    assert make_workload("sharegpt", 50, 2.0, seed=3) != make_workload("sharegpt", 50, 2.0, seed=4)


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_arrivals_have_the_asked_rate_and_burstiness(cv):
    times = arrival_times(20000, 4.0, random.Random(0), cv)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.1)


def test_trace_files(tmp_path):
    trace = make_workload("alpaca", 20, 3.0, seed=2)
    save_workload(tmp_path / "t.jsonl", trace)
    t0 = trace[0].arrival_time  # a file's times are taken relative to its first arrival
    loaded = make_workload(str(tmp_path / "t.jsonl"), 20, 1.0)
    assert [(r.arrival_time + t0, r.input_len, r.output_len) for r in loaded] == [
        (pytest.approx(r.arrival_time), r.input_len, r.output_len) for r in trace
    ]
    (tmp_path / "nots.jsonl").write_text('{"input_len": 5, "output_len": 7}\n' * 3)
    untimed = make_workload(str(tmp_path / "nots.jsonl"), 10, 2.0, seed=1)
    assert [(r.input_len, r.output_len) for r in untimed] == [(5, 7)] * 3
    assert untimed[0].arrival_time == 0.0 < untimed[1].arrival_time
    (tmp_path / "b.csv").write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5.0,ChatGPT,100,20,120,Conversation log\n7.5,GPT-4,40,0,40,API log\n"
        "9.0,GPT-4,30,10,40,API log\n"
    )
    rows = load_workload(tmp_path / "b.csv")
    assert [(r.arrival_time, r.input_len, r.output_len) for r in rows] == [
        (0, 100, 20),
        (4, 30, 10),
    ]
    assert make_workload(str(tmp_path / "b.csv"), 5, 1.0)[1] == WorkloadRequest(
        4.0, 30, 10, request_id="r1", tenant="API log", app="GPT-4"
    )
    (tmp_path / "bench.jsonl").write_text(
        '{"request_id": "q", "arrival_time": 0.5, "prompt_tokens": 9, "output_tokens": 4}\n'
    )
    assert make_workload(str(tmp_path / "bench.jsonl"), 5, 1.0) == [
        WorkloadRequest(0.0, 9, 4, request_id="q")
    ]
    (tmp_path / "bad.jsonl").write_text('{"input_len": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        make_workload(str(tmp_path / "bad.jsonl"), 5, 1.0)
    with pytest.raises(ValueError, match="neither a dataset"):
        make_workload("nope", 5, 1.0)


def test_workload_metadata_reaches_the_policy_and_the_summary(tmp_path):
    """A workload file's ids, tenants and classes are what the simulated loop serves."""
    rows = [
        WorkloadRequest(0.0, 40, 8, "gold-0", tenant="gold", app="chat", ttft_slo_ms=500),
        WorkloadRequest(0.1, 60, 8, "abuser-0", tenant="abuser"),
        WorkloadRequest(0.1, 60, 8, "abuser-1", tenant="abuser"),
        WorkloadRequest(0.2, 80, 16, "batch-0", tenant="batch", priority_class="offline"),
    ]
    path = save_workload(tmp_path / "w.jsonl", rows)
    trace = make_workload(str(path), 10, 1.0)
    requests = build_requests(trace)
    assert [r.request_id for r in requests] == [r.request_id for r in rows]
    assert [r.metadata.model_dump() for r in requests] == [r.metadata() for r in rows]

    seen: list[tuple[str, str, str]] = []

    class Recording(Admission):
        def admit(self, request, view):  # type: ignore[no-untyped-def]
            meta = request.metadata
            seen.append((request.request_id, meta.tenant, meta.priority_class))
            return None

    def recording_policy(setup: SimSetup) -> StagedPolicy:
        policy = make_policy("fcfs", setup.scheduler)
        policy.admission = Recording()
        return policy

    setup = SimSetup("fcfs", COST)
    with patch("quanta.sim.driver.make_sim_policy", recording_policy):
        result = summarize(simulate(trace, setup))
    assert sorted(seen) == sorted((r.request_id, r.tenant, r.priority_class) for r in rows)
    tenants = result["by_tenant"]["tenants"]
    assert set(tenants) == {"gold", "abuser", "batch"}
    assert tenants["abuser"]["num_finished"] == 2
    assert 0 < result["by_tenant"]["jain_service"] <= 1
    assert set(result["by_class"]) == {"online", "offline"}


# -- the runner's timeline -----------------------------------------------------------------
def seq(rid: str, new: int, start: int, table: tuple[int, ...]) -> ScheduledSeq:
    return ScheduledSeq(rid, (1,) * new, start, table, True, 0.0, 1.0, 0, 0, 0)


def test_step_time_is_the_cost_models():
    clock = VirtualClock()
    runner = SimRunner(COST, clock, 16)
    so = SchedulerOutput((seq("a", 300, 0, tuple(range(19))), seq("b", 1, 40, (20, 21, 22))))
    out = runner.execute(so)
    assert out.sampled_token_ids == (1, 1)
    assert clock.now() == pytest.approx(COST.step_time([(300, 0), (1, 40)]))


def test_reactive_swap_in_stalls_but_prefetch_overlaps():
    swap = COST.swap_time(8, 16)
    decode = COST.step_time([(1, 100)])
    table = tuple(range(8))
    # Reactive: the blocks come in and are read in the same step.
    clock = VirtualClock()
    runner = SimRunner(COST, clock, 16)
    pairs = tuple(zip(table, table, strict=True))
    runner.execute(SchedulerOutput((seq("a", 1, 100, table),), swap_in=pairs))
    assert clock.now() == pytest.approx(swap + decode)
    assert runner.stats.stall_by_request["a"] == pytest.approx(swap)
    # Proactive: they come in during another job's step and are ready by the next one.
    clock = VirtualClock()
    runner = SimRunner(COST, clock, 16)
    other = seq("b", 1, 100, tuple(range(100, 108)))
    runner.execute(SchedulerOutput((other,), swap_in=pairs))
    runner.execute(SchedulerOutput((seq("a", 1, 100, table),)))
    assert clock.now() == pytest.approx(2 * decode) and runner.stats.stall_s == 0


def test_copies_inside_the_step_are_never_hidden():
    """The CPU engine copies blocks inside ``execute``: a profile that says so puts every
    copy of a step on its critical path, prefetch or not."""
    inline = COST.model_copy(update={"swap_overlaps_compute": False})
    pairs = tuple((i, i) for i in range(8))
    clock = VirtualClock()
    runner = SimRunner(inline, clock, 16)
    other = seq("b", 1, 100, tuple(range(100, 108)))
    runner.execute(SchedulerOutput((other,), swap_in=pairs))
    step = inline.swap_time(8, 16) + inline.step_time([(1, 100)])
    assert clock.now() == pytest.approx(step)
    runner.execute(SchedulerOutput((seq("a", 1, 100, tuple(range(8))),)))
    assert clock.now() == pytest.approx(step + inline.step_time([(1, 100)]))


def test_swapped_out_block_is_reused_only_after_its_copy():
    clock = VirtualClock()
    runner = SimRunner(COST, clock, 16)
    runner.execute(SchedulerOutput((seq("n", 16, 0, (5,)),), swap_out=((5, 0),)))
    assert clock.now() == pytest.approx(COST.swap_time(1, 16) + COST.step_time([(16, 0)]))
    assert runner.stats.swap_out_blocks == 1


# -- whole runs ----------------------------------------------------------------------------
def test_same_seed_same_json():
    runs = []
    for _ in range(2):
        trace = make_workload("sharegpt", 40, 2.0, seed=5)
        runs.append(
            json.dumps(summarize(simulate(trace, SimSetup("sj-mlfq", COST))), sort_keys=True)
        )
    assert runs[0] == runs[1]
    other = make_workload("sharegpt", 40, 2.0, seed=6)
    assert (
        json.dumps(summarize(simulate(other, SimSetup("sj-mlfq", COST))), sort_keys=True) != runs[0]
    )


def test_every_request_stops_at_its_trace_length_under_memory_pressure():
    trace = make_workload("sharegpt", 60, 4.0, seed=2)
    for policy in ("fcfs", "sj-mlfq", "sj-mlfq-reactive", "sj-mlfq-recompute"):
        res = simulate(trace, SimSetup(policy, COST, num_device_blocks=120, num_host_blocks=60))
        assert [r.num_output_tokens for r in res.requests] == [t.output_len for t in trace]
        assert not res.rejected
    assert res.loop.num_preemptions_recompute > 0


def test_requests_that_cannot_fit_are_rejected_not_dropped():
    trace = [WorkloadRequest(0.0, 1000, 100), WorkloadRequest(0.1, 10, 10)]
    res = simulate(trace, SimSetup("sj-mlfq", COST, num_device_blocks=20))
    assert [r.request_id for r, _ in res.rejected] == ["r0"]
    assert "could never complete" in res.rejected[0][1]
    assert res.requests[1].num_output_tokens == 10


def test_skip_join_beats_fcfs_and_srpt_bounds_both():
    trace = make_workload("sharegpt", 200, 1.75, seed=0)
    lat = {
        p: summarize(simulate(trace, SimSetup(p, COST)))["mean_normalized_latency"]
        for p in ("fcfs", "sj-mlfq", "srpt")
    }
    assert lat["srpt"] < lat["sj-mlfq"] < lat["fcfs"]


# -- metrics -------------------------------------------------------------------------------
def test_metrics_conventions():
    r = Request("a", [1, 2], SamplingParams(max_tokens=3), arrival_time=1.0, seed=0)
    for t in (2.0, 2.5, 3.0):
        r.append_token(7, t)
    r.finish_time, r.attained_service = 3.0, 1.5
    m = request_metrics([r], {"a": 0.25})
    assert m["mean_ttft"] == 1.0 and m["mean_e2e"] == 2.0
    assert m["mean_tpot"] == 0.5 and m["mean_normalized_latency"] == pytest.approx(2 / 3)
    assert m["mean_time_queued"] == 0.5 and m["mean_time_swapping"] == 0.25
    assert m["mean_time_executing"] == 1.25
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 95) == 5


def test_write_sections_keeps_the_prose(tmp_path):
    doc = tmp_path / "d.md"
    write_sections(doc, {"a": "one"}, "T")
    doc.write_text(doc.read_text() + "\nprose after\n")
    write_sections(doc, {"a": "two", "b": "three"}, "T")
    text = doc.read_text()
    assert "one" not in text and "two" in text and "three" in text and "prose after" in text


# -- the CLI -------------------------------------------------------------------------------
def test_cli_simulate_writes_the_promised_keys(tmp_path: Path):
    out = tmp_path / "r.json"
    args = [
        "simulate",
        "--policy",
        "sj-mlfq",
        "--workload",
        "sharegpt",
        "--rate",
        "1.5",
        "--num-requests",
        "40",
        "--profile",
        "a100-opt13b",
        "--seed",
        "1",
        "--output",
        str(out),
        "--policy-option",
        "memory=reactive",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    for key in (
        "mean_normalized_latency",
        "p95_normalized_latency",
        "mean_ttft",
        "p95_ttft",
        "mean_tpot",
        "throughput_rps",
        "num_preemptions",
        "swap_out_blocks",
    ):
        assert key in data
    assert data["num_finished"] == 40 and data["policy_options"] == {"memory": "reactive"}
    again = tmp_path / "again.json"
    assert (
        CliRunner()
        .invoke(app, [*args[:-4], "--output", str(again), "--policy-option", "memory=reactive"])
        .exit_code
        == 0
    )
    assert again.read_text() == out.read_text()
    for policy in ("fcfs", "mlfq", "fixed-priority", "srpt"):
        res = CliRunner().invoke(app, ["simulate", "--policy", policy, "--num-requests", "10"])
        assert res.exit_code == 0, res.output
    bad = CliRunner().invoke(app, ["simulate", "--policy", "nope", "--num-requests", "5"])
    assert bad.exit_code == 2 and "unknown policy 'nope'" in bad.output
    bad = CliRunner().invoke(app, ["simulate", "--policy-option", "starve_limit=-1"])
    assert bad.exit_code == 2 and "starve_limit" in bad.output


def test_cli_repro_runs_the_real_trace_sweep(tmp_path: Path):
    trace = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:15:{10 + i:02d}.5000000,{100 + 37 * i},{5 + i}" for i in range(12)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    doc = tmp_path / "fastserve.md"
    args = ["simulate", "repro", "--figure", "azure", "--num-requests", "10", "--jobs", "1"]
    res = CliRunner().invoke(app, [*args, "--trace", str(trace), "--output", str(doc)])
    assert res.exit_code == 0, res.output
    text = doc.read_text()
    for name in ("azure-a100-opt13b", "azure-a100-llama7b"):
        assert f"<!-- BEGIN repro:{name} -->" in text
    assert "sj-mlfq (paper reading) mean / P95" in text and "Splitwise" in text
    missing = CliRunner().invoke(app, ["simulate", "repro", "--figure", "azure"])
    assert missing.exit_code == 2 and "--trace" in missing.output


def test_cli_repro_updates_the_doc(tmp_path: Path):
    doc = tmp_path / "fastserve.md"
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "repro",
            "--figure",
            "15a",
            "--num-requests",
            "20",
            "--jobs",
            "1",
            "--output",
            str(doc),
        ],
    )
    assert res.exit_code == 0, res.output
    text = doc.read_text()
    assert "<!-- BEGIN repro:fig15 -->" in text and "sj-mlfq-reactive" in text


def test_cli_bench_scheduler():
    res = CliRunner().invoke(
        app, ["bench", "scheduler", "--candidates", "50,200", "--repeats", "2"]
    )
    assert res.exit_code == 0, res.output
    assert "Apt-Serve Table 6: 1.0 ms" in res.output


def test_cli_bench_schedule_step_times_the_loop_with_caching_off_and_on():
    args = ["bench", "schedule-step", "--waiting", "40", "--steps", "3", "--policies", "fcfs"]
    res = CliRunner().invoke(app, [*args, "--max-num-seqs", "4", "--warm"])
    assert res.exit_code == 0, res.output
    assert "prefix caching off" in res.output and "fcfs on / off:" in res.output


def test_schedule_step_timing_keeps_the_queue_and_finds_warm_prompts_cached():
    from quanta_lab.sim.step_time import time_steps, workload_prompts

    prompts = workload_prompts("chat", 30)
    off = time_steps(prompts, "fcfs", prefix_caching=False, max_num_seqs=4, steps=3)
    on = time_steps(prompts, "sj-mlfq", prefix_caching=True, warm=True, max_num_seqs=4, steps=3)
    assert off.num_waiting == on.num_waiting == 30 and off.num_running == 4
    assert off.cached_tokens == 0 and off.median_ms > 0
    full = sum(16 * ((len(p) - 1) // 16) for p in prompts[4:])  # still waiting: all cached
    assert on.cached_tokens >= full


@pytest.mark.engine
def test_cli_bench_policies_on_a_trace_file(tmp_path: Path):
    """The documented real-engine comparison, at a tiny size: a trace's rows on opt-tiny."""
    trace = tmp_path / "azure.csv"
    rows = [
        f"2023-11-16 18:15:{10 + 2 * i:02d}.5000000,{90 + 61 * i},{4 + 3 * i}" for i in range(6)
    ]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    args = ["bench", "policies", "--workload", str(trace), "--num-requests", "6"]
    args += ["--calibration-seconds", "0.2"]
    res = CliRunner().invoke(app, [*args, "--token-scale", "0.1", "--policies", "fcfs,sj-mlfq"])
    assert res.exit_code == 0, res.output
    assert "6 requests at" in res.output and "P99 TBT" in res.output
    assert "fcfs / sj-mlfq: mean" in res.output


@pytest.mark.engine
def test_cli_profile_refits_on_a_serving_replay(tmp_path: Path):
    from quanta.build.checkpoint import ensure_checkpoint
    from quanta.costmodel import load_profile

    model = ensure_checkpoint("opt-tiny", tmp_path / "opt-tiny")
    out = tmp_path / "p.json"
    args = ["profile", "--model", str(model), "--output", str(out), "--repeats", "1"]
    res = CliRunner().invoke(app, [*args, "--calibration-seconds", "0.2"])
    assert res.exit_code == 0, res.output
    assert "sweep fit on a serving replay:" in res.output
    assert "calibrated fit on the same replay:" in res.output
    cost = load_profile(out)
    assert "refitted on" in cost.source and not cost.swap_overlaps_compute
    assert cost.min_iteration_time > 0


@pytest.mark.engine
def test_cli_simulate_validate_compares_the_engine_and_the_simulator(tmp_path: Path):
    out = tmp_path / "validate.json"
    args = ["simulate", "validate", "--num-requests", "12", "--loads", "0.5", "--policies"]
    png = tmp_path / "validate.png"
    more = ["--repeats", "2", "--step-repeats", "2", "--calibration-seconds", "0.1"]
    res = CliRunner().invoke(app, [*args, "fcfs", "--output", str(out), "--plot", str(png), *more])
    assert res.exit_code == 0, res.output
    assert png.stat().st_size > 0
    (row,) = json.loads(out.read_text())
    assert row["policy"] == "fcfs" and row["load"] == 0.5
    for key in ("mean_ttft", "mean_tpot", "mean_e2e", "p95_normalized_latency"):
        measured, simulated = row["measured"][key], row["simulated"][key]
        assert measured > 0 and simulated > 0
        assert row["error"][key] == pytest.approx((simulated - measured) / measured)
        assert row["noise"][key] >= 0  # two engine runs: their spread is a number
        assert row["rescaled"][key] > 0 and math.isfinite(row["rescaled_error"][key])
    assert row["repeats"] == 2 and row["step_error"]["median"] >= 0
    assert "| 0.5 | fcfs |" in res.output


@pytest.mark.engine
def test_cli_simulate_validate_on_shared_prefixes_shares_alike_on_both_sides(tmp_path: Path):
    """Multi-turn chat: later turns find earlier ones cached in the engine as in the
    simulator, and with caching off neither finds anything."""
    out = tmp_path / "validate.json"
    args = ["simulate", "validate", "--workload", "chat", "--num-requests", "10"]
    args += ["--loads", "0.5", "--policies", "fcfs", "--repeats", "1"]
    args += ["--calibration-seconds", "0.1", "--output", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())
    (engine,), sim = row["prefix_cache"]["measured"], row["prefix_cache"]["simulated"]
    assert engine["queries"] == sim["queries"] > 0
    assert engine["hits"] > 0 and sim["hits"] > 0
    assert abs(engine["hit_rate"] - sim["hit_rate"]) < 0.1
    assert "| engine hit rate | simulated |" in res.output
    res = CliRunner().invoke(app, [*args, "--no-enable-prefix-caching"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())
    assert (
        row["prefix_cache"]["measured"][0]["hits"] == row["prefix_cache"]["simulated"]["hits"] == 0
    )


def test_simulate_reports_the_prefix_cache_hit_rate_and_can_turn_it_off(tmp_path: Path):
    out = tmp_path / "chat.json"
    args = ["simulate", "--workload", "chat", "--num-requests", "40", "--rate", "2"]
    args += ["--policy", "fcfs", "--output", str(out)]
    on = CliRunner().invoke(app, args)
    assert on.exit_code == 0, on.output
    cache = json.loads(out.read_text())["prefix_cache"]
    assert cache["enabled"] and 0.3 < cache["hit_rate"] < 1 and cache["hits"] > 0
    assert f"prefix_cache_hit_rate: {cache['hit_rate']:.3f}" in on.output
    off = CliRunner().invoke(app, [*args, "--no-enable-prefix-caching"])
    assert off.exit_code == 0, off.output
    cache_off = json.loads(out.read_text())["prefix_cache"]
    assert not cache_off["enabled"] and cache_off["hits"] == 0
    assert "prefix_cache_hit_rate: off" in off.output


def test_validate_error_is_relative_and_nan_without_a_measurement():
    from quanta_lab.sim.validate import error

    assert error(1.1, 1.0) == pytest.approx(0.1)
    assert math.isnan(error(1.0, 0.0)) and math.isnan(error(float("nan"), 1.0))
