"""Locust load test for a Quanta Triton server: users stream over HTTP ``generate_stream``.

Headless run against a server started with ``quanta serve``::

    locust -f loadtests/locustfile.py --headless -u 32 -r 8 --run-time 2m \\
        -H http://127.0.0.1:8000 --csv out/locust --tenant-mix "gold:1,silver:2,bronze:4"

Besides the ``generate_stream`` request itself, each request reports custom ``METRIC`` events:
``time_to_first_token``, ``time_per_output_token`` (mean gap between streamed tokens) and
``e2e_latency``, all in ms, so they land in the same stats tables and CSV files.

Two ways to make requests:

- Generated (default): user *i* draws prompts, lengths, tenant and class from
  ``Random((seed, i))``, so two runs with the same options and user count send the same
  requests; each user sends one request at a time with a short think time.
- ``--workload FILE``: replay a workload file in the format ``quanta bench`` and ``quanta
  simulate`` read (``quanta bench workload`` writes one; BurstGPT and Azure LLM trace CSVs work
  too). Users take the file's requests in arrival order, each with its tenant, app,
  interaction, class and SLOs; a prompt given only as a length is sent as seeded token ids
  (those of ``quanta bench serve`` and the simulator: rows of one ``prefix_group`` share
  their first ``prefix_tokens``).
  ``--time-scale``, ``--token-scale`` and ``--too-long`` (against ``--max-len``) act as in
  ``quanta simulate`` and ``quanta bench serve``. With ``--workload-timing arrival``
  (default) a request is sent at its ``arrival_time`` after the first user started, so give
  enough users (``-u``) for the requests in flight at once; ``asap`` sends back to back. A
  later call of a multi-call interaction (``interaction_stage``, e.g. ``--dataset agents``)
  is taken only once the call before it finished: at max(its ``arrival_time``, that finish +
  its ``think_time_s``) (``asap``: at once); after a failed or throttled call the rest of the
  interaction is never sent, and each such call is counted as an ``ABANDONED`` event. The
  run stops when every request has finished or been abandoned. Run it in one process (not
  ``--processes`` or workers): each process would replay the whole file.

HTTP streaming (not tritonclient's gRPC stream) is used because gRPC's real threads fight
Locust's gevent.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event
from locust import HttpUser, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

if TYPE_CHECKING:
    from quanta.workloads.dependencies import Interactions

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
    group.add_argument(
        "--workload",
        default="",
        env_var="QUANTA_WORKLOAD",
        help="replay this workload file (JSONL of `quanta bench workload`, or a BurstGPT or "
        "Azure LLM trace CSV) instead of generating requests",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        env_var="QUANTA_TIME_SCALE",
        help="divide the workload file's inter-arrival times by this (2: twice as fast)",
    )
    group.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        env_var="QUANTA_TOKEN_SCALE",
        help="multiply the workload file's prompt tokens by this (rounded, >= 1)",
    )
    group.add_argument(
        "--too-long",
        choices=["error", "skip", "clip"],
        default="error",
        env_var="QUANTA_TOO_LONG",
        help="workload rows with prompt + output > --max-len: error, skip or clip them",
    )
    group.add_argument(
        "--max-len",
        type=int,
        default=2048,
        env_var="QUANTA_MAX_LEN",
        help="the served model's length: a workload row's prompt + output must fit",
    )
    group.add_argument(
        "--workload-timing",
        choices=["arrival", "asap"],
        default="arrival",
        env_var="QUANTA_WORKLOAD_TIMING",
        help="arrival: send each request at its arrival_time; asap: back to back",
    )
    group.add_argument(
        "--token-id-range",
        default="10,250",
        env_var="QUANTA_TOKEN_ID_RANGE",
        help="lo,hi token ids for workload prompts given only as a length",
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


@dataclass
class Replay:
    """A workload file shared by all users of this process: who sends what, and when.

    ``due`` holds the requests that may be taken, earliest first; a later call of an
    interaction joins it when ``plan`` releases it. gevent switches only at I/O, so plain
    fields need no lock.
    """

    bodies: dict[str, dict[str, Any]]  # request id -> generate_stream body
    plan: Interactions  # which calls wait for which
    timing: str
    order: dict[str, int]  # request id -> its place in the file (ties)
    due: list[tuple[float, int, str]] = field(default_factory=list)  # (send at, order, id)
    start: float | None = None
    in_flight: int = 0
    changed: gevent.event.Event = field(default_factory=gevent.event.Event)

    @classmethod
    def from_options(cls, options: Any) -> Replay:
        # NOTE: imported only in replay mode, so the generated mode runs without quanta.
        from quanta.bench.client import Target, to_client_requests, triton_inputs
        from quanta.workloads import load_workload
        from quanta.workloads.dependencies import Call, Interactions
        from quanta.workloads.prompts import PromptIds

        lo, hi = _range(options.token_id_range)
        target = Target(url=options.host or "", transport="http", token_id_range=(lo, hi))
        workload = load_workload(
            options.workload,
            time_scale=options.time_scale,
            token_scale=options.token_scale,
            too_long=options.too_long,
            max_len=options.max_len,
        )
        rows = to_client_requests(workload)
        plan = Interactions(
            Call(r.request_id, r.arrival_s, r.interaction_id, r.interaction_stage, r.think_time_s)
            for r in rows
        )
        ids = PromptIds(target.token_id_range)  # NOTE: one for the file: prefixes drawn once
        replay = cls(
            {r.request_id: triton_inputs(r, target, ids) for r in rows},
            plan,
            options.workload_timing,
            {r.request_id: i for i, r in enumerate(rows)},
        )
        for call in plan.free():
            replay._push(call.arrival_s, call.request_id)
        return replay

    def take(self) -> tuple[str, dict[str, Any]] | None:
        """The next request (id, body), once it is due; None when the file is used up."""
        while not self.due:
            if self.done:
                return None
            self.changed.clear()  # NOTE: a call in flight will release its follower
            self.changed.wait(0.05)
        when, _, request_id = heapq.heappop(self.due)
        self.in_flight += 1
        if self.start is None:
            self.start = time.monotonic()
        if self.timing == "arrival":
            gevent.sleep(max(0.0, self.start + when - time.monotonic()))
        return request_id, self.bodies[request_id]

    def finished(self, request_id: str, ok: bool) -> bool:
        """Count a request as ended, release or abandon the calls waiting for it; True when
        it was the file's last."""
        self.in_flight -= 1
        end = time.monotonic() - (self.start or 0.0)
        for follower, when in self.plan.finished(request_id, end, ok).items():
            if when is None:
                _abandoned(follower)
            else:
                self._push(when, follower)
        self.changed.set()
        return self.done

    @property
    def done(self) -> bool:
        """Nothing due, in flight or waiting for another call."""
        return not self.due and self.in_flight == 0 and not self.plan.pending

    def _push(self, when: float, request_id: str) -> None:
        heapq.heappush(self.due, (when, self.order[request_id], request_id))


