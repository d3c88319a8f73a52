"""A soak: a steady mix of ordinary requests against a running ``quanta serve`` for minutes,
with the serving processes' memory recorded as it goes.

Why: leaks, slow growth and the rare hang show only over time. Workers (``--concurrency``)
send streaming and non-streaming chat and completion requests through the OpenAI gateway
(and, with ``--grpc-url``, streaming requests straight to Triton over gRPC), one after
another, for ``--duration``. Every ``--interval`` seconds a row is printed and kept: the
requests that finished in that window (ok, failed, hung), their p50/p99 latency, and the RSS
of tritonserver, its Python backend stub(s) and the gateway's process, found from ``quanta
serve``'s process tree (psutil when it is installed, else /proc). At the end it says whether
RSS grew (the mean of the last quarter of the samples against the first quarter) and exits
non-zero on any hang, loudly.

    python bench/trust/soak.py --gateway-url http://127.0.0.1:9000 --grpc-url 127.0.0.1:8001 \\
        --duration 10m --concurrency 8 --out out/soak

Only the standard library, aiohttp, numpy and tritonclient are used; Quanta is not imported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import queue
import random
import re
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

KINDS = ("completion", "completion-stream", "chat", "chat-stream", "grpc-stream")
ROLES = ("tritonserver", "stub", "gateway")
PROMPTS = (
    "Tell me about the sea",
    "Write a haiku about autumn leaves",
    "What is the capital of France?",
    "List three prime numbers and explain why they are prime",
    "Summarize the plot of a story about a lighthouse keeper",
    "Translate 'good morning' into Spanish, French and German",
    "Explain what a hash table is to a ten year old",
    "Give me a recipe for pancakes",
)


# -- durations ---------------------------------------------------------------------------------
def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90s``, ``3m``, ``1h``; a bare number is minutes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90s, 3m, 1h, or minutes)")
    value, unit = float(match.group(1)), match.group(2) or "m"
    return value * {"s": 1, "m": 60, "h": 3600}[unit]


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LOW:HIGH with 1 <= LOW <= HIGH")
    return lo, hi


# -- the serving processes ---------------------------------------------------------------------
try:
    import psutil
except ImportError:  # NOTE: /proc gives the same on Linux
    psutil = None


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def parent(pid: int) -> int | None:
    if psutil is not None:
        try:
            return psutil.Process(pid).ppid()
        except psutil.Error:
            return None
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 else None


def descendants(pid: int) -> list[int]:
    if psutil is not None:
        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    children: dict[int, list[int]] = {}
    for p in _pids():
        ppid = parent(p)
        if ppid is not None:
            children.setdefault(ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def name_of(pid: int) -> str:
    """The executable's name and command line, for telling the roles apart."""
    if psutil is not None:
        try:
            proc = psutil.Process(pid)
            return f"{proc.name()} {' '.join(proc.cmdline())}"
        except psutil.Error:
            return ""
    comm = _read(f"/proc/{pid}/comm").strip()
    return f"{comm} {_read(f'/proc/{pid}/cmdline').replace(chr(0), ' ')}"


def rss_of(pid: int) -> int | None:
    """Resident set size in bytes; None once the process is gone."""
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None
    match = re.search(r"VmRSS:\s+(\d+) kB", _read(f"/proc/{pid}/status"))
    return int(match.group(1)) * 1024 if match else None


def listener(port: int) -> int | None:
    """The process listening on TCP ``port`` (one of this user's)."""
    if psutil is not None:
        for proc in psutil.process_iter():
            try:
                for conn in proc.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                        return proc.pid
            except psutil.Error:
                continue
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for pid in _pids():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
        except OSError:
            continue
    return None


