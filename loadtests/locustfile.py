"""Locust load test for a Quanta Triton server: users stream over HTTP ``generate_stream``.

Headless run against a server started with ``quanta serve``::

    locust -f loadtests/locustfile.py --headless -u 32 -r 8 --run-time 2m \\
        -H http://127.0.0.1:8000 --csv out/locust --tenant-mix "gold:1,silver:2,bronze:4"

Besides the ``generate_stream`` request itself, each request reports custom ``METRIC`` events:
``time_to_first_token``, ``time_per_output_token`` (mean gap between streamed tokens) and
``e2e_latency``, all in ms, so they land in the same stats tables and CSV files.

Prompts and lengths come from a seeded workload: user *i* draws from ``Random((seed, i))``, so
two runs with the same options and user count send the same requests. HTTP streaming (not
tritonclient's gRPC stream) is used because gRPC's real threads fight Locust's gevent.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from locust import HttpUser, between, events, task

# NOTE: prompts are drawn from this text's words; kept as prose so the file stays short.
CORPUS = (
    "the quick brown fox jumps over a lazy dog while scheduling tokens in batches of "
    "requests that arrive from many tenants with different service level objectives and "
    "preemption swaps key value blocks between device and host memory tiers"
)
WORDS = CORPUS.split()
_user_ids = itertools.count()


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("quanta workload")
    group.add_argument(
        "--model-name", default="quanta", env_var="QUANTA_MODEL", help="Triton model to load-test"
    )
    group.add_argument(
        "--tenant-mix",
        default="default:1",
        env_var="QUANTA_TENANT_MIX",
        help='weighted tenants, e.g. "gold:1,silver:2,bronze:4"',
    )
    group.add_argument(
        "--workload-seed",
        type=int,
        default=0,
        env_var="QUANTA_WORKLOAD_SEED",
        help="seed of the prompt/length/tenant draws",
    )
    group.add_argument(
        "--prompt-words",
        default="4,48",
        env_var="QUANTA_PROMPT_WORDS",
        help="min,max words per prompt (uniform)",
    )
    group.add_argument(
        "--output-tokens",
        default="8,64",
        env_var="QUANTA_OUTPUT_TOKENS",
        help="min,max generated tokens per request (uniform; EOS ignored)",
    )
    group.add_argument(
        "--offline-fraction",
        type=float,
        default=0.0,
        env_var="QUANTA_OFFLINE_FRACTION",
        help="share of requests sent as priority_class=offline",
    )


@dataclass(frozen=True)
class Workload:
    """The seeded request generator of one user."""

    rng: random.Random
    tenants: list[str]
    weights: list[float]
    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]
    offline_fraction: float

    @classmethod
    def from_options(cls, options: Any, user_index: int) -> Workload:
        tenants, weights = _tenant_mix(options.tenant_mix)
        return cls(
            rng=random.Random(f"{options.workload_seed}-{user_index}"),
            tenants=tenants,
            weights=weights,
            prompt_words=_range(options.prompt_words),
            output_tokens=_range(options.output_tokens),
            offline_fraction=options.offline_fraction,
        )

    def next_request(self) -> dict[str, Any]:
        rng = self.rng
        words = [rng.choice(WORDS) for _ in range(rng.randint(*self.prompt_words))]
        offline = rng.random() < self.offline_fraction
        return {
            "text_input": " ".join(words),
            "max_tokens": rng.randint(*self.output_tokens),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "tenant": rng.choices(self.tenants, self.weights)[0],
            "priority_class": "offline" if offline else "online",
        }


def _tenant_mix(spec: str) -> tuple[list[str], list[float]]:
    tenants, weights = [], []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        tenants.append(name)
        weights.append(float(weight or 1))
    return tenants, weights


def _range(spec: str) -> tuple[int, int]:
    low, _, high = spec.partition(",")
    return int(low), int(high or low)


def _metric(name: str, ms: float, length: int = 0) -> None:
    events.request.fire(
        request_type="METRIC",
        name=name,
        response_time=ms,
        response_length=length,
        exception=None,
        context={},
    )


class StreamingUser(HttpUser):
    """Sends one streamed generation at a time, with a short think time between them."""

    wait_time = between(0.05, 0.2)

    def on_start(self) -> None:
        self.workload = Workload.from_options(self.environment.parsed_options, next(_user_ids))
        self.path = f"/v2/models/{self.environment.parsed_options.model_name}/generate_stream"

    @task
    def generate_stream(self) -> None:
        body = self.workload.next_request()
        start = time.perf_counter()
        first = last = None
        tokens = 0
        with self.client.post(
            self.path, json=body, stream=True, catch_response=True, name="generate_stream"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:") :])
                if "error" in event:
                    resp.failure(event["error"])
                    return
                ids = event.get("output_ids", [])
                count = 1 if isinstance(ids, int) else len(ids)
                if count and first is None:
                    first = time.perf_counter()
                    _metric("time_to_first_token", (first - start) * 1000)
                if count:
                    last = time.perf_counter()
                tokens += count
            if first is None or last is None:
                resp.failure("the stream ended without tokens")
                return
            resp.success()
        if tokens > 1:
            _metric("time_per_output_token", (last - first) * 1000 / (tokens - 1), tokens)
        _metric("e2e_latency", (last - start) * 1000, tokens)
