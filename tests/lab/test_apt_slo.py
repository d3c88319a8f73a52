"""Apt-Serve's SLO attainment: the per-request rule, the Table 3 presets, the ``slo_attainment``
key of ``quanta simulate`` and of ``quanta bench serve``'s summaries, and the Tables 4/5
reproduction in its quick mode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import quanta.bench.client as bench_client
from quanta.bench.client import ClientResult
from quanta.cli import app
from quanta.costmodel import PROFILES
from quanta.metrics import SLO, RequestRecord, attains_slo, from_requests, slo_attainment
from quanta.sim import SimSetup, simulate, summarize
from quanta.slo import APT_SERVE_SLOS, attainment, resolve_slo, slo_preset, with_slo
from quanta.workloads import WorkloadRequest, make_workload
from quanta_lab.sim.apt_repro import APT_ROWS, APT_SCHEDULER, PAPER_TABLE4, PAPER_TABLE5
from typer.testing import CliRunner

SLO_1S = SLO(ttft_s=1.0, tpot_s=1.0)


def rec(rid: str, times: tuple[float, ...], **kw) -> RequestRecord:
    """A request that arrived at 0 and got one token at each of ``times``."""
    end = times[-1] if times else math.nan
    return RequestRecord(rid, 0.0, times, end, len(times), **kw)


def steady(ttft: float, gaps: list[float]) -> tuple[float, ...]:
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return tuple(times)


# -- the per-request rule ------------------------------------------------------------------
def test_ttft_is_checked_inclusively():
    assert attains_slo(rec("a", (1.0, 1.5)), SLO_1S)  # exactly at the limit attains
    assert not attains_slo(rec("b", (1.0625, 1.5)), SLO_1S)
    assert not attains_slo(rec("c", ()), SLO_1S)  # never produced a token


def test_p99_tbt_at_the_boundary():
    # One gap: it is the P99. Exactly 1 s attains (binary-exact times), a hair more does not.
    assert attains_slo(rec("a", (0.5, 1.5)), SLO_1S)
    assert not attains_slo(rec("b", (0.5, 1.5078125)), SLO_1S)
    # 101 gaps: the P99 is the 100th smallest, so one 2 s pause hides below it, two do not.
    one = rec("c", steady(0.25, [0.125] * 100 + [2.0]))
    two = rec("d", steady(0.25, [0.125] * 99 + [2.0, 2.0]))
    assert one.p99_tbt == pytest.approx(0.125) and attains_slo(one, SLO_1S)
    assert two.p99_tbt == pytest.approx(2.0) and not attains_slo(two, SLO_1S)
    # The mean gap (TPOT) passes while the P99 gap fails: attainment is not goodput.
    stall = rec("e", steady(0.25, [0.125] * 10 + [1.5, 1.5]))
    assert stall.tpot is not None and stall.tpot < 1.0 and not attains_slo(stall, SLO_1S)


def test_single_token_requests_are_judged_on_ttft_alone():
    assert rec("a", (0.5,)).p99_tbt is None
    assert attains_slo(rec("a", (0.5,)), SLO_1S)
    assert not attains_slo(rec("b", (1.5,)), SLO_1S)


def test_failures_count_as_misses_and_own_slos_come_first():
    failed = RequestRecord("f", 0.0, (0.1,), math.nan, 1, error="boom")
    tight = rec("t", (0.5, 0.75), ttft_slo_s=0.25, tpot_slo_s=1.0)
    loose = rec("l", (1.5, 1.75), ttft_slo_s=2.0, tpot_slo_s=1.0)
    records = [failed, tight, loose, rec("ok", (0.5, 0.75))]
    assert [attains_slo(r, SLO_1S) for r in records] == [False, False, True, True]
    assert slo_attainment(records, SLO_1S) == attainment(records, SLO_1S) == 0.5


def test_attainment_without_a_run_slo_needs_every_requests_own():
    own = [rec("a", (0.5, 0.75), ttft_slo_s=1.0, tpot_slo_s=1.0)]
    own.append(rec("b", (3.0, 3.25), ttft_slo_s=4.0, tpot_slo_s=1.0))
    assert attainment(own, None) == 1.0
    assert attainment([*own, rec("c", (0.5,))], None) is None
    assert attainment([], SLO_1S) is None


# -- presets and options -------------------------------------------------------------------
def test_presets_are_apt_serve_table_3():
    table3 = {
        "13b": {"sharegpt": (1.0, 1.0), "humaneval": (0.5, 0.5), "longbench": (4.0, 1.0)},
        "30b": {"sharegpt": (1.5, 1.0), "humaneval": (1.0, 0.5), "longbench": (4.5, 1.0)},
        "66b": {"sharegpt": (2.0, 1.0), "humaneval": (1.5, 0.5), "longbench": (5.0, 1.0)},
    }
    expected = {f"{d}-{size}": v for size, row in table3.items() for d, v in row.items()}
    assert dict(APT_SERVE_SLOS) == expected
    slo = slo_preset("longbench-13b")
    assert (slo.ttft_s, slo.tbt_s, slo.tpot_s) == (4.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="unknown SLO preset 'nope'; presets: sharegpt-13b"):
        slo_preset("nope")


def test_resolve_slo_from_options():
    assert resolve_slo() is None
    assert resolve_slo(ttft=2.0, tbt=0.5) == SLO(ttft_s=2.0, tpot_s=0.5, tbt_s=0.5)
    assert resolve_slo(ttft=2.0, tpot=0.3) == SLO(ttft_s=2.0, tpot_s=0.3, tbt_s=0.3)
    assert resolve_slo(ttft=2.0, tpot=0.3, tbt=1.0) == SLO(ttft_s=2.0, tpot_s=0.3, tbt_s=1.0)
    assert resolve_slo(preset="humaneval-30b", ttft=3.0) == SLO(3.0, 0.5, 0.5)
    for partial in ({"ttft": 1.0}, {"tbt": 1.0}, {"tpot": 1.0}):
        with pytest.raises(ValueError, match="needs a TTFT limit"):
            resolve_slo(**partial)


def test_with_slo_fills_only_rows_without_their_own():
    rows = [WorkloadRequest(0.0, 8, 4, "a"), WorkloadRequest(0.0, 8, 4, "b", ttft_slo_ms=300)]
    a, b = with_slo(rows, slo_preset("longbench-13b"))
    assert (a.ttft_slo_ms, a.tpot_slo_ms) == (4000.0, 1000.0)
    assert b == rows[1]


# -- the simulator's JSON ------------------------------------------------------------------
def test_simulator_summary_carries_slo_attainment():
    trace = make_workload("sharegpt", 40, 20.0, seed=1)
    result = simulate(trace, SimSetup("fcfs", PROFILES["a100-opt13b"]))
    slo = slo_preset("sharegpt-13b")
    out = summarize(result, slo=slo)
    expected = slo_attainment(from_requests(result.requests), slo)
    assert out["slo_attainment"] == pytest.approx(expected)
    assert 0.0 < out["slo_attainment"] < 1.0  # 20 req/s overloads it: some miss, some attain
    assert out["slo"] == {"ttft_s": 1.0, "tbt_s": 1.0, "tpot_s": 1.0}
    plain = summarize(result)
    assert plain["slo_attainment"] is None and plain["slo"] is None


def test_simulate_cli_writes_slo_attainment(tmp_path: Path):
    out = tmp_path / "run.json"
    args = ["simulate", "--policy", "fcfs", "--num-requests", "8", "--rate", "2"]
    res = CliRunner().invoke(app, [*args, "--slo-preset", "sharegpt-13b", "--output", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["slo_attainment"] == 1.0 and report["slo"]["ttft_s"] == 1.0
    assert "slo_attainment: 1.0" in res.output
    explicit = tmp_path / "explicit.json"
    res = CliRunner().invoke(
        app, [*args, "--ttft-slo", "0.001", "--tbt-slo", "1", "--output", str(explicit)]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(explicit.read_text())["slo_attainment"] == 0.0
    res = CliRunner().invoke(app, [*args, "--output", str(explicit)])
    assert json.loads(explicit.read_text())["slo_attainment"] is None
    bad = CliRunner().invoke(app, [*args, "--ttft-slo", "1"], env={"COLUMNS": "300"})
    assert bad.exit_code == 2 and "needs a TTFT limit and a TPOT or TBT limit" in bad.output


# -- bench serve's summary -----------------------------------------------------------------
def test_bench_serve_summary_has_slo_attainment(tmp_path: Path, monkeypatch):
    """No server: ``replay`` is replaced by one that answers with chosen timings, so the
    summary ``bench serve`` writes is checked, not the transport."""
    sent = []

    async def fake_replay(requests, target, *, concurrency_limit=None, on_result=None):
        sent.extend(requests)
        timings = [(0.25, 0.125, 4), (1.5, 0.125, 4), (0.5, 0.0, 1)]  # TTFT, gap, tokens
        results = []
        for req, (ttft, gap, n) in zip(requests, timings, strict=True):
            chunks = [req.arrival_s + ttft + i * gap for i in range(n)]
            res = ClientResult(req.request_id, req.arrival_s, req.tenant, None)
            res.send_s, res.chunk_s, res.end_s = req.arrival_s, chunks, chunks[-1]
            res.num_output_tokens = n
            results.append(res)
            if on_result is not None:
                on_result(res)
        return results

    monkeypatch.setattr(bench_client, "replay", fake_replay)
    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--url", "127.0.0.1:1", "--num-requests", "3", "--rate", "inf"]
    res = CliRunner().invoke(app, [*args, "--slo-preset", "sharegpt-13b", "--output", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["slo_attainment"] == pytest.approx(2 / 3)  # the 1.5 s TTFT misses
    assert summary["slo"] == {"ttft_s": 1.0, "tpot_s": 1.0, "tbt_s": 1.0}
    assert "SLO attainment at inf req/s: 66.7%" in res.output
    assert {(r.ttft_slo_ms, r.tpot_slo_ms) for r in sent} == {(1000.0, 1000.0)}
    bad = CliRunner().invoke(app, [*args, "--tpot-slo", "1"], env={"COLUMNS": "300"})
    assert bad.exit_code == 2 and "needs a TTFT limit" in bad.output


# -- the reproduction ----------------------------------------------------------------------
def test_paper_tables_cover_every_row():
    cells = {(d, r, cv) for d, r, _ in APT_ROWS for cv in (1.0, 5.0, 10.0)}
    assert set(PAPER_TABLE5) == set(PAPER_TABLE4) == cells
    # The paper's adaptive column (Table 5) is its hybrid-cache column (Table 4).
    assert all(PAPER_TABLE5[c][1] == PAPER_TABLE4[c][1] for c in cells)
    assert APT_SCHEDULER.max_num_seqs == 256 and not APT_SCHEDULER.enable_chunked_prefill


def test_repro_apt_quick(tmp_path: Path):
    doc = tmp_path / "aptserve.md"
    args = ["simulate", "repro", "--figure", "apt", "--quick", "--num-requests", "8"]
    res = CliRunner().invoke(app, [*args, "--jobs", "1", "--output", str(doc)])
    assert res.exit_code == 0, res.output
    text = doc.read_text()
    for name in ("apt-table5", "apt-table4", "apt-detail"):
        assert f"<!-- BEGIN repro:{name} -->" in text and f"{name}:" in res.output
    assert "| ShareGPT | 3 | 1 |" in text and "(26.4) |" in text and "(96.6) |" in text
    assert "| LongBench | 3 | 10 |" in text
    printed = CliRunner().invoke(app, [*args, "--jobs", "1"])  # quick without --output
    assert printed.exit_code == 0 and "updated" not in printed.output
    wrong = CliRunner().invoke(app, ["simulate", "repro", "--figure", "14", "--quick"])
    assert wrong.exit_code == 2
