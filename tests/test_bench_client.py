"""``quanta bench serve`` and ``replay`` against a live ``quanta serve --openai-port``.

A handful of requests over each transport (Triton gRPC, Triton HTTP SSE, OpenAI
``/v1/completions`` through the gateway): every request succeeds and its timings are sane.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import typer
from quanta.bench.client import ClientRequest, Target, poisson_requests, replay, summarize
from quanta.bench.serve_cli import register
from test_openai_gateway import start_serve, stop_serve
from typer.testing import CliRunner

WORKLOAD = ["--num-requests", "4", "--seed", "3", "--prompt-tokens", "4:12"]
WORKLOAD += ["--output-tokens", "3:8", "--tenants", "a,b"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    serve = start_serve(tmp_path_factory.mktemp("serve"))
    try:
        yield serve
    finally:
        code, out = stop_serve(serve.proc)
    assert code == 0, out


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
        expected = poisson_requests(
            4, rate, seed=3, prompt_tokens=(4, 12), output_tokens=(3, 8), tenants=("a", "b")
        )
        summary = run["summary"]
        assert summary["num_requests"] == 4 and summary["num_errors"] == 0
        for key in ("ttft_s", "tpot_s", "e2e_s", "normalized_latency_s", "itl_s"):
            assert set(summary[key]) == {"mean", "p50", "p95", "p99"}
            assert summary[key]["p50"] <= summary[key]["p99"]
        assert summary["request_throughput"] > 0
        for res, req in zip(run["results"], expected, strict=True):
            assert res["error"] is None
            assert res["request_id"] == req.request_id and res["tenant"] == req.tenant
            assert res["num_output_tokens"] == req.max_tokens  # ignore_eos
            assert res["num_prompt_tokens"] == req.prompt
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
    assert summarize(results)["num_errors"] == 0


def test_errors_are_recorded_not_raised(live):
    requests = [ClientRequest("bad", 0.0, "hi", 600), ClientRequest("good", 0.0, "hi", 2)]
    for transport, url in targets(live).items():
        target = Target(url=url, transport=transport)  # type: ignore[arg-type]
        bad, good = asyncio.run(replay(requests, target))
        assert bad.error is not None and "maximum length" in bad.error, (transport, bad.error)
        assert good.ok and good.num_output_tokens == 2, (transport, good.error)
    summary = summarize([bad, good])
    assert summary["num_errors"] == 1 and summary["num_requests"] == 2
