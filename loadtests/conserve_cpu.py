"""ConServe on the real CPU server: online traffic from Locust, an offline batch through the
official ``openai`` client's Batch API, then the same batch with the server killed mid-way.

For each policy it starts ``quanta serve`` (Triton, the quanta backend and the OpenAI gateway
with its Batch API state under a temporary ``--state-dir``) and runs three phases:

1. online alone: Locust users stream over Triton's HTTP ``generate_stream`` for ``--run-time``
   seconds; their P99 TTFT is the baseline;
2. online + batch: a batch of ``--batch-lines`` ``/v1/completions`` lines is submitted with
   ``client.files.create`` / ``client.batches.create`` as Locust starts again; the online P99
   TTFT beside the batch, and the batch's completion time (from submission; Locust stops
   after ``--run-time`` whether or not the batch is done);
3. restart: another batch; once a third of its lines are done, the whole ``quanta serve``
   process group is killed (SIGKILL: no drain) and started again on the same state directory;
   the batch must finish with every line answered exactly once.

    python loadtests/conserve_cpu.py --preset opt-125m --policies conserve,fcfs

Prints a table per policy; ``--output FILE`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from openai import OpenAI
from quanta.build.checkpoint import ensure_checkpoint

BIN = Path(sys.executable).parent
TEXT = (
    "the quick brown fox jumps over a lazy dog while scheduling tokens in batches of requests "
    "that arrive from many tenants with different service level objectives"
)
WORDS = TEXT.split(" ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``quanta serve`` process group on fixed free ports."""

    def __init__(self, model_dir: Path, policy: str, options: dict[str, Any], state: Path,
                 log: Path, extra: list[str]) -> None:  # fmt: skip
        self.ports = {k: _free_port() for k in ("http", "grpc", "metrics", "openai")}
        options_args = [a for k, v in options.items() for a in ("--policy-option", f"{k}={v}")]
        self.cmd = [
            str(BIN / "quanta"), "serve", str(model_dir), "--policy", policy, *options_args,
            "--http-port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
            "--metrics-port", str(self.ports["metrics"]),
            "--openai-port", str(self.ports["openai"]), "--state-dir", str(state), *extra,
        ]  # fmt: skip
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['openai']}/v1"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    def start(self, timeout: float = 600.0) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quanta serve exited {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.openai_url.removesuffix("/v1") + "/health"):
                    return  # 200: Triton has the model ready behind the gateway
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"quanta serve not ready in {timeout} s; see {self.log}")

    def counters(self) -> dict[str, float]:
        """ConServe's counters from the server's Prometheus endpoint (summed over labels)."""
        names = (
            "quanta_safepoint_aborts_total",
            "quanta_checkpoint_blocks_copied_total",
            "quanta_num_preemptions_total",
        )
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url) as r:
            text = r.read().decode()
        out = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def kill(self) -> None:
        """SIGKILL the whole group: Triton, its backend and the gateway die with no drain."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def batch_file(path: Path, lines: int, prompt_words: tuple[int, int], max_tokens: int,
               seed: int) -> Path:  # fmt: skip
    """A Batch API input file of ``/v1/completions`` lines: long-ish prompts, short outputs
    (summarisation-shaped, like ConServe's LongBench offline work)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(lines):
            words = [rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))]
            body = {
                "model": "quanta",
                "prompt": " ".join(words),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            f.write(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")  # fmt: skip
    return path


def submit(client: OpenAI, path: Path) -> str:
    with path.open("rb") as f:
        file = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    return batch.id


def wait_batch(client: OpenAI, batch_id: str, until_done: int | None = None,
               timeout: float = 3600.0) -> Any:  # fmt: skip
    """Poll until the batch ends (or has ``until_done`` lines done); retries while the gateway
    is down."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            b = client.batches.retrieve(batch_id)
        except Exception:  # the server is restarting
            time.sleep(1.0)
            continue
        done = b.request_counts.completed + b.request_counts.failed if b.request_counts else 0
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        if until_done is not None and done >= until_done:
            return b
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} did not finish in {timeout} s")


def exactly_once(client: OpenAI, batch: Any, lines: int) -> dict[str, int]:
    """Count the output and error files' lines by custom_id: each input line exactly once."""
    seen: Counter[str] = Counter()
    errors = 0
    for file_id, is_error in ((batch.output_file_id, False), (batch.error_file_id, True)):
        if not file_id:
            continue
        for row in client.files.content(file_id).text.splitlines():
            if row.strip():
                seen[json.loads(row)["custom_id"]] += 1
                errors += is_error
    twice = sum(1 for n in seen.values() if n > 1)
    missing = sum(1 for i in range(lines) if f"line-{i}" not in seen)
    return {"answered": len(seen), "twice": twice, "missing": missing, "errors": errors}


def locust(server: Server, out: Path, users: int, run_time: int, seed: int) -> dict[str, float]:
    """Locust's online users for ``run_time`` s: requests finished, TTFT and TPOT percentiles
    (ms) from the stats CSV."""
    subprocess.run(
        [
            str(BIN / "locust"), "-f", str(Path(__file__).with_name("locustfile.py")),
            "--headless", "-u", str(users), "-r", str(users), "--run-time", f"{run_time}s",
            "-H", server.http_url, "--csv", str(out), "--workload-seed", str(seed),
            "--prompt-words", "8,48", "--output-tokens", "16,48", "--only-summary",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    rows = {
        row["Name"]: row
        for row in csv.DictReader(io.StringIO(Path(f"{out}_stats.csv").read_text()))
    }
    if "time_to_first_token" not in rows:
        raise RuntimeError(f"no time_to_first_token row in {out}_stats.csv")
    ttft, tpot = rows["time_to_first_token"], rows.get("time_per_output_token")
    return {
        "requests": float(ttft["Request Count"]),
        "p50_ttft_ms": float(ttft["50%"]),
        "p99_ttft_ms": float(ttft["99%"]),
        "p99_tpot_ms": float(tpot["99%"]) if tpot else float("nan"),
    }


def run_policy(args: argparse.Namespace, model_dir: Path, root: Path, policy: str,
               options: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    tag = policy.replace("+", "_")
    state = root / f"state-{tag}"
    extra = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    server = Server(model_dir, policy, options, state, root / f"{tag}.log", extra)
    result: dict[str, Any] = {"policy": policy, "options": options}
    server.start()
    try:
        client = OpenAI(base_url=server.openai_url, api_key="unused", max_retries=5)
        result["online_alone"] = locust(server, root / f"{tag}-a", args.users, args.run_time, 0)
        path = batch_file(root / "batch.jsonl", args.batch_lines, (64, 192), 16, args.seed)
        started = time.monotonic()
        batch_id = submit(client, path)
        with ThreadPoolExecutor(1) as pool:  # Locust runs while the batch is polled
            online = pool.submit(locust, server, root / f"{tag}-b", args.users, args.run_time, 0)
            batch = wait_batch(client, batch_id)
            result["batch_seconds"] = time.monotonic() - started
            result["online_with_batch"] = online.result()
        result["counters"] = server.counters()
        result["batch"] = exactly_once(client, batch, args.batch_lines)
        # -- the same batch again, the server killed once a third is done --------------------
        started = time.monotonic()
        batch_id = submit(client, path)
        wait_batch(client, batch_id, until_done=args.batch_lines // 3)
        server.kill()
        server.start()
        client = OpenAI(base_url=server.openai_url, api_key="unused", max_retries=5)
        batch = wait_batch(client, batch_id)
        result["restart_batch_seconds"] = time.monotonic() - started
        result["restart_batch"] = exactly_once(client, batch, args.batch_lines)
        result["restart_status"] = batch.status
    finally:
        server.stop()
    return result


def _online(m: dict[str, float]) -> str:
    return f"{m['requests']:.0f}, {m['p99_ttft_ms']:.0f} ms, {m['p99_tpot_ms']:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="opt-tiny", help="random-weight preset to build")
    parser.add_argument("--model-dir", type=Path, help="serve this checkpoint instead")
    parser.add_argument("--policies", default="conserve,fcfs")
    parser.add_argument("--batch-lines", type=int, default=300)
    parser.add_argument("--users", type=int, default=4, help="Locust online users")
    parser.add_argument("--run-time", type=int, default=60, help="seconds of online load")
    parser.add_argument("--kv-cache-memory", default="", help="device KV pool, e.g. 64MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quanta-conserve-") as tmp:
        root = Path(tmp)
        model_dir = args.model_dir or ensure_checkpoint(args.preset, root / args.preset)
        profile = root / "profile.json"
        subprocess.run(
            [str(BIN / "quanta"), "profile", "--model", str(model_dir), "--output", str(profile),
             "--calibration-seconds", "0", "--repeats", "1"],
            check=True,
        )  # fmt: skip
        results = []
        for policy in args.policies.split(","):
            options = {"profile": str(profile)} if policy.endswith("conserve") else {}
            results.append(run_policy(args, model_dir, root, policy, options))
    print(
        f"\n{args.users} online Locust users for {args.run_time} s; a batch of "
        f"{args.batch_lines} lines (64-192 words, 16 tokens)"
    )
    print(
        "| policy | online requests, P99 TTFT, P99 TPOT: alone | with the batch | batch time "
        "| killed mid-batch: answered / twice / missing |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        a, b, k = r["online_alone"], r["online_with_batch"], r["restart_batch"]
        print(
            f"| {r['policy']} | {_online(a)} | {_online(b)} | {r['batch_seconds']:.0f} s "
            f"| {k['answered']} / {k['twice']} / {k['missing']} "
            f"({r['restart_batch_seconds']:.0f} s) |"
        )
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
