"""``quanta bench serve`` and ``replay`` against a live server: the session's shared
tritonserver and an OpenAI gateway in front of it, as ``quanta serve --openai-port`` runs them.

A handful of requests over each transport (Triton gRPC, Triton HTTP SSE, OpenAI
``/v1/completions`` through the gateway): every request succeeds and its timings are sane.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, replace

import pytest
import typer
from quanta.bench.client import ClientRequest, Target, replay
from quanta.bench.serve_cli import register
from quanta.bench.workload_spec import WorkloadSpec
from quanta.metrics import from_client_results, summarize
from quanta.workloads import WorkloadRequest, load_workload, save_workload
from typer.testing import CliRunner

WORKLOAD = ["--num-requests", "4", "--seed", "3", "--prompt-tokens", "4:12"]
WORKLOAD += ["--output-tokens", "3:8", "--tenants", "a,b"]


@dataclass(frozen=True)
class Live:
    """The shared server's endpoints and a gateway in front of its ``quanta`` model."""

    grpc_url: str
    http_url: str
    openai_url: str


@pytest.fixture(scope="module")
def live(triton):
    return Live(triton.grpc_url, triton.http_url, triton.openai_url())


def targets(live) -> dict[str, str]:
    return {"grpc": live.grpc_url, "http": live.http_url, "openai": live.openai_url}


@pytest.fixture(scope="module")
def cli():
    app = typer.Typer()
    bench_app = typer.Typer()
    app.add_typer(bench_app, name="bench")
    app.command("noop")(lambda: None)  # NOTE: a lone sub-app would be collapsed into the root
    register(app, bench_app)
    return app


