"""Every command the README and docs/ show runs here, at a tiny size.

The commands come from the markdown itself (``doc_commands``), so a refactor that breaks a
documented command, or a doc that shows a command nothing runs, fails this module. Each runs
through bash as written, after ``shrink`` (counts, durations and the larger checkpoint made
tiny; the documented ports mapped to free ones) in a scratch directory laid out like the
repository: ``loadtests/``, ``triton_models/`` and ``bench/`` linked, ``docs/`` copied
(reproductions rewrite their doc), and ``../shared/data`` holding the first rows of the Azure
trace (a synthetic stand-in when the data is not beside the checkout). Client commands run
against one real server started with the documented ``quanta serve --openai-port 9000``.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from doc_commands import ROOT, DocCommand, documented_commands, shrink
from quanta.frontends.triton.launcher import free_port
from serving import Background

COMMANDS = documented_commands()
BIN = Path(sys.executable).parent
AZURE = Path("data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
SERVER_COMMAND = "quanta serve --openai-port 9000"

# Commands no smoke test can run here, and why; each is still listed, so a new one is seen.
NOT_RUN = {
    "bash scripts/test.sh": "the test suite itself: CI runs it (.ci/run)",
    "source .venv/bin/activate": "a shell built-in; these tests already run inside the venv",
    "bench/peer/setup_vllm.sh": "installs vLLM's CPU build (GBs from the network), by hand",
    "bench/gpu/run.sh --output": "the prepared run itself needs a GPU (minutes); its CPU form "
    "in bench/gpu/README.md is run",
    "bench/gpu/fetch_wheels.sh": "downloads the GPU machine's wheels from PyPI (network)",
    "bench/peer/families.sh": "one `quanta bench peer` per family and dtype: needs the vLLM "
    "venv, and takes most of an hour",
    "quanta bench peer": "needs the vLLM venv above; tests/lab/test_bench_peer.py covers the "
    "harness",
    "bench/lm_eval/run.sh": "installs lm-evaluation-harness (network) and evaluates a real "
    "model twice (minutes); tests/lab/test_bench_lm_eval.py covers its data and report",
    "bench/clients/run.sh": "installs vLLM and lm-evaluation-harness (network) to run their "
    "clients against a server (minutes); the routes and fields they use are covered by "
    "tests/frontends/openai (tokenizer routes, batched prompts, embeddings and responses, "
    "gateway metrics)",
    "docker ": "builds and runs the image: tests/project/test_container.py (the docker tier) does",
    "bash scripts/docker-base.sh": "debootstraps Debian (root, minutes): "
    "tests/project/test_container.py runs it",
    "python loadtests/fair_replicas.py": "starts two replicas (and Redis) for each mode and "
    "loads them for a minute each; tests/frontends/openai/test_openai_gateway.py runs "
    "--replicas 2 behind the gateway and tests/policies/test_fair_redis.py the shared state",
    "quanta serve smollm2-135m-instruct --openai-port": "the real model's tool call, pasted "
    "into docs/openai-api.md; docs/models.md's quanta serve smollm2-135m-instruct is run, and "
    "tests/frontends/openai/test_tool_calling_live.py makes forced calls on random weights",
    "bash loadtests/genai_perf.sh": "installs genai-perf and perf_analyzer's libraries (network); "
    "tests/build/test_trtllm_layout.py sends TensorRT-LLM-shaped requests",
}
# Inline mentions that name a flag rather than show a whole command.
FRAGMENTS = {
    "quanta bench serve --workload out/w.jsonl": "its whole command is in loadtests/README.md",
    "quanta bench workload --dataset chat": "names the dataset; docs/results/prefix-caching.md's "
    "blocks give the whole command",
    "quanta bench workload --dataset agents --num-requests 60 --rate 1 --seed 0": "the options "
    "of a trace; docs/results/prefix-caching.md's blocks give the whole command",
    "quanta bench serve --workload out/peer/workload_rate2.jsonl --transport openai": "reads "
    "the workload `quanta bench peer` writes (not run here)",
}
# Extra options that keep the slowest documented commands to seconds.
FASTER = {
    "quanta simulate validate": "--calibration-seconds 0.2 --repeats 1",
    "quanta bench policies": "--calibration-seconds 0.2",
    "quanta bench quality": "--max-tokens 4 --no-bf16 --questions 2",
    "quanta bench schedule-step": "--waiting 40 --steps 3",
    "quanta bench engine": "--repeat 1",
    "quanta simulate repro --figure apt --quick": "--num-requests 8",
    "quanta simulate repro --figure conserve --quick": "--num-requests 12",
    "quanta simulate repro --figure safepoints --quick": "--num-requests 3",
    "quanta simulate repro --figure safepoints --num-requests": "--num-requests 3",
    "quanta bench structured": "--batch 1 --max-tokens 8",
    "quanta bench speculative": "--batch 1 --max-tokens 8 --workload edit",
    "quanta bench prefix-prefill": "--shapes 64:16 --repeats 1",
    "python bench/gpu/hidden_recompute.py": "--device cpu --dtype float32 --hidden 64 "
    "--layers 2 --batches 2,4 --hidden-tokens 8,16,32 --repeats 2",
}


def kind(cmd: DocCommand) -> str:
    words = cmd.words
    if cmd.python:
        return "client" if "OpenAI(" in cmd.text else "offline"
    if any(cmd.text.startswith(prefix) for prefix in NOT_RUN) or cmd.text in FRAGMENTS:
        return "not run"
    if cmd.text == "bash scripts/demo.sh":
        return "demo"
    if cmd.text == SERVER_COMMAND:
        return "fixture"
    if words[:2] == ["quanta", "serve"]:
        return "demo" if "--demo" in words else "server"
    if words[:2] == ["quanta", "openai"]:
        return "gateway"
    if words[0] in ("curl", "locust") or words[:3] == ["quanta", "bench", "serve"]:
        return "client"
    if words[:2] == ["quanta", "generate"] and "--url" in words:
        return "client"
    if words[:2] == ["quanta", "batch"]:
        return "client"  # the Batch API's CLI talks to a running gateway
    if words[:2] == ["quanta", "reset-prefix-cache"]:
        return "client"
    if words[0] == "python" and words[1].startswith("bench/trust/"):
        return "client"  # a burst against the running server (restarted if it aborts)
    if words[0] == "quanta" or (words[0] == "python" and words[1].startswith("loadtests/")):
        return "offline"  # (a load-test script that starts its own server)
    if words[0] == "python" and words[1].startswith("bench/gpu/"):
        return "offline"  # a device benchmark, run here on the CPU at a tiny size
    if words[0] == "bench/gpu/run.sh":
        return "offline"  # the prepared GPU run's CPU form (its smoke test)
    return "unknown"


# Commands that run the PyTorch engine (or HF transformers beside it): the `engine` tier.
ENGINE = (
    "quanta build",
    "quanta generate --model",
    "quanta bench engine",
    "quanta bench load",
    "quanta bench loop",
    "quanta bench policies",
    "quanta bench quality",
    "quanta bench decode-profile",
    "quanta bench structured",
    "quanta bench speculative",
    "quanta bench prefix-prefill",
    "quanta fetch-model",
    "quanta profile",
    "quanta simulate validate",
    "python bench/gpu/",
    "bench/gpu/run.sh",
)


def own_tiers(cmd: DocCommand) -> set[str]:
    """The test tiers (markers in pyproject.toml) a command's smoke test needs by itself."""
    tiers = set()
    if kind(cmd) in ("demo", "server", "gateway", "client") or cmd.text.startswith(
        "python loadtests/"
    ):
        tiers.add("live")  # a server of its own or the module's
    if cmd.text.startswith(ENGINE) or (cmd.python and "quanta.LLM(" in cmd.text):
        tiers.add("engine")
    if cmd.words[0] == "locust":
        tiers.add("slow")
    return tiers


