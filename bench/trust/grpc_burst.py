"""A burst of gRPC streaming requests, bad ones mixed with valid ones, against a Triton port.

Why: tritonserver 2.51 aborts (``proto_buffer_writer.h:65`` assertion, signal 6) on some
mixes of gRPC stream errors from clients: requests naming an input the model does not have,
requests for a model that does not exist, and valid requests, back to back on one stream.
Triton answers these itself, before any backend sees them, so the question this script
answers is whether the service as deployed stays up (``quanta serve`` restarts its Triton)
and how much of the traffic is lost while it does.

Each of ``--concurrency`` threads opens a stream, sends ``--per-stream`` requests drawn from
``--kinds`` back to back, waits for each one's answer, closes the stream and starts over, until
``--duration`` seconds passed. A separate thread asks the server whether the model is ready every
``--probe-interval`` seconds and counts the times it went down and came back.

    python bench/trust/grpc_burst.py --url 127.0.0.1:8001 --duration 600 --concurrency 8 \\
        --metrics-url http://127.0.0.1:9000/metrics

prints one JSON object: requests sent, answered (a final response), refused (Triton's error
answer, as every bad request should get), lost (no answer: in flight when the server died),
unreachable (sent while it was away, on a stream that never answered), the deaths and
recoveries the probe saw with the longest outage, and, with ``--metrics-url`` (the gateway's
``/metrics`` of ``quanta serve --openai-port``, or Triton's), the restart counters before and
after. Exit status 0 when the server serves the model at the end, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

KINDS = ("valid", "bad-input", "unknown-model")
# errors that end the stream (the server went away), not answers to one request
_BROKEN = re.compile(r"Stream removed|Socket closed|UNAVAILABLE|Connection reset|failed to connect")
_RESTARTS = re.compile(
    r"^(quanta_supervisor_restarts_total|quanta_server_restarts_total)\{[^}]*\} (\S+)$", re.M
)


@dataclass
class Counts:
    """What happened to the requests; one per thread, summed at the end."""

    sent: int = 0
    answered: int = 0
    refused: int = 0
    lost: int = 0  # in flight on a stream that broke after answering (the server died)
    unreachable: int = 0  # sent on a stream that broke before any answer (it was away)
    stream_failures: int = 0  # streams that could not be opened or broke
    errors: dict[str, int] = field(default_factory=dict)  # first words of each refusal

    def add(self, other: Counts) -> None:
        for name in ("sent", "answered", "refused", "lost", "unreachable", "stream_failures"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, n in other.errors.items():
            self.errors[key] = self.errors.get(key, 0) + n


def _tensor(grpcclient: Any, name: str, array: np.ndarray, dtype: str) -> Any:
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _request(grpcclient: Any, kind: str, model: str, max_tokens: int) -> tuple[str, list[Any]]:
    """The model name and inputs of one request of ``kind``."""
    text = _tensor(grpcclient, "text_input", np.array([b"hello"], dtype=np.object_), "BYTES")
    tokens = _tensor(grpcclient, "max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")
    if kind == "valid":
        return model, [text, tokens]
    if kind == "bad-input":  # an input the model does not have
        extra = _tensor(grpcclient, "no_such_input", np.array([1], dtype=np.int32), "INT32")
        return model, [text, tokens, extra]
    return f"{model}-does-not-exist", [text, tokens]


def _error_key(message: str) -> str:
    return " ".join(re.sub(r"'[^']*'", "'…'", message).split()[:6])


def worker(args: argparse.Namespace, seed: int, deadline: float, counts: Counts) -> None:
    """Streams of ``args.per_stream`` requests until ``deadline``."""
    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(seed)
    kinds = args.kinds.split(",")
    while time.monotonic() < deadline:
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(args.url)
        pending, heard = 0, False  # heard: any answer on this stream
        try:
            client.start_stream(callback=lambda result, error, q=answers: q.put((result, error)))
            for _ in range(args.per_stream):
                model, inputs = _request(grpcclient, str(rng.choice(kinds)), args.model, 2)
                client.async_stream_infer(
                    model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
                )
                counts.sent += 1
                pending += 1
            while pending:
                result, error = answers.get(timeout=args.answer_timeout)
                heard = heard or error is None
                if error is not None:
                    message = str(error.message() if hasattr(error, "message") else error)
                    if _BROKEN.search(message):  # the stream itself ended: the rest are lost
                        raise ConnectionError(message)
                    pending -= 1
                    heard = True
                    counts.refused += 1
                    key = _error_key(message)
                    counts.errors[key] = counts.errors.get(key, 0) + 1
                elif result.get_response().parameters["triton_final_response"].bool_param:
                    pending -= 1
                    counts.answered += 1
        except Exception:  # the stream broke, timed out or never opened: the server is away
            counts.stream_failures += 1
            time.sleep(0.2)
        finally:
            if heard:
                counts.lost += pending
            else:
                counts.unreachable += pending
            try:
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception:
                pass  # the server it talked to is gone


@dataclass
class Probe:
    """Readiness as seen from outside: deaths, recoveries, the longest outage."""

    deaths: int = 0
    recoveries: int = 0
    longest_outage_s: float = 0.0
    serving_at_end: bool = False


def probe(args: argparse.Namespace, stop: threading.Event, seen: Probe) -> None:
    """Polls the model's readiness (down: dead, or reloading after a restart)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(args.url)
    down_since: float | None = None
    while True:
        live = serving(client, args.model)
        now = time.monotonic()
        if not live and down_since is None:
            down_since, seen.deaths = now, seen.deaths + 1
        elif live and down_since is not None:
            seen.recoveries += 1
            seen.longest_outage_s = max(seen.longest_outage_s, now - down_since)
            down_since = None
        seen.serving_at_end = live
        if stop.wait(args.probe_interval):
            break


