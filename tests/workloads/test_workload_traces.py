"""Real traces: the Azure LLM inference trace reader, time and token scaling, the policy for
rows too long for the model, and the flags every tool that reads a workload file shares."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from quanta.bench.workload_spec import WorkloadSpec
from quanta.cli import app
from quanta.workloads import (
    WorkloadError,
    WorkloadRequest,
    fit_to_model,
    load_workload,
    make_workload,
    save_workload,
    scale_time,
    scale_tokens,
)
from typer.testing import CliRunner

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
WIDE = {"COLUMNS": "1000"}  # error boxes unwrapped, so messages can be matched whole
# The Azure Public Dataset (AzureLLMInferenceDataset2023), CC BY 4.0; Patel et al., Splitwise,
# ISCA 2024. Shared beside the repository, not in it: tests that read it skip without it.
SHARED_AZURE = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "data"
    / "azure-llm-2023"
    / "AzureLLMInferenceTrace_conv.csv"
)


@pytest.fixture
def azure_csv(tmp_path: Path) -> Path:
    """Five rows with the real file's timestamp format; the third is failed (0 tokens)."""
    path = tmp_path / "azure.csv"
    path.write_text(
        AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.0000000,0,12\n"
        "2023-11-16 18:15:51.2224670,1900,300\n"
        "2023-11-16 18:15:51.3910170,91,16\n"
    )
    return path


# -- the Azure reader ----------------------------------------------------------------------
def test_azure_trace_times_are_seconds_since_the_first_row(azure_csv):
    reqs = load_workload(azure_csv)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (374, 44),
        (396, 109),
        (1900, 300),
        (91, 16),
    ]
    assert [r.arrival_time for r in reqs] == pytest.approx([0.0, 4.314579, 4.541877, 4.710427])
    assert reqs[0].arrival_time == 0.0
    assert [r.request_id for r in reqs] == ["r0", "r1", "r2", "r3"]
    assert {(r.tenant, r.app, r.prompt) for r in reqs} == {("default", "default", None)}


def test_azure_timestamps_are_parsed_exactly(tmp_path):
    """Seven fractional digits survive (a float of epoch seconds would round them), other
    precisions and plain seconds work, and an unsorted file is rebased to its earliest row."""
    path = tmp_path / "a.csv"
    path.write_text(
        AZURE_HEADER + "2023-12-31 23:59:59.9999999,5,5\n"
        "2024-01-01 00:00:00.0000001,5,5\n"
        "2024-01-01T00:00:01.5,5,5\n"
        "2023-12-31 23:59:59,5,5\n"
    )
    times = [r.arrival_time for r in load_workload(path)]
    assert times == pytest.approx([0.0, 0.9999999, 1.0000001, 2.5], abs=1e-12)
    (tmp_path / "s.csv").write_text(AZURE_HEADER + "10.5,5,5\n12,5,5\n")
    assert [r.arrival_time for r in load_workload(tmp_path / "s.csv")] == [0.0, 1.5]


@pytest.mark.parametrize(
    ("body", "line", "problem"),
    [
        ("2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,x,4\n", 3, "ContextTokens must be"),
        ("2023-11-16 18:15:46.68,374,-1\n", 2, "GeneratedTokens must be"),
        ("16/11/2023 18:15,374,44\n", 2, "TIMESTAMP must be a date-time"),
        ("2023-02-30 18:15:46,374,44\n", 2, "TIMESTAMP '2023-02-30"),
        ("2023-11-16 18:15:46,374\n", 2, "wrong number of columns"),
    ],
)
def test_bad_azure_rows_name_the_line(tmp_path, body, line, problem):
    path = tmp_path / "bad.csv"
    path.write_text(AZURE_HEADER + body)
    with pytest.raises(WorkloadError, match=rf"bad\.csv:{line}: .*{problem}"):
        load_workload(path)


