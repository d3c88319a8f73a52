"""bench/trust's battery and soak, run as bench/trust/README.md shows them (at a tiny size)
against a real ``quanta serve`` of the tiny default model: their reports have the documented
shape, the bad inputs they send are refused, and the valid requests between and around them
succeed."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from serving import LiveServe, start_serve, stop_serve

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "bench" / "trust" / "README.md"
CLASSES = ("2xx", "4xx", "5xx", "hang", "crash", "error")


def load(script: str) -> Any:
    """A bench/trust script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(script, ROOT / "bench" / "trust" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[script] = module  # NOTE: dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_rss_growth_tells_a_leak_from_a_pool_that_fills_then_levels_off():
    soak = load("soak.py")

    def sample(stub_mb: float) -> dict[str, Any]:
        return {
            "tritonserver": {"pids": [1], "rss": 50 << 20},
            "stub": {"pids": [2], "rss": int(stub_mb * (1 << 20))},
            "gateway": {"pids": [3], "rss": 400 << 20},
        }

    leak = [(5.0 * i, sample(1000 + 10 * i)) for i in range(40)]
    filled = [(5.0 * i, sample(1000 + 10 * min(i, 12))) for i in range(40)]
    restarted = [(5.0 * i, sample(1000 + 300 * (i < 20))) for i in range(40)]
    restarted = [(t, s | {"stub": {**s["stub"], "pids": [2 + (t >= 100)]}}) for t, s in restarted]
    verdict = soak.growth(leak, 20, 0.05)
    assert verdict["stub"]["grew"] and verdict["stub"]["last_half_mb_per_min"] == pytest.approx(120)
    assert verdict["gateway"]["grew"] is False and verdict["tritonserver"]["delta_mb"] == 0
    verdict = soak.growth(filled, 20, 0.05)
    assert verdict["stub"]["grew"] and verdict["stub"]["last_half_mb_per_min"] == pytest.approx(0)
    verdict = soak.growth(restarted, 20, 0.05)  # only the process alive at the end counts
    assert verdict["stub"]["samples"] == 20 and verdict["stub"]["grew"] is False


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> LiveServe:
    srv = start_serve(tmp_path_factory.mktemp("trust"), timeout=300)
    yield srv
    code, out = stop_serve(srv)
    assert code == 0, out


def documented(script: str, serve: LiveServe, **options: str) -> list[str]:
    """The README's command for ``script``, pointed at ``serve``, with ``options`` set."""
    lines = [ln for ln in README.read_text().splitlines() if ln.startswith(f"python {script}")]
    assert len(lines) == 1, f"{README} shows no single command for {script}"
    text = lines[0]
    for documented_url, actual in (
        ("http://127.0.0.1:9000", serve.openai_url.removesuffix("/v1")),
        ("http://127.0.0.1:8000", serve.http_url),
        ("127.0.0.1:8001", serve.grpc_url.split("://")[-1]),
    ):
        text = text.replace(documented_url, actual)
    argv = shlex.split(text)[1:]
    for flag, value in options.items():
        flag = "--" + flag.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return [sys.executable, *argv]


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_battery_classifies_every_case_and_the_server_keeps_answering(serve, tmp_path):
    out = tmp_path / "battery.json"
    proc = run(documented("bench/trust/battery.py", serve, cases="smoke", out=str(out)), 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cases, summary = report["cases"], report["summary"]
    assert set(summary) == {"gateway", "triton-http", "triton-grpc", "total"}
    for interface, row in summary.items():
        assert sum(row[k] for k in CLASSES) + row["not run"] == row["cases"], interface
        assert re.search(rf"^{interface}\s+{row['cases']}\s", proc.stdout, re.M), proc.stdout
    assert summary["total"]["cases"] == len(cases) > 0
    by_name = {c["name"]: c for c in cases}
    # every case ran, and the valid request after each one was answered
    assert [c["name"] for c in cases if c["klass"] == "not run"] == []
    assert [c["name"] for c in cases if not c["check_ok"]] == [], proc.stdout
    assert summary["total"]["lost"] == 0
    # a bad input is refused and named; a valid stream cancelled mid-way was served
    malformed = by_name["completions.malformed_json"]
    assert (malformed["klass"], malformed["status"]) == ("4xx", 400), malformed
    assert by_name["generate.max_tokens_negative"]["klass"] == "4xx"
    assert "max_tokens" in by_name["generate.max_tokens_negative"]["detail"]
    assert by_name["completions.stream_cancelled"]["klass"] == "2xx"
    assert not any(c["crash"] for c in cases), proc.stdout


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_soak_reports_windows_and_memory_of_every_process(serve, tmp_path):
    argv = documented(
        "bench/trust/soak.py",
        serve,
        duration="6s",
        interval="2",
        sample_interval="1",
        concurrency="2",
        max_tokens="2:6",
        out=str(tmp_path),
    )
    proc = run(argv, 240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "soak.json").read_text())
    summary, windows = report["summary"], report["windows"]
    assert summary["ok"] == summary["requests"] > 0
    assert summary["failed"] == summary["hangs"] == 0
    assert summary["by_kind"]["grpc-stream"] + summary["by_kind"]["chat-stream"] > 0
    assert len(windows) >= 3 and sum(w["ok"] for w in windows) == summary["ok"]
    assert summary["p50_ms"] > 0
    assert all(isinstance(v["last_half_mb_per_min"], float) for v in summary["rss"].values())
    assert report["processes"]["root"] == serve.proc.pid
    last = windows[-1]["rss_mb"]
    assert last["tritonserver"] > 0 and last["stub"] > 0 and last["gateway"] > 0, windows[-1]
    for role in ("tritonserver", "stub", "gateway"):
        assert summary["rss"][role]["grew"] in (True, False), summary["rss"]
        assert re.search(rf"^RSS {role}\s+\S+ MB -> \S+ MB", proc.stdout, re.M), proc.stdout
    with open(tmp_path / "soak.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(windows)
    assert {"ok", "failed", "hang", "p50_ms", "p99_ms", "tritonserver_rss_mb"} <= set(rows[0])
