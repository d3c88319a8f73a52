"""A model's shape is declared once (``quanta.shape``): the manifest stores it, the runner's
config and the build presets hold it, the cost model's presets are made of it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from quanta.build.checkpoint import hf_config
from quanta.build.manifest import EngineModel
from quanta.build.presets import PRESETS, ModelPreset
from quanta.costmodel import PROFILES
from quanta.runner.models.config import parse_model_config
from quanta.shape import PUBLISHED, ModelShape

# The ``model`` object of a quanta_engine.json written before the shape had a module of its own.
OLD_MANIFEST_MODEL = {
    "family": "opt",
    "architecture": "OPTForCausalLM",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 16,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
}


def test_an_engine_manifest_written_before_still_reads_and_writes_the_same_keys():
    model = EngineModel.model_validate(OLD_MANIFEST_MODEL)
    assert model.model_dump() == OLD_MANIFEST_MODEL
    assert model.num_kv_heads == 4 and isinstance(model, ModelShape)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_shape_is_what_the_runner_reads_from_its_config(name):
    preset = PRESETS[name]
    assert parse_model_config(hf_config(preset)).shape == preset.shape


def test_the_real_shape_presets_are_the_published_ones():
    assert PRESETS["opt-125m"].shape == PUBLISHED["opt-125m"]


def _as_preset(shape: ModelShape) -> ModelPreset:
    """A published shape as a build preset, to count its parameters the family's way."""
    extra: dict[str, object] = (
        {"word_embed_proj_dim": shape.hidden_size}
        if shape.family == "opt"
        else {"rope_theta": 1e4, "rms_norm_eps": 1e-5}
    )
    return ModelPreset(name="published", shape=shape, **extra)


@pytest.mark.parametrize(
    ("profile", "shape", "params"),
    [
        ("a100-opt13b", "opt-13b", 12.85e9),
        ("a100x4-opt66b", "opt-66b", 65.7e9),
        ("a100x16-opt175b", "opt-175b", 175e9),
        ("a100-llama7b", "llama-2-7b", 6.74e9),
    ],
)
def test_a_cost_profile_is_its_published_shape_on_its_hardware(profile, shape, params):
    model, published = PROFILES[profile], PUBLISHED[shape]
    assert model.num_layers == published.num_layers
    assert model.kv_bytes_per_token == published.kv_bytes_per_token(2)
    assert model.max_model_len == published.max_position_embeddings
    # the published parameter count the weights time is made of is the shape's own
    assert _as_preset(published).num_parameters() == pytest.approx(params, rel=0.01)


def test_the_shape_imports_nothing_of_quanta_and_no_torch():
    code = (
        "import sys, quanta; before = set(sys.modules); import quanta.shape; "
        "print(sorted(set(sys.modules) - before), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['quanta.shape'] False"
