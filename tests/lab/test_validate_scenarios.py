"""``quanta simulate validate`` beyond latency: FairServe's figures on agents with an abuser,
ConServe's on online requests beside an offline backlog, Apt-Serve's SLO attainment.

The fast tests stand a simulator in for the engine (``SimEngine``: the same loop and policy on
a profile ``slowdown`` times slower, its trace shifted in time as the engine's warm-up shifts
it), so the rows' arithmetic is checked without torch: with ``slowdown`` 1 every figure must
come out equal on both sides, and otherwise each error is (simulated - measured) / measured.
The ``engine`` tests run the command on opt-tiny at a tiny size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from quanta.cli import app
from quanta.core.config import SchedulerConfig
from quanta.costmodel import PROFILES
from quanta.sim.driver import SimSetup, simulate
from quanta.workloads import WorkloadRequest
from quanta_lab.sim.bench import AgentUsers, EngineBench, parse_entry
from quanta_lab.sim.calibrate import rescale
from quanta_lab.sim.engine_replay import EngineRun
from quanta_lab.sim.validate import table, validate
from quanta_lab.sim.validate_scenarios import (
    COSERVE_FIGURES,
    FAIR_FIGURES,
    SLO_FIGURES,
    engine_slo,
    with_backlog,
)
from typer.testing import CliRunner

COST = PROFILES["a100-opt13b"].model_copy(update={"max_model_len": 512})
SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048)
WARM_UP_S = 7.0  # where the stand-in's trace starts, as the engine's does after its warm-up


@dataclass(frozen=True)
class SimEngine(EngineBench):
    """The simulator standing in for the engine, on a profile ``slowdown`` times slower."""

    slowdown: float = 1.0

    def serve(self, policy, trace, sched, cache, seed, *, record=None, options=None, until=None):
        setup = SimSetup(
            policy,
            rescale(self.cost, self.slowdown),
            sched,
            cache.block_size,
            cache.num_device_blocks,
            cache.num_host_blocks,
            dict(options or {}),
            prefix_caching=self.prefix_caching,
        )
        shifted = [replace(r, arrival_time=r.arrival_time + WARM_UP_S) for r in trace]
        sim = simulate(shifted, setup, until=None if until is None else WARM_UP_S + until)
        return EngineRun(sim.requests, sim.loop, sim.throttled, sim.abandoned, sim.cut_off)


def bench(slowdown: float) -> SimEngine:
    return SimEngine(Path("unused"), COST, lambda: 0.0, slowdown=slowdown)


def fair_rows(slowdown: float) -> list[dict[str, Any]]:
    """vtc and fair on agents with one abuser, past capacity: users wait, and fair (with
    tight limits) refuses some of the abuser's interactions."""
    return validate(
        bench(slowdown),
        ["vtc", "fair:user_limit=1:overload_watermark=0.3"],
        [3.0],
        num_requests=60,
        seed=0,
        max_num_seqs=8,
        repeats=1,
        workload="agents",
        users=AgentUsers(num_users=4, abusers=1, abuse_factor=15.0),
        echo=lambda _: None,
    )


def coserve_rows(slowdown: float) -> list[dict[str, Any]]:
    """fcfs and conserve: the trace online in ON/OFF phases beside an offline backlog."""
    return validate(
        bench(slowdown),
        ["fcfs", "conserve"],
        [0.9],
        num_requests=40,
        seed=0,
        max_num_seqs=8,
        repeats=1,
        offline_backlog=True,
        echo=lambda _: None,
    )


