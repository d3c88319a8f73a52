"""Locally built checkpoints: presets, determinism, HF compatibility and tokenizer loading.

These checkpoints stand in for downloaded models everywhere in Quanta, so the tests hold them to
what HF transformers itself would load, and hold load_tokenizer to what AutoTokenizer encodes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from quanta.build.checkpoint import (
    PRESET_FILE,
    ensure_checkpoint,
    hf_config,
    make_checkpoint,
    tensor_specs,
)
from quanta.build.presets import PRESETS, TINY_VOCAB_SIZE, ModelPreset, get_preset
from quanta.build.tokenizer import TOKENIZER_VOCAB_TARGET, build_tokenizer
from quanta.text.tokenizer import load_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file

TINY = ["opt-tiny", "llama-tiny"]
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Unicode: café, naïve, 日本語, emoji 🙂🚀, math ∑ x² ≤ ∞",
    "code: def f(x):\n    return x ** 2  # square",
    "",
]
Checkpoint = Callable[[str], Path]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Build each preset at most once per session (seed 0, float32)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return lambda name: ensure_checkpoint(name, root / name)


def _read_json(path: Path) -> dict[str, object]:
    return json.loads(path.read_text(encoding="utf-8"))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# --- presets and layout -------------------------------------------------------------------


# Real-shape presets past a billion parameters (Mistral-7B, Qwen3-8B, Phi-3-mini) are there for
# their shapes (the simulator, the cost model, GPU benchmarks); writing one takes 15-33 GB in
# fp32, more than a test machine holds, so the suite checks what their shape implies instead.
_WRITTEN = sorted(n for n, p in PRESETS.items() if p.num_parameters() <= 1_000_000_000)
_SHAPE_ONLY = sorted(set(PRESETS) - set(_WRITTEN))


@pytest.mark.parametrize("name", _SHAPE_ONLY)
def test_a_large_preset_implies_its_published_size_and_config(name: str) -> None:
    preset = PRESETS[name]
    specs = tensor_specs(preset)
    assert sum(torch.Size(shape).numel() for _, shape, _ in specs) == preset.num_parameters()
    config = hf_config(preset)
    assert config["vocab_size"] == preset.shape.vocab_size
    assert config["num_hidden_layers"] == preset.shape.num_layers
    assert config["hidden_size"] == preset.shape.hidden_size


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if "tiny" in n else [pytest.mark.slow]) for n in _WRITTEN],
)
def test_every_preset_builds_with_the_shape_it_implies(checkpoint: Checkpoint, name: str) -> None:
    preset = PRESETS[name]
    out = checkpoint(name)
    expected_files = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        PRESET_FILE,
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert {p.name for p in out.iterdir()} == expected_files
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
        assert f.metadata() == {"format": "pt"}
    assert shapes == {key: shape for key, shape, _ in tensor_specs(preset)}
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert total == preset.num_parameters()
    config = _read_json(out / "config.json")
    assert config["vocab_size"] == preset.shape.vocab_size
    assert config["num_hidden_layers"] == preset.shape.num_layers
    if preset.family == "opt":
        rows = shapes["model.decoder.embed_positions.weight"][0]
        assert rows == preset.shape.max_position_embeddings + 2


def test_big_presets_have_the_expected_sizes() -> None:
    assert PRESETS["opt-125m"].num_parameters() == 125_239_296  # facebook/opt-125m
    assert 95e6 < PRESETS["llama-100m"].num_parameters() < 105e6


@pytest.mark.parametrize("name", TINY)
def test_tiny_vocab_is_the_tokenizer_vocab(checkpoint: Checkpoint, name: str) -> None:
    family = PRESETS[name].family
    assert build_tokenizer(family).get_vocab_size() == TOKENIZER_VOCAB_TARGET == TINY_VOCAB_SIZE
    assert load_tokenizer(checkpoint(name)).vocab_size == PRESETS[name].shape.vocab_size


def test_config_json_matches_the_families(checkpoint: Checkpoint) -> None:
    opt = _read_json(checkpoint("opt-tiny") / "config.json")
    assert opt["architectures"] == ["OPTForCausalLM"] and opt["model_type"] == "opt"
    assert (opt["bos_token_id"], opt["eos_token_id"], opt["pad_token_id"]) == (2, 2, 1)
    assert opt["tie_word_embeddings"] is True and opt["torch_dtype"] == "float32"
    assert opt["ffn_dim"] == 256 and opt["word_embed_proj_dim"] == 64
    llama = _read_json(checkpoint("llama-tiny") / "config.json")
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["model_type"] == "llama"
    assert (llama["bos_token_id"], llama["eos_token_id"], llama["pad_token_id"]) == (1, 2, None)
    assert llama["tie_word_embeddings"] is False
    assert (llama["num_key_value_heads"], llama["head_dim"], llama["intermediate_size"]) == (
        2,
        16,
        176,
    )
    generation = _read_json(checkpoint("opt-tiny") / "generation_config.json")
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (2, 2)


def test_weights_follow_hf_init(checkpoint: Checkpoint) -> None:
    opt = load_file(checkpoint("opt-tiny") / "model.safetensors")
    assert torch.all(opt["model.decoder.final_layer_norm.weight"] == 1)
    assert torch.all(opt["model.decoder.layers.0.fc1.bias"] == 0)
    assert torch.all(opt["model.decoder.embed_tokens.weight"][1] == 0)  # padding row
    assert "lm_head.weight" not in opt  # tied, as save_pretrained stores it
    llama = load_file(checkpoint("llama-tiny") / "model.safetensors")
    assert torch.all(llama["model.norm.weight"] == 1)
    std = llama["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.018 < std < 0.022
    assert not torch.equal(llama["lm_head.weight"], llama["model.embed_tokens.weight"])


def test_unknown_preset_and_bad_shapes_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"known presets: .*opt-tiny"):
        get_preset("gpt-5")
    llama = PRESETS["llama-tiny"].model_dump()
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelPreset.model_validate(llama | {"shape": llama["shape"] | {"num_kv_heads": 3}})
    with pytest.raises(ValueError, match="dtype"):
        make_checkpoint("opt-tiny", tmp_path / "x", dtype="int8")


# --- determinism ------------------------------------------------------------------------------


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = _files(make_checkpoint("llama-tiny", tmp_path / "a", seed=7))
    b = _files(make_checkpoint("llama-tiny", tmp_path / "b", seed=7))
    assert a == b
    c = _files(make_checkpoint("llama-tiny", tmp_path / "c", seed=8))
    assert c["model.safetensors"] != a["model.safetensors"]
    assert c["config.json"] == a["config.json"] and c["tokenizer.json"] == a["tokenizer.json"]


def test_tokenizer_training_is_the_same_in_a_fresh_process() -> None:
    code = (
        "from quanta.build.tokenizer import build_tokenizer;"
        "print(build_tokenizer('opt').to_str(), end='')"
    )
    env = os.environ | {"PYTHONHASHSEED": "random"}
    fresh = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert fresh.stdout == build_tokenizer("opt").to_str()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints(tmp_path: Path, dtype: str) -> None:
    out = make_checkpoint("opt-tiny", tmp_path / dtype, dtype=dtype)
    assert _read_json(out / "config.json")["torch_dtype"] == dtype
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {getattr(torch, dtype)}


# --- writing safely -------------------------------------------------------------------------


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    out = make_checkpoint("opt-tiny", tmp_path / "ckpt", seed=0)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_checkpoint("opt-tiny", out, seed=1)
    assert _read_json(out / PRESET_FILE)["seed"] == 0
    make_checkpoint("opt-tiny", out, seed=1, overwrite=True)
    assert _read_json(out / PRESET_FILE)["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dirs left


def test_empty_dir_is_filled_and_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    make_checkpoint("llama-tiny", tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    (tmp_path / "file").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="not a directory"):
        make_checkpoint("llama-tiny", tmp_path / "file", overwrite=True)


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    opt = PRESETS["opt-tiny"]
    shape = opt.shape.model_copy(update={"vocab_size": 100})
    too_small = opt.model_copy(update={"name": "too-small", "shape": shape})
    with pytest.raises(ValueError, match="vocab_size 100"):
        make_checkpoint(too_small, tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []


def test_ensure_checkpoint_builds_once_and_checks_provenance(tmp_path: Path) -> None:
    out = ensure_checkpoint("opt-tiny", tmp_path / "ckpt")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoint("opt-tiny", out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="different checkpoint"):
        ensure_checkpoint("opt-tiny", out, seed=3)
    with pytest.raises(ValueError, match="different checkpoint"):
        ensure_checkpoint("llama-tiny", out)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not built by quanta"):
        ensure_checkpoint("opt-tiny", tmp_path / "other")


# quanta_preset.json as checkpoints built before presets held a shape wrote it: the sizes
# flat, in HF's config.json names.
OLD_PROVENANCE = {
    "preset": "llama-tiny",
    "seed": 0,
    "dtype": "float32",
    "spec": {
        "name": "llama-tiny",
        "family": "llama",
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 176,
        "max_position_embeddings": 512,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "word_embed_proj_dim": None,
    },
}


def test_a_checkpoint_built_before_presets_held_a_shape_still_matches(tmp_path: Path) -> None:
    out = make_checkpoint("llama-tiny", tmp_path / "ckpt")
    (out / PRESET_FILE).write_text(json.dumps(OLD_PROVENANCE), encoding="utf-8")
    assert ensure_checkpoint("llama-tiny", out) == out
    assert ModelPreset.model_validate(OLD_PROVENANCE["spec"]) == PRESETS["llama-tiny"]
    with pytest.raises(ValueError, match="different checkpoint"):
        ensure_checkpoint("llama-tiny-mha", out)  # the old form still tells presets apart
    with pytest.raises(ValueError, match="different checkpoint"):
        ensure_checkpoint("llama-tiny", out, seed=1)


def test_custom_preset_objects_are_accepted(tmp_path: Path) -> None:
    llama = PRESETS["llama-tiny"].model_dump()
    small = ModelPreset.model_validate(
        llama | {"name": "llama-mini", "shape": llama["shape"] | {"num_layers": 1}}
    )
    out = ensure_checkpoint(small, tmp_path / "mini")
    assert _read_json(out / "config.json")["num_hidden_layers"] == 1


def test_building_does_not_import_transformers() -> None:
    code = (
        "import sys, tempfile, pathlib;"
        "from quanta.build.checkpoint import make_checkpoint;"
        "from quanta.text.tokenizer import load_tokenizer;"
        "d = pathlib.Path(tempfile.mkdtemp()) / 'c';"
        "load_tokenizer(make_checkpoint('opt-tiny', d));"
        "print('transformers' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_load_tokenizer_does_not_import_torch() -> None:
    code = "import sys; import quanta.text.tokenizer; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


# --- HF transformers compatibility -----------------------------------------------------------


@pytest.mark.engine
@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_tiny_checkpoints_exactly(checkpoint: Checkpoint, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    out = checkpoint(name)
    cls = transformers.OPTForCausalLM if name.startswith("opt") else transformers.LlamaForCausalLM
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    stored = load_file(out / "model.safetensors")
    state = model.state_dict()
    for key, tensor in stored.items():
        assert torch.equal(state[key], tensor), key  # nothing was re-initialised
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == (name == "opt-tiny")
    ids = torch.tensor([load_tokenizer(out).encode("Hello there")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], PRESETS[name].shape.vocab_size)


@pytest.mark.engine
@pytest.mark.parametrize("name", TINY)
def test_autotokenizer_agrees_with_load_tokenizer(checkpoint: Checkpoint, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    out = checkpoint(name)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(out)
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    assert len(hf) == ours.vocab_size
    for text in [*TEXTS, "with </s> a special token inside"]:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    bos = {"opt-tiny": ("</s>", 2), "llama-tiny": ("<s>", 1)}[name]
    assert ours.encode("x")[0] == bos[1] == ours.token_to_id(bos[0])


# --- load_tokenizer ------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=200))
def test_encode_decode_round_trips_any_text(checkpoint: Checkpoint, name: str, text: str) -> None:
    assume(not any(s in text for s in ("<s>", "</s>", "<pad>", "<unk>")))
    tokenizer = load_tokenizer(checkpoint(name))
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_decode_ignores_ids_beyond_the_tokenizer(checkpoint: Checkpoint) -> None:
    out = checkpoint("opt-125m")  # 50272 embedding rows, 512 tokens
    tokenizer = load_tokenizer(out)
    ids = tokenizer.encode("Hello world")
    size = tokenizer.vocab_size
    noisy = [ids[0], size, *ids[1:], 50271, size + 1, 2**31]
    assert tokenizer.decode(noisy) == "Hello world"
    assert tokenizer.decode(list(range(size, 50272))) == ""


def _export_vocab_and_merges(source: Path, target: Path, keep: tuple[str, ...]) -> Path:
    target.mkdir()
    for name in keep:
        shutil.copy(source / name, target / name)
    load_tokenizer(source).backend.model.save(str(target))
    assert {"vocab.json", "merges.txt"} <= {p.name for p in target.iterdir()}
    return target


def test_vocab_and_merges_fallback_like_real_opt(checkpoint: Checkpoint, tmp_path: Path) -> None:
    source = checkpoint("opt-tiny")
    target = _export_vocab_and_merges(source, tmp_path / "opt", keep=("config.json",))
    real_style = {"add_bos_token": True, "bos_token": {"content": "</s>", "lstrip": False}}
    (target / "tokenizer_config.json").write_text(json.dumps(real_style))
    fallback, reference = load_tokenizer(target), load_tokenizer(source)
    assert (fallback.bos_token_id, fallback.eos_token_id) == (2, 2)
    for text in [*TEXTS, "a </s> b"]:
        assert fallback.encode(text) == reference.encode(text)
        assert fallback.decode(fallback.encode(text)) == reference.decode(reference.encode(text))


def test_vocab_and_merges_opt_defaults(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Only config.json to go on: model_type "opt" means BOS is `</s>` and is prepended."""
    source = checkpoint("opt-tiny")
    target = _export_vocab_and_merges(source, tmp_path / "opt", keep=("config.json",))
    fallback, reference = load_tokenizer(target), load_tokenizer(source)
    assert (fallback.bos_token_id, fallback.eos_token_id) == (2, 2)
    for text in TEXTS:
        assert fallback.encode(text) == reference.encode(text)


def test_vocab_and_merges_with_tokenizer_config(checkpoint: Checkpoint, tmp_path: Path) -> None:
    source = checkpoint("llama-tiny")
    keep = ("config.json", "tokenizer_config.json", "special_tokens_map.json")
    target = _export_vocab_and_merges(source, tmp_path / "llama", keep=keep)
    fallback, reference = load_tokenizer(target), load_tokenizer(source)
    assert (fallback.bos_token_id, fallback.eos_token_id) == (1, 2)
    for text in [*TEXTS, "a </s> b <unk>"]:
        assert fallback.encode(text) == reference.encode(text)
        assert fallback.decode(fallback.encode(text)) == reference.decode(reference.encode(text))


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json, or vocab\.json and merges\.txt"):
        load_tokenizer(tmp_path)


def test_cli_make_model_into_an_existing_dir_is_a_clear_error(tmp_path):
    from quanta.cli import app
    from typer.testing import CliRunner

    out = tmp_path / "m"
    (out / "x").mkdir(parents=True)
    res = CliRunner().invoke(app, ["make-model", "opt-tiny", "--out", str(out)])
    assert res.exit_code == 1
    assert "already exists" in res.output and "--overwrite" in res.output
    assert "Traceback" not in res.output
