"""``quanta serve`` outlives its tritonserver: the gRPC error mix that aborts Triton 2.51 is
sent for real, and the server must be serving again (HTTP, gRPC, the OpenAI gateway) within
RECOVERY_S, with no client left hanging, the restart counted on /metrics and no shared
memory left behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quanta import SamplingParams
from quanta.frontends.triton.client import GenerateError, http_events, request_inputs
from quanta.frontends.triton.launcher import free_port
from serving import Background, wait_for

pytestmark = [pytest.mark.live, pytest.mark.slow]

RECOVERY_S = 60.0  # from the crash to serving again, on a 2-core machine


@pytest.fixture(scope="module")
def model_dir(opt_tiny) -> Path:
    return opt_tiny


def start(model_dir: Path, tmp_path: Path, *flags: str) -> tuple[Background, dict[str, int]]:
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    cmd = [sys.executable, "-m", "quanta.cli", "serve", str(model_dir), *flags]
    cmd += ["--log-file", str(tmp_path / "triton.log")]
    cmd += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    srv = Background(shlex.join(cmd), tmp_path, env)
    srv.wait_for_line("ready", timeout=180)
    return srv, ports


def tritonserver_pid(serve_pid: int) -> int:
    out = subprocess.run(
        ["pgrep", "-f", f"shm-region-prefix-name=quanta{serve_pid}_"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


def shared_memory(serve_pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"quanta{serve_pid}_*")]


def send_crash_mix(grpc_url: str) -> None:
    """One gRPC stream: requests for a model that does not exist, back to back with
    requests carrying an input the model lacks (each kind alone does no harm)."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        client.start_stream(callback=lambda result, error: None)
        for i in range(60):
            text = tensor("text_input", np.array([b"hi"], dtype=np.object_), "BYTES")
            if i % 2 == 0:
                client.async_stream_infer("nope", [text], request_id=uuid.uuid4().hex)
            else:
                extra = tensor("foo", np.array([1], dtype=np.int32), "INT32")
                client.async_stream_infer("quanta", [text, extra], request_id=uuid.uuid4().hex)
        time.sleep(1.0)
    finally:
        try:
            client.stop_stream()
            client.close()
        except Exception:
            pass  # the server it talked to is gone


