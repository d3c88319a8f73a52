"""What a very large request does to a short one running beside it, on the OpenAI gateway.

Sends short requests (``--short-tokens`` tokens each) one after another and times them, first
alone, then while large requests arrive: a body of ``--refused-mb`` MB that the gateway's size
limit must refuse (413) without reading it, and a prompt of ``--prompt-mb`` MB that goes as
far as the server lets it (refused by the prompt limit, or tokenized and refused for its
length). Prints one JSON object: each phase's short-request latencies and the large requests'
statuses and times.

    python bench/trust/big_request.py --url http://127.0.0.1:9000 --model quanta

Needs only the standard library; the server must be running.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse
from typing import Any

MB = 1 << 20


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout
    )


def _headers(key: str | None, length: int) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Content-Length": str(length)}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def post(url: str, body: bytes, key: str | None, timeout: float = 600.0) -> dict[str, Any]:
    """POST ``body`` to /v1/completions in 1 MB writes; the status (or what cut it short),
    how long it took, and how many bytes the server let us send."""
    start = time.perf_counter()
    conn = _connection(url, timeout)
    sent = 0
    try:
        conn.putrequest("POST", "/v1/completions")
        for name, value in _headers(key, len(body)).items():
            conn.putheader(name, value)
        conn.endheaders()
        try:
            for i in range(0, len(body), MB):
                conn.send(body[i : i + MB])
                sent += len(body[i : i + MB])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed: its answer may still be readable
        try:
            response = conn.getresponse()
            status: int | str = response.status
            detail = json.loads(response.read() or b"{}").get("error", {}).get("message", "")
        except (ConnectionResetError, http.client.HTTPException, OSError) as exc:
            status, detail = f"connection closed ({type(exc).__name__})", ""
    finally:
        conn.close()
    return {
        "status": status,
        "seconds": round(time.perf_counter() - start, 3),
        "bytes_sent": sent,
        "message": detail[:160],
    }


def short_request(url: str, model: str, key: str | None, tokens: int) -> float:
    body = json.dumps(
        {"model": model, "prompt": "Hello", "max_tokens": tokens, "temperature": 0}
    ).encode()
    start = time.perf_counter()
    answer = post(url, body, key, timeout=120)
    if answer["status"] != 200:
        raise RuntimeError(f"the short request failed: {answer}")
    return time.perf_counter() - start


def _summary(latencies: list[float]) -> dict[str, Any]:
    return {
        "n": len(latencies),
        "median_ms": round(statistics.median(latencies) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the gateway")
    parser.add_argument("--model", default="quanta")
    parser.add_argument("--api-key", default=None, help="if the gateway needs one")
    parser.add_argument("--refused-mb", type=float, default=20.0, help="the oversized body")
    parser.add_argument("--prompt-mb", type=float, default=1.0, help="the large prompt")
    parser.add_argument("--short-requests", type=int, default=10, help="per phase")
    parser.add_argument("--short-tokens", type=int, default=2)
    args = parser.parse_args()

    short_request(args.url, args.model, args.api_key, args.short_tokens)  # warm up
    alone = [
        short_request(args.url, args.model, args.api_key, args.short_tokens)
        for _ in range(args.short_requests)
    ]

    words = "lorem ipsum dolor sit amet " * int(args.prompt_mb * MB / 27 + 1)
    prompt = json.dumps({"model": args.model, "prompt": words, "max_tokens": 2}).encode()
    filler = b" " * int(args.refused_mb * MB)
    refused = b'{"model": "' + args.model.encode() + b'", "prompt": "x"}' + filler
    big: dict[str, Any] = {}

    def send(name: str, body: bytes) -> None:
        big[name] = post(args.url, body, args.api_key)

    threads = [
        threading.Thread(target=send, args=(f"{args.refused_mb:g} MB body", refused)),
        threading.Thread(target=send, args=(f"{args.prompt_mb:g} MB prompt", prompt)),
    ]
    for thread in threads:
        thread.start()
    beside = []
    while any(t.is_alive() for t in threads) or len(beside) < args.short_requests:
        beside.append(short_request(args.url, args.model, args.api_key, args.short_tokens))
    for thread in threads:
        thread.join()
    report = {"alone": _summary(alone), "beside_large": _summary(beside), "large": big}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