@dataclass
class Processes:
    """The processes of one ``quanta serve``: its root and the gateway's listener."""

    root: int
    gateway: int

    @classmethod
    def find(cls, serve_pid: int | None, gateway_port: int) -> Processes | None:
        gateway = listener(gateway_port)
        if serve_pid is None:
            if gateway is None:
                return None
            serve_pid = gateway
            for _ in range(3):  # NOTE: the gateway may be a child of quanta serve
                if any("tritonserver" in name_of(p).split(" ")[0] for p in descendants(serve_pid)):
                    break
                up = parent(serve_pid)
                if up is None or up <= 1:
                    serve_pid = gateway
                    break
                serve_pid = up
        return cls(serve_pid, gateway if gateway is not None else serve_pid)

    def sample(self) -> dict[str, dict[str, Any]]:
        """Role -> {"pids": [...], "rss": bytes}; the stubs' RSS is their sum."""
        roles: dict[str, dict[str, Any]] = {r: {"pids": [], "rss": 0} for r in ROLES}
        for pid in [self.root, *descendants(self.root)]:
            name = name_of(pid)
            exe = name.split(" ", 1)[0]
            if exe == "tritonserver":
                role = "tritonserver"
            elif exe.startswith("triton_python_b") or "triton_python_backend_stub" in name:
                role = "stub"
            elif pid == self.gateway:
                role = "gateway"
            else:
                continue
            if (rss := rss_of(pid)) is not None:
                roles[role]["pids"].append(pid)
                roles[role]["rss"] += rss
        if not roles["gateway"]["pids"] and (rss := rss_of(self.gateway)) is not None:
            roles["gateway"] = {"pids": [self.gateway], "rss": rss}
        return roles


# -- requests --------------------------------------------------------------------------------
@dataclass
class Record:
    kind: str
    started: float  # monotonic
    done: float
    ok: bool
    hang: bool = False
    error: str = ""


@dataclass
class Soak:
    gateway: str  # base URL, no /v1
    grpc: str | None
    api_key: str | None
    model: str
    triton_model: str
    max_tokens: tuple[int, int]
    timeout: float
    grpc_share: float
    records: list[Record] = field(default_factory=list)
    in_flight: int = 0

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def pick(self, rng: random.Random) -> str:
        if self.grpc and rng.random() < self.grpc_share:
            return "grpc-stream"
        return rng.choice(KINDS[:4])


async def gateway_request(
    s: Soak, session: aiohttp.ClientSession, kind: str, rng: random.Random
) -> str | None:
    """One request through the gateway; None when it succeeded, else what went wrong."""
    prompt = f"{rng.choice(PROMPTS)} (#{rng.randrange(10_000)})"
    stream = kind.endswith("-stream")
    body: dict[str, Any] = {
        "model": s.model,
        "max_tokens": rng.randint(*s.max_tokens),
        "temperature": rng.choice((0.0, 0.7, 1.0)),
        "stream": stream,
        "seed": rng.randrange(1 << 30),
    }
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    async with session.post(f"{s.gateway}{path}", json=body, headers=s.headers()) as resp:
        text = (await resp.read()).decode(errors="replace")
    if resp.status != 200:
        return f"{resp.status}: {text[:200]}"
    if not stream:
        return None if '"choices"' in text else f"no choices: {text[:200]}"
    for line in text.splitlines():
        if line.startswith("data:") and '"error"' in line:
            return f"in stream: {line[5:205]}"
    return None if "data: [DONE]" in text else f"stream ended without [DONE]: {text[-200:]}"