def test_csv_format_is_told_by_the_header(tmp_path):
    (tmp_path / "half.csv").write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n")
    with pytest.raises(WorkloadError, match=r"half\.csv:1: Azure trace header lacks .*Generated"):
        load_workload(tmp_path / "half.csv")
    (tmp_path / "other.csv").write_text("when,in,out\n1,2,3\n")
    with pytest.raises(WorkloadError, match=r"BurstGPT header lacks .*or an Azure trace's"):
        load_workload(tmp_path / "other.csv")


@pytest.mark.skipif(not SHARED_AZURE.is_file(), reason="shared Azure trace not present")
def test_the_real_azure_trace():
    head = load_workload(SHARED_AZURE, limit=200)
    assert [(r.prompt_tokens, r.output_tokens) for r in head[:4]] == [
        (374, 44),
        (396, 109),
        (879, 55),
        (91, 16),
    ]
    assert head[0].arrival_time == 0.0 and head[1].arrival_time == pytest.approx(4.314579)
    rows = load_workload(SHARED_AZURE)
    assert rows[:200] == head
    assert len(rows) == 19366  # docs/benchmarking.md's count; every row is a request
    span = rows[-1].arrival_time
    assert (len(rows) - 1) / span == pytest.approx(5.5, abs=0.1)  # about 5.5 req/s
    assert statistics.mean(r.prompt_tokens for r in rows) == pytest.approx(1155, abs=1)
    assert statistics.mean(r.output_tokens for r in rows) == pytest.approx(211, abs=1)
    assert sum(r.prompt_tokens + r.output_tokens > 2048 for r in rows) > 0  # needs too_long


# -- scaling -------------------------------------------------------------------------------
def test_time_scale_divides_the_gaps_and_token_scale_multiplies_prompts(azure_csv):
    base = load_workload(azure_csv)
    fast = load_workload(azure_csv, time_scale=2.0)
    assert [r.arrival_time for r in fast] == pytest.approx([r.arrival_time / 2 for r in base])
    assert [(r.prompt_tokens, r.output_tokens) for r in fast] == [
        (r.prompt_tokens, r.output_tokens) for r in base
    ]
    short = load_workload(azure_csv, token_scale=0.25)
    assert [r.prompt_tokens for r in short] == [94, 99, 475, 23]  # rounded
    assert [r.output_tokens for r in short] == [r.output_tokens for r in base]
    assert [r.prompt_tokens for r in scale_tokens(base, 0.001)] == [1, 1, 2, 1]  # >= 1
    assert scale_time(base, 1.0) == base and scale_tokens(base, 1.0) == base
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(WorkloadError, match="time_scale must be"):
            scale_time(base, bad)
        with pytest.raises(WorkloadError, match="token_scale must be"):
            scale_tokens(base, bad)


def test_token_scale_turns_text_prompts_into_lengths():
    (r,) = scale_tokens([WorkloadRequest(0.0, 10, 4, "a", prompt="some text here")], 2.0)
    assert (r.prompt_tokens, r.prompt) == (20, None)


def test_scaling_is_for_files_not_datasets():
    with pytest.raises(WorkloadError, match="rescale a workload file"):
        make_workload("sharegpt", 10, 1.0, time_scale=2.0)
    with pytest.raises(WorkloadError, match="rescale a workload file"):
        WorkloadSpec(None, 4, token_scale=0.5).build(1.0)


# -- rows too long for the model -----------------------------------------------------------
def test_too_long_rows_are_an_error_that_says_where_and_what_to_do(azure_csv):
    with pytest.raises(WorkloadError) as info:
        load_workload(azure_csv, max_len=2048)
    message = str(info.value)
    assert message.startswith(f"{azure_csv}:5: request 'r2': ")  # line 5 of the file
    assert "1900 prompt + 300 output tokens = 2200 > max_len 2048" in message
    assert "--too-long skip" in message and "--too-long clip" in message
    with pytest.raises(WorkloadError, match=r"azure\.csv:5: request 'r2'"):
        make_workload(str(azure_csv), 10, 1.0, max_len=2048)


