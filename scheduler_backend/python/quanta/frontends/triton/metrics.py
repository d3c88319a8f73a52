"""Prometheus metrics of one model instance, exported through Triton's metrics port.

Every metric update is an IPC round trip to the Triton process, so nothing is updated on the
engine or response threads: those only hand over ``LoopStats`` snapshots (read from the loop)
and finished-request records (appended under a lock); a side thread turns them into updates
every ``interval`` seconds. Names follow vLLM's (``vllm:time_to_first_token_seconds`` ->
``quanta_time_to_first_token_seconds``), with an underscore since Triton's names are plain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quanta.core.loop import LoopHealth, LoopStats
from quanta.core.stream import RequestMetrics
from quanta.policies.fair_stores import state_errors

# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0]
# the phases of a request (queue, prefill, decode, inference): vLLM's, down to a CPU's 5 ms
PHASE_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,
                 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0]
# token counts: 1-2-5 steps, as vLLM's
TOKEN_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0,
                 5000.0, 10000.0, 20000.0, 50000.0, 100000.0]
ITERATION_BUCKETS = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                     4096.0, 8192.0, 16384.0]
# fmt: on

# name -> (kind, description, buckets)
FAMILIES: dict[str, tuple[str, str, list[float] | None]] = {
    "quanta_time_to_first_token_seconds": (
        "HISTOGRAM",
        "Time from arrival to the first generated token.",
        TTFT_BUCKETS,
    ),
    "quanta_time_per_output_token_seconds": (
        "HISTOGRAM",
        "Mean time between output tokens of each finished request.",
        TPOT_BUCKETS,
    ),
    "quanta_e2e_request_latency_seconds": (
        "HISTOGRAM",
        "Time from arrival to the end of each finished request.",
        E2E_BUCKETS,
    ),
    "quanta_inter_token_latency_seconds": (
        "HISTOGRAM",
        "Time between consecutive output tokens of a request (each gap; tokens of one "
        "speculative step share a time).",
        TPOT_BUCKETS,
    ),
    "quanta_request_queue_time_seconds": (
        "HISTOGRAM",
        "Time from arrival to first being scheduled.",
        PHASE_BUCKETS,
    ),
    "quanta_request_prefill_time_seconds": (
        "HISTOGRAM",
        "Time from first being scheduled to the first generated token.",
        PHASE_BUCKETS,
    ),
    "quanta_request_decode_time_seconds": (
        "HISTOGRAM",
        "Time from the first generated token to the last.",
        PHASE_BUCKETS,
    ),
    "quanta_request_inference_time_seconds": (
        "HISTOGRAM",
        "Time from first being scheduled to the last generated token (prefill + decode).",
        PHASE_BUCKETS,
    ),
    "quanta_request_prompt_tokens": (
        "HISTOGRAM",
        "Prompt length of each finished request, in tokens.",
        TOKEN_BUCKETS,
    ),
    "quanta_request_generation_tokens": (
        "HISTOGRAM",
        "Generated tokens of each finished request.",
        TOKEN_BUCKETS,
    ),
    "quanta_iteration_tokens_total": (
        "HISTOGRAM",
        "Tokens computed by each engine step (prefill chunks and decodes together).",
        ITERATION_BUCKETS,
    ),
    "quanta_kv_cache_usage_perc": (
        "GAUGE",
        "Fraction of the device tier's KV blocks in use, 0 to 1 (vLLM's kv_cache_usage_perc).",
        None,
    ),
    "quanta_engine_info": (
        "GAUGE",
        "Always 1; the labels say what the engine runs with (policy, dtype, limits, cache).",
        None,
    ),
    "quanta_server_restarts_total": (
        "COUNTER",
        "Times quanta serve restarted a tritonserver that died (counted across restarts).",
        None,
    ),
    "quanta_num_requests_waiting": ("GAUGE", "Requests waiting to be scheduled.", None),
    "quanta_num_requests_running": ("GAUGE", "Requests with KV in the device tier.", None),
    "quanta_num_requests_swapped": ("GAUGE", "Requests with KV in the host tier.", None),
    "quanta_kv_blocks_used": ("GAUGE", "KV blocks in use, by tier.", None),
    "quanta_kv_blocks_total": ("GAUGE", "KV blocks in the pool, by tier.", None),
    "quanta_hidden_cache_requests": (
        "GAUGE",
        "Requests whose device cache holds hidden states instead of K and V (Apt-Serve).",
        None,
    ),
    "quanta_hidden_cache_blocks_used": (
        "GAUGE",
        "Device blocks holding hidden states (included in quanta_kv_blocks_used).",
        None,
    ),
    "quanta_num_preemptions_total": (
        "COUNTER",
        "Preemptions, by kind: swap, recompute, checkpoint (a swap whose copy a checkpoint "
        "had already made: the device blocks are just freed).",
        None,
    ),
    "quanta_class_time_to_first_token_seconds": (
        "HISTOGRAM",
        "Time from arrival to the first generated token, by priority class (online, offline).",
        TTFT_BUCKETS,
    ),
    "quanta_class_time_per_output_token_seconds": (
        "HISTOGRAM",
        "Mean time between output tokens of each finished request, by priority class.",
        TPOT_BUCKETS,
    ),
    "quanta_safepoint_aborts_total": (
        "COUNTER",
        "Steps of offline work stopped at a layer safepoint for an online arrival (ConServe).",
        None,
    ),
    "quanta_checkpoint_blocks_used": (
        "GAUGE",
        "Host blocks holding incremental checkpoints of device KV (included in the host's "
        "quanta_kv_blocks_used).",
        None,
    ),
    "quanta_checkpoint_blocks_copied_total": (
        "COUNTER",
        "Blocks copied device to host by incremental checkpoints.",
        None,
    ),
    "quanta_engine_steps_total": ("COUNTER", "Engine iterations executed.", None),
    "quanta_engine_healthy": (
        "GAUGE",
        "1 while the engine serves; 0 once its loop died or made no step for the stall "
        "timeout with requests waiting or running (the log says why).",
        None,
    ),
    "quanta_engine_seconds_since_step": (
        "GAUGE",
        "Seconds since the engine's latest step ended, while requests wait or run (0 idle).",
        None,
    ),
    "quanta_fairness_state_errors_total": (
        "COUNTER",
        "Operations on the shared fairness state (--state-url) that failed and fell back to "
        "this replica's own view.",
        None,
    ),
    "quanta_prefix_cache_queries_total": (
        "COUNTER",
        "Tokens looked up in the prefix cache, each time a request starts (or restarts after "
        "a recompute) computing its K/V.",
        None,
    ),
    "quanta_prefix_cache_hits_total": (
        "COUNTER",
        "Of those, tokens found cached and not computed (hits / queries: the hit rate).",
        None,
    ),
    "quanta_prefix_cache_blocks": (
        "GAUGE",
        "Blocks holding a cached prefix, by tier (device, host): in use or free to evict.",
        None,
    ),
    "quanta_spec_decode_num_drafts_total": (
        "COUNTER",
        "Speculative decoding: request steps that verified drafts (prompt lookup).",
        None,
    ),
    "quanta_spec_decode_num_draft_tokens_total": (
        "COUNTER",
        "Draft tokens verified.",
        None,
    ),
    "quanta_spec_decode_num_accepted_tokens_total": (
        "COUNTER",
        "Of those, drafts the target model accepted (accepted / draft tokens: the acceptance "
        "rate; each step also yields one token of its own).",
        None,
    ),
    "quanta_generation_tokens_total": (
        "COUNTER",
        "Generated tokens, by tenant and priority class.",
        None,
    ),
    "quanta_prompt_tokens_total": (
        "COUNTER",
        "Prompt tokens, by tenant and priority class: counted when a request's first token "
        "comes out (its prompt was computed), or when it ends without one.",
        None,
    ),
    "quanta_request_finished_total": ("COUNTER", "Finished requests, by finish reason.", None),
    "quanta_request_throttled_total": (
        "COUNTER",
        "Requests refused by the policy under load, by tenant.",
        None,
    ),
    "quanta_tenant_service_tokens_total": (
        "COUNTER",
        "Service received, by tenant: prompt tokens + 2 x generated tokens (VTC's weights).",
        None,
    ),
    "quanta_tenant_queue_time_seconds": (
        "HISTOGRAM",
        "Time from arrival to first being scheduled, by tenant.",
        TTFT_BUCKETS,
    ),
    "quanta_tenant_time_to_first_token_seconds": (
        "HISTOGRAM",
        "Time from arrival to the first generated token, by tenant.",
        TTFT_BUCKETS,
    ),
}
OTHER_TENANTS = "other"

# Counters fed from the loop's cumulative ``LoopStats``: (metric, labels, field); each report
# adds what the field grew by since the last one.
_LOOP_COUNTERS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("quanta_num_preemptions_total", (("kind", "swap"),), "num_preemptions_swap"),
    ("quanta_num_preemptions_total", (("kind", "recompute"),), "num_preemptions_recompute"),
    ("quanta_num_preemptions_total", (("kind", "checkpoint"),), "num_preemptions_checkpoint"),
    ("quanta_engine_steps_total", (), "num_steps"),
    ("quanta_safepoint_aborts_total", (), "num_safepoint_aborts"),
    ("quanta_checkpoint_blocks_copied_total", (), "num_checkpoint_blocks_copied"),
    ("quanta_prefix_cache_queries_total", (), "prefix_cache_queries"),
    ("quanta_prefix_cache_hits_total", (), "prefix_cache_hits"),
    ("quanta_spec_decode_num_drafts_total", (), "spec_num_drafts"),
    ("quanta_spec_decode_num_draft_tokens_total", (), "spec_num_draft_tokens"),
    ("quanta_spec_decode_num_accepted_tokens_total", (), "spec_num_accepted_tokens"),
)


@dataclass(frozen=True, slots=True)
class FinishedRecord:
    """What the metrics need from one finished request."""

    tenant: str
    priority_class: str
    finish_reason: str
    throttled: bool
    metrics: RequestMetrics | None
    prompt_counted: bool = False  # its prompt tokens went in at its first token (``prefilled``)


@dataclass(frozen=True, slots=True)
class PrefilledRecord:
    """A request whose first token came out: its prompt was computed."""

    tenant: str
    priority_class: str
    num_prompt_tokens: int


class TenantLabels:
    """The ``tenant`` label value of each tenant: its name for the first ``cap`` tenants
    seen, ``other`` for the rest, so a flood of user ids cannot blow up the series count."""

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError(f"max_tenant_labels must be >= 0, got {cap}")
        self.cap = cap
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.cap and tenant != OTHER_TENANTS:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class MetricsReporter:
    """Owns the metric families of one model instance and updates them on a side thread.

    ``pb_utils`` is passed in (it only exists inside Triton's stub), so tests can use a fake.
    """

    def __init__(
        self,
        pb_utils: Any,
        labels: dict[str, str],
        stats: Callable[[], LoopStats],
        interval: float = 0.5,
        max_tenant_labels: int = 32,
        info: dict[str, str] | None = None,
        restarts: int = 0,
        health: Callable[[], LoopHealth] | None = None,
        step_tokens: Callable[[], list[int]] | None = None,
    ) -> None:
        self._labels = labels
        self._step_tokens = step_tokens
        self._health = health
        self._restarts = restarts
        self._info = tuple(sorted((info or {}).items()))
        self._tenant = TenantLabels(max_tenant_labels)
        self._stats = stats
        self._interval = interval
        self._families = {
            name: pb_utils.MetricFamily(
                name=name, description=desc, kind=getattr(pb_utils.MetricFamily, kind)
            )
            for name, (kind, desc, _) in FAMILIES.items()
        }
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._pending: list[FinishedRecord | PrefilledRecord] = []
        self._lock = threading.Lock()
        self._last: LoopStats | None = None
        self._state_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quanta-metrics", daemon=True)

    def start(self) -> None:
        self._metric("quanta_engine_info", self._info).set(1.0)
        restarts = self._metric("quanta_server_restarts_total")
        if self._restarts:
            restarts.increment(float(self._restarts))
        self.flush()
        self._thread.start()

    def record(self, record: FinishedRecord | PrefilledRecord) -> None:
        """Called on the response thread: just remember it."""
        with self._lock:
            self._pending.append(record)

    def stop(self) -> None:
        """Flush what is left, then delete the metrics before their families (Triton's rule)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.flush()
        self._metrics.clear()
        self._families.clear()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def flush(self) -> None:
        """Apply the latest snapshot and the finished requests since the last flush."""
        with self._lock:
            pending, self._pending = self._pending, []
        self._apply_stats(self._stats())
        if self._health is not None:
            h = self._health()
            self._metric("quanta_engine_healthy").set(1.0 if h.healthy else 0.0)
            self._metric("quanta_engine_seconds_since_step").set(h.seconds_since_step)
        if self._step_tokens is not None:
            for tokens in self._step_tokens():
                self._metric("quanta_iteration_tokens_total").observe(float(tokens))
        for rec in pending:
            if isinstance(rec, PrefilledRecord):
                self._count_prompt(rec.tenant, rec.priority_class, rec.num_prompt_tokens)
            else:
                self._apply_finished(rec)

    def _apply_stats(self, s: LoopStats) -> None:
        gauges = {
            ("quanta_num_requests_waiting", ()): s.num_waiting,
            ("quanta_num_requests_running", ()): s.num_running,
            ("quanta_num_requests_swapped", ()): s.num_swapped,
            ("quanta_kv_blocks_used", (("tier", "device"),)): s.device_blocks_used,
            ("quanta_kv_blocks_used", (("tier", "host"),)): s.host_blocks_used,
            ("quanta_kv_blocks_total", (("tier", "device"),)): s.device_blocks_total,
            ("quanta_kv_blocks_total", (("tier", "host"),)): s.host_blocks_total,
            ("quanta_hidden_cache_requests", ()): s.num_hidden_cache,
            ("quanta_hidden_cache_blocks_used", ()): s.hidden_blocks_used,
            ("quanta_checkpoint_blocks_used", ()): s.checkpoint_blocks_used,
            ("quanta_prefix_cache_blocks", (("tier", "device"),)): s.device_cached_blocks,
            ("quanta_prefix_cache_blocks", (("tier", "host"),)): s.host_cached_blocks,
        }
        for (name, labels), value in gauges.items():
            self._metric(name, labels).set(float(value))
        usage = s.device_blocks_used / s.device_blocks_total if s.device_blocks_total else 0.0
        self._metric("quanta_kv_cache_usage_perc").set(usage)
        last = self._last
        counters = {
            (name, labels): getattr(s, field) - (getattr(last, field) if last else 0)
            for name, labels, field in _LOOP_COUNTERS
        }
        for (name, labels), delta in counters.items():
            metric = self._metric(name, labels)  # created at 0 so it shows from the start
            if delta > 0:
                metric.increment(float(delta))
        self._last = s
        errors = state_errors()
        metric = self._metric("quanta_fairness_state_errors_total")
        if errors > self._state_errors:
            metric.increment(float(errors - self._state_errors))
            self._state_errors = errors

    def _apply_finished(self, rec: FinishedRecord) -> None:
        tenant = (("tenant", self._tenant(rec.tenant)),)
        cls = (("priority_class", rec.priority_class),)
        who = (*tenant, *cls)
        reason = (("reason", rec.finish_reason),)
        self._metric("quanta_request_finished_total", reason).increment(1.0)
        if rec.throttled:
            self._metric("quanta_request_throttled_total", tenant).increment(1.0)
        m = rec.metrics
        if m is None:
            return
        if m.num_output_tokens:
            self._metric("quanta_generation_tokens_total", who).increment(
                float(m.num_output_tokens)
            )
        if not rec.prompt_counted:
            self._count_prompt(rec.tenant, rec.priority_class, m.num_prompt_tokens)
        self._metric("quanta_request_prompt_tokens").observe(float(m.num_prompt_tokens))
        self._metric("quanta_request_generation_tokens").observe(float(m.num_output_tokens))
        self._observe_phases(m)
        service = 0 if rec.throttled else m.num_prompt_tokens + 2 * m.num_output_tokens
        if service:
            self._metric("quanta_tenant_service_tokens_total", tenant).increment(float(service))
        if m.first_scheduled_time is not None:
            self._metric("quanta_tenant_queue_time_seconds", tenant).observe(
                max(0.0, m.first_scheduled_time - m.arrival_time)
            )
        if m.first_token_time is not None:
            ttft = max(0.0, m.first_token_time - m.arrival_time)
            self._metric("quanta_time_to_first_token_seconds").observe(ttft)
            self._metric("quanta_tenant_time_to_first_token_seconds", tenant).observe(ttft)
            self._metric("quanta_class_time_to_first_token_seconds", cls).observe(ttft)
        if m.finish_time is not None:
            self._metric("quanta_e2e_request_latency_seconds").observe(
                max(0.0, m.finish_time - m.arrival_time)
            )
        if m.first_token_time is not None and len(m.token_times) > 1:
            decode_time = m.token_times[-1] - m.first_token_time
            tpot = max(0.0, decode_time / (len(m.token_times) - 1))
            self._metric("quanta_time_per_output_token_seconds").observe(tpot)
            self._metric("quanta_class_time_per_output_token_seconds", cls).observe(tpot)

    def _count_prompt(self, tenant: str, priority_class: str, tokens: int) -> None:
        who = (("tenant", self._tenant(tenant)), ("priority_class", priority_class))
        self._metric("quanta_prompt_tokens_total", who).increment(float(tokens))

    def _observe_phases(self, m: RequestMetrics) -> None:
        """The phase histograms of one finished request, as vLLM splits its life: queued,
        prefill (to the first token), decode (to the last), and each gap between tokens."""
        scheduled, first = m.first_scheduled_time, m.first_token_time
        if scheduled is not None:
            self._metric("quanta_request_queue_time_seconds").observe(
                max(0.0, scheduled - m.arrival_time)
            )
        if scheduled is None or first is None or not m.token_times:
            return
        last = m.token_times[-1]
        self._metric("quanta_request_prefill_time_seconds").observe(max(0.0, first - scheduled))
        self._metric("quanta_request_decode_time_seconds").observe(max(0.0, last - first))
        self._metric("quanta_request_inference_time_seconds").observe(max(0.0, last - scheduled))
        itl = self._metric("quanta_inter_token_latency_seconds")
        for before, after in zip(m.token_times, m.token_times[1:], strict=False):
            itl.observe(max(0.0, after - before))

    def _metric(self, name: str, labels: tuple[tuple[str, str], ...] = ()) -> Any:
        key = (name, labels)
        metric = self._metrics.get(key)
        if metric is None:
            buckets = FAMILIES[name][2]
            all_labels = {**self._labels, **dict(labels)}
            family = self._families[name]
            metric = (
                family.Metric(labels=all_labels, buckets=buckets)
                if buckets
                else family.Metric(labels=all_labels)
            )
            self._metrics[key] = metric
        return metric
