"""The layer kit's presets against transformers' own models of the same config: the ~100M
benchmark shapes and the real-model shapes store exactly the tensors HF's model has, a shape
whose heads are wider than its hidden size (Gemma-2-2B's, Qwen3-0.6B's) serves HF's tokens, and
``quanta make-model`` writes each benchmark shape in bf16 as a checkpoint HF and the engine
load and agree on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from quanta.build.checkpoint import hf_config, make_checkpoint, tensor_specs
from quanta.build.presets import PRESETS, TINY_VOCAB_SIZE, ModelPreset
from quanta.cli import app
from quanta.runner import ModelRunner
from quanta.shape import ModelShape
from runner_helpers import FakeRequest, ToyScheduler, hf_greedy, widen_weights
from typer.testing import CliRunner

BENCH = ["qwen2-100m", "mistral-100m", "phi3-100m", "gemma2-100m", "qwen3-100m"]
REAL = ["qwen2.5-0.5b", "qwen3-0.6b", "qwen3-8b", "mistral-7b", "phi3-mini", "gemma-2-2b"]


def _hf_meta_model(preset: ModelPreset) -> torch.nn.Module:
    """transformers' model of the preset's config.json, on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = hf_config(preset)
    config = AutoConfig.for_model(str(raw.pop("model_type")), **raw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("name", BENCH + REAL)
def test_a_preset_stores_what_transformers_model_holds(name: str) -> None:
    preset = PRESETS[name]
    hf = {k: tuple(v.shape) for k, v in _hf_meta_model(preset).state_dict().items()}
    ours = {key: shape for key, shape, _ in tensor_specs(preset)}
    if "lm_head.weight" not in ours:  # tied: save_pretrained stores the embedding once
        assert hf.pop("lm_head.weight") == ours["model.embed_tokens.weight"]
    assert ours == hf


def test_the_published_shapes_have_their_published_sizes() -> None:
    sizes = {name: PRESETS[name].num_parameters() for name in BENCH + REAL}
    assert sizes["qwen3-0.6b"] == 596_049_920  # Qwen/Qwen3-0.6B, tied
    assert sizes["gemma-2-2b"] == 2_614_341_888  # google/gemma-2-2b
    assert PRESETS["qwen3-0.6b"].shape.head_dim == 128  # 16 heads of 128 over a hidden of 1024
    gemma = hf_config(PRESETS["gemma-2-2b"])
    assert (gemma["head_dim"], gemma["query_pre_attn_scalar"], gemma["sliding_window"]) == (
        256,
        256,
        4096,
    )
    assert (gemma["attn_logit_softcapping"], gemma["final_logit_softcapping"]) == (50.0, 30.0)
    # Comparable benchmark shapes: llama-100m's, give or take what each family adds or ties.
    assert all(
        95e6 < sizes[n] < 106e6 for n in ("qwen2-100m", "mistral-100m", "phi3-100m", "qwen3-100m")
    )
    assert 74e6 < sizes["gemma2-100m"] < 76e6  # its LM head is its embedding


def _wide_heads(family: str) -> ModelPreset:
    """A tiny preset whose 4 heads of 32 are twice its hidden size, as Qwen3-0.6B's are."""
    shape = ModelShape(
        family=family,
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=256,
    )
    return ModelPreset(name=f"{family}-wide", shape=shape, rope_theta=1e4, rms_norm_eps=1e-6)


def test_opt_refuses_a_head_dim_its_config_cannot_state() -> None:
    opt = PRESETS["opt-tiny"].model_dump()
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        ModelPreset.model_validate(opt | {"shape": opt["shape"] | {"head_dim": 32}})


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB_SIZE - 1, (length,), generator=gen).tolist()


def _greedy(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    runner = ModelRunner(
        path, num_device_blocks=32, num_host_blocks=0, block_size=16, dtype="float32"
    )
    request = FakeRequest("r", prompt, new_tokens)
    return ToyScheduler(runner, [request]).run()["r"]


@pytest.mark.engine
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_heads_wider_than_the_hidden_size_serve_hf_tokens(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(_wide_heads(family), tmp_path / family)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    widen_weights(hf)  # margins wide enough that greedy choices are not ties
    hf.save_pretrained(path, safe_serialization=True)
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    prompt = _prompt(11, seed=1)
    assert _greedy(path, prompt, 8) == hf_greedy(hf, prompt, 8)


@pytest.mark.engine
@pytest.mark.parametrize("name", BENCH)
def test_make_model_writes_a_bf16_benchmark_shape_hf_and_the_engine_load(
    name: str, tmp_path: Path
) -> None:
    """Written in bf16 as the benchmarks take it; both sides then run those weights in fp32,
    where greedy tokens are exact."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / name
    result = CliRunner().invoke(app, ["make-model", name, "--out", str(out), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    hf = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    expected_params = PRESETS[name].num_parameters()
    assert sum(p.numel() for p in hf.parameters()) == expected_params
    assert math.isclose(
        (out / "model.safetensors").stat().st_size, 2 * expected_params, rel_tol=1e-3
    )
    prompt = _prompt(9, seed=2)
    assert _greedy(out, prompt, 4) == hf_greedy(hf, prompt, 4)
