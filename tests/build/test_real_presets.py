"""The real shapes the GPU run measures (``quanta bench engine --preset NAME``): their sizes
are the published models' own, down to the tied head and RoPE scaling of LLaMA-3.2."""

from __future__ import annotations

import pytest
from quanta.build.checkpoint import hf_config, tensor_specs
from quanta.build.presets import PRESETS, ModelPreset
from quanta.families.config import RopeScaling
from quanta.runner.models.config import parse_model_config


@pytest.mark.parametrize(
    ("name", "params"),
    [("llama-3.2-1b", 1.236e9), ("llama-3-8b", 8.030e9), ("opt-13b", 12.853e9)],
)
def test_a_real_shape_has_its_published_parameter_count(name, params):
    assert PRESETS[name].num_parameters() == pytest.approx(params, rel=1e-3)


def test_llama_3_2_1b_ties_its_head_and_scales_rope_as_llama3():
    preset = PRESETS["llama-3.2-1b"]
    config = parse_model_config(hf_config(preset))
    assert config.tie_word_embeddings and config.shape == preset.shape
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert "lm_head.weight" not in {name for name, _, _ in tensor_specs(preset)}


def test_llama_3_8b_keeps_its_own_head_and_plain_rope():
    config = parse_model_config(hf_config(PRESETS["llama-3-8b"]))
    assert not config.tie_word_embeddings and config.rope_scaling is None
    assert (config.num_kv_heads, config.intermediate_size, config.vocab_size) == (8, 14336, 128256)


def test_rope_scaling_is_refused_outside_llama():
    with pytest.raises(ValueError, match="LLaMA field"):
        ModelPreset(
            name="x",
            shape=PRESETS["qwen2-tiny"].shape,
            rope_theta=1e4,
            rms_norm_eps=1e-6,
            rope_scaling=RopeScaling(rope_type="linear", factor=2.0),
        )
