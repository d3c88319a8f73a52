"""Every metric formula on hand-computed cases, and the adapters from client and loop."""

from __future__ import annotations

import math

import pytest
from quanta.metrics import (
    SLO,
    RequestRecord,
    attains_slo,
    flat_metrics,
    from_client_results,
    from_requests,
    goodput,
    jain_index,
    json_safe,
    max_rate_meeting,
    meets_slo,
    per_class,
    per_tenant,
    percentile,
    service,
    slo_attainment,
    span,
    stats,
    summarize,
    throughput,
)
from quanta.workloads import WorkloadRequest


def rec(rid, arrival, times, end=None, n=None, **kw) -> RequestRecord:
    times = tuple(times)
    return RequestRecord(
        rid,
        arrival,
        times,
        times[-1] if end is None else end,
        len(times) if n is None else n,
        **kw,
    )


# r1: arrival 0, tokens at 0.5, 0.7, 1.0, 1.6 -> TTFT 0.5, E2E 1.6, TPOT 1.1/3, ITL .2 .3 .6
R1 = rec("r1", 0.0, (0.5, 0.7, 1.0, 1.6), num_prompt_tokens=10, tenant="a")
# r2: arrival 1, tokens at 1.2, 1.4, 3.0 -> TTFT 0.2, E2E 2.0, TPOT 0.9, ITL .2 1.6
R2 = rec("r2", 1.0, (1.2, 1.4, 3.0), num_prompt_tokens=4, tenant="b")
# r3: arrival 2, one token at 2.3, ends 2.5 -> TTFT 0.3, no TPOT, normalized 0.5
R3 = rec("r3", 2.0, (2.3,), end=2.5, num_prompt_tokens=7, tenant="b", priority_class="offline")
# r4: failed after one token
R4 = rec("r4", 3.0, (3.1,), end=3.4, n=1, tenant="a", error="RuntimeError: boom")


def test_per_request_formulas():
    assert R1.ttft == pytest.approx(0.5)
    assert R1.e2e == pytest.approx(1.6)
    assert R1.tpot == pytest.approx(1.1 / 3)
    assert R1.itl == pytest.approx([0.2, 0.3, 0.6])
    assert R1.normalized_latency == pytest.approx(0.4)
    assert R1.p99_tbt == pytest.approx(0.3 + 0.3 * 0.98)  # k = 2 * 0.99 = 1.98
    assert R2.tpot == pytest.approx(0.9) and R2.normalized_latency == pytest.approx(2 / 3)
    assert R3.tpot is None and R3.p99_tbt is None and R3.normalized_latency == pytest.approx(0.5)
    empty = RequestRecord("e", 0.0, (), 1.0, 0)
    assert empty.ttft is None and empty.tpot is None and empty.normalized_latency is None
    assert not R4.ok and not RequestRecord("n", 0.0, (0.1,), math.nan, 1).ok