def outputs(cmd: DocCommand) -> list[str]:
    """What a command writes that a later one may read."""
    made = written(cmd.text)
    if cmd.words[:3] == ["quanta", "bench", "workload"]:
        made.append(cmd.words[3])
    return made


def reads(cmd: DocCommand, path: str) -> bool:
    """Whether ``cmd`` names ``path`` (or a file under it) among its words."""
    return path in cmd.words or f"{path}/" in cmd.text


@functools.cache
def tiers_of() -> dict[str, set[str]]:
    """Each command's tiers, including those of every later command that reads what it
    writes: a tier run alone (`-m live`) still runs what its commands need first."""
    tiers: dict[str, set[str]] = {}
    for i in reversed(range(len(COMMANDS))):
        cmd = COMMANDS[i]
        tiers[cmd.text] = own_tiers(cmd)
        for later in COMMANDS[i + 1 :]:
            if any(reads(later, path) for path in outputs(cmd)):
                tiers[cmd.text] |= tiers[later.text]
    return tiers


def of_kind(name: str) -> list[pytest.param]:
    def param(c: DocCommand) -> pytest.param:
        marks = [getattr(pytest.mark, tier) for tier in sorted(tiers_of()[c.text])]
        return pytest.param(c, id=c.where, marks=marks)

    return [param(c) for c in COMMANDS if kind(c) == name]


