"""The layer kit's families end to end: a checkpoint transformers itself wrote goes through
``quanta build`` and generates through ``quanta.LLM`` the greedy tokens HF generates; and each
family's tiny preset is written by ``quanta make-model`` and loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import quanta
import torch
from quanta import SamplingParams
from quanta.build.presets import PRESETS
from quanta.build.tokenizer import write_tokenizer
from quanta.cli import app
from runner_helpers import TINY_KIT_CONFIG, hf_greedy, widen_weights
from typer.testing import CliRunner

WINDOW = 8
COMMON = TINY_KIT_CONFIG
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "mistral": {"head_dim": 16, "sliding_window": WINDOW},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW},
}
KIT_FAMILIES = ("qwen2", "qwen3", "mistral", "phi3", "gemma2")


def _hf_checkpoint(family: str, path: Path) -> Any:
    """A random fp32 checkpoint written by transformers from the family's config, plus a
    tokenizer (transformers writes none; ``quanta build`` checks the one it finds)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(family, path, model_max_length=COMMON["max_position_embeddings"])
    return model


@pytest.mark.engine
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_checkpoint_builds_and_generates_hf_tokens(family, tmp_path):
    hf_model = _hf_checkpoint(family, tmp_path / "ckpt")
    out = tmp_path / "engine"
    args = ["build", str(tmp_path / "ckpt"), "--out", str(out), "--max-seq-len", "128"]
    result = CliRunner().invoke(
        app, [*args, "--kv-cache-memory", "1MiB", "--host-cache-memory", "256KiB"]
    )
    assert result.exit_code == 0, result.output
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 19, 33)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with quanta.LLM(str(out)) as llm:
        got = [r.token_ids for r in llm.generate(prompts, greedy)]
    for prompt, tokens in zip(prompts, got, strict=True):
        expected = hf_greedy(hf_model, prompt, 24)
        assert tokens[: len(expected)] == expected, family


@pytest.mark.parametrize("family", KIT_FAMILIES)
def test_make_model_writes_each_tiny_preset_and_it_loads(family, tmp_path):
    preset = f"{family}-tiny"
    assert preset in PRESETS
    out = tmp_path / preset
    result = CliRunner().invoke(app, ["make-model", preset, "--out", str(out)])
    assert result.exit_code == 0, result.output
    with quanta.LLM(str(out), kv_cache_memory="1MiB", host_cache_memory="0") as llm:
        [done] = llm.generate("Hello there", SamplingParams(max_tokens=4, temperature=0.0))
    assert done.error is None and len(done.token_ids) >= 1


@pytest.mark.parametrize(
    ("family", "overrides", "named"),
    [
        ("qwen2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ("gemma2", {"attn_implementation": "flash_attention_2"}, "'flash_attention_2'"),
    ],
)
def test_what_the_runner_cannot_serve_is_refused_by_name(family, overrides, named, tmp_path):
    """A config option the runner does not serve stops the build, named, before any file."""
    ckpt = tmp_path / "ckpt"
    _hf_checkpoint(family, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | overrides))
    result = CliRunner().invoke(app, ["build", str(ckpt), "--out", str(tmp_path / "engine")])
    assert result.exit_code == 1 and named in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "engine").exists()