def test_too_long_skip_and_clip(azure_csv):
    skipped = load_workload(azure_csv, max_len=2048, too_long="skip")
    assert [r.request_id for r in skipped] == ["r0", "r1", "r3"]
    clipped = load_workload(azure_csv, max_len=2048, too_long="clip")
    assert [r.request_id for r in clipped] == ["r0", "r1", "r2", "r3"]
    assert (clipped[2].prompt_tokens, clipped[2].output_tokens) == (1748, 300)
    fitting = load_workload(azure_csv, max_len=2048, token_scale=0.5)  # 950 + 300 fits now
    assert fitting[2].prompt_tokens == 950
    with pytest.raises(WorkloadError, match="too_long must be one of"):
        load_workload(azure_csv, too_long="drop")  # type: ignore[arg-type]


def test_clip_shortens_the_output_when_it_alone_does_not_fit():
    row = WorkloadRequest(0.0, 50, 600, "x", prompt="text")
    assert fit_to_model(row, 512, "clip") == WorkloadRequest(0.0, 1, 511, "x")
    kept = WorkloadRequest(0.0, 50, 400, "y", prompt="text")
    assert fit_to_model(kept, 512, "clip") is kept
    shortened = fit_to_model(WorkloadRequest(0.0, 200, 400, "z", prompt="t"), 512, "clip")
    assert shortened == WorkloadRequest(0.0, 112, 400, "z")  # text cannot be cut: a length
    assert fit_to_model(row, 512, "skip") is None
    with pytest.raises(WorkloadError, match="50 prompt \\+ 600 output tokens"):
        fit_to_model(row, 512, "error")


def test_num_requests_takes_the_first_rows_and_checks_only_those(azure_csv):
    """Rows past the first N are not read into the run, so they cannot fail it."""
    first = make_workload(str(azure_csv), 2, 1.0, max_len=2048)
    assert [r.request_id for r in first] == ["r0", "r1"]
    some = make_workload(str(azure_csv), 3, 1.0, max_len=2048, too_long="skip")
    assert [r.request_id for r in some] == ["r0", "r1"]  # the first 3, one skipped
    (azure_csv.parent / "long.csv").write_text(AZURE_HEADER + "2023-11-16 18:15:46,3000,3\n")
    with pytest.raises(WorkloadError, match="no request fits max_len 2048"):
        load_workload(azure_csv.parent / "long.csv", max_len=2048, too_long="skip")


def test_jsonl_files_take_the_same_options(tmp_path):
    rows = [WorkloadRequest(1.0 + i, 1000 * (i + 1), 10, f"j{i}") for i in range(3)]
    path = save_workload(tmp_path / "w.jsonl", rows)
    got = load_workload(path, max_len=2048, too_long="clip", time_scale=4.0, token_scale=0.5)
    assert [(r.arrival_time, r.prompt_tokens) for r in got] == [
        (0.25, 500),
        (0.5, 1000),
        (0.75, 1500),
    ]
    with pytest.raises(WorkloadError, match=r"w\.jsonl:3: request 'j2': 3000 prompt"):
        load_workload(path, max_len=2048)