def test_every_documented_command_has_a_smoke_test():
    assert len(COMMANDS) >= 30  # the parser still finds the docs' commands
    unknown = [f"{c.where}: {c.text}" for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, "documented commands no smoke test knows how to run:\n" + "\n".join(unknown)
    assert any(c.text == SERVER_COMMAND for c in COMMANDS), "the server fixture's command moved"


def test_shrink_keeps_the_shape_and_maps_ports():
    text = "quanta bench serve --url 127.0.0.1:8001 --rate 1,2,4 --num-requests 200 --seed 0"
    assert shrink(text, {8001: 41234}) == (
        "quanta bench serve --url 127.0.0.1:41234 --rate 4 --num-requests 6 --seed 0"
    )
    assert shrink("quanta make-model opt-125m --out engines/opt-125m") == (
        "quanta make-model opt-tiny --out engines/opt-125m"
    )


# -- the scratch checkout ------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("docs")
    work = base / "work"
    work.mkdir()
    (work / "loadtests").symlink_to(ROOT / "loadtests")
    (work / "triton_models").symlink_to(ROOT / "triton_models")
    (work / "bench").symlink_to(ROOT / "bench")
    shutil.copytree(ROOT / "docs", work / "docs")
    (work / "out").mkdir()
    trace = base / "shared" / AZURE
    trace.parent.mkdir(parents=True)
    real = ROOT.parent / "shared" / AZURE
    if real.is_file():
        with real.open() as f:
            trace.write_text("".join(itertools.islice(f, 301)))
    else:  # the same columns, invented rows two seconds apart
        rows = [
            f"2023-11-16 18:{15 + i // 30:02d}:{(2 * i) % 60:02d}.0000000,"
            f"{90 + 37 * (i % 9)},{5 + 11 * (i % 7)}"
            for i in range(300)
        ]
        trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return work


def env(**ports: int) -> dict[str, str]:
    extra = {f"QUANTA_{k.upper()}_PORT": str(v) for k, v in ports.items()}
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def run(text: str, cwd: Path, timeout: float = 600, **ports: int) -> str:
    proc = subprocess.run(
        ["bash", "-c", text],
        cwd=cwd,
        env=env(**ports),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{text}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def run_python(source: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", source], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{source}\n--- stderr\n{proc.stderr}"


def written(text: str) -> list[str]:
    """Files and folders a command says it writes (--output, --plot, --out, --csv prefix)."""
    return re.findall(r"--(?:output|plot|out|plot-dir)\s+(\S+)", text)


def ensure_inputs(cmd: DocCommand, workdir: Path, seen: frozenset[str] = frozenset()) -> None:
    """Run first the documented commands that write what ``cmd`` reads and is not there yet.

    The docs give them in order, and in a full run the earlier test made it; a test selected
    alone (``-k``, a rerun of a failure) must not depend on that order."""
    for maker in COMMANDS:
        if maker is cmd or maker.python or kind(maker) != "offline" or maker.text in seen:
            continue
        missing = [
            p
            for p in outputs(maker)
            if reads(cmd, p) and p not in outputs(cmd) and not (workdir / p).exists()
        ]
        if missing:
            ensure_inputs(maker, workdir, seen | {cmd.text})
            run_offline(maker, workdir)


def run_offline(cmd: DocCommand, workdir: Path) -> None:
    text = shrink(cmd.text)
    for prefix, extra in FASTER.items():
        if text.startswith(prefix):
            text = f"{text} {extra}"
    run(text, workdir)
    for path in written(text):
        assert (workdir / path).exists(), f"{cmd.where}: {text} did not write {path}"


# -- offline commands, in the order the docs give them ---------------------------------------
@pytest.mark.parametrize("cmd", of_kind("offline"))
def test_offline_command(cmd: DocCommand, workdir: Path):
    if cmd.python:
        run_python(cmd.text, workdir)
        return
    ensure_inputs(cmd, workdir)
    run_offline(cmd, workdir)


# -- the demo --------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", of_kind("demo"))
def test_demo_command(cmd: DocCommand, workdir: Path):
    cwd = ROOT if cmd.text.startswith("bash scripts/") else workdir
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    out = run(cmd.text, cwd, timeout=600, **ports)
    assert re.search(r"^> .+", out, re.MULTILINE), out
    assert f"HTTP    http://127.0.0.1:{ports['http']}" in out


# -- servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(workdir: Path):
    """The documented ``quanta serve --openai-port 9000`` on free ports."""
    ports = {8000: free_port(), 8001: free_port(), 8002: free_port(), 9000: free_port()}
    srv = Background(
        shrink(SERVER_COMMAND, ports),
        workdir,
        env(http=ports[8000], grpc=ports[8001], metrics=ports[8002]),
    )
    try:
        srv.wait_for_line("OpenAI ")
        yield ports
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.parametrize("cmd", of_kind("server"))
def test_server_command_starts_and_stops_on_ctrl_c(cmd: DocCommand, workdir: Path, server):
    # NOTE: `server` is requested so the default checkpoint exists; MODELS is a repository.
    text = cmd.text
    if "MODELS" in text:
        from quanta.frontends.triton.repository import write_model_repository

        repo = write_model_repository(
            workdir / "MODELS",
            overrides={"model_dir": str(workdir / "engines" / "opt-tiny"), "policy": "fair"},
        )
        text = text.replace("MODELS", str(repo))
    srv = Background(text, workdir, env(http=free_port(), grpc=free_port(), metrics=free_port()))
    try:
        srv.wait_for_line("ready")
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.parametrize("cmd", of_kind("gateway"))
def test_gateway_command_serves_next_to_a_running_triton(cmd: DocCommand, workdir: Path, server):
    port = free_port()
    gateway = Background(shrink(cmd.text, {8001: server[8001], 9000: port}), workdir, env())
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    assert b"quanta" in r.read()
                    break
            except OSError:
                assert gateway.proc.poll() is None, "".join(gateway.lines)
                assert time.monotonic() < deadline, "the gateway never answered"
                time.sleep(0.5)
    finally:
        gateway.stop()


@pytest.mark.parametrize("cmd", of_kind("client"))
def test_client_command_against_the_server(cmd: DocCommand, workdir: Path, server):
    if cmd.python:
        run_python(shrink(cmd.text, server), workdir)
        return
    text = shrink(cmd.text, server)
    out = run(text, workdir, timeout=300)
    if cmd.words[0] in ("curl", "quanta") and "bench" not in cmd.words:
        assert out.strip(), f"{text}: no output"
    for path in written(text):
        assert (workdir / path).exists(), f"{cmd.where}: {text} did not write {path}"