def completion(port: int) -> str:
    body = {"model": "quanta", "prompt": "hi", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_a_crashed_tritonserver_is_restarted_and_serves_again(model_dir, tmp_path):
    srv, ports = start(model_dir, tmp_path, "--max-restarts", "2")
    http = f"http://127.0.0.1:{ports['http']}"
    try:
        first_pid = tritonserver_pid(srv.proc.pid)
        ended: list[str] = []

        def bystander() -> None:  # a long stream in flight when the server dies
            params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            inputs = request_inputs("x", params, stream=True)
            try:
                list(http_events(http, "quanta", inputs, stream=True, timeout=60))
                ended.append("completed")
            except GenerateError as exc:
                ended.append(f"error: {exc}")

        threads = [threading.Thread(target=bystander, daemon=True) for _ in range(4)]
        for thread in threads:
            thread.start()
        crashed_by = "the gRPC error mix"
        for _ in range(10):  # NOTE: a race in Triton: about 1 round in 4 aborts it here
            # NOTE: bounded: the same race can also leave Triton's stream open for good
            mix = threading.Thread(
                target=send_crash_mix, args=(f"127.0.0.1:{ports['grpc']}",), daemon=True
            )
            mix.start()
            mix.join(timeout=30)
            if mix.is_alive() or not _alive(first_pid):
                break
        if _alive(first_pid):  # NOTE: it did not abort; the restart path is tested all the same
            crashed_by = "SIGABRT"
            os.kill(first_pid, signal.SIGABRT)
        died = srv.wait_for_line("tritonserver died", timeout=30)
        assert re.search(r"signal 6 \(SIGABRT\)|exit code", died), (crashed_by, died)
        crashed_at = time.monotonic()
        srv.wait_for_line("ready again after restart 1", timeout=RECOVERY_S)
        assert time.monotonic() - crashed_at < RECOVERY_S
        for thread in threads:
            thread.join(timeout=30)
        assert len(ended) == len(threads), "a client in flight during the crash hung"
        assert tritonserver_pid(srv.proc.pid) != first_pid
        inputs = request_inputs("hi", GREEDY, stream=False)
        events = list(http_events(http, "quanta", inputs, stream=False))
        assert events[-1]["finish_reason"] == "length"
        assert completion(ports["openai"])  # the gateway reconnected by itself
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics").read()
        assert re.search(rb"quanta_server_restarts_total\{[^}]*\} 1\b", metrics)
        assert len(shared_memory(srv.proc.pid)) == 1  # the dead server's segment is gone
    finally:
        code = srv.stop()
    assert code == 0, "".join(srv.lines)
    assert shared_memory(srv.proc.pid) == []


def test_it_gives_up_after_max_restarts(model_dir, tmp_path):
    """--max-restarts N: N restarts in a row, then the next death ends `quanta serve`."""
    srv, _ = start(model_dir, tmp_path, "--max-restarts", "1", "--max-restart-delay", "0.5")
    try:
        os.kill(tritonserver_pid(srv.proc.pid), signal.SIGABRT)
        assert "restart 1 in" in srv.wait_for_line("tritonserver died", timeout=30)
        srv.wait_for_line("ready again after restart 1", timeout=RECOVERY_S)
        os.kill(tritonserver_pid(srv.proc.pid), signal.SIGABRT)
        line = srv.wait_for_line("tritonserver died", timeout=30)
        assert "(--max-restarts 1); giving up" in line
        assert srv.proc.wait(timeout=30) != 0
    finally:
        srv.stop()


KILLS = 7  # the old default gave up at the sixth death in a row


def test_it_never_gives_up_by_default(model_dir, tmp_path):
    """Killed more times in a row than any old limit, it comes back every time; while it is
    down the gateway answers 503 with Retry-After and fails readiness, and its /metrics
    counts the restarts and says the server is up again."""
    srv, ports = start(model_dir, tmp_path, "--max-restart-delay", "1")
    gateway = f"http://127.0.0.1:{ports['openai']}"
    try:
        for kill in range(1, KILLS + 1):
            pid = tritonserver_pid(srv.proc.pid)
            os.kill(pid, signal.SIGABRT)
            died = srv.wait_for_line("tritonserver died", timeout=30)
            assert f"restart {kill} in" in died and "giving up" not in died, died
            if kill == 1:
                _, headers, body = wait_for(
                    lambda: (answer := _completion_status(gateway))[0] == 503 and answer,
                    timeout=30,
                    what="a 503 from the gateway while Triton is down",
                    interval=0.02,
                )
                assert int(headers["Retry-After"]) >= 1
                assert body["error"]["code"] == "backend_unavailable"
                assert _status(f"{gateway}/health") == 503
            srv.wait_for_line(f"ready again after restart {kill}", timeout=RECOVERY_S)
            assert tritonserver_pid(srv.proc.pid) != pid
        assert srv.proc.poll() is None
        assert completion(ports["openai"])
        assert _status(f"{gateway}/health") == 200
        metrics = urllib.request.urlopen(f"{gateway}/metrics", timeout=10).read().decode()
        assert re.search(rf"quanta_supervisor_restarts_total\{{[^}}]*\}} {KILLS}\b", metrics)
        assert re.search(r'quanta_supervisor_state\{[^}]*state="up"\} 1', metrics)
        triton = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics").read()
        assert re.search(rb"quanta_server_restarts_total\{[^}]*\} %d\b" % KILLS, triton)
    finally:
        code = srv.stop()
    assert code == 0, "".join(srv.lines)


def _completion_status(gateway: str) -> tuple[int, Any, dict]:
    body = {"model": "quanta", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(
        f"{gateway}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