# -- the command lines ---------------------------------------------------------------------
def test_simulate_replays_an_azure_trace_scaled(azure_csv, tmp_path):
    rows = [
        f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.{i:07d},{300 + 37 * i},{20 + i}"
        for i in range(40)
    ]
    rows[5] = "2023-11-16 18:15:05.0000005,7000,40"  # fits after token scaling by 0.25
    trace = tmp_path / "trace.csv"
    trace.write_text(AZURE_HEADER + "\n".join(rows) + "\n")
    out = tmp_path / "r.json"
    args = ["simulate", "--workload", str(trace), "--time-scale", "2", "--token-scale", "0.25"]
    args += ["--num-requests", "30", "--policy", "fcfs", "--output", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["num_finished"] == 30
    assert data["workload"]["time_scale"] == 2.0 and data["workload"]["token_scale"] == 0.25
    unscaled = CliRunner().invoke(
        app,
        ["simulate", "--workload", str(trace), "--num-requests", "30", "--policy", "fcfs"],
        env=WIDE,
    )
    assert unscaled.exit_code == 2
    assert "trace.csv:7: request 'r5': 7000 prompt" in unscaled.output
    skipped = CliRunner().invoke(
        app,
        ["simulate", "--workload", str(trace), "--num-requests", "30", "--policy", "fcfs",
         "--too-long", "skip", "--output", str(out)],
    )  # fmt: skip
    assert skipped.exit_code == 0, skipped.output
    assert json.loads(out.read_text())["num_finished"] == 29


@pytest.mark.skipif(not SHARED_AZURE.is_file(), reason="shared Azure trace not present")
def test_simulate_the_real_azure_trace():
    args = ["simulate", "--workload", str(SHARED_AZURE), "--time-scale", "2"]
    args += ["--token-scale", "0.25", "--num-requests", "30", "--policy", "fcfs"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    unscaled = CliRunner().invoke(app, args[:3] + args[7:], env=WIDE)
    assert unscaled.exit_code == 2 and "--too-long skip" in unscaled.output


def test_bench_workload_converts_a_trace(azure_csv, tmp_path):
    out = tmp_path / "w.jsonl"
    args = ["bench", "workload", str(out), "--trace", str(azure_csv), "--time-scale", "2"]
    args += ["--token-scale", "0.5", "--too-long", "clip", "--max-len", "512"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = load_workload(out)
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [
        (187, 44),
        (198, 109),
        (212, 300),  # 950 prompt tokens clipped so 300 output tokens fit 512
        (46, 16),
    ]
    assert [r.arrival_time for r in rows] == pytest.approx([0.0, 2.1572895, 2.2709385, 2.3552135])
    both = CliRunner().invoke(app, ["bench", "workload", str(out), "--trace", str(azure_csv),
                                    "--dataset", "alpaca"])  # fmt: skip
    assert both.exit_code == 2


def test_bench_serve_options_reach_the_workload(azure_csv):
    spec = WorkloadSpec(str(azure_csv), num_requests=3, time_scale=2.0, too_long="skip")
    assert [r.request_id for r in spec.build(None)] == ["r0", "r1"]
    with pytest.raises(WorkloadError, match="--rate or sped up by --time-scale"):
        spec.build(4.0)
    res = CliRunner().invoke(
        app, ["bench", "serve", "--url", "127.0.0.1:1", "--workload", str(azure_csv)], env=WIDE
    )
    assert res.exit_code == 2 and "azure.csv:5: request 'r2'" in res.output
    assert "--too-long skip" in res.output


def test_the_policies_bench_trace_is_sharegpt_scaled():
    """``quanta bench policies`` shrinks ShareGPT-like lengths for a small CPU model."""
    from quanta_lab.sim.engine_replay import bench_trace

    base = make_workload("sharegpt", 20, 1.0, seed=3)
    small = bench_trace(20, 2048, 3, 0.25)
    assert [r.prompt_tokens for r in small] == [max(1, round(r.prompt_tokens / 4)) for r in base]
    assert [r.output_tokens for r in small] == [max(1, round(r.output_tokens / 4)) for r in base]


@pytest.mark.slow
def test_a_missing_workload_file_is_one_clear_error_everywhere(tmp_path):
    """The loader says it (every consumer shows the message); Locust stops at start-up with
    it, not with a traceback."""
    import subprocess
    import sys

    from quanta.workloads import WorkloadError, load_workload

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(WorkloadError, match="no such workload file"):
        load_workload(missing)
    root = Path(__file__).resolve().parents[2]
    locust = Path(sys.executable).parent / "locust"
    cmd = [str(locust), "-f", str(root / "loadtests" / "locustfile.py"), "--headless"]
    cmd += ["-u", "1", "-r", "1", "--run-time", "2s", "-H", "http://127.0.0.1:9"]
    proc = subprocess.run(
        [*cmd, "--workload", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "no such workload file" in proc.stderr and "Traceback" not in proc.stderr
