"""The two servers of a comparison as subprocesses: vLLM's OpenAI server from its own virtual
environment and ``quanta serve --openai-port``, with the same limits; start, poll until
ready, stop (the whole process group), and the ports and environment they get.

Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from quanta_lab.bench.peer.config import SYSTEMS, PeerSetup


class Server:
    """A server subprocess in its own session, logging to a file, stopped by SIGINT."""

    name = "server"
    model = "model"

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    # The prefix cache's Prometheus counters (tokens) and the route that empties it.
    metrics_names: tuple[str, str] = ("", "")  # (queries, hits)

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def prefix_cache_counters(self) -> tuple[float, float] | None:
        """(queries, hits) so far, in tokens, from the server's metrics; None when it
        exports neither."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
                text = r.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return None
        found = [prometheus_total(text, name) for name in self.metrics_names]
        if any(v is None for v in found):
            return None
        queries, hits = found
        assert queries is not None and hits is not None
        return queries, hits

    def reset_prefix_cache(self) -> None:
        """Empty the server's prefix cache (vLLM's ``/reset_prefix_cache``)."""
        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.name}: /reset_prefix_cache answered {r.status}")

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("ab")
        self._proc = subprocess.Popen(
            self.command(),
            env=self.env(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/v1/models`` answers 200; raises with the log tail otherwise."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self._tail()}")

    def stop(self, timeout: float = 60.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGINT)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


class VllmServer(Server):
    """vLLM's OpenAI server (CPU build) on the checkpoint, one policy."""

    model = "opt-125m"
    metrics_names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")

    def __init__(self, setup: PeerSetup, policy: str, port: int, log: Path) -> None:
        super().__init__(port, log)
        self.setup, self.policy, self.name = setup, policy, f"vllm-{policy}"
        self.model = setup.model_dir.name

    def command(self) -> list[str]:
        s = self.setup
        return [
            str(s.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(s.model_dir.resolve()), "--served-model-name", self.model,
            "--tokenizer", str(s.model_dir.resolve()),
            "--dtype", s.dtype, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(s.max_model_len), "--enforce-eager",
            "--block-size", str(s.block_size),  # NOTE: its CPU default is 128, Quanta's 16
            "--kv-cache-memory-bytes", str(s.kv_cache_bytes),
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--scheduling-policy", self.policy, "--seed", str(s.seed),
            # as Quanta's (``QuantaServer.parameters``)
            "--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # NOTE: vLLM serves /reset_prefix_cache only in its development mode
        return {**super().env(), **vllm_env(self.setup.threads), "VLLM_SERVER_DEV_MODE": "1"}


class QuantaServer(Server):
    """``quanta serve`` (Triton + the OpenAI gateway) with a generated model repository."""

    model = "quanta"
    metrics_names = ("quanta_prefix_cache_queries_total", "quanta_prefix_cache_hits_total")

    def __init__(self, setup: PeerSetup, policy: str, port: int, log: Path) -> None:
        super().__init__(port, log)
        self.setup, self.policy, self.name = setup, policy, f"quanta-{policy}"
        self._repo = Path(tempfile.mkdtemp(prefix="quanta-peer-"))
        self.metrics_port = free_port()  # Triton's /metrics; the OpenAI port has none

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def parameters(self) -> dict[str, str]:
        s = self.setup
        per_block = kv_bytes_per_block(s.model_dir, s.block_size, DTYPE_BYTES[s.dtype])
        params = {
            "model_dir": str(s.model_dir.resolve()),
            "preset": "",
            "policy": self.policy,
            "torch_threads": str(s.threads),
            "dtype": s.dtype,
            "num_device_blocks": str(s.kv_cache_bytes // per_block),
            "num_host_blocks": str(s.kv_cache_bytes // per_block),
            "block_size": str(s.block_size),
            "max_num_seqs": str(s.max_num_seqs),
            "max_num_batched_tokens": str(s.max_num_batched_tokens),
            "enable_chunked_prefill": "true",
            # as vLLM's (``VllmServer.command``); each rate starts with an empty cache
            "enable_prefix_caching": str(s.prefix_caching).lower(),
        }
        if self.policy.startswith("sj-mlfq") and s.sj_profile is not None:
            params["policy_options"] = json.dumps({"profile": json.loads(s.sj_profile.read_text())})
        return params

    def command(self) -> list[str]:
        from quanta.frontends.triton.repository import write_model_repository

        write_model_repository(self._repo, overrides=self.parameters())
        return [
            sys.executable, "-m", "quanta.cli", "serve",
            "--model-repository", str(self._repo), "--host", "127.0.0.1",
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", str(self.metrics_port),
            "--openai-port", str(self.port), "--model-name", self.model,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": str(self.setup.threads)}

    def stop(self, timeout: float = 60.0) -> None:
        super().stop(timeout)
        shutil.rmtree(self._repo, ignore_errors=True)


def vllm_env(threads: int) -> dict[str, str]:
    """Torch threads without vLLM pinning them to cores (the machine is shared)."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def kv_bytes_per_block(model_dir: Path, block_size: int = 16, dtype_bytes: int = 4) -> int:
    """K and V of every layer for ``block_size`` tokens: what vLLM sizes its cache by, so
    both servers hold as many tokens in the same bytes (a grouped-query model keeps K and V
    for its KV heads only)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    width = kv_heads * head_dim if kv_heads and head_dim else cfg["hidden_size"]
    return 2 * cfg["num_hidden_layers"] * width * dtype_bytes * block_size


def prometheus_total(text: str, name: str) -> float | None:
    """The sum of ``name`` over its label sets in a Prometheus text exposition; None when
    no sample of it is there."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(None, 1)[1])
            seen = True
    return total if seen else None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_server(setup: PeerSetup, system: str) -> Server:
    kind, _, policy = system.partition("-")
    log = setup.out_dir / "logs" / f"{system}.log"
    if kind == "vllm":
        return VllmServer(setup, policy, free_port(), log)
    if kind == "quanta":
        return QuantaServer(setup, policy, free_port(), log)
    raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