def restart_counters(url: str | None) -> dict[str, float] | None:
    """The restart counters on a Prometheus page (summed over servers), or None."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for name, value in _RESTARTS.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def serving(client: Any, model: str) -> bool:
    """Whether the server is up with ``model`` loaded (Triton's health protocol)."""
    try:
        return bool(client.is_model_ready(model, client_timeout=2.0))
    except Exception:
        return False


def wait_serving(url: str, model: str, timeout: float) -> bool:
    """Until the server serves ``model`` (a run may start or end while it restarts)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serving(client, model):
            return True
        time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC host:port")
    parser.add_argument("--model", default="quanta", help="the served model's name")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to send for")
    parser.add_argument("--concurrency", type=int, default=8, help="streams at once")
    parser.add_argument("--per-stream", type=int, default=40, help="requests per stream")
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated request kinds to draw from: {', '.join(KINDS)}",
    )
    parser.add_argument("--answer-timeout", type=float, default=60.0, help="seconds per answer")
    parser.add_argument("--probe-interval", type=float, default=0.2, help="liveness poll, s")
    parser.add_argument(
        "--metrics-url",
        help="a Prometheus page with quanta_supervisor_restarts_total or "
        "quanta_server_restarts_total, read before and after",
    )
    parser.add_argument(
        "--settle", type=float, default=120.0, help="seconds to wait for the server at the end"
    )
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown --kinds {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
    if not wait_serving(args.url, args.model, 30.0):
        print(f"error: {args.url} does not serve {args.model!r}", file=sys.stderr)
        return 1

    before = restart_counters(args.metrics_url)
    stop, seen = threading.Event(), Probe()
    prober = threading.Thread(target=probe, args=(args, stop, seen), daemon=True)
    prober.start()
    started = time.monotonic()
    deadline = started + args.duration
    per_thread = [Counts() for _ in range(args.concurrency)]
    threads = [
        threading.Thread(target=worker, args=(args, i, deadline, c), daemon=True)
        for i, c in enumerate(per_thread)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    back = wait_serving(args.url, args.model, args.settle)  # a death at the end: its restart
    time.sleep(2 * args.probe_interval)
    stop.set()
    prober.join()
    total = Counts()
    for c in per_thread:
        total.add(c)
    summary = {
        "url": args.url,
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "kinds": args.kinds,
        **{k: v for k, v in asdict(total).items() if k != "errors"},
        "deaths_seen": seen.deaths,
        "recoveries_seen": seen.recoveries,
        "longest_outage_s": round(seen.longest_outage_s, 1),
        "serving_at_end": back,
        "restart_counters_before": before,
        "restart_counters_after": restart_counters(args.metrics_url),
        "refusals": dict(sorted(total.errors.items(), key=lambda kv: -kv[1])),
    }
    print(json.dumps(summary, indent=2))
    return 0 if back else 1


if __name__ == "__main__":
    sys.exit(main())