def check_errors(row: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Every figure has a measured and a simulated value and its error is their relative
    difference (nan exactly when that is undefined)."""
    for key in keys:
        measured, simulated = row["measured"][key], row["simulated"][key]
        assert key in row["noise"] and key in row["rescaled_error"]
        if math.isfinite(measured) and measured != 0 and math.isfinite(simulated):
            assert row["error"][key] == pytest.approx((simulated - measured) / measured)
        else:
            assert math.isnan(row["error"][key])


def test_fairness_figures_match_when_the_engine_is_the_simulator():
    rows = fair_rows(1.0)
    assert [r["policy"] for r in rows] == ["vtc", "fair:user_limit=1:overload_watermark=0.3"]
    for row in rows:
        # Same machine: nothing to get wrong (but rounding, the trace starting later).
        assert row["measured"] == pytest.approx(row["simulated"], nan_ok=True)
        assert row["scenario"]["delay_threshold_s"] > 0
    vtc, fair = (r["measured"] for r in rows)
    assert fair["throttled_interactions"] > 0 == vtc["throttled_interactions"]
    assert 0 < fair["delayed_users_fraction"] < vtc["delayed_users_fraction"] <= 1


def test_fairness_errors_are_relative_to_the_measurement():
    rows = fair_rows(1.5)
    for row in rows:
        check_errors(row, FAIR_FIGURES)
        # The engine ran 1.5x slower than the simulator predicts: calls waited longer, and
        # who was delayed or served what share moved with it.
        assert row["error"]["mean_ttft"] < 0
        moved = [row["error"][k] for k in FAIR_FIGURES[:4]]
        assert any(math.isfinite(e) and e != 0 for e in moved)
    text = table(rows, FAIR_FIGURES)
    assert "| 3 | vtc |" in text and "benign_share" in text


def test_conserve_figures_match_when_the_engine_is_the_simulator():
    rows = coserve_rows(1.0)
    for row in rows:
        for key in COSERVE_FIGURES:
            assert row["measured"][key] == pytest.approx(row["simulated"][key], nan_ok=True)
        assert row["scenario"]["until_s"] > 0 and row["scenario"]["offline_requests"] > 0
        assert row["measured"]["offline_tokens_s"] > 0
    fcfs, conserve = (r["measured"] for r in rows)
    assert fcfs["online_slo_met"] < conserve["online_slo_met"]  # FCFS: online behind offline


def test_conserve_errors_are_relative_to_the_measurement():
    rows = coserve_rows(1.3)
    for row in rows:
        check_errors(row, COSERVE_FIGURES)
        assert row["simulated"]["offline_tokens_s"] > row["measured"]["offline_tokens_s"]
        assert row["error"]["offline_tokens_s"] > 0


def test_slo_attainment_is_compared_for_slo_aware_policies_only():
    (fcfs,) = validate(
        bench(1.0), ["fcfs"], [0.9], num_requests=40, seed=0, max_num_seqs=8, repeats=1,
        echo=lambda _: None,
    )  # fmt: skip
    assert "slo_attainment" not in fcfs["measured"] and "scenario" not in fcfs
    rows = validate(
        bench(1.4), ["fcfs", "apt:cache=kv"], [1.2], num_requests=60, seed=0, max_num_seqs=8,
        repeats=1, echo=lambda _: None,
    )  # fmt: skip
    for row in rows:
        check_errors(row, SLO_FIGURES)
        assert 0 <= row["measured"]["slo_attainment"] < row["simulated"]["slo_attainment"] <= 1
        assert row["scenario"]["slo"]["ttft_s"] > 0


def test_the_backlog_outlasts_the_run_and_waits_at_the_start():
    online = [WorkloadRequest(i / 10, 50, 20, request_id=f"r{i}") for i in range(40)]
    trace, until = with_backlog(online, 10.0, COST, SCHED, seed=0)
    offline = [r for r in trace if r.priority_class == "offline"]
    assert until == pytest.approx(2 * 40 / 10.0)  # ON and OFF phases of a quarter each
    assert offline and all(r.arrival_time == 0 for r in offline)
    assert max(r.arrival_time for r in trace if r.priority_class == "online") < until
    slo = engine_slo(COST, online, SCHED, (25.0, 4.0))
    assert slo.ttft_s == pytest.approx(25 / 4 * slo.tpot_s)


def test_a_policy_entry_carries_its_options():
    assert parse_entry("apt:cache=kv:decay=0.5") == ("apt", {"cache": "kv", "decay": 0.5})
    assert parse_entry("fcfs") == ("fcfs", {})
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        parse_entry("apt:cache")


# -- the command on the real engine ---------------------------------------------------------
def run_validate(tmp_path: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path / "validate.json"
    base = ["simulate", "validate", "--loads", "0.9", "--calibration-seconds", "0.1"]
    res = CliRunner().invoke(app, [*base, *args, "--output", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


@pytest.mark.engine
def test_cli_validate_compares_fairness_figures_with_an_abuser(tmp_path: Path):
    rows, output = run_validate(
        tmp_path, "--workload", "agents", "--num-users", "4", "--abusers", "1",
        "--num-requests", "16", "--policies", "vtc,fair", "--repeats", "1",
    )  # fmt: skip
    assert [r["policy"] for r in rows] == ["vtc", "fair"]
    for row in rows:
        check_errors(row, FAIR_FIGURES)
        assert row["measured"]["benign_share"] > 0 and row["simulated"]["benign_share"] > 0
    assert "| load | policy | delayed_users_fraction |" in output


@pytest.mark.engine
def test_cli_validate_compares_conserve_figures_beside_an_offline_backlog(tmp_path: Path):
    rows, output = run_validate(
        tmp_path, "--offline-backlog", "--policies", "fcfs,conserve", "--num-requests", "16",
        "--repeats", "1",
    )  # fmt: skip
    for row in rows:
        check_errors(row, COSERVE_FIGURES)
        assert row["measured"]["offline_tokens_s"] > 0 and row["simulated"]["offline_tokens_s"] > 0
        assert row["scenario"]["offline_requests"] > 0
    assert "| load | policy | online_slo_met |" in output


@pytest.mark.engine
def test_cli_validate_compares_apt_slo_attainment(tmp_path: Path):
    rows, output = run_validate(
        tmp_path, "--policies", "apt,apt:cache=kv", "--num-requests", "16", "--repeats", "1"
    )
    assert [r["policy"] for r in rows] == ["apt", "apt:cache=kv"]
    for row in rows:
        check_errors(row, SLO_FIGURES)
        assert 0 <= row["measured"]["slo_attainment"] <= 1
    assert "| load | policy | slo_attainment |" in output
    res = CliRunner().invoke(app, ["simulate", "validate", "--policies", "apt:cache=none"])
    assert res.exit_code != 0 and "cache" in res.output
