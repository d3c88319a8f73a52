"""One spec per model family: each registered spec's parts are checked against each other.

Every test here walks the registry, so a family added as a model file and a spec is held to
the same checks without a new test: its presets validate, its parser reads the config.json its
checkpoints are written with, its stored tensors are exactly what its model and builder take,
its tokenizer puts the special tokens where config.json says, and reading any of that loads no
model code.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError
from quanta.build.checkpoint import hf_config, tensor_specs
from quanta.build.presets import PRESETS, ModelPreset
from quanta.build.steps import FamilyBuilder, builder_for, builders
from quanta.build.tokenizer import build_tokenizer, special_token_ids
from quanta.families import FAMILIES, family_names, get_family
from quanta.runner.models import build_model_skeleton
from quanta.runner.models.config import parse_model_config

NAMES = family_names()


def _presets(family: str) -> list[ModelPreset]:
    return [p for p in PRESETS.values() if p.family == family]


def test_the_registry_lists_opt_and_llama_by_their_model_type():
    assert NAMES == ("opt", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2")
    assert all(spec.name == name for name, spec in FAMILIES.items())
    with pytest.raises(ValueError, match=r"unknown model family 'gpt2'"):
        get_family("gpt2")


def test_a_preset_of_an_unregistered_family_is_refused():
    fields = PRESETS["llama-tiny"].model_dump()
    fields |= {"name": "x", "shape": fields["shape"] | {"family": "gpt2"}}
    with pytest.raises(ValidationError, match=r"unknown model family 'gpt2'"):
        ModelPreset(**fields)


@pytest.mark.parametrize("name", NAMES)
def test_the_parser_reads_what_the_checkpoint_writer_writes(name):
    spec = get_family(name)
    assert _presets(name), f"{name} has no preset to build a checkpoint from"
    for preset in _presets(name):
        raw = json.loads(json.dumps(hf_config(preset)))  # as read back from config.json
        assert raw["model_type"] == name and raw["architectures"] == [spec.architecture]
        config = parse_model_config(raw)
        ids = special_token_ids(name)
        assert config.family == name
        assert (config.bos_token_id, config.eos_token_ids) == (
            ids["bos_token_id"],
            (ids["eos_token_id"],),
        )
        assert config.shape == preset.shape


@pytest.mark.parametrize("name", NAMES)
def test_the_stored_tensors_are_what_the_model_and_builder_take(name):
    """Every model parameter comes from one stored tensor of the same shape; the only
    leftovers are ones the builder may drop (a tied LM head)."""
    builder = builder_for(name, "cpu")
    for preset in _presets(name):
        config = parse_model_config(hf_config(preset))
        params = {n: tuple(p.shape) for n, p in build_model_skeleton(config).named_parameters()}
        filled: dict[str, tuple[int, ...]] = {}
        for key, shape, _ in tensor_specs(preset):
            target = builder.tensor_name(key, params)
            if target is None:
                assert builder.droppable(key, config), f"{preset.name}: {key} has no parameter"
                continue
            assert target not in filled and params[target] == shape, (preset.name, key)
            filled[target] = shape
        assert filled == params, preset.name


@pytest.mark.parametrize("name", NAMES)
def test_every_family_has_its_own_builder_on_each_device(name):
    for device in ("cpu", "cuda"):
        builder = builder_for(name, device)
        assert isinstance(builder, FamilyBuilder) and builder.family == name


def test_every_builder_builds_a_registered_family():
    assert {b.family for b in builders()} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_tokenizer_puts_the_special_tokens_at_the_config_ids(name):
    tokens = get_family(name).tokens
    tokenizer = build_tokenizer(name)
    assert [tokenizer.token_to_id(t) for t in tokens.tokens] == list(range(len(tokens.tokens)))
    ids = special_token_ids(name)
    assert tokenizer.encode("hello").ids[0] == ids["bos_token_id"]
    assert tokenizer.token_to_id(tokens.eos) == ids["eos_token_id"]


def test_reading_configs_and_presets_loads_no_model_code():
    """The model class is imported only when a model is built: presets, specs and tokenizer
    rules load no torch, and parsing a config loads no family's model module."""
    code = (
        "import json, sys\n"
        "import quanta.families, quanta.build.presets, quanta.build.tokenizer\n"
        "import quanta.text.tokenizer, quanta.build.manifest\n"
        "light = 'torch' not in sys.modules\n"
        "from quanta.build.presets import PRESETS\n"
        "from quanta.runner.models.config import parse_model_config\n"
        "from quanta.families import FAMILIES\n"
        "for p in PRESETS.values():\n"
        "    raw = {'model_type': p.family, 'vocab_size': p.shape.vocab_size,\n"
        "           'hidden_size': p.shape.hidden_size, 'num_hidden_layers': 1,\n"
        "           'num_attention_heads': p.shape.num_heads, 'intermediate_size': 8}\n"
        "    parse_model_config(raw)\n"
        "models = sorted(m for m in sys.modules if m.startswith('quanta.runner.models.')\n"
        "                and m.rsplit('.', 1)[1] in FAMILIES)\n"
        "print(json.dumps([light, models]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [True, []]


@pytest.mark.parametrize(
    ("family", "keys"),
    [
        ("gemma2", {"sliding_window": 16}),
        ("mistral", {"sliding_window": 16}),
        ("qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}),
        ("qwen2", {"sliding_window": 16}),
        ("qwen3", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}),
    ],
)
def test_a_config_without_layer_types_slides_where_transformers_does(family, keys):
    """Hub configs written before ``layer_types`` existed name only a window; each layer then
    slides or not as transformers' own config class decides (Gemma 2 alternates)."""
    from quanta.families.decoder import sliding_windows
    from transformers import AutoConfig

    hf = AutoConfig.for_model(family, num_hidden_layers=4, **keys)
    if not getattr(hf, "sliding_window", None):
        types = ["full_attention"] * 4
    else:  # Mistral's config has no layer types: every layer slides
        types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 4
    expected = tuple(16 if t == "sliding_attention" else 0 for t in types)
    assert (sliding_windows(keys, 4, family) or (0,) * 4) == expected
