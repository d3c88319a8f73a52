"""Tokens a server still generates for a stream after its client disconnected, measured
from outside through ``/metrics`` while other streams keep the server busy: with one token
per decode step, the number of steps a cancellation took. Used by
``loadtests/cancel_latency.py`` and the cancellation test."""

from __future__ import annotations

import re
import statistics
import threading
import time
import urllib.request
from typing import Protocol

from quanta.core.request import SamplingParams
from quanta.frontends.triton.client import grpc_events, http_events, output_ids, request_inputs

READ_BEFORE_DISCONNECT = 5


class Server(Protocol):
    """What the measurement needs of a running server (``TritonServer`` fits)."""

    @property
    def http_url(self) -> str: ...
    @property
    def grpc_url(self) -> str: ...
    @property
    def metrics_url(self) -> str: ...


def counter_total(server: Server, name: str) -> float:
    """The server's counter ``name`` summed over all its label sets."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    pattern = rf"^{name}\{{[^}}]*\}} (\S+)"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def generated_tokens(server: Server) -> float:
    """The server's ``quanta_generation_tokens_total`` over all label sets."""
    return counter_total(server, "quanta_generation_tokens_total")


def finished_requests(server: Server) -> float:
    """The server's ``quanta_request_finished_total`` over all finish reasons."""
    return counter_total(server, "quanta_request_finished_total")


def wait_for_finished(server: Server, count: float, timeout: float = 60.0) -> None:
    """Waits until ``/metrics`` has counted ``count`` finished requests. Tokens are counted
    when a request finishes and reach ``/metrics`` on the metrics thread's next push, which
    a loaded machine can delay by seconds: a fixed sleep read some streams before they were
    counted (and the next measurement counted them as its own)."""
    deadline = time.monotonic() + timeout
    while finished_requests(server) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"/metrics did not count {count:.0f} finished requests")
        time.sleep(0.1)


def tokens_after_disconnect(
    server: Server, streams: int, tokens: int, transport: str, model: str = "quanta"
) -> tuple[int, float]:
    """``streams - 1`` streams of ``tokens`` run to the end while one more reads 5 tokens
    and disconnects over ``transport`` (http|grpc). Returns (tokens generated for nobody,
    mean ms per token of the full streams). The server must be otherwise idle."""
    before = generated_tokens(server)
    finished_before = finished_requests(server)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    inputs = request_inputs("x", params, stream=True)
    per_token: list[float] = []

    def full() -> None:
        started, got = time.perf_counter(), 0
        for event in http_events(server.http_url, model, inputs, stream=True, timeout=900):
            got += len(output_ids(event))
        per_token.append((time.perf_counter() - started) / max(got, 1))

    others = [threading.Thread(target=full, daemon=True) for _ in range(streams - 1)]
    for thread in others:
        thread.start()
    time.sleep(1.0)  # the others are streaming
    if transport == "http":
        events = http_events(server.http_url, model, inputs, stream=True, timeout=900)
    else:
        events = grpc_events(server.grpc_url, model, inputs, timeout=900)
    read = 0
    for event in events:
        read += len(output_ids(event))
        if read >= READ_BEFORE_DISCONNECT:
            break
    events.close()  # the disconnect
    for thread in others:
        thread.join(timeout=900)
    wait_for_finished(server, finished_before + streams)
    after = generated_tokens(server) - before - (streams - 1) * tokens - read
    return round(after), 1000 * statistics.mean(per_token or [0.0])
