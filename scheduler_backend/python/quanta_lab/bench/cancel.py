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


def generated_tokens(server: Server) -> float:
    """The server's ``quanta_generation_tokens_total`` over all label sets."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    pattern = r"^quanta_generation_tokens_total\{[^}]*\} (\S+)"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def tokens_after_disconnect(
    server: Server, streams: int, tokens: int, transport: str, model: str = "quanta"
) -> tuple[int, float]:
    """``streams - 1`` streams of ``tokens`` run to the end while one more reads 5 tokens
    and disconnects over ``transport`` (http|grpc). Returns (tokens generated for nobody,
    mean ms per token of the full streams). The server must be otherwise idle."""
    before = generated_tokens(server)
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
    time.sleep(0.5)  # the last metrics push
    after = generated_tokens(server) - before - (streams - 1) * tokens - read
    return round(after), 1000 * statistics.mean(per_token or [0.0])
