"""Helpers for tests that run servers: waiting, scraping ``/metrics``, commands under test, and
the suite's shared tritonserver.

``Background`` is a long-running command under test, started in its own process group, read
line by line and stopped with Ctrl-C (SIGINT) as a user would. ``start_serve`` runs
``quanta serve --openai-port`` for the tests whose subject is that command. ``SharedTriton``
is the one tritonserver the live tests share (``conftest.triton``): its repository holds every
model variant they need, and each OpenAI gateway it hands out runs on a thread in front of one
variant, as ``quanta serve --openai-port`` runs its own.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.05,
) -> T:
    """``predicate()``'s first truthy value, polled every ``interval`` s for ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)
    return value


def scrape(metrics_url: str, model: str | None = None) -> dict[str, float]:
    """``quanta_*`` samples on ``metrics_url``, keyed by name{labels} without the labels every
    series carries (model, version, instance); with ``model``, only that model's series."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if not line.startswith("quanta_"):
            continue
        if model is not None and f'model="{model}"' not in line:
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'(instance|model|version)="[^"]*",?', "", key).replace(",}", "}")
        samples[key.replace("{}", "")] = float(value)
    return samples


class OutputPump:
    """Reads a child's combined output in a thread as it comes. Why: a child whose pipe
    nobody reads blocks once it fills (64 KiB), so a server that logs after its ready line
    would freeze mid-test; and a ``readline`` on a silent child blocks past any deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []  # everything read so far
        self._new: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str | None:
        """The first line not yet waited past that starts with ``prefix``; None when the
        child ended or ``timeout`` s went by first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self._new.put(None)  # NOTE: a later wait sees the end too
                return None
            if line.startswith(prefix):
                return line
        return None

    def text(self, timeout: float = 10) -> str:
        """All the output; once the child has exited, up to its last line."""
        self._thread.join(timeout)
        return "".join(self.lines)


class Background:
    """``text`` run through bash (``exec``, so the signal reaches the command itself)."""

    def __init__(self, text: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.text = text
        self.proc = subprocess.Popen(
            ["bash", "-c", f"exec {text.rstrip(' &')}"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.output = OutputPump(self.proc.stdout)

    @property
    def lines(self) -> list[str]:
        return self.output.lines

    def wait_for_line(self, prefix: str, timeout: float = 300) -> str:
        line = self.output.wait_for(prefix, timeout)
        if line is None:
            raise AssertionError(f"{self.text}: no {prefix!r} line\n" + "".join(self.lines))
        return line

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.output.text()  # NOTE: the lines up to the exit, for the caller's message
        return self.proc.returncode


# -- the model settings the live tests serve -------------------------------------------------
# A small device pool (24 blocks of 16 tokens) on purpose: concurrent traffic preempts and a
# long request visibly holds blocks. Metrics every 50 ms, so a test sees them move quickly.
TEST_MODEL = {
    "num_device_blocks": "24",
    "num_host_blocks": "64",
    "max_num_batched_tokens": "256",
    "metrics_interval_ms": "50",
    "torch_threads": "1",
}


# -- quanta serve --openai-port, for the tests whose subject it is ---------------------------
@dataclass
class LiveServe:
    """A running ``quanta serve --openai-port`` and its endpoints."""

    proc: subprocess.Popen[str]
    http_url: str
    grpc_url: str
    metrics_url: str
    openai_url: str
    model_dir: Path
    output: OutputPump

    @property
    def lines(self) -> list[str]:
        return self.output.lines


def start_serve(
    root: Path,
    overrides: dict[str, str] | None = None,
    timeout: float = 180.0,
    model_dir: Path | None = None,
    args: tuple[str, ...] = (),
) -> LiveServe:
    """Start ``quanta serve`` with the gateway on free ports; return once it printed "ready".

    Without ``model_dir`` the backend's preset builds ``root/engines/opt-tiny`` at model load.
    ``args`` go to the command; with ``--replicas`` Triton's ports are left to each replica
    (0), and the URLs returned are the first replica's.
    """
    from quanta.frontends.triton.launcher import free_port
    from quanta.frontends.triton.repository import write_model_repository

    model_dir = model_dir or root / "engines" / "opt-tiny"
    repo = write_model_repository(
        root / "models", overrides={"model_dir": str(model_dir), **TEST_MODEL, **(overrides or {})}
    )
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--model-repository", str(repo)]
    replicated = "--replicas" in args
    for option in ("--http-port", "--grpc-port", "--metrics-port", "--openai-port"):
        cmd += [option, "0" if replicated and option != "--openai-port" else str(free_port())]
    cmd += list(args)
    cmd += ["--log-file", str(root / "tritonserver.log")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root
    )
    assert proc.stdout is not None
    output = OutputPump(proc.stdout)
    if output.wait_for("ready", timeout) is None:
        _stop(proc)
        raise RuntimeError("quanta serve did not become ready:\n" + output.text())
    urls: dict[str, str] = {}
    for line in output.lines:
        if m := re.match(r"(HTTP|gRPC|metrics|OpenAI)\s+(\S+)", line):
            urls.setdefault(m.group(1), m.group(2))
    return LiveServe(
        proc, urls["HTTP"], urls["gRPC"], urls["metrics"], urls["OpenAI"], model_dir, output
    )


def stop_serve(serve: LiveServe) -> tuple[int, str]:
    """Ctrl-C, as a user would; returns the exit code and the whole output."""
    return _stop(serve.proc), serve.output.text()


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


# -- the shared server -----------------------------------------------------------------------
def shared_models(checkpoint: Path) -> dict[str, dict[str, str]]:
    """The variants the shared server loads, by Triton model name: ``config.pbtxt``
    parameters over the backend's defaults, all serving ``checkpoint``."""
    served = {"model_dir": str(checkpoint), **TEST_MODEL}
    return {
        "quanta": served,
        # one request runs at a time, so a second one deterministically waits
        "quanta-one-seq": served | {"max_num_seqs": "1"},
        # one request per user per minute: the second is throttled
        "quanta-rpm": served | {"policy": "rpm", "policy_options": '{"rpm_limit": 1}'},
        # fair with one seat: the order alone decides who is served next (tenant attacks)
        "quanta-fair-one-seq": served | {"policy": "fair", "max_num_seqs": "1"},
        # room for 31 streams of 300 tokens, nothing swapped (cancellation under load)
        "quanta-roomy": {
            "model_dir": str(checkpoint),
            "num_device_blocks": "1024",
            "num_host_blocks": "0",
            "max_num_seqs": "64",
            "metrics_interval_ms": "50",
        },
        # speculative decoding by prompt lookup: outputs must equal the plain model's
        "quanta-spec": served
        | {
            "speculative_config": '{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 1, "prompt_lookup_max": 3}',
            "metrics_interval_ms": "50",
        },
    }