@pytest.mark.parametrize("transport", ["grpc", "http", "openai"])
def test_bench_serve_over_each_transport(live, cli, tmp_path, transport):
    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--url", targets(live)[transport], "--transport", transport]
    args += ["--rate", "20,inf", *WORKLOAD, "--output", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["transport"] == transport
    assert [run["rate"] for run in report["runs"]] == [20.0, "inf"]
    for run, rate in zip(report["runs"], (20.0, float("inf")), strict=True):
        spec = WorkloadSpec(None, 4, seed=3, prompt_tokens=(4, 12), output_tokens=(3, 8))
        expected = replace(spec, tenants="a,b").build(rate)
        summary = run["summary"]
        assert summary["num_requests"] == 4 and summary["num_errors"] == 0
        for key in ("ttft_s", "tpot_s", "e2e_s", "normalized_latency_s", "itl_s"):
            assert set(summary[key]) == {"mean", "p50", "p95", "p99"}
            assert summary[key]["p50"] <= summary[key]["p99"]
        assert summary["request_throughput"] > 0
        for res, req in zip(run["results"], expected, strict=True):
            assert res["error"] is None
            assert res["request_id"] == req.request_id and res["tenant"] == req.tenant
            assert res["num_output_tokens"] == req.output_tokens  # ignore_eos
            assert res["num_prompt_tokens"] == req.prompt_tokens
            assert res["finish_reason"] == "length"
            assert res["send_s"] >= res["scheduled_s"]
            chunks = res["chunk_s"]
            assert chunks and chunks == sorted(chunks)
            assert res["send_s"] < chunks[0] <= chunks[-1] <= res["end_s"]


def test_plots_are_written(live, cli, tmp_path):
    pytest.importorskip("matplotlib")
    args = ["bench", "serve", "--url", live.grpc_url, "--rate", "10,40", *WORKLOAD]
    result = CliRunner().invoke(cli, [*args, "--plot-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name in ("latency_vs_rate.png", "cdf_ttft.png", "cdf_tpot.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_concurrency_limit_serializes_requests(live):
    requests = [ClientRequest(f"c{i}", 0.0, "count to ten", 4, tenant="c") for i in range(3)]
    target = Target(url=live.grpc_url, transport="grpc")
    results = asyncio.run(replay(requests, target, concurrency_limit=1))
    assert all(r.ok and r.num_output_tokens == 4 for r in results)
    spans = sorted((r.send_s, r.end_s) for r in results)
    assert all(prev_end <= start for (_, prev_end), (start, _) in itertools.pairwise(spans))
    assert summarize(from_client_results(results))["num_errors"] == 0


def test_errors_are_recorded_not_raised(live):
    requests = [ClientRequest("bad", 0.0, "hi", 600), ClientRequest("good", 0.0, "hi", 2)]
    for transport, url in targets(live).items():
        target = Target(url=url, transport=transport)  # type: ignore[arg-type]
        bad, good = asyncio.run(replay(requests, target))
        assert bad.error is not None and "maximum length" in bad.error, (transport, bad.error)
        assert good.ok and good.num_output_tokens == 2, (transport, good.error)
    summary = summarize(from_client_results([bad, good]))
    assert summary["num_errors"] == 1 and summary["num_requests"] == 2


def test_bench_serve_replays_a_workload_file_with_its_metadata(live, cli, tmp_path):
    rows = [
        WorkloadRequest(0.0, 6, 3, "a0", tenant="gold", app="chat", interaction_id="g-i0"),
        WorkloadRequest(0.05, 5, 4, "a1", tenant="gold", app="chat", interaction_id="g-i0"),
        WorkloadRequest(0.1, 8, 2, "b0", tenant="batch", priority_class="offline"),
        WorkloadRequest(0.1, 4, 5, "c0", tenant="free", ttft_slo_ms=60_000, tpot_slo_ms=60_000),
    ]
    path = save_workload(tmp_path / "w.jsonl", rows)
    out = tmp_path / "bench.json"
    for transport in ("grpc", "openai"):
        args = ["bench", "serve", "--url", targets(live)[transport], "--transport", transport]
        result = CliRunner().invoke(cli, [*args, "--workload", str(path), "--output", str(out)])
        assert result.exit_code == 0, result.output
        (run,) = json.loads(out.read_text())["runs"]
        assert run["rate"] is None  # the file's own times
        got = {r["request_id"]: r for r in run["results"]}
        for row in rows:
            res = got[row.request_id]
            assert res["error"] is None and res["num_output_tokens"] == row.output_tokens
            assert (res["tenant"], res["priority_class"]) == (row.tenant, row.priority_class)
        by_tenant = run["summary"]["by_tenant"]["tenants"]
        assert set(by_tenant) == {"gold", "batch", "free"}
        assert set(run["summary"]["by_class"]) == {"online", "offline"}


def test_bench_serve_rejects_an_unknown_workload(cli):
    args = ["bench", "serve", "--url", "127.0.0.1:1", "--workload", "no-such-thing"]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert "neither a file nor a dataset" in result.output


def test_workload_spec_scales_a_file_to_each_rate(tmp_path):
    rows = [WorkloadRequest(10.0 + 2 * i, 5, 3, f"r{i}") for i in range(5)]
    path = save_workload(tmp_path / "w.jsonl", rows)
    spec = WorkloadSpec(str(path), num_requests=4)
    assert [r.arrival_time for r in spec.build(None)] == [0.0, 2.0, 4.0, 6.0]
    assert [r.arrival_time for r in spec.build(1.0)] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert {r.arrival_time for r in spec.build(float("inf"))} == {0.0}


def test_bench_workload_writes_the_shared_format(cli, tmp_path):
    out = tmp_path / "w.jsonl"
    args = ["bench", "workload", str(out), "--dataset", "alpaca", "--num-requests", "30"]
    args += ["--rate", "5", "--tenants", "gold:1,abuser:9", "--seed", "4"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = load_workload(out)
    assert len(rows) == 30 and rows == WorkloadSpec(
        "alpaca", 30, seed=4, tenants="gold:1,abuser:9"
    ).build(5.0)
    assert sum(r.tenant == "abuser" for r in rows) > 15


def test_payloads_carry_metadata_and_vllm_priority():
    from quanta.bench.client import _OpenAISender, triton_inputs

    request = ClientRequest(
        "r1", 0.0, 5, 3, tenant="t", priority_class="offline", app="chat",
        interaction_id="i7", ttft_slo_ms=500.0, tpot_slo_ms=50.0, priority=12,
    )  # fmt: skip
    triton = triton_inputs(request, Target(url="x:1", transport="grpc"))
    assert len(triton["input_ids"]) == 5
    for key, value in request.metadata().items():
        assert triton[key] == value
    assert "priority" not in triton  # vLLM's field; Quanta's scheduling reads the metadata
    body = json.loads(
        _OpenAISender(Target(url="http://x", transport="openai"), None).prepare(request)
    )
    assert body["user"] == "t" and body["app"] == "chat" and body["interaction_id"] == "i7"
    assert body["ttft_slo_ms"] == 500.0 and body["priority"] == 12
    bare = Target(url="http://x", transport="openai", send_metadata=False)
    body = json.loads(_OpenAISender(bare, None).prepare(request))
    assert "user" not in body and "app" not in body and body["priority"] == 12


def test_bench_serve_honours_interactions_and_reports_fairness(live, cli, tmp_path):
    from quanta.workloads import agents

    rows = [  # NOTE: short times and outputs keep the run short; the dependency orders calls
        replace(
            r,
            arrival_time=min(r.arrival_time, 0.3),
            think_time_s=r.think_time_s / 20,
            output_tokens=min(r.output_tokens, 6),
        )
        for r in agents(10, 20.0, num_users=3, abusers=1, seed=1, max_len=128)
    ]
    assert any(r.interaction_stage for r in rows)  # some interaction has several calls
    path = save_workload(tmp_path / "agents.jsonl", rows)
    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--url", live.grpc_url, "--workload", str(path)]
    result = CliRunner().invoke(cli, [*args, "--output", str(out), "--delay-threshold", "5"])
    assert result.exit_code == 0, result.output
    assert "interactions answered" in result.output
    (run,) = json.loads(out.read_text())["runs"]
    got = {r["request_id"]: r for r in run["results"]}
    assert all(r["error"] is None for r in got.values())
    by_stage = {(r.interaction_id, r.interaction_stage): r for r in rows}
    for row in rows:
        if row.interaction_stage:
            before = got[by_stage[(row.interaction_id, row.interaction_stage - 1)].request_id]
            res = got[row.request_id]
            assert res["scheduled_s"] >= before["end_s"] + row.think_time_s - 1e-9
            assert res["send_s"] >= res["scheduled_s"]
    fairness = run["fairness"]
    assert fairness["delay_threshold_s"] == 5.0
    assert fairness["num_interactions"] == len({r.interaction_id for r in rows})
    assert fairness["completed_interactions"] == fairness["num_interactions"]
    assert fairness["completed_requests"] == len(rows)
    assert fairness["throttled_requests"] == fairness["abandoned_requests"] == 0
    assert fairness["wasted_tokens"] == 0 and fairness["served_users_fraction"] == 1.0
    assert fairness["delayed_users_fraction"] == 0.0
    assert set(fairness["by_tenant"]) == {r.tenant for r in rows}
    assert 0 < fairness["jain_index"] <= 1