def grpc_request(s: Soak, max_tokens: int, prompt: str) -> str | None:
    """One streamed request to Triton over gRPC; runs on a thread of its own."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(s.grpc)
    final = False
    try:
        tensors = []
        for name, array, dtype in (
            ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
            ("stream", np.array([True]), "BOOL"),
        ):
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(
            s.triton_model, tensors, request_id=uuid.uuid4().hex, enable_empty_final_response=True
        )
        deadline = time.monotonic() + s.timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                result, error = answers.get(timeout=left)
            except queue.Empty:
                break
            if error is not None:
                final = True
                return f"grpc: {error}"[:250]
            params = result.get_response().parameters
            if "triton_final_response" not in params or params["triton_final_response"].bool_param:
                final = True
                return None
        return "hang"
    except InferenceServerException as exc:
        return f"grpc: {exc}"[:250]
    finally:
        with contextlib.suppress(Exception):  # NOTE: a server gone mid-call
            client.stop_stream(cancel_requests=not final)
            client.close()


def in_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on a daemon thread, so a stuck call never blocks the exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=target, daemon=True).start()
    return future


async def worker(s: Soak, session: aiohttp.ClientSession, seed: int, until: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        kind = s.pick(rng)
        started = time.monotonic()
        s.in_flight += 1
        try:
            if kind == "grpc-stream":
                prompt = f"{rng.choice(PROMPTS)} (#{rng.randrange(10_000)})"
                call = in_thread(grpc_request, s, rng.randint(*s.max_tokens), prompt)
                error = await asyncio.wait_for(call, timeout=s.timeout + 5)
            else:
                error = await asyncio.wait_for(
                    gateway_request(s, session, kind, rng), timeout=s.timeout
                )
        except TimeoutError:
            error = "hang"
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:250]
        finally:
            s.in_flight -= 1
        hang = error == "hang"
        if hang:
            print(f"!!! HANG: a {kind} request got no answer in {s.timeout:.0f}s", flush=True)
        record = Record(kind, started, time.monotonic(), error is None, hang, error or "")
        s.records.append(record)
        if error and not hang:
            await asyncio.sleep(0.5)  # NOTE: a server that is down is not hammered


# -- windows ------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.array(values), q))


@dataclass
class Window:
    t_s: float  # seconds since the start, at the window's end
    ok: int
    failed: int
    hang: int
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    in_flight: int
    rss_mb: dict[str, float | None]
    pids: dict[str, list[int]]


def window(s: Soak, start: float, begin: float, end: float, sample: dict[str, Any]) -> Window:
    mine = [r for r in s.records if begin <= r.done < end]
    ok = [r for r in mine if r.ok]
    latencies = [(r.done - r.started) * 1000 for r in ok]
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    return Window(
        t_s=round(end - start, 1),
        ok=len(ok),
        failed=sum(not r.ok and not r.hang for r in mine),
        hang=sum(r.hang for r in mine),
        rps=round(len(mine) / max(end - begin, 1e-9), 2),
        p50_ms=None if p50 is None else round(p50, 1),
        p99_ms=None if p99 is None else round(p99, 1),
        in_flight=s.in_flight,
        rss_mb={r: _mb(sample, r) for r in ROLES},
        pids={r: sample[r]["pids"] if sample else [] for r in ROLES},
    )


def _mb(sample: dict[str, Any], role: str) -> float | None:
    if not sample or not sample[role]["pids"]:
        return None
    return round(sample[role]["rss"] / (1 << 20), 1)


HEADER = (
    f"{'t_s':>7} {'ok':>6} {'failed':>6} {'hang':>5} {'req/s':>6} {'p50_ms':>8} {'p99_ms':>8} "
    f"{'triton_MB':>10} {'stub_MB':>8} {'gateway_MB':>11}"
)


def row(w: Window) -> str:
    def num(value: float | None, width: int) -> str:
        return ("-" if value is None else f"{value:g}").rjust(width)

    return (
        f"{w.t_s:>7g} {w.ok:>6} {w.failed:>6} {w.hang:>5} {w.rps:>6g} {num(w.p50_ms, 8)} "
        f"{num(w.p99_ms, 8)} {num(w.rss_mb['tritonserver'], 10)} {num(w.rss_mb['stub'], 8)} "
        f"{num(w.rss_mb['gateway'], 11)}"
    )


def growth(
    samples: list[tuple[float, dict[str, Any]]], min_mb: float, min_frac: float
) -> dict[str, Any]:
    """Per role: the mean RSS of the first and the last quarter of the samples, whether it
    grew by more than both ``min_mb`` and ``min_frac``, and the slope over the last half (MB
    per minute). A role whose processes changed (a restart) is compared over the samples of
    its last processes only."""
    verdict: dict[str, Any] = {}
    for role in ROLES:
        series = [(t, smp[role]) for t, smp in samples if smp and smp[role]["pids"]]
        if series:
            last_pids = series[-1][1]["pids"]
            series = [(t, v) for t, v in series if v["pids"] == last_pids]
        if len(series) < 2:
            verdict[role] = {"samples": len(series), "grew": None}
            continue
        quarter = max(1, len(series) // 4)
        first = sum(v["rss"] for _, v in series[:quarter]) / quarter / (1 << 20)
        last = sum(v["rss"] for _, v in series[-quarter:]) / quarter / (1 << 20)
        delta = last - first
        half = series[len(series) // 2 :]
        times = np.array([t for t, _ in half]) / 60
        sizes = np.array([v["rss"] for _, v in half]) / (1 << 20)
        slope = float(np.polyfit(times, sizes, 1)[0]) if len(half) > 1 and np.ptp(times) else 0.0
        verdict[role] = {
            "samples": len(series),
            "first_quarter_mb": round(first, 1),
            "last_quarter_mb": round(last, 1),
            "delta_mb": round(delta, 1),
            "delta_pct": round(100 * delta / first, 2) if first else None,
            "grew": bool(delta > min_mb and delta > min_frac * first),
            # a leak keeps its slope to the end; a pool touched lazily levels off
            "last_half_mb_per_min": round(slope, 2),
        }
    return verdict


# -- main -------------------------------------------------------------------------------------
async def discover_model(s: Soak, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{s.gateway}/v1/models", headers=s.headers()) as resp:
        if resp.status != 200:
            raise SystemExit(f"GET {s.gateway}/v1/models: {resp.status} (--api-key?)")
        s.model = s.model or (await resp.json())["data"][0]["id"]


async def main_async(args: argparse.Namespace) -> int:
    gateway = args.gateway_url.rstrip("/").removesuffix("/v1")
    if "://" not in gateway:
        gateway = f"http://{gateway}"
    grpc = args.grpc_url.split("://", 1)[-1].rstrip("/") if args.grpc_url else None
    s = Soak(
        gateway=gateway,
        grpc=grpc,
        api_key=args.api_key,
        model=args.model or "",
        triton_model=args.triton_model,
        max_tokens=args.max_tokens,
        timeout=args.request_timeout,
        grpc_share=args.grpc_share if grpc else 0.0,
    )
    port = aiohttp.client.URL(gateway).port or 80
    procs = Processes.find(args.serve_pid, port)
    if procs is None:
        print(f"warning: no process listens on port {port}: RSS is not recorded", file=sys.stderr)
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
    ) as session:
        await discover_model(s, session)
        start = time.monotonic()
        until = start + args.duration
        kinds = ", ".join(k for k in KINDS if k != "grpc-stream" or s.grpc)
        print(
            f"soak: {args.duration:g}s, {args.concurrency} workers, model {s.model!r}, {kinds}; "
            f"processes: {procs}",
            flush=True,
        )
        print(HEADER, flush=True)
        workers = [
            asyncio.create_task(worker(s, session, args.seed * 1000 + i, until))
            for i in range(args.concurrency)
        ]
        samples: list[tuple[float, dict[str, Any]]] = []
        windows: list[Window] = []
        begin = start
        next_sample = start
        every = min(args.sample_interval, args.interval)
        while True:
            done = all(w.done() for w in workers)
            now = time.monotonic()
            if now >= next_sample or done:
                samples.append((now - start, procs.sample() if procs else {}))
                next_sample = now + every
            if now - begin >= args.interval or done:
                windows.append(window(s, start, begin, now, samples[-1][1]))
                print(row(windows[-1]), flush=True)
                begin = now
            if done:
                break
            await asyncio.sleep(min(0.25, max(0.0, min(next_sample, begin + args.interval) - now)))
        for w in workers:
            w.result()  # NOTE: a bug in the soak itself surfaces here, not as silence
    ok = [r for r in s.records if r.ok]
    latencies = [(r.done - r.started) * 1000 for r in ok]
    hangs = [r for r in s.records if r.hang]
    failed = [r for r in s.records if not r.ok and not r.hang]
    rss = growth(samples, args.rss_growth_mb, args.rss_growth)
    restarts = len({tuple(smp["tritonserver"]["pids"]) for _, smp in samples if smp}) - 1
    summary = {
        "requests": len(s.records),
        "ok": len(ok),
        "failed": len(failed),
        "hangs": len(hangs),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "by_kind": {k: sum(r.kind == k for r in s.records) for k in KINDS},
        "tritonserver_restarts_seen": max(restarts, 0),
        "rss": rss,
        "errors": sorted({r.error for r in failed})[:20],
    }
    print(
        f"\n{len(s.records)} requests: {len(ok)} ok, {len(failed)} failed, {len(hangs)} hung; "
        f"p50 {_fmt(summary['p50_ms'])} ms, p99 {_fmt(summary['p99_ms'])} ms"
    )
    for role, v in rss.items():
        if v["grew"] is None:
            print(f"RSS {role:<12} not enough samples ({v['samples']})")
        else:
            print(
                f"RSS {role:<12} {v['first_quarter_mb']:.1f} MB -> {v['last_quarter_mb']:.1f} MB "
                f"({v['delta_mb']:+.1f} MB, {v['delta_pct']:+.2f}%; last half "
                f"{v['last_half_mb_per_min']:+.1f} MB/min): " + ("GREW" if v["grew"] else "steady")
            )
    for error in summary["errors"][:5]:
        print(f"failure: {error}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "options": {
                "duration_s": args.duration,
                "interval_s": args.interval,
                "concurrency": args.concurrency,
                "max_tokens": list(args.max_tokens),
                "grpc_share": s.grpc_share,
                "gateway": s.gateway,
                "grpc": s.grpc,
                "model": s.model,
            },
            "processes": asdict(procs) if procs else None,
            "summary": summary,
            "windows": [asdict(w) for w in windows],
            "rss_samples": [
                {"t_s": round(t, 1), **{r: _mb(smp, r) for r in ROLES}} for t, smp in samples
            ],
        }
        (out / "soak.json").write_text(json.dumps(report, indent=1))
        with open(out / "soak.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(
                ["t_s", "ok", "failed", "hang", "rps", "p50_ms", "p99_ms", "in_flight"]
                + [f"{r}_rss_mb" for r in ROLES]
            )
            for w in windows:
                writer.writerow(
                    [w.t_s, w.ok, w.failed, w.hang, w.rps, w.p50_ms, w.p99_ms, w.in_flight]
                    + [w.rss_mb[r] for r in ROLES]
                )
        print(f"wrote {out / 'soak.json'} and {out / 'soak.csv'}")
    if hangs:
        print(f"\n!!! FAILED: {len(hangs)} request(s) hung (no answer in {s.timeout:.0f}s)")
        return 1
    if len(failed) > args.max_failed:
        print(f"\nFAILED: {len(failed)} request(s) failed (--max-failed {args.max_failed})")
        return 2
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Soak a running quanta serve with a steady request mix; record latency "
        "and the serving processes' RSS over time.",
    )
    p.add_argument("--gateway-url", required=True, help="the OpenAI gateway, e.g. "
                   "http://127.0.0.1:9000")
    p.add_argument("--grpc-url", help="also send streamed requests to Triton's gRPC port")
    p.add_argument("--api-key", help="sent as Authorization: Bearer")
    p.add_argument("--model", help="the gateway's model name (default: the first of /v1/models)")
    p.add_argument("--triton-model", default="quanta", help="Triton's model name (gRPC)")
    p.add_argument("--duration", type=parse_duration, default=parse_duration("10m"),
                   help="how long to send requests: 90s, 3m, 1h (a bare number is minutes)")
    p.add_argument("--interval", type=float, default=30.0,
                   help="seconds per reported window")
    p.add_argument("--sample-interval", type=float, default=5.0,
                   help="seconds between RSS samples (at most --interval)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--grpc-share", type=float, default=0.2,
                   help="the share of requests sent over gRPC (with --grpc-url)")
    p.add_argument("--max-tokens", type=parse_range, default=(8, 32),
                   help="LOW:HIGH tokens per answer, drawn uniformly")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds a request may take before it counts as a hang")
    p.add_argument("--serve-pid", type=int,
                   help="quanta serve's PID (default: found from the gateway's port)")
    p.add_argument("--rss-growth-mb", type=float, default=20.0,
                   help="RSS grew: by more than this many MB ...")
    p.add_argument("--rss-growth", type=float, default=0.05,
                   help="... and by more than this fraction")
    p.add_argument("--max-failed", type=int, default=0,
                   help="exit 2 when more requests than this failed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for soak.json and soak.csv")
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
