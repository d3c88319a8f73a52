"""``quanta bench engine`` against a built engine: it fits the run to the limits the engine was
built for and says so, or names the ``quanta build`` option to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quanta.bench.engine import STEP_TOKENS, fit_to_engine
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
    assert all(row["quanta_decode_tps"] > 0 for row in rows)
    assert all(row["greedy_agreement_fp32"] is not None for row in rows)  # from the checkpoint


def test_a_request_longer_than_the_engine_names_the_build_option(engine):
    result = bench(engine, "--batch", "1", "--prompt-len", "60", "--gen-len", "8")
    assert result.exit_code == 1
    said = " ".join(result.output.split())
    assert "exceed the max_seq_len 64" in said and "--max-seq-len 68" in said
    assert "Traceback" not in result.output


def test_every_run_computes_its_prompts_in_full(checkpoint):
    """The runs repeat the same prompts: with the prefix cache kept between them, every run
    after the first would time a prefill it never did."""
    from quanta.bench.engine import _prompts, _run_quanta
    from quanta.core.config import CacheConfig, EngineConfig
    from quanta.frontends.engine import build_engine

    cache = CacheConfig(num_device_blocks=32, num_host_blocks=0)
    engine = build_engine(EngineConfig(model=str(checkpoint), cache=cache))
    prompts = _prompts(2, 40, engine.model_config.vocab_size)
    first, again = (_run_quanta(engine, prompts, 2)[1] for _ in range(2))
    stats = engine.loop.stats()
    assert first == again
    assert stats.prefix_cache_queries == 2 * 2 * 40 and stats.prefix_cache_hits == 0
