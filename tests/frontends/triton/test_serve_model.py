"""``quanta build`` then ``quanta serve MODEL``, end to end: a real tritonserver serves the engine
(or a plain checkpoint) with the flags given, over HTTP streaming and the OpenAI gateway, and
its outputs equal the offline API's on the same directory."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import quanta
from quanta import SamplingParams
from quanta.build.checkpoint import ensure_checkpoint
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.frontends.triton.client import http_events, output_ids, request_inputs
from quanta.frontends.triton.launcher import free_port
from serving import Background

pytestmark = pytest.mark.live

QUANTA = f"{shlex.quote(sys.executable)} -m quanta.cli"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SMALL = {"kv_cache_memory": 1 << 23, "host_cache_memory": 1 << 22}

# (case, preset, build options or None to serve the checkpoint itself, serve flags)
CASES = [
    (
        "opt-tiny",
        "opt-tiny",
        BuildOptions(max_batch_size=16, **SMALL),
        "--policy sj-mlfq --max-num-seqs 8 --served-model-name ensemble",
    ),
    ("llama-tiny", "llama-tiny", BuildOptions(max_seq_len=256, **SMALL), ""),
    (
        "opt-125m-bf16",
        "opt-125m",
        BuildOptions(dtype="bfloat16", max_seq_len=512, kv_cache_memory=1 << 26),
        "--policy fair",
    ),
    (
        "llama-tiny-checkpoint",
        "llama-tiny",
        None,
        "--kv-cache-memory 4MiB --host-cache-memory 0 --max-num-batched-tokens 512 "
        "--no-enable-prefix-caching",
    ),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def prepare(root: Path, preset: str, options: BuildOptions | None, name: str) -> Path:
    checkpoint = ensure_checkpoint(preset, root / preset)
    if options is None:
        return checkpoint
    out = root / "engines" / name
    if not out.exists():
        build_engine_dir(checkpoint, out, options)
    return out


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def complete(url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def engine_info(metrics_url: str) -> dict[str, str]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("quanta_engine_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


@pytest.mark.parametrize(
    ("case", "preset", "options", "flags"),
    [
        pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[1] == "opt-125m" else [])
        for c in CASES
    ],
)
def test_build_then_serve_end_to_end(checkpoints, tmp_path, case, preset, options, flags):
    model = prepare(checkpoints, preset, options, case)
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    cmd = f"{QUANTA} serve {shlex.quote(str(model))} {flags} --torch-threads 1 " + " ".join(
        f"--{name}-port {port}" for name, port in ports.items()
    )
    served = "ensemble" if "ensemble" in flags else "quanta"
    srv = Background(cmd, tmp_path, env())
    try:
        srv.wait_for_line("OpenAI ", timeout=300)
        http = f"http://127.0.0.1:{ports['http']}"
        inputs = request_inputs("Hello there", GREEDY, stream=True)
        events = list(http_events(http, served, inputs, stream=True, timeout=120))
        streamed = [t for e in events for t in output_ids(e)]
        answer = complete(f"http://127.0.0.1:{ports['openai']}", served, "Hello there")
        info = engine_info(f"http://127.0.0.1:{ports['metrics']}/metrics")
    finally:
        code = srv.stop()
    log = "".join(srv.lines)
    assert code == 0, log
    assert f"serving {model} as model {served!r}" in log
    expected = quanta.LLM(str(model), cache={"num_device_blocks": 64, "num_host_blocks": 0})
    want = expected.generate("Hello there", GREEDY)[0]
    assert streamed == want.token_ids
    assert answer["choices"][0]["text"] == want.text
    assert info["model_dir"] == str(model.resolve())
    assert info["policy"] == (re.search(r"--policy (\S+)", flags) or [None, "fcfs"])[1]
    assert info["prefix_caching"] == ("false" if "--no-enable-prefix-caching" in flags else "true")
    if options is not None:
        assert info["dtype"] == (options.dtype or "float32")
        assert info["max_seq_len"] == str(options.max_seq_len or 512)
        assert info["block_size"] == str(options.block_size)
    if "--max-num-seqs 8" in flags:
        assert info["max_num_seqs"] == "8"
        assert re.search(r"serving model_dir=\S+ policy=sj-mlfq .*max_num_seqs=8 ", log), log
    elif options is not None:  # the engine's limit is the default
        assert info["max_num_seqs"] == str(options.max_batch_size)
    if "--kv-cache-memory 4MiB" in flags:
        per_block = quanta.LLM(str(model)).engine.runner.bytes_per_block
        assert info["device_blocks"] == str((4 << 20) // per_block)
        assert info["max_num_batched_tokens"] == "512"


def test_serve_refuses_settings_beyond_the_engine_before_starting_triton(checkpoints, tmp_path):
    engine = prepare(checkpoints, "opt-tiny", CASES[0][2], "opt-tiny")
    proc = subprocess.run(
        [sys.executable, "-m", "quanta.cli", "serve", str(engine), "--max-num-seqs", "64"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "max_num_seqs 64 exceeds the 16 engine 'opt-tiny' was built for" in proc.stderr
    assert "(rebuild with --max-batch-size 64)" in proc.stderr
    assert "nothing started" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-repository", "{repo}", "--max-num-seqs", "8"], "--max-num-seqs set the model"),
        (["{engine}", "--model-repository", "{repo}"], "give MODEL or --model-repository"),
        (["{tmp}"], "is not an engine or checkpoint directory (no config.json)"),
        (["{engine}", "--kv-cache-memory", "lots"], "not a memory size"),
    ],
    ids=["flags-with-repository", "both", "not-a-model", "bad-size"],
)
def test_serve_argument_mistakes(checkpoints, tmp_path, args, message):
    engine = prepare(checkpoints, "opt-tiny", CASES[0][2], "opt-tiny")
    repo = tmp_path / "models"
    repo.mkdir()
    values = {"repo": str(repo), "engine": str(engine), "tmp": str(tmp_path)}
    argv = [a.format(**values) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "quanta.cli", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**env(), "COLUMNS": "200"},
    )
    assert proc.returncode in (1, 2), proc.stdout + proc.stderr
    assert message in " ".join(proc.stderr.split()), proc.stderr


def test_default_model_takes_the_flags_and_the_served_name(tmp_path):
    """No MODEL and no ./triton_models: the tiny default model, named and set by flags."""
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--served-model-name", "ensemble"]
    cmd += ["--policy", "sj-mlfq", "--max-num-seqs", "4", "--demo", "Hello"]
    for option in ("--http-port", "--grpc-port", "--metrics-port"):
        cmd += [option, str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "serving the default tiny model" in out and "> Hello\n" in proc.stdout
    assert re.search(r"serving model_dir=\S+ policy=sj-mlfq .*max_num_seqs=4 ", out), out
    assert (tmp_path / "engines" / "opt-tiny" / "config.json").is_file()  # the preset, at load
