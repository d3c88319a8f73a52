"""The prepared GPU run's harness (``quanta bench gpu``, ``bench/gpu/run.sh``): the bounds it
reads each engine against, the time budget it keeps, and a whole run at a tiny size on the
CPU. The run itself on a GPU is what bench/gpu/README.md describes."""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from dataclasses import asdict

import pytest
import torch
from quanta.build.presets import PRESETS
from quanta_lab.bench.gpu import (
    Budget,
    Pacer,
    Point,
    Settings,
    Timing,
    _point_report,
    _run_engine,
    _time_points,
    print_report,
    run_gpu_bench,
)
from quanta_lab.bench.gpu_card import Card, ShapeCost
from rich.console import Console


def test_a_decode_step_streams_every_weight_but_the_lookup_tables():
    params = {name: PRESETS[name].num_parameters() for name in PRESETS}
    bf16 = torch.bfloat16
    # untied: the embedding is looked up, the head streamed
    assert ShapeCost.of("llama-3-8b", bf16).weight_bytes == 2 * (
        params["llama-3-8b"] - 128256 * 4096
    )
    # tied: the one table is the head, streamed once
    assert ShapeCost.of("llama-3.2-1b", bf16).weight_bytes == 2 * params["llama-3.2-1b"]
    # OPT: tied, and its learned positions (2048 + 2 rows) are looked up
    assert ShapeCost.of("opt-13b", bf16).weight_bytes == 2 * (params["opt-13b"] - 2050 * 5120)


def test_the_bandwidth_bound_adds_each_sequences_kv():
    cost = ShapeCost.of("llama-3-8b", torch.bfloat16)
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    one = cost.decode_bound_s(1, 576, 3e12)
    assert one == pytest.approx((cost.weight_bytes + 576 * cost.kv_bytes_per_token) / 3e12)
    assert 4.9e-3 < one < 5.2e-3  # 15 GB of weights at 3 TB/s
    assert cost.decode_bound_s(64, 576, 3e12) - one == pytest.approx(
        63 * 576 * cost.kv_bytes_per_token / 3e12
    )


def test_prefill_flops_count_every_token_through_every_matrix():
    cost = ShapeCost.of("llama-3-8b", torch.bfloat16)
    one_token = 2 * cost.matmul_params + 2 * 32 * 4096 + 2 * cost.head_params
    assert cost.prefill_flops(1, 1) == one_token
    assert cost.prefill_flops(8, 512) > 8 * 512 * 2 * 6.9e9  # ~7B matmul weights per token


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_gives_each_part_its_share_of_what_is_left():
    clock = Clock()
    budget = Budget(300, clock)
    assert budget.part(3) == 100
    clock.now = 150  # the first part overran by 50
    assert budget.part(2) == 225  # the rest split evenly
    assert budget.part(1, until=225) == 225


def test_a_point_starts_only_if_the_last_one_scaled_ends_in_time():
    clock = Clock()
    pacer = Pacer(deadline=100, clock=clock)
    assert pacer.allows(1)

    def measure() -> Timing:
        clock.now += 20
        return Timing(1.0, 1.0)

    pacer.timed(1, measure)  # batch 1 took 20 s
    assert pacer.allows(4)  # 20 + 80 <= 100
    assert not pacer.allows(8)  # 20 + 160 > 100


def test_an_engine_that_fails_is_not_tried_at_larger_batches():
    """HF's continuous batching does not run OPT: one failure, said once, and no more tries."""
    settings = Settings(
        device="cpu", presets=("opt-tiny",), batches=(1, 2, 4), prompt_len=4, gen_len=2
    )
    points = [Point("opt-tiny", b, bound_step_s=1.0) for b in settings.batches]
    calls = []

    def measure(prompts):
        calls.append(len(prompts))
        raise RuntimeError("'PagedAttentionCache' object has no attribute 'get_seq_length'")

    _time_points("hf-cb", measure, points, settings, Pacer(deadline=1e9, clock=Clock()))
    assert calls == [1]
    assert points[0].skipped["hf-cb"].startswith("failed: RuntimeError: 'PagedAttentionCache'")
    assert [p.skipped["hf-cb"] for p in points[1:]] == ["not run: failed at batch 1"] * 2