def test_percentiles_and_stats():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([7], 99) == 7 and math.isnan(percentile([], 50))
    s = stats([1.0, None, 3.0])
    assert s == {"mean": 2.0, "p50": 2.0, "p95": pytest.approx(2.9), "p99": pytest.approx(2.98)}
    assert all(math.isnan(v) for v in stats([]).values())
    np = pytest.importorskip("numpy")
    xs = [0.3, 1.7, 0.2, 9.0, 4.4, 4.4, 0.0]
    for p in (50, 95, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_throughput_over_the_span_of_finished_requests():
    records = [R1, R2, R3, R4]
    assert span(records) == pytest.approx(3.0)  # arrival 0 .. end 3.0 (R4 failed)
    rps, tps = throughput(records)
    assert rps == pytest.approx(3 / 3.0) and tps == pytest.approx((4 + 3 + 1) / 3.0)
    assert all(math.isnan(x) for x in throughput([R4]))


def test_goodput_and_slo_attainment():
    slo = SLO(ttft_s=0.4, tpot_s=1.0)
    # DistServe: TTFT and TPOT. R1 misses TTFT (0.5); R2 meets (0.2, 0.9); R3 meets (0.3, -)
    assert [meets_slo(r, slo) for r in (R1, R2, R3, R4)] == [False, True, True, False]
    assert goodput([R1, R2, R3, R4], slo) == pytest.approx(2 / 3.0)
    # Apt-Serve: TTFT and the request's P99 TBT. R2's gaps .2 and 1.6: P99 = 1.586 > 1.0
    assert [attains_slo(r, slo) for r in (R1, R2, R3, R4)] == [False, False, True, False]
    assert slo_attainment([R1, R2, R3, R4], slo) == pytest.approx(1 / 4)  # failures count
    loose = SLO(ttft_s=1.0, tpot_s=0.5, tbt_s=2.0)
    assert [attains_slo(r, loose) for r in (R1, R2, R3)] == [True, True, True]
    assert [meets_slo(r, loose) for r in (R1, R2, R3)] == [True, False, True]
    # A request's own SLOs override the run's (both TPOT and TBT).
    own = rec("o", 0.0, (0.5, 0.7, 1.6), ttft_slo_s=0.6, tpot_slo_s=0.6)
    assert meets_slo(own, slo) and not attains_slo(own, slo)  # TPOT .55, P99 TBT .89
    assert math.isnan(slo_attainment([], slo))
    with pytest.raises(ValueError):
        SLO(0.0, 1.0)


def test_max_rate_meeting_a_goal():
    points = [(1.0, 0.99), (3.0, 0.5), (2.0, 0.95)]
    assert max_rate_meeting(points, 0.9) == 2.0
    assert max_rate_meeting(points, 0.9, interpolate=True) == pytest.approx(2 + 0.05 / 0.45)
    assert max_rate_meeting([(1.0, 0.8), (2.0, 0.95)], 0.9) is None
    assert max_rate_meeting([(1.0, 0.95), (2.0, 0.8), (3.0, 0.95)], 0.9) == 1.0
    assert max_rate_meeting([(1.0, 0.95), (2.0, 0.92)], 0.9, interpolate=True) == 2.0


def test_jain_index_and_service():
    assert jain_index([1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([2, 1]) == pytest.approx(9 / 10)
    assert math.isnan(jain_index([])) and math.isnan(jain_index([0, 0]))
    assert service(R1) == 10 + 2 * 4
    assert service(R1, input_weight=0.5, output_weight=1) == 5 + 4
    assert service(R4) == 2 * 1  # prompt unknown: only what reached the client
    assert service(RequestRecord("q", 0.0, (), math.nan, 0, 50, error="cancelled")) == 0


def test_per_tenant_and_per_class():
    slo = SLO(ttft_s=0.4, tpot_s=1.0)
    out = per_tenant([R1, R2, R3, R4], slo)
    a, b = out["tenants"]["a"], out["tenants"]["b"]
    assert (a["num_requests"], a["num_finished"], a["num_errors"]) == (2, 1, 1)
    assert a["service"] == 18 + 2 and b["service"] == (4 + 6) + (7 + 2)
    assert a["service_share"] == pytest.approx(20 / 39)
    assert out["jain_service"] == pytest.approx(39**2 / (2 * (20**2 + 19**2)))
    assert b["slo_attainment"] == pytest.approx(0.5)
    assert b["normalized_latency_s"]["mean"] == pytest.approx((2 / 3 + 0.5) / 2)
    lat = [0.4, (2 / 3 + 0.5) / 2]
    assert out["jain_normalized_latency"] == pytest.approx(jain_index(lat))
    classes = per_class([R1, R2, R3, R4], slo)
    assert set(classes) == {"online", "offline"}
    assert classes["offline"]["num_requests"] == 1
    assert classes["online"]["ttft_s"]["mean"] == pytest.approx(0.35)


def test_summarize_and_flat_metrics():
    slo = SLO(ttft_s=0.4, tpot_s=1.0)
    s = summarize([R1, R2, R3, R4], slo)
    assert (s["num_requests"], s["num_finished"], s["num_errors"]) == (4, 3, 1)
    assert s["ttft_s"]["mean"] == pytest.approx((0.5 + 0.2 + 0.3) / 3)
    assert s["tpot_s"]["mean"] == pytest.approx((1.1 / 3 + 0.9) / 2)
    assert s["itl_s"]["mean"] == pytest.approx((0.2 + 0.3 + 0.6 + 0.2 + 1.6) / 5)
    assert s["e2e_s"]["p50"] == pytest.approx(1.6)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((0.4 + 2 / 3 + 0.5) / 3)
    assert s["goodput_rps"] == pytest.approx(2 / 3) and s["slo_attainment"] == 0.25
    assert s["slo"] == {"ttft_s": 0.4, "tpot_s": 1.0, "tbt_s": 1.0}
    assert set(s["by_class"]) == {"online", "offline"} and "tenants" in s["by_tenant"]
    flat = flat_metrics([R1, R2, R3, R4])
    assert flat["mean_ttft"] == s["ttft_s"]["mean"]
    assert flat["p95_normalized_latency"] == s["normalized_latency_s"]["p95"]
    assert flat["throughput_rps"] == pytest.approx(1.0) and flat["num_finished"] == 3
    safe = json_safe({"x": math.nan, "y": (1.0, math.inf), "z": "s"})
    assert safe == {"x": None, "y": [1.0, None], "z": "s"}


def test_from_client_results_and_their_summary():
    client = pytest.importorskip("quanta.bench.client")
    results = [
        client.ClientResult("a", 0.0, "t1", None, send_s=0.1, chunk_s=[0.4, 0.5, 0.9], end_s=1.0,
                            num_output_tokens=3, num_prompt_tokens=8),
        client.ClientResult("b", 0.5, "t2", "offline", send_s=0.5, chunk_s=[0.7, 0.75], end_s=0.8,
                            num_output_tokens=4),
        client.ClientResult("c", 0.6, "t1", None, send_s=0.6, end_s=0.9, error="HTTP 503"),
    ]  # fmt: skip
    workload = [WorkloadRequest(0.5, 12, 4, "b", app="code", ttft_slo_ms=100)]
    records = from_client_results(results, workload)
    a, b, c = records
    assert a.arrival == 0.1 and a.ttft == pytest.approx(0.3) and a.priority_class == "online"
    assert (b.app, b.num_prompt_tokens, b.ttft_slo_s, b.tpot_slo_s) == ("code", 12, 0.1, None)
    assert b.tpot == pytest.approx(0.1 / 3) and not c.ok
    assert from_client_results([r.to_dict() for r in results], workload) == records
    s = summarize(records)
    assert (s["num_requests"], s["num_finished"], s["num_errors"]) == (3, 2, 1)
    assert s["duration_s"] == pytest.approx(0.9)  # first send 0.1 .. last finished end 1.0
    assert s["request_throughput"] == pytest.approx(2 / 0.9)
    assert s["output_token_throughput"] == pytest.approx(7 / 0.9)
    assert s["ttft_s"]["mean"] == pytest.approx((0.3 + 0.2) / 2)
    assert s["e2e_s"]["mean"] == pytest.approx((0.9 + 0.3) / 2)
    assert s["tpot_s"]["mean"] == pytest.approx(((0.9 - 0.3) / 2 + (0.3 - 0.2) / 3) / 2)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((0.9 / 3 + 0.3 / 4) / 2)
    assert sorted(s["itl_s"].keys()) == ["mean", "p50", "p95", "p99"]
    assert s["itl_s"]["mean"] == pytest.approx((0.1 + 0.4 + 0.05) / 3)


def test_from_requests_and_the_simulators_flat_keys():
    from quanta.core.request import Request, RequestMetadata, SamplingParams

    meta = RequestMetadata(tenant="t", app="a", priority_class="offline", ttft_slo_ms=250)
    done = Request("x", [1, 2, 3], SamplingParams(max_tokens=3), 1.0, 0, metadata=meta)
    for i, t in enumerate((1.5, 1.75, 2.5)):
        done.append_token(7 + i, t)
    done.finish_time = 2.5
    done.attained_service = 1.0
    pending = Request("y", [1], SamplingParams(max_tokens=3), 2.0, 0)
    x, y = from_requests([done, pending])
    assert (x.arrival, x.token_times, x.end, x.num_output_tokens) == (1.0, (1.5, 1.75, 2.5), 2.5, 3)
    assert (x.tenant, x.app, x.priority_class, x.ttft_slo_s) == ("t", "a", "offline", 0.25)
    assert x.num_prompt_tokens == 3 and x.tpot == pytest.approx(0.5) and x.ok
    assert y.error == "not finished" and not y.ok
    sim = pytest.importorskip("quanta.sim.metrics")
    theirs = sim.request_metrics([done, pending])
    ours = flat_metrics([x, y])
    shared = [k for k in theirs if k in ours]
    assert len(shared) >= 12
    for key in shared:
        assert ours[key] == pytest.approx(theirs[key], nan_ok=True), key
