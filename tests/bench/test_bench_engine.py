"""``quanta bench engine`` against a built engine: it fits the run to the limits the engine was
built for and says so, or names the ``quanta build`` option to change."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from quanta.bench.engine import STEP_TOKENS, fit_to_engine, paired_rates
from quanta.build.checkpoint import ensure_checkpoint
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.cli import app
from typer.testing import CliRunner

pytestmark = pytest.mark.engine

LIMITS = {"max_batch_size": 4, "max_num_tokens": 32, "max_seq_len": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return ensure_checkpoint("opt-tiny", tmp_path_factory.mktemp("ckpt") / "opt-tiny")


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory) -> Path:
    """A bf16 engine with small limits: the fp32 reference must come from its checkpoint."""
    out = tmp_path_factory.mktemp("engines") / "small"
    options = BuildOptions(dtype="bfloat16", kv_cache_memory=1 << 22, **LIMITS)
    build_engine_dir(checkpoint, out, options)
    return out


def bench(model: Path, *args: str):
    cmd = ["bench", "engine", "--model", str(model), "--no-compare-hf", "--repeat", "1"]
    return CliRunner().invoke(app, [*cmd, *args])


def decode_measured(rate: float | None) -> bool:
    """A rate, or NaN (null in the JSON file) where no round's full run outlasted its
    prefill-only run (said in a note): a run of one round with a few tokens on a busy machine
    can measure no decode."""
    return rate is None or math.isnan(rate) or rate > 0


def test_a_plain_checkpoint_runs_as_asked(checkpoint):
    plan = fit_to_engine(checkpoint, [1, 8, 32], prompt_len=128, gen_len=128)
    assert (plan.batches, plan.max_num_batched_tokens, plan.notes) == ([1, 8, 32], STEP_TOKENS, ())


def test_batch_and_step_budget_are_clamped_to_the_engine_and_said(engine, tmp_path):
    out = tmp_path / "rows.json"
    result = bench(
        engine, "--batch", "1,8", "--prompt-len", "16", "--gen-len", "4", "--output", str(out)
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "batch 8 is over the max_batch_size 4" in said
    assert "measuring 1, 4 (rebuild with --max-batch-size 8" in said
    assert "step budget 32 tokens" in said and "--max-num-tokens 64" in said
    rows = json.loads(out.read_text())
    assert [row["batch"] for row in rows] == [1, 4]
    assert all(decode_measured(row["quanta_decode_tps"]) for row in rows)
    assert all(row["greedy_agreement_fp32"] is not None for row in rows)  # from the checkpoint


def test_a_request_longer_than_the_engine_names_the_build_option(engine):
    result = bench(engine, "--batch", "1", "--prompt-len", "60", "--gen-len", "8")
    assert result.exit_code == 1
    said = " ".join(result.output.split())
    assert "exceed the max_seq_len 64" in said and "--max-seq-len 68" in said
    assert "Traceback" not in result.output


def test_the_panel_kernel_is_timed_against_an_fp32_reference(engine):
    """``--linear-kernel native`` runs bf16 only; its fp32 reference takes fp32's kernel."""
    from quanta.runner import panel_linear

    if not panel_linear.supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no panel kernel (AVX512_BF16 and a C compiler)")
    result = bench(engine, "--batch", "1", "--prompt-len", "8", "--gen-len", "4",
                   "--linear-kernel", "native")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_every_run_computes_its_prompts_in_full(checkpoint):
    """The runs repeat the same prompts: with the prefix cache kept between them, every run
    after the first would time a prefill it never did."""
    from quanta.bench.engine import _prompts, run_quanta
    from quanta.core.config import CacheConfig, EngineConfig
    from quanta.frontends.engine import build_engine

    cache = CacheConfig(num_device_blocks=32, num_host_blocks=0)
    engine = build_engine(EngineConfig(model=str(checkpoint), cache=cache))
    prompts = _prompts(2, 40, engine.model_config.vocab_size)
    first, again = (run_quanta(engine, prompts, 2)[1] for _ in range(2))
    stats = engine.loop.stats()
    assert first == again
    assert stats.prefix_cache_queries == 2 * 2 * 40 and stats.prefix_cache_hits == 0


def test_a_preset_runs_with_random_weights_made_on_the_device(tmp_path):
    """``--preset``: no checkpoint on disk; both engines get the shape's random weights."""
    out = tmp_path / "rows.json"
    args = ["--preset", "llama-tiny", "--device", "cpu", "--batch", "1,2", "--prompt-len", "8"]
    result = CliRunner().invoke(
        app, ["bench", "engine", *args, "--gen-len", "3", "--repeat", "1", "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "llama-tiny: prompt 8" in " ".join(result.output.split())
    rows = json.loads(out.read_text())
    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["quanta_prefill_tps"] > 0 and row["hf_prefill_tps"] > 0 for row in rows)
    assert all(
        decode_measured(row[k]) for row in rows for k in ("quanta_decode_tps", "hf_decode_tps")
    )


def test_a_model_and_a_preset_together_are_refused():
    both = ["bench", "engine", "--model", "engines/x", "--preset", "llama-tiny"]
    for args in (both, ["bench", "engine"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "--model or --preset" in result.output


# A prefill-only run of 1.0 s and a decode part of 4.0 s, every round slowed: one round's
# prefill run by 3 s while its full run ran almost clean.
SLOWED_ROUNDS = [(2.5, 6.5), (2.0, 6.0), (5.0, 5.2)]


def test_decode_is_each_rounds_own_full_minus_prefill_run():
    """Best full minus best prefill would be 5.2 - 2.0 = 3.2 s (and the shortest round's
    difference 0.2 s): the median of each round's own difference is the 4.0 s decode part."""
    prefill_tps, decode_tps = paired_rates(SLOWED_ROUNDS, batch=2, prompt_len=16, gen_len=9)
    assert prefill_tps == pytest.approx(2 * 16 / 2.0)  # the shortest prefill-only run
    assert decode_tps == pytest.approx(2 * 8 / 4.0)


def test_rounds_that_measured_no_decode_are_dropped():
    rounds = [(1.0, 5.0), (3.0, 2.9)]  # the second full run was shorter than its prefill run
    assert paired_rates(rounds, 1, 8, 5)[1] == pytest.approx(4 / 4.0)
    assert math.isnan(paired_rates([(3.0, 2.9)], 1, 8, 5)[1])
