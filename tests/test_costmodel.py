"""The cost model: presets consistent with the published figures, JSON profiles, purity."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.costmodel import (
    PROFILES,
    CostModel,
    available_profiles,
    get_profile,
    load_profile,
    save_profile,
    tensor_parallel,
)

LAYERS_HIDDEN = {
    "a100-opt13b": (40, 5120),
    "a100x4-opt66b": (64, 9216),
    "a100x16-opt175b": (96, 12288),
    "a100-llama7b": (32, 4096),
}


def test_presets_exist():
    assert available_profiles() == sorted(LAYERS_HIDDEN)


@pytest.mark.parametrize("name", sorted(LAYERS_HIDDEN))
def test_kv_bytes_per_token_follows_fastserve(name):
    layers, hidden = LAYERS_HIDDEN[name]
    assert PROFILES[name].kv_bytes_per_token == 4 * layers * hidden


@pytest.mark.parametrize("name", sorted(LAYERS_HIDDEN))
def test_decode_iterations_are_tens_of_ms_and_prefill_grows(name):
    m = PROFILES[name]
    assert 0.010 <= m.min_iteration_time <= m.decode_time(16, 16 * 500) <= 0.100
    times = [m.prefill_time(n) for n in (1, 128, 256, 512, 1024, 2048)]
    assert times == sorted(times) and times[-1] > 4 * times[2]
    assert m.prefill_time(1) == pytest.approx(m.min_iteration_time)


def test_opt175b_matches_the_papers_swap_example():
    """FastServe §4.2: a 512-token OPT-175B job holds ~2.3 GB (GiB), swapped in ~36 ms;
    a decode iteration takes ~60 ms."""
    m = PROFILES["a100x16-opt175b"]
    assert m.kv_bytes_per_token * 512 / 2**30 == pytest.approx(2.25, abs=0.05)
    assert m.swap_time(512 // 16, 16) == pytest.approx(0.036, rel=0.1)
    assert m.decode_time(16, 16 * 500) == pytest.approx(0.060, rel=0.1)


def test_llama7b_has_a_4k_context_and_about_40k_tokens_of_kv():
    """LLaMA-2-7B on an A100-40GB: 0.5 MB of fp16 K+V per token, ~20 GB for KV."""
    m = PROFILES["a100-llama7b"]
    assert m.max_model_len == 4096
    assert m.kv_bytes_per_token == 512 * 1024
    device, _ = m.num_blocks(16)
    assert 35_000 <= device * 16 <= 42_000


# A CPU-engine-like profile: every term of the formula is non-zero.
CPU_LIKE = PROFILES["a100-opt13b"].model_copy(
    update={
        "step_overhead_s": 4e-4,
        "per_attention_call_s": 8e-5,
        "decode_pad_per_token_s": 4e-7,
        "swap_overlaps_compute": False,
    }
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000)), min_size=1, max_size=20),
    st.sampled_from(["a100-opt13b", "cpu-like"]),
)
def test_shares_add_up_to_the_step(chunks, name):
    m = CPU_LIKE if name == "cpu-like" else PROFILES[name]
    assert sum(m.shares(chunks)) == pytest.approx(m.step_time(chunks), rel=1e-9)


def test_cpu_engine_terms_count_attention_calls_and_padded_decode_slots():
    """One attention call per prefill chunk plus one for all decode rows; decode rows are
    padded to the longest decode context."""
    base = PROFILES["a100-opt13b"]
    calls = base.model_copy(update={"per_attention_call_s": 1.0})
    chunks = [(100, 0), (50, 20), (1, 10), (1, 300)]
    assert calls.step_time(chunks) - base.step_time(chunks) == pytest.approx(3.0)
    assert calls.step_time([(1, 5)] * 8) - base.step_time([(1, 5)] * 8) == pytest.approx(1.0)
    pad = base.model_copy(update={"decode_pad_per_token_s": 1.0})
    assert pad.step_time(chunks) - base.step_time(chunks) == pytest.approx(2 * 301)
    assert pad.step_time([(64, 0)]) == base.step_time([(64, 0)])  # prefills are not padded


def test_a_decode_token_riding_with_a_long_prefill_pays_about_a_decode_tokens_share():
    m = PROFILES["a100-opt13b"]
    alone = m.shares([(1, 500)] * 16)[0]
    beside_prefill = m.shares([(1, 500), (2000, 0)])[0]
    assert beside_prefill < 2 * alone < m.step_time([(1, 500), (2000, 0)]) / 10


def test_opt13b_fits_its_a100_and_uses_pcie4():
    m = PROFILES["a100-opt13b"]
    assert m.swap_bandwidth == pytest.approx(25e9)
    device, host = m.num_blocks(16)
    assert 800 <= device <= 1000  # ~12 GB of KV at 0.8 MB per token
    assert host > device


def test_step_time_mixes_prefill_and_decode():
    m = PROFILES["a100-opt13b"]
    mixed = m.step_time([(512, 0), (1, 300), (1, 40)])
    assert mixed > m.prefill_time(512)
    assert mixed < m.prefill_time(512) + m.decode_time(2, 342)  # one weight read, not two
    assert m.step_time([]) == 0.0


def test_json_round_trip_and_lookup(tmp_path):
    m = PROFILES["a100x4-opt66b"]
    path = save_profile(m, tmp_path / "p.json")
    assert load_profile(path) == m
    assert load_profile("a100x4-opt66b") is m
    assert get_profile(m.model_dump()) == m
    assert get_profile(m) is m
    with pytest.raises(ValueError, match="a100-opt13b"):
        get_profile("h100-nope")
    with pytest.raises(ValueError, match="neither a preset"):
        load_profile(tmp_path / "missing.json")


def test_invalid_profiles_are_rejected():
    with pytest.raises(ValueError):
        CostModel.model_validate({**PROFILES["a100-opt13b"].model_dump(), "swap_bandwidth": 0})


def test_cost_model_and_policies_stay_torch_free():
    code = (
        "import sys, quanta.policies, quanta.costmodel, quanta.sim; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_quantized_preset_reads_fewer_weight_bytes_and_nothing_else_changes():
    from quanta.costmodel import QUANTIZED_BYTES_PER_PARAM, get_profile, load_profile

    base = get_profile("a100-opt13b")
    int4 = get_profile("a100-opt13b@int4")
    assert load_profile("a100-opt13b@int4") == int4
    assert int4.weights_read_s == pytest.approx(
        base.weights_read_s * QUANTIZED_BYTES_PER_PARAM["int4"] / 2
    )
    assert int4.compute_per_token_s == base.compute_per_token_s
    assert int4.kv_bytes_per_token == base.kv_bytes_per_token  # the KV cache stays float
    assert int4.step_time([(1, 512)]) < base.step_time([(1, 512)])
    with pytest.raises(ValueError, match="NAME@int8"):
        get_profile("a100-opt13b@int3")


def test_tensor_parallel_splits_the_work_and_adds_the_allreduces():
    one = get_profile("a100-opt13b")
    assert tensor_parallel(one, 1) is one
    assert one.allreduce_time(512) == 0.0
    two, four = tensor_parallel(one, 2), tensor_parallel(one, 4)
    assert two.tensor_parallel_size == 2 and two.allreduce_calls == 2 * one.num_layers
    assert two.weights_read_s == pytest.approx(one.weights_read_s / 2)
    # a ring moves 2 (N-1)/N of hidden x fp16 per token per call: 5120 x 2 bytes on OPT-13B
    per_call = 2 * (1 / 2) * 2 * 5120 * 100 / two.allreduce_bandwidth
    assert two.allreduce_time(100) == pytest.approx(80 * (two.allreduce_latency_s + per_call))
    assert four.allreduce_time(100) > two.allreduce_time(100)
    # decode gets faster, but by less than the split: the all-reduces and overheads remain
    d1, d2, d4 = (m.decode_time(32, 32 * 600) for m in (one, two, four))
    assert d1 > d2 > d4 > d1 / 4
    assert sum(two.shares([(1, 99), (64, 0)])) == pytest.approx(two.step_time([(1, 99), (64, 0)]))
    assert two.num_blocks(16)[0] > 2 * one.num_blocks(16)[0]  # the weights are paid once
    with pytest.raises(ValueError, match="already split"):
        tensor_parallel(two, 2)


def test_simulate_plans_a_tensor_parallel_deployment(tmp_path):
    from quanta.cli import app
    from typer.testing import CliRunner

    out = tmp_path / "tp.json"
    args = ["simulate", "--profile", "a100-opt13b", "--num-requests", "40", "--rate", "4"]
    result = CliRunner().invoke(app, [*args, "--tp-size", "4", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["profile"] == "a100-opt13b@tp4"