_replay: Replay | None = None


def _shared_replay(options: Any) -> Replay | None:
    global _replay
    if options.workload and _replay is None:
        _replay = Replay.from_options(options)
    return _replay


@events.init.add_listener
def _load_workload(environment: Any, **_: Any) -> None:
    """Read ``--workload`` once at start-up: a bad file (or rows too long for ``--max-len``)
    stops Locust at once with the file's error, not one traceback per user mid-run."""
    options = environment.parsed_options
    if options is None or not options.workload:
        return
    from quanta.workloads import WorkloadError

    try:
        _shared_replay(options)
    except WorkloadError as exc:
        logging.getLogger("quanta.locust").error("--workload: %s", exc)
        sys.exit(2)


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


def _abandoned(request_id: str) -> None:
    """A call never sent because an earlier call of its interaction failed: counted in the
    stats under ``ABANDONED`` (not a failure of the server)."""
    events.request.fire(
        request_type="ABANDONED",
        name="interaction_call",
        response_time=0,
        response_length=0,
        exception=None,
        context={"request_id": request_id},
    )


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
    """Sends one streamed generation at a time: generated ones with a short think time, or
    the workload file's requests at their arrival times."""

    def wait_time(self) -> float:
        return 0.0 if self.replay is not None else random.uniform(0.05, 0.2)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.replay = _shared_replay(options)
        self.workload = Workload.from_options(options, next(_user_ids))
        self.path = f"/v2/models/{options.model_name}/generate_stream"

    @task
    def generate_stream(self) -> None:
        if self.replay is None:
            self._send(self.workload.next_request())
            return
        taken = self.replay.take()
        if taken is None:
            raise StopUser()
        request_id, body = taken
        ok = False
        try:
            ok = self._send(body)
        finally:
            if self.replay.finished(request_id, ok):  # every request of the file has ended
                # NOTE: the CSV writer snapshots every CSV_STATS_INTERVAL_SEC; quitting at
                # once would leave the last requests out of --csv files.
                gevent.spawn_later(CSV_STATS_INTERVAL_SEC + 0.5, self.environment.runner.quit)

    def _send(self, body: dict[str, Any]) -> bool:
        """Stream one generation and report it; True when it succeeded."""
        start = time.perf_counter()
        first = last = None
        tokens = 0
        with self.client.post(
            self.path, json=body, stream=True, catch_response=True, name="generate_stream"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return False
            for line in resp.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:") :])
                if "error" in event:
                    resp.failure(event["error"])
                    return False
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
                return False
            resp.success()
        if tokens > 1:
            _metric("time_per_output_token", (last - first) * 1000 / (tokens - 1), tokens)
        _metric("e2e_latency", (last - start) * 1000, tokens)
        return True
