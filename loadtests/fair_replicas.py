"""Two live replicas behind one gateway, with a tenant pinned to one of them: per-replica
fairness counters against counters shared in Redis.

``quanta serve --replicas 2 --openai-port`` runs FairServe's ordering (``wsc``) on two
tritonservers behind the gateway's ``prefix-affinity`` router, with few seats per replica
(``--max-num-seqs``) so that requests queue. Two tenants keep ``--concurrency`` requests
each in flight for ``--duration`` seconds:

- ``wide``: every prompt different, so the router spreads them over both replicas;
- ``narrow``: every prompt opens with the same long system text, so the router keeps them
  all on one replica (as it keeps an application's calls where their prefix is cached).

With ``own`` counters each replica shares itself fairly between the tenants it sees, so
``wide`` gets half of ``narrow``'s replica and all of the other one. With ``shared``
counters (a Redis server started here, ``--state-url``) ``narrow``'s replica sees how much
``wide`` got elsewhere and serves ``narrow`` until the counters meet.

    python loadtests/fair_replicas.py --model-dir checkpoints/opt-125m --duration 60

Prints, per mode and tenant, the completions, the generated tokens and the mean latency;
``--output FILE`` writes them as JSON. Needs Debian's ``redis-server`` for the shared mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

BIN = Path(sys.executable).parent
SYSTEM = (
    "You are the support assistant of a large online shop. Answer politely, in one short "
    "paragraph, and never promise a refund before checking the order status with the "
    "customer. Keep every answer under fifty words and end it with a question. "
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cmd: list[str], ready: str, log: Path, timeout: float = 300.0) -> subprocess.Popen:
    """A process whose output (kept in ``log``) says ``ready`` within ``timeout``; it runs in
    ``log``'s folder (so ``quanta serve`` generates its own repository there)."""
    out = log.open("w")
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent
    )
    deadline = time.monotonic() + timeout
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"{cmd[0]} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _load(url: str, duration: float, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Both tenants' closed loops for ``duration`` seconds; what each got."""
    client = OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120)
    stats: dict[str, dict[str, float]] = {
        t: {"completions": 0, "tokens": 0, "latency_s": 0.0} for t in ("wide", "narrow")
    }
    lock = threading.Lock()
    end = time.monotonic() + duration

    def loop(tenant: str, worker: int) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            own = f"customer {worker}-{i} asks about order {worker * 1000 + i}."
            prompt = SYSTEM + own if tenant == "narrow" else own + " " + SYSTEM
            start = time.monotonic()
            answer = client.completions.create(
                model="quanta", prompt=prompt, max_tokens=max_tokens, user=tenant
            )
            done = time.monotonic()
            if done > end:  # NOTE: only what finished inside the window counts
                return
            with lock:
                s = stats[tenant]
                s["completions"] += 1
                s["tokens"] += answer.usage.completion_tokens if answer.usage else 0
                s["latency_s"] += done - start

    threads = [
        threading.Thread(target=loop, args=(tenant, w))
        for tenant in ("wide", "narrow")
        for w in range(concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stats.values():
        s["mean_latency_s"] = s.pop("latency_s") / max(1, s["completions"])
        s["tokens_per_s"] = s["tokens"] / duration
    return stats


def run(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    redis = None
    cmd = [str(BIN / "quanta"), "serve"]
    if args.model_dir is not None:
        cmd.append(str(args.model_dir.resolve()))
    port = _free_port()
    cmd += ["--replicas", "2", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    cmd += ["--openai-port", str(port), "--router", "prefix-affinity", "--policy", "wsc"]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--state-dir", str(work / mode)]
    # NOTE: two engines share the machine; no prefix cache, so both tenants' prompts cost
    # the same (the narrow tenant's shared opening would otherwise be computed once)
    cmd += ["--torch-threads", "1", "--no-enable-prefix-caching"]
    if mode == "shared":
        redis_port = _free_port()
        redis = _start(
            ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            "Ready to accept connections",
            work / "redis.log",
        )
        cmd += ["--state-url", f"redis://127.0.0.1:{redis_port}/0"]
    serve = _start(cmd, "ready; Ctrl-C stops the servers", work / f"serve-{mode}.log")
    try:
        return _load(f"http://127.0.0.1:{port}/v1", args.duration, args.concurrency, 32)
    finally:
        _stop(serve)
        if redis is not None:
            _stop(redis)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per mode")
    parser.add_argument("--concurrency", type=int, default=6, help="requests in flight per tenant")
    parser.add_argument("--max-num-seqs", type=int, default=2, help="seats per replica")
    parser.add_argument("--modes", default="own,shared", help="own, shared or both")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "shared" in modes and shutil.which("redis-server") is None:
        parser.error("the shared mode needs redis-server (Debian's package)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="quanta-fair-replicas-") as tmp:
        for mode in modes:
            results[mode] = run(mode, args, Path(tmp))
            for tenant, s in results[mode].items():
                print(
                    f"{mode:>6} {tenant:>6}: {s['completions']:5d} completions, "
                    f"{s['tokens']:6d} tokens ({s['tokens_per_s']:.1f}/s), "
                    f"mean latency {s['mean_latency_s']:.2f} s",
                    flush=True,
                )
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