def test_nothing_of_an_engine_outlives_its_turn(monkeypatch):
    """OPT-13B's weights and K/V fill an 80 GB card: the next engine loads only once the last
    one's are unreachable."""
    import quanta_lab.bench.gpu as gpu

    class Weights:
        pass

    alive = []

    @contextlib.contextmanager
    def engine(name, source, settings):
        weights = Weights()
        alive.append(weakref.ref(weights))
        yield lambda prompts: (weights, Timing(1.0, 1.0))[1]

    monkeypatch.setattr(gpu, "_engine", engine)
    settings = Settings(
        device="cpu", presets=("llama-tiny",), batches=(1,), prompt_len=4, gen_len=2
    )
    point = Point("llama-tiny", 1, bound_step_s=1.0)
    _run_engine("quanta", None, [point], settings, Pacer(deadline=1e9, clock=Clock()))
    gc.collect()
    assert point.timings["quanta"] == Timing(1.0, 1.0)
    assert alive[0]() is None


def test_an_engine_that_cannot_load_costs_only_itself(monkeypatch):
    import quanta_lab.bench.gpu as gpu

    @contextlib.contextmanager
    def engine(name, source, settings):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26 GiB")
        yield

    monkeypatch.setattr(gpu, "_engine", engine)
    settings = Settings(device="cpu", presets=("opt-13b",), batches=(1, 8), prompt_len=4, gen_len=2)
    points = [Point("opt-13b", b, bound_step_s=1.0) for b in settings.batches]
    _run_engine("hf-generate", None, points, settings, Pacer(deadline=1e9, clock=Clock()))
    assert {p.skipped["hf-generate"] for p in points} == {
        "failed to load: OutOfMemoryError: CUDA out of memory. Tried to allocate 26 GiB"
    }


def test_an_unknown_engine_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="unknown engines"):
        Settings(device="cpu", presets=("llama-tiny",), batches=(1,), prompt_len=4, gen_len=2,
                 engines=("vllm",))  # fmt: skip


def _report() -> dict:
    settings = Settings(
        device="cpu", presets=("llama-tiny",), batches=(8,), prompt_len=512, gen_len=129
    )
    card = Card("test", 2e12, 5e14)
    point = Point("llama-tiny", 8, bound_step_s=0.001)
    point.timings = {
        "quanta": Timing(prefill_s=0.5, decode_s=0.256),
        "hf-cb": Timing(prefill_s=1.0, decode_s=0.512),
    }
    point.skipped = {"hf-generate": "time budget"}
    row = _point_report(point, settings, ShapeCost.of("llama-tiny", torch.bfloat16), card)
    return {
        "card": asdict(card),
        "settings": asdict(settings),
        "tests": "26 passed",
        "points": [row],
    }


def test_a_point_reports_rates_bounds_and_ratios_to_each_peer():
    row = _report()["points"][0]
    quanta = row["engines"]["quanta"]
    assert quanta["prefill_tps"] == pytest.approx(8 * 512 / 0.5)
    assert quanta["decode_tps"] == pytest.approx(8 * 128 / 0.256)
    assert quanta["step_ms"] == pytest.approx(2.0) and quanta["step_over_bound"] == pytest.approx(
        2.0
    )
    assert row["ratios"] == {
        "decode_vs_hf-cb": pytest.approx(2.0),
        "prefill_vs_hf-cb": pytest.approx(2.0),
    }
    assert row["skipped"] == {"hf-generate": "time budget"}


def test_the_report_prints_both_tables_and_what_was_not_measured():
    console = Console(record=True, width=200)
    print_report(_report(), console)
    text = console.export_text()
    assert "decode tok/s" in text and "prefill tok/s" in text and "GPU tests: 26 passed" in text
    assert "4000 (2.00, 2.00x)" in text and "2.00x" in text
    assert "not measured: llama-tiny batch 8 hf-generate: time budget" in text


@pytest.mark.engine
def test_a_tiny_run_on_the_cpu_times_every_engine_it_is_given(tmp_path):
    settings = Settings(
        device="cpu",
        presets=("llama-tiny",),
        batches=(1, 2),
        prompt_len=8,
        gen_len=3,
        engines=("quanta", "hf-generate"),
        copy_mib=4,
        gemm_n=64,
    )
    report = run_gpu_bench(settings)
    json.dumps(report)  # what --output writes
    assert report["card"]["bandwidth"] > 0 and report["card"]["gemm_flops"] > 0
    assert [p["batch"] for p in report["points"]] == [1, 2]
    for p in report["points"]:
        assert set(p["engines"]) == {"quanta", "hf-generate"}, p["skipped"]
        assert "decode_vs_hf-generate" in p["ratios"]
