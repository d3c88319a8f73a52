"""ConServe on the simulator: layer safepoints in the cost-model runner, checkpoint copies, the
online/offline figures of ``quanta simulate`` and the ON/OFF reproduction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quanta.cli import app
from quanta.core.clock import VirtualClock
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.core.request import Request, SamplingParams
from quanta.core.safepoint import AbortSignal, StepAborted
from quanta.costmodel import PROFILES
from quanta.sim import SimRunner, SimSetup, simulate, summarize
from quanta.sim.interactions import Replay
from quanta.workloads import WorkloadRequest, save_workload
from quanta_lab.sim.conserve_repro import CONSERVE_SCHEDULER, CONSERVE_SLO, conserve_profile
from quanta_lab.sim.safepoint_repro import head_of_line_waits
from typer.testing import CliRunner

COST = PROFILES["a100-llama7b"]
CLASSES = ("online", "offline")


def prefill(rid: str, tokens: int, blocks: tuple[int, ...] = (0,)) -> ScheduledSeq:
    return ScheduledSeq(rid, (1,) * tokens, 0, blocks, True, 0.0, 1.0, -1, 0, 0)


def test_preset_knows_its_layers_and_safepoints_cost_nothing_by_default():
    assert COST.num_layers == 32 and PROFILES["a100-opt13b"].num_layers == 40
    assert COST.safepoint_overhead == 0.0
    assert conserve_profile().safepoint_overhead == pytest.approx(0.04)


def test_an_arrival_stops_the_step_at_the_next_safepoint():
    cost = conserve_profile()
    clock = VirtualClock()
    runner = SimRunner(cost, clock, 16, safepoint_interval=8)
    so = SchedulerOutput((prefill("a", 2048),), abort=AbortSignal())
    compute = cost.step_time([(2048, 0)]) * (1 + cost.safepoint_overhead)
    seen: list[tuple[float, float]] = []

    def hook(start: float, end: float) -> float:
        seen.append((start, end))
        return start + 0.3 * compute  # layer 9.6 of 32: the safepoint after layer 16 stops it

    runner.interrupt = hook
    with pytest.raises(StepAborted) as info:
        runner.execute(so)
    assert seen == [(0.0, pytest.approx(compute))]
    assert info.value.layer == 16
    assert clock.now() == pytest.approx(compute / 2)
    assert info.value.elapsed_s == pytest.approx(compute / 2)
    assert so.abort is not None and so.abort.raised_at == pytest.approx(0.3 * compute)
    st = runner.stats
    assert (st.safepoint_aborts, st.steps) == (1, 0)
    assert st.aborted_compute_s == pytest.approx(compute / 2)
    assert st.abort_wait_s == pytest.approx(0.2 * compute)
    assert st.abort_end_wait_s == pytest.approx(0.7 * compute)  # had it run to its end
    assert st.spans == [(0.0, pytest.approx(compute / 2), True)]  # a stopped step ends there


def test_no_abort_without_a_signal_or_after_the_last_safepoint():
    cost = conserve_profile()
    clock = VirtualClock()
    runner = SimRunner(cost, clock, 16)
    runner.interrupt = lambda start, end: start + 0.9 * (end - start)  # after layer 24 of 32
    out = runner.execute(SchedulerOutput((prefill("a", 512),), abort=AbortSignal()))
    slowed = cost.step_time([(512, 0)]) * 1.04
    assert out.sampled_token_ids == (1,) and clock.now() == pytest.approx(slowed)
    runner.interrupt = lambda start, end: start  # never asked: the step is not preemptible
    runner.execute(SchedulerOutput((prefill("b", 512),)))
    assert clock.now() == pytest.approx(slowed + cost.step_time([(512, 0)]))
    assert runner.stats.safepoint_aborts == 0
    assert runner.stats.spans == [
        (0.0, pytest.approx(slowed), True),
        (pytest.approx(slowed), pytest.approx(clock.now()), False),
    ]


def test_checkpoint_copies_follow_the_forward_pass():
    clock = VirtualClock()
    overlapped = SimRunner(COST, clock, 16)
    so = SchedulerOutput((prefill("a", 64, (0, 1, 2, 3)),), checkpoint=((0, 5), (1, 6)))
    overlapped.execute(so)
    compute = COST.step_time([(64, 0)])
    assert clock.now() == pytest.approx(compute)  # behind the next steps, not in this one
    assert overlapped.stats.checkpoint_blocks == 2
    assert overlapped.stats.copy_busy_s == pytest.approx(COST.swap_time(2, 16))
    inline = COST.model_copy(update={"swap_overlaps_compute": False})
    clock = VirtualClock()
    SimRunner(inline, clock, 16).execute(so)
    assert clock.now() == pytest.approx(compute + COST.swap_time(2, 16))


def test_replay_peeks_at_the_arrivals_inside_a_step_without_taking_them():
    reqs = [
        Request(f"r{i}", [1], SamplingParams(max_tokens=1), t, seed=i)
        for i, t in enumerate([0.5, 0.1, 0.3, 0.9, 0.3])
    ]
    plan = Replay(reqs)
    assert [r.request_id for r in plan.peek(0.6)] == ["r1", "r2", "r4", "r0"]
    assert plan.peek(0.1) == []
    assert [r.request_id for r in plan.due(0.3)] == ["r1", "r2", "r4"]


def _offline_then_online(ttft_slo_ms: float) -> list[WorkloadRequest]:
    offline = [
        WorkloadRequest(0.0, 3000, 20, request_id=f"b{i}", priority_class="offline")
        for i in range(3)
    ]
    online = WorkloadRequest(0.05, 200, 10, request_id="o0", ttft_slo_ms=ttft_slo_ms)
    return [*offline, online]


def test_an_online_arrival_aborts_an_offline_step_and_nothing_is_committed():
    trace = _offline_then_online(ttft_slo_ms=100)  # waiting for a 2048-token step misses it
    setup = SimSetup("conserve", conserve_profile(), CONSERVE_SCHEDULER)
    result = simulate(trace, setup)  # NOTE: checks block integrity and that nothing failed
    assert result.runner.safepoint_aborts == result.loop.num_safepoint_aborts >= 1
    assert result.runner.aborted_compute_s > 0
    by_id = {r.request_id: r for r in result.requests}
    assert all(
        r.num_output_tokens == row.output_len for r, row in zip(result.requests, trace, strict=True)
    )
    steady = simulate(
        trace,
        SimSetup(
            "conserve", conserve_profile(), CONSERVE_SCHEDULER, policy_options={"safepoints": False}
        ),
    )
    waited = {r.request_id: r for r in steady.requests}
    assert steady.runner.safepoint_aborts == 0
    ttft = by_id["o0"].first_token_time - by_id["o0"].arrival_time
    assert ttft < waited["o0"].first_token_time - waited["o0"].arrival_time
    # The step stopped at its first safepoint after the arrival: at most 8 of 32 layers late.
    step = conserve_profile().step_time([(2048, 0)]) * 1.04
    assert result.runner.abort_wait_s <= step / 4 + 1e-9


def test_a_loose_slo_lets_the_step_finish():
    trace = _offline_then_online(ttft_slo_ms=60_000)
    result = simulate(trace, SimSetup("conserve", conserve_profile(), CONSERVE_SCHEDULER))
    assert result.runner.safepoint_aborts == 0


def test_checkpoints_are_counted_under_memory_pressure():
    trace = [
        WorkloadRequest(0.0, 900, 200, request_id=f"b{i}", priority_class="offline")
        for i in range(8)
    ] + [WorkloadRequest(1.0 + i, 500, 50, request_id=f"o{i}") for i in range(4)]
    setup = SimSetup("conserve", conserve_profile(), CONSERVE_SCHEDULER, num_device_blocks=400)
    result = simulate(trace, setup)
    assert result.runner.checkpoint_blocks > 0
    assert result.runner.checkpoint_blocks == result.loop.num_checkpoint_blocks_copied
    summary = summarize(result)
    assert summary["checkpoint_blocks"] == result.runner.checkpoint_blocks


def test_until_cuts_the_run_off_and_keeps_integrity():
    trace = [
        WorkloadRequest(0.0, 2000, 20, request_id=f"b{i}", priority_class="offline")
        for i in range(50)
    ]
    result = simulate(trace, SimSetup("priority", COST, CONSERVE_SCHEDULER), until=5.0)
    assert result.cut_off and len(result.cut_off) < 50
    assert summarize(result)["num_cut_off"] == len(result.cut_off)


def test_cli_simulate_reports_online_and_offline(tmp_path: Path):
    rows = [
        WorkloadRequest(0.0, 1500, 60, request_id=f"b{i}", priority_class="offline")
        for i in range(6)
    ] + [
        WorkloadRequest(0.2 * i, 300, 30, request_id=f"o{i}", ttft_slo_ms=50 if i == 0 else None)
        for i in range(6)
    ]
    save_workload(tmp_path / "w.jsonl", rows)
    out = tmp_path / "run.json"
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--policy",
            "conserve",
            "--workload",
            str(tmp_path / "w.jsonl"),
            "--profile",
            "a100-llama7b",
            "--ttft-slo",
            "1.5",
            "--tbt-slo",
            "0.11",
            "--output",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    for cls, n in (("online", 6), ("offline", 6)):
        figures = data[cls]
        for key in ("p99_ttft", "p99_tpot", "slo_attainment", "mean_ttft", "p50_ttft"):
            assert key in figures
        assert figures["num_finished"] == figures["num_requests"] == n
    assert data["online"]["output_tokens"] == 180 and data["offline"]["output_tokens"] == 360
    spans = [data[c]["output_tokens"] / data[c]["throughput_tokens_per_s"] for c in CLASSES]
    assert spans[0] == pytest.approx(spans[1])  # one makespan: the whole run's
    assert data["online"]["frac_meeting_slo"] <= 5 / 6  # o0's own 50 ms TTFT is out of reach
    for key in ("mean_normalized_latency", "slo_attainment", "by_class", "safepoint_aborts"):
        assert key in data


def test_cli_repro_conserve_quick_writes_the_report(tmp_path: Path):
    trace = tmp_path / "azure.csv"
    lines = [
        f"2023-11-16 18:15:{i:02d}.5000000,{300 + 97 * (i % 7)},{20 + 13 * (i % 5)}"
        for i in range(40)
    ]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
    doc = tmp_path / "conserve.md"
    doc.write_text("# ConServe\n\nprose kept\n")
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "repro",
            "--figure",
            "conserve",
            "--quick",
            "--trace",
            str(trace),
            "--jobs",
            "1",
            "--output",
            str(doc),
        ],
    )
    assert res.exit_code == 0, res.output
    text = doc.read_text()
    assert "prose kept" in text
    for name in ("conserve-systems", "conserve-headline"):
        assert f"<!-- BEGIN repro:{name} -->" in text
    for system in ("online-only", "priority (vLLM++)", "conserve, no safepoints", "online alone"):
        assert f"| {system} |" in text
    assert "24 online requests" in text and "Azure Public Dataset" in text


def test_head_of_line_wait_is_what_the_running_step_had_left():
    spans = [(0.0, 1.0, True), (1.0, 1.5, False), (3.0, 4.0, True)]
    got = head_of_line_waits(spans, [0.0, 0.25, 1.2, 2.0, 3.5, 5.0])
    assert [w for w, _ in got] == pytest.approx([1.0, 0.75, 0.3, 0.0, 0.5, 0.0])
    assert [p for _, p in got] == [True, True, False, False, True, False]
    assert head_of_line_waits([], [1.0]) == [(0.0, False)]


@pytest.mark.slow
def test_cli_repro_safepoints_stop_steps_only_under_a_tight_slo(tmp_path: Path):
    """Online arrivals every 20 s beside long offline prompts: at a 0.2 s TTFT SLO the
    safepoints stop offline steps and cut the head-of-line wait; at 1.5 s they stop none."""
    trace = tmp_path / "azure.csv"
    lines = [f"2023-11-16 18:15:{2 * i:02d}.5000000,{200 + 50 * i},{8 + i}" for i in range(6)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
    doc = tmp_path / "conserve.md"
    doc.write_text("# ConServe\n\nprose kept\n")
    args = ["simulate", "repro", "--figure", "safepoints", "--num-requests", "6", "--seeds", "0"]
    res = CliRunner().invoke(
        app, [*args, "--trace", str(trace), "--jobs", "1", "--output", str(doc)]
    )
    assert res.exit_code == 0, res.output
    text = doc.read_text()
    assert "prose kept" in text and "<!-- BEGIN repro:conserve-safepoints -->" in text
    assert "6 online requests" in text and "Azure Public Dataset" in text
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0].endswith(" s") and cells[0][0].isdigit():
            rows[cells[0], cells[1]] = cells
    assert len(rows) == 8
    layer, iteration = "layer-level (safepoints)", "iteration-level"
    for slo in ("0.2 s", "0.3 s", "0.5 s", "1.5 s"):
        assert rows[slo, iteration][6] == "0"  # nothing to stop a step with
        assert rows[slo, iteration][4] == "0"  # and no step is preemptible
    assert int(rows["0.2 s", layer][6]) > 0 and int(rows["0.2 s", layer][4]) > 0
    assert rows["1.5 s", layer][6] == "0"
    stop, end = (int(x) for x in rows["0.2 s", layer][7].split(" / "))
    assert stop < end  # each stop cut its arrival's wait
    hol = {k: int(v[5].split(" / ")[0]) for k, v in rows.items()}
    assert hol["0.2 s", layer] < hol["0.2 s", iteration]


def test_cli_repro_conserve_needs_a_trace():
    res = CliRunner().invoke(app, ["simulate", "repro", "--figure", "conserve", "--quick"])
    assert res.exit_code != 0 and "--trace" in res.output


# -- the step-time calibration -----------------------------------------------------------------
_TIME_FIELDS = (
    "step_overhead_s",
    "per_seq_s",
    "weights_read_s",
    "compute_per_token_s",
    "attn_per_pair_s",
    "kv_read_per_token_s",
    "per_attention_call_s",
    "decode_pad_per_token_s",
)


def _online_tpots(calibrate: bool) -> list[float]:
    """Online requests decoding beside long offline prefills, scheduled by a profile that
    predicts every step at a third of the time the (simulated) engine takes; the step's
    token cap is high enough that the SLO budget, not the cap, sizes the steps."""
    engine = conserve_profile()
    optimistic = engine.model_copy(update={f: getattr(engine, f) / 3 for f in _TIME_FIELDS})
    scheduler = CONSERVE_SCHEDULER.model_copy(update={"max_num_batched_tokens": 8192})
    trace = [
        WorkloadRequest(0.0, 4000, 50, request_id=f"b{i}", priority_class="offline")
        for i in range(60)
    ] + [WorkloadRequest(0.5 + 0.4 * i, 200, 40, request_id=f"o{i}") for i in range(10)]
    options = {"profile": optimistic, "calibrate": calibrate}
    result = simulate(trace, SimSetup("conserve", engine, scheduler, policy_options=options))
    online = [r for r in result.requests if r.request_id.startswith("o")]
    return sorted(
        (r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)
        for r in online
        if r.finish_time is not None and r.first_token_time is not None
    )


def test_calibration_holds_the_tpot_slo_when_the_profile_is_optimistic():
    """ConServe sizes online steps to the 110 ms TPOT SLO by its profile; on an engine three times
    as slow as the profile the SLO is missed, unless the policy scales its predictions by
    what steps really took (``CalibratedCost``)."""
    slo = CONSERVE_SLO.tpot_s
    blind = _online_tpots(calibrate=False)
    calibrated = _online_tpots(calibrate=True)
    assert max(blind) > slo, blind  # the problem is there
    assert max(calibrated) <= slo, calibrated
    assert sum(calibrated) < sum(blind)


def test_calibration_changes_nothing_where_the_profile_is_right():
    trace = _offline_then_online(ttft_slo_ms=100)
    runs = [
        simulate(
            trace,
            SimSetup(
                "conserve",
                conserve_profile(),
                CONSERVE_SCHEDULER,
                policy_options={"calibrate": calibrate},
            ),
        )
        for calibrate in (False, True)
    ]
    times = [[(r.first_token_time, r.finish_time) for r in run.requests] for run in runs]
    assert times[0] == times[1]
