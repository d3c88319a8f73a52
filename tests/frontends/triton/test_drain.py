"""Ctrl-C under load: ``quanta serve`` refuses new requests (503 naming the shutdown), lets
the in-flight streams finish within ``--drain-timeout``, ends the rest with an error event
rather than cutting them, and exits 0 with no Triton crash, orphan or shared memory left."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from quanta import SamplingParams
from quanta.frontends.triton.client import (
    GenerateError,
    http_events,
    output_ids,
    request_inputs,
)
from quanta.frontends.triton.launcher import free_port
from serving import Background

pytestmark = pytest.mark.live

STREAMS = 20


@pytest.fixture(scope="module")
def model_dir(opt_tiny) -> Path:
    return opt_tiny


def serve(model_dir: Path, tmp_path: Path, drain_timeout: float) -> tuple[Background, str]:
    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    cmd = [sys.executable, "-m", "quanta.cli", "serve", str(model_dir)]
    cmd += ["--drain-timeout", str(drain_timeout), "--log-file", str(tmp_path / "triton.log")]
    cmd += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    srv = Background(shlex.join(cmd), tmp_path, {**os.environ, "PYTHONUNBUFFERED": "1"})
    srv.wait_for_line("ready", timeout=180)
    return srv, f"http://127.0.0.1:{ports['http']}"


def load(url: str, max_tokens: int) -> tuple[list[threading.Thread], list, threading.Event]:
    """``STREAMS`` concurrent streams; ``started`` is set once every one has a token."""
    results: list = []
    started = threading.Event()
    firsts = threading.Semaphore(0)

    def one() -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        events = []
        try:
            for event in http_events(
                url, "quanta", request_inputs("x", params, stream=True), stream=True, timeout=120
            ):
                if not events:
                    firsts.release()
                events.append(event)
            results.append(("done", sum(len(output_ids(e)) for e in events), events[-1]))
        except GenerateError as exc:
            results.append(("error", str(exc), None))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(STREAMS)]
    for t in threads:
        t.start()

    def wait_first_tokens() -> None:
        for _ in range(STREAMS):
            firsts.acquire(timeout=60)
        started.set()

    threading.Thread(target=wait_first_tokens, daemon=True).start()
    return threads, results, started


def finish(srv: Background, tmp_path: Path) -> str:
    """After the one Ctrl-C the test sent: ``quanta serve`` must end by itself, cleanly."""
    try:
        code = srv.proc.wait(timeout=120)
    finally:
        srv.stop()
    assert code == 0, "".join(srv.lines)
    log = (tmp_path / "triton.log").read_text()
    assert "Signal (11)" not in log and "Signal (6)" not in log
    assert not list(Path("/dev/shm").glob(f"quanta{srv.proc.pid}_*"))
    return log


def test_in_flight_streams_finish_and_new_requests_are_refused(model_dir, tmp_path):
    srv, url = serve(model_dir, tmp_path, drain_timeout=120)
    try:
        threads, results, started = load(url, max_tokens=200)
        assert started.wait(60), "the streams never started"
        os.killpg(srv.proc.pid, signal.SIGINT)
        srv.wait_for_line("draining:", timeout=30)
        late = request_inputs("hi", SamplingParams(max_tokens=4), stream=False)
        # NOTE: Triton's generate endpoint answers every backend error with HTTP 400; the
        # tag carries the kind (the OpenAI gateway turns it into a 503).
        with pytest.raises(GenerateError, match=r"\[shutting_down\] the server is shutting"):
            list(http_events(url, "quanta", late, stream=False))
        for t in threads:
            t.join(timeout=120)
        srv.wait_for_line("drained", timeout=60)
    finally:
        finish(srv, tmp_path)
    assert len(results) == STREAMS
    assert all(kind == "done" and n == 200 for kind, n, _ in results), results
    assert all(last["finish_reason"] == "length" for _, _, last in results)


def test_streams_past_the_drain_timeout_end_with_an_error_event(model_dir, tmp_path):
    srv, url = serve(model_dir, tmp_path, drain_timeout=0.5)
    try:
        threads, results, started = load(url, max_tokens=500)
        assert started.wait(60), "the streams never started"
        os.killpg(srv.proc.pid, signal.SIGINT)
        for t in threads:
            t.join(timeout=120)
    finally:
        finish(srv, tmp_path)
    assert len(results) == STREAMS, "a stream was cut without an end"
    errors = [detail for kind, detail, _ in results if kind == "error"]
    assert errors, "every stream finished within 0.5 s: the timeout was never exercised"
    assert all(re.search(r"shut down before this request finished", e) for e in errors), errors


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc, Linux only)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_a_killed_serve_takes_its_tritonserver_with_it(model_dir, tmp_path):
    """SIGKILL gives ``quanta serve`` no chance to stop Triton (its own session): the server
    must still go, or it holds the ports the next ``quanta serve`` needs."""
    srv, _ = serve(model_dir, tmp_path, drain_timeout=1)
    triton = _children(srv.proc.pid)
    try:
        assert triton, "quanta serve started no process"
        srv.proc.kill()
        srv.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in triton) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in triton), "tritonserver outlived quanta serve"
    finally:
        srv.stop()
        for pid in triton:  # NOTE: never leave an orphan holding ports to the next test
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)
