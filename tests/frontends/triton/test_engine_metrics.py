"""The engine's serving metrics beside vLLM's: per-request phases and inter-token gaps, token
histograms, each step's tokens, the KV-cache usage ratio, and prompt tokens counted when the
prompt was computed; on a fake ``pb_utils`` and then scraped from the live server."""

from __future__ import annotations

import urllib.request

import pytest
import quanta
from prometheus_client.parser import text_string_to_metric_families
from quanta.core.loop import LoopStats
from quanta.core.request import SamplingParams
from quanta.core.stream import RequestMetrics
from quanta.frontends.triton.client import grpc_events
from quanta.frontends.triton.inputs import request_inputs
from quanta.frontends.triton.metrics import (
    FAMILIES,
    FinishedRecord,
    MetricsReporter,
    PrefilledRecord,
)
from serving import wait_for


class Series(list):
    def increment(self, value):
        self.append(value)

    set = observe = increment


class Family:
    HISTOGRAM = COUNTER = GAUGE = "kind"

    def __init__(self, name, description, kind):
        self.series = {}

    def Metric(self, labels, buckets=None):
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "model"))
        return self.series.setdefault(key, Series())


class Pb:
    MetricFamily = Family


def stats(used: int = 0, total: int = 24) -> LoopStats:
    return LoopStats(0, 0, 0, used, total, 0, 64, 1, 0, 0, 0)


def reporter(steps: list[list[int]] | None = None, used: int = 6) -> MetricsReporter:
    batches = iter(steps or [])
    return MetricsReporter(
        Pb, {"model": "m"}, stats=lambda: stats(used), step_tokens=lambda: next(batches, [])
    )


def series(r: MetricsReporter, name: str, **labels: str) -> list[float]:
    return r._families[name].series.get(tuple(sorted(labels.items())), [])


METRICS = RequestMetrics(
    arrival_time=1.0,
    first_scheduled_time=1.25,
    first_token_time=1.5,
    finish_time=2.5,
    token_times=(1.5, 1.75, 2.25, 2.25),
    num_prompt_tokens=40,
    num_output_tokens=4,
    num_preemptions=0,
    num_swapped_blocks=0,
    num_recomputed_tokens=0,
)


def test_a_finished_request_gives_its_phases_gaps_and_lengths():
    r = reporter()
    r.record(FinishedRecord("t", "online", "length", False, METRICS))
    r.flush()
    assert series(r, "quanta_request_queue_time_seconds") == [0.25]
    assert series(r, "quanta_request_prefill_time_seconds") == [0.25]
    assert series(r, "quanta_request_decode_time_seconds") == [0.75]
    assert series(r, "quanta_request_inference_time_seconds") == [1.0]
    assert series(r, "quanta_inter_token_latency_seconds") == [0.25, 0.5, 0.0]
    assert series(r, "quanta_request_prompt_tokens") == [40]
    assert series(r, "quanta_request_generation_tokens") == [4]


def test_prompt_tokens_count_when_the_first_token_comes_out_and_never_twice():
    r = reporter()
    who = {"tenant": "t", "priority_class": "offline"}
    r.record(PrefilledRecord("t", "offline", 40))
    r.flush()
    assert series(r, "quanta_prompt_tokens_total", **who) == [40]  # before it finished
    r.record(FinishedRecord("t", "offline", "length", False, METRICS, prompt_counted=True))
    r.flush()
    assert series(r, "quanta_prompt_tokens_total", **who) == [40]
    # one that ended before its first token (cancelled while waiting) counts when it ends
    r.record(FinishedRecord("t", "offline", "cancelled", False, METRICS))
    r.flush()
    assert series(r, "quanta_prompt_tokens_total", **who) == [40, 40]


def test_each_step_is_one_iteration_observation_and_kv_usage_is_a_ratio():
    r = reporter(steps=[[7, 1, 1], [], [3]], used=6)
    for _ in range(3):
        r.flush()
    assert series(r, "quanta_iteration_tokens_total") == [7, 1, 1, 3]
    assert series(r, "quanta_kv_cache_usage_perc") == [0.25] * 3


# -- live -------------------------------------------------------------------------------------
NEW = (
    "quanta_inter_token_latency_seconds",
    "quanta_request_queue_time_seconds",
    "quanta_request_prefill_time_seconds",
    "quanta_request_decode_time_seconds",
    "quanta_request_inference_time_seconds",
    "quanta_request_prompt_tokens",
    "quanta_request_generation_tokens",
    "quanta_iteration_tokens_total",
)


def model_samples(metrics_url: str) -> dict[tuple[str, frozenset], float]:
    """The ``quanta`` model's samples, parsed as Prometheus parses them, without the labels
    every series of the model carries."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != "quanta":
                continue
            labels = {
                k: v for k, v in s.labels.items() if k not in ("model", "version", "instance")
            }
            found[(s.name, frozenset(labels.items()))] = s.value
    return found


@pytest.mark.live
def test_the_live_engine_exports_vllms_serving_metrics(triton):
    tenant = {"tenant": "engine-metrics", "priority_class": "online"}
    before = model_samples(triton.metrics_url)
    usage = before[("quanta_kv_cache_usage_perc", frozenset())]
    assert 0.0 <= usage <= 1.0
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    meta = quanta.RequestMetadata(tenant=tenant["tenant"])
    inputs = request_inputs("tell me more", params, stream=True, metadata=meta)
    events = list(grpc_events(triton.grpc_url, "quanta", inputs, timeout=60))
    prompt = events[-1]["num_prompt_tokens"]
    key = ("quanta_prompt_tokens_total", frozenset(tenant.items()))
    after = wait_for(
        lambda: (
            (s := model_samples(triton.metrics_url)).get(key) == prompt
            and s.get(("quanta_request_generation_tokens_sum", frozenset()), 0)
            >= before.get(("quanta_request_generation_tokens_sum", frozenset()), 0) + 12
            and s
        ),
        what="the request on /metrics",
    )

    for name in NEW:  # a histogram shows once it has an observation
        assert (f"{name}_count", frozenset()) in after, name

    def grew(name: str) -> float:
        return after[(name, frozenset())] - before.get((name, frozenset()), 0.0)

    assert grew("quanta_inter_token_latency_seconds_count") >= 11
    assert grew("quanta_request_prefill_time_seconds_count") >= 1
    assert grew("quanta_request_prompt_tokens_sum") >= prompt
    assert grew("quanta_iteration_tokens_total_count") >= 12  # a prefill and 11 decodes at least
    assert grew("quanta_iteration_tokens_total_sum") >= prompt + 11


def test_every_new_family_is_declared_once():
    assert all(name in FAMILIES for name in (*NEW, "quanta_kv_cache_usage_perc"))