# What `quanta serve CHECKPOINT --served-model-name ensemble --io-layout tensorrt_llm
# --kv-cache-memory 8MiB --host-cache-memory 4MiB` serves (the entry is written by the same
# code). A small host tier: the default (2GiB) costs seconds to allocate and is never used.
TRTLLM_MODEL = "ensemble"
TRTLLM_FLAGS = {"io_layout": "tensorrt_llm", "kv_cache_memory": "8MiB", "host_cache_memory": "4MiB"}


def write_shared_repository(root: Path, checkpoint: Path) -> Path:
    """``root`` as a model repository holding every variant of the shared server."""
    from quanta.frontends.triton.model_entry import served_parameters, write_entry
    from quanta.frontends.triton.repository import write_model_repository

    for name, parameters in shared_models(checkpoint).items():
        write_model_repository(root, model_name=name, overrides=parameters)
    write_entry(root, TRTLLM_MODEL, checkpoint, served_parameters(**TRTLLM_FLAGS))
    return root


class SharedTriton:
    """One tritonserver for the whole session and OpenAI gateways in front of its models.

    The tests that use it run one after another, so a test sees only its own traffic; one
    that counts on ``/metrics`` reads its model's series (``scrape``), before and after.
    """

    def __init__(self, root: Path, checkpoint: Path) -> None:
        from quanta.frontends.triton.launcher import ServerOptions, TritonServer

        self.root = root
        self.model_dir = checkpoint
        repo = write_shared_repository(root / "models", checkpoint)
        self.server = TritonServer(
            ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=5),
            log_file=root / "tritonserver.log",
        )
        self._gateways: dict[tuple[str, str], Any] = {}

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    @property
    def options(self) -> Any:
        return self.server.options

    def start(self, timeout: float = 300.0) -> SharedTriton:
        self.server.start()
        self.server.wait_ready(timeout=timeout)
        return self

    def scrape(self, model: str = "quanta") -> dict[str, float]:
        return scrape(self.metrics_url, model)

    def openai_url(self, triton_model: str = "quanta", model_name: str | None = None) -> str:
        """The ``/v1`` URL of a gateway serving ``triton_model`` as ``model_name`` (default:
        the same), started on first use as ``quanta serve --openai-port`` starts its own."""
        from quanta.frontends.openai.server import start_gateway
        from quanta.frontends.triton.launcher import free_port

        name = model_name or triton_model
        key = (triton_model, name)
        if key not in self._gateways:
            state = self.root / "state" / f"{triton_model}-{name}"
            self._gateways[key] = start_gateway(
                self.grpc_url,
                host="127.0.0.1",
                port=free_port(),
                model_name=name,
                model_dir=self.model_dir,
                triton_model=triton_model,
                state_dir=state,
            )
        return f"{self._gateways[key].url}/v1"

    def state_dir(self, triton_model: str = "quanta", model_name: str | None = None) -> Path:
        """Where the gateway of ``openai_url(triton_model, model_name)`` keeps the Batch API."""
        return self.root / "state" / f"{triton_model}-{model_name or triton_model}"

    def stop(self) -> None:
        for gateway in self._gateways.values():
            gateway.stop()
        self._gateways.clear()
        self.server.stop()
