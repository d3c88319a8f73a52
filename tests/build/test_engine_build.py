"""``quanta build``: a checkpoint becomes an engine directory whose outputs equal the
checkpoint's, whose manifest tells the truth, and which refuses to run beyond what it was
built for."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import quanta
import torch
from quanta import SamplingParams
from quanta.build.checkpoint import make_checkpoint
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.build.manifest import MANIFEST_FILE, EngineManifestError, read_manifest
from quanta.build.presets import get_preset
from quanta.build.steps import BuildError, FamilyBuilder, builder_for, builders
from quanta.cli import app
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

SMALL = {"kv_cache_memory": 1 << 22, "host_cache_memory": 1 << 20}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = ["Hello there", "The quick brown fox"]


@pytest.fixture(scope="module")
def checkpoints(opt_tiny, llama_tiny) -> dict[str, Path]:
    return {"opt-tiny": opt_tiny, "llama-tiny": llama_tiny}


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "opt-tiny"
    build_engine_dir(checkpoints["opt-tiny"], out, BuildOptions(max_seq_len=256, **SMALL))
    return out


def texts(model: Path, **kwargs) -> list[list[int]]:
    llm = quanta.LLM(str(model), **kwargs)
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def copy_engine(engine: Path, dest: Path) -> Path:
    shutil.copytree(engine, dest)
    return dest


# -- what a build writes -------------------------------------------------------------------------
def test_manifest_records_the_shape_limits_sizing_and_digests(engine, checkpoints):
    m = read_manifest(engine)
    assert m is not None
    spec = get_preset("opt-tiny")
    assert (m.model.family, m.model.num_layers, m.model.hidden_size) == ("opt", 2, 64)
    assert m.num_parameters == spec.num_parameters()
    assert (m.dtype, m.device, m.name) == ("float32", "cpu", "opt-tiny")
    assert (m.limits.max_batch_size, m.limits.max_num_tokens, m.limits.max_seq_len) == (
        128,
        2048,
        256,
    )
    per_block = spec.shape.num_layers * 2 * 16 * spec.shape.hidden_size * 4  # K and V, fp32
    assert m.cache.kv_bytes_per_block == per_block
    assert m.cache.num_device_blocks == (1 << 22) // per_block
    assert m.cache.max_cached_tokens == m.cache.num_device_blocks * 16
    assert m.capabilities.hidden_cache  # multi-head attention
    assert m.capabilities.layer_safepoints  # the PyTorch runner stops between layers
    assert not m.capabilities.async_swap
    source = checkpoints["opt-tiny"]
    for name, digest in m.source.files.items():
        assert hashlib.sha256((source / name).read_bytes()).hexdigest() == digest
    assert "model.safetensors" in m.source.files
    for weight in m.weights:
        assert hashlib.sha256((engine / weight.name).read_bytes()).hexdigest() == weight.sha256
    assert (engine / "tokenizer.json").is_file()
    assert not (engine / "quanta_preset.json").exists()  # the preset's provenance is not ours


@pytest.mark.engine
@pytest.mark.parametrize("family", ["opt-tiny", "llama-tiny"])
def test_engine_outputs_equal_the_checkpoints(family, checkpoints, tmp_path):
    out = tmp_path / family
    build_engine_dir(checkpoints[family], out, BuildOptions(**SMALL))
    cache = {"num_device_blocks": 64, "num_host_blocks": 0}
    assert texts(out) == texts(checkpoints[family], cache=cache)


@pytest.mark.engine
def test_bfloat16_engine_stores_bfloat16_and_matches_a_bfloat16_load(checkpoints, tmp_path):
    out = tmp_path / "bf16"
    m = build_engine_dir(checkpoints["opt-tiny"], out, BuildOptions(dtype="bfloat16", **SMALL))
    assert m.dtype == "bfloat16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    cache = {"num_device_blocks": 64, "num_host_blocks": 0}
    assert texts(out) == texts(checkpoints["opt-tiny"], dtype="bfloat16", cache=cache)


@pytest.mark.engine
def test_small_shards_are_written_with_an_index_and_load(checkpoints, engine, tmp_path):
    out = tmp_path / "sharded"
    m = build_engine_dir(
        checkpoints["opt-tiny"], out, BuildOptions(max_shard_size=200_000, **SMALL)
    )
    assert len(m.weights) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {w.name for w in m.weights}
    merged = {}
    for w in m.weights:
        merged |= load_file(out / w.name)
    assert merged.keys() == load_file(engine / "model.safetensors").keys()
    assert texts(out) == texts(engine)


# -- the check at load ---------------------------------------------------------------------------
def test_manifest_supplies_defaults_and_explicit_settings_win_within_limits(engine):
    e = quanta.LLM(str(engine)).engine
    assert (e.config.dtype, e.loop.max_model_len) == ("float32", 256)
    assert e.config.scheduler.max_num_seqs == 128
    m = read_manifest(engine)
    assert e.runner.num_device_blocks == m.cache.num_device_blocks
    e = quanta.LLM(
        str(engine), scheduler={"max_num_seqs": 4}, cache={"num_device_blocks": 8}
    ).engine
    assert (e.config.scheduler.max_num_seqs, e.runner.num_device_blocks) == (4, 8)
    assert e.runner.num_host_blocks == m.cache.num_host_blocks
    e = quanta.LLM(str(engine), cache={"block_size": 8}).engine  # other blocks: from the bytes
    assert e.runner.num_device_blocks == (1 << 22) // (m.cache.kv_bytes_per_block // 2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dtype": "bfloat16"}, r"built for dtype float32.*--dtype bfloat16"),
        ({"scheduler": {"max_num_seqs": 129}}, r"max_num_seqs 129 exceeds the 128"),
        ({"scheduler": {"max_num_batched_tokens": 4096}}, r"--max-num-tokens 4096"),
        ({"device": "cuda"}, r"built for device cpu"),
    ],
)
def test_settings_beyond_the_engine_are_refused(engine, settings, message):
    with pytest.raises(EngineManifestError, match=message):
        quanta.LLM(str(engine), **settings)


def test_longer_max_seq_len_is_refused(engine):
    from quanta.core.config import EngineConfig
    from quanta.frontends.engine import build_engine

    with pytest.raises(EngineManifestError, match=r"max_seq_len 512 exceeds the 256"):
        build_engine(EngineConfig(model=str(engine), max_seq_len=512))


def test_kv_tiers_larger_than_the_machine_are_refused_before_loading(checkpoints):
    with pytest.raises(ValueError, match=r"KV tiers need 1\.0EiB, more than this machine's"):
        quanta.LLM(str(checkpoints["opt-tiny"]), cache={"device_bytes": 1 << 60})


def _edit_config(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))


def _truncate_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-64])


def _newer_format(d: Path) -> None:
    raw = json.loads((d / MANIFEST_FILE).read_text())
    (d / MANIFEST_FILE).write_text(json.dumps(raw | {"format": 99}))


def _unknown_dtype(d: Path) -> None:
    raw = json.loads((d / MANIFEST_FILE).read_text())
    (d / MANIFEST_FILE).write_text(json.dumps(raw | {"dtype": "int4"}))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_edit_config, r"config\.json no longer matches .*num_layers 2 -> 1"),
        (_truncate_weights, r"model\.safetensors has \d+ bytes, the manifest says"),
        (_newer_format, r"engine format 99 is newer"),
        (_unknown_dtype, r"dtype: Input should be"),
        (lambda d: (d / MANIFEST_FILE).write_text("{"), r"not readable JSON"),
    ],
    ids=["config", "weights", "format", "field", "json"],
)
def test_a_mismatched_engine_is_refused_clearly(engine, tmp_path, damage, message):
    broken = copy_engine(engine, tmp_path / "broken")
    damage(broken)
    with pytest.raises(EngineManifestError, match=message):
        quanta.LLM(str(broken))


# -- what a build refuses ------------------------------------------------------------------------
def _drop_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    del tensors["model.decoder.layers.1.fc1.weight"]
    save_file(tensors, d / "model.safetensors")


def _extra_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    save_file(tensors | {"model.decoder.adapter.weight": torch.zeros(2)}, d / "model.safetensors")


def _reshape_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    tensors["model.decoder.layers.0.fc2.bias"] = torch.zeros(63)
    save_file(tensors, d / "model.safetensors")


def _family(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))


def _chat_template(d: Path) -> None:
    config = json.loads((d / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m.content }"
    (d / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))


def _small_vocab(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"vocab_size": 8}))
    tensors = load_file(d / "model.safetensors")
    tensors["model.decoder.embed_tokens.weight"] = tensors["model.decoder.embed_tokens.weight"][:8]
    save_file(tensors, d / "model.safetensors")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_drop_tensor, r"1 tensor\(s\) missing .*layers\.1\.fc1\.weight"),
        (_extra_tensor, r"1 unexpected .*adapter\.weight"),
        (_reshape_tensor, r"fc2\.bias' has shape \(63,\); config\.json implies \(64,\)"),
        (_family, r"unsupported model_type 'gpt2'"),
        (_chat_template, r"chat template does not render"),
        (_small_vocab, r"tokenizer produces ids up to \d+, the model has 8"),
    ],
    ids=["missing", "unexpected", "shape", "family", "chat-template", "vocab"],
)
def test_a_bad_checkpoint_is_refused_before_anything_is_written(
    checkpoints, tmp_path, damage, message
):
    source = copy_engine(checkpoints["opt-tiny"], tmp_path / "source")
    damage(source)
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=message):
        build_engine_dir(source, out, BuildOptions(**SMALL))
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["source"]  # no temp dir left behind


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_seq_len": 4096}, r"--max-seq-len 4096 exceeds the model's context length 512"),
        ({"kv_cache_memory": 20_000}, r"holds 16 tokens .* fewer than one --max-seq-len 512"),
        ({"kv_cache_memory": 1 << 60}, r"exceed this machine's cpu memory"),
        ({"device": "cuda"}, r"CUDA is not available"),
    ],
)
def test_limits_the_engine_cannot_hold_are_refused(checkpoints, tmp_path, options, message):
    if options.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BuildError, match=message):
        build_engine_dir(checkpoints["opt-tiny"], tmp_path / "e", BuildOptions(**SMALL | options))


def test_an_existing_engine_is_replaced_only_with_overwrite(checkpoints, tmp_path):
    out = tmp_path / "e"
    build_engine_dir(checkpoints["opt-tiny"], out, BuildOptions(**SMALL))
    with pytest.raises(FileExistsError):
        build_engine_dir(checkpoints["opt-tiny"], out, BuildOptions(**SMALL))
    m = build_engine_dir(checkpoints["llama-tiny"], out, BuildOptions(**SMALL), overwrite=True)
    assert m.model.family == "llama" and read_manifest(out) == m


# -- build steps ---------------------------------------------------------------------------------
def test_each_family_has_a_cpu_and_a_cuda_builder():
    for family in ("opt", "llama"):
        for device in ("cpu", "cuda"):
            assert builder_for(family, device).family == family
    with pytest.raises(BuildError, match=r"no engine builder for gpt2 on cpu"):
        builder_for("gpt2", "cpu")


def test_a_builder_added_beside_the_others_is_used_without_touching_the_cli(
    tmp_path, monkeypatch, checkpoints
):
    from quanta.build import steps

    (tmp_path / "opt_gpu.py").write_text(
        "from quanta.build.steps.base import FamilyBuilder\n"
        "class FastOPT(FamilyBuilder):\n"
        "    family = 'opt'\n"
        "    devices = ('cpu',)\n"
        "    priority = 10\n"
        "BUILDERS = [FastOPT()]\n"
    )
    monkeypatch.setattr(steps, "__path__", [*steps.__path__, str(tmp_path)])
    assert any(type(b).__name__ == "FastOPT" for b in builders())
    chosen = builder_for("opt", "cpu")
    assert isinstance(chosen, FamilyBuilder) and type(chosen).__name__ == "FastOPT"
    m = build_engine_dir(checkpoints["opt-tiny"], tmp_path / "e", BuildOptions(**SMALL))
    assert m.builder.endswith("FastOPT")


# -- the command ---------------------------------------------------------------------------------
def test_cli_builds_and_reports_errors_in_one_line(checkpoints, tmp_path):
    runner = CliRunner()
    out = tmp_path / "engine"
    args = ["build", str(checkpoints["llama-tiny"]), "--out", str(out)]
    args += ["--dtype", "bfloat16", "--max-batch-size", "8", "--max-seq-len", "128"]
    result = runner.invoke(app, [*args, "--kv-cache-memory", "2MiB", "--host-cache-memory", "0"])
    assert result.exit_code == 0, result.output
    assert "built engine (LlamaForCausalLM" in result.output
    assert f"quanta serve {out}" in result.output
    m = read_manifest(out)
    assert (m.dtype, m.limits.max_batch_size, m.cache.kv_cache_memory) == (
        "bfloat16",
        8,
        2 << 20,
    )
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "already exists" in again.output
    assert "Traceback" not in again.output
    bad_size = runner.invoke(app, [*args[:4], "--kv-cache-memory", "lots"])
    assert bad_size.exit_code == 2 and "not a memory size" in bad_size.output


def test_a_preset_checkpoint_written_in_bfloat16_builds_to_float32(tmp_path):
    source = make_checkpoint("opt-tiny", tmp_path / "ck", dtype="bfloat16")
    m = build_engine_dir(source, tmp_path / "e", BuildOptions(dtype="float32", **SMALL))
    assert m.dtype == "float32"
    with safe_open(str(tmp_path / "e" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.decoder.embed_tokens.weight").dtype == torch.float32


def test_a_template_that_refuses_a_system_turn_still_builds(checkpoints, tmp_path):
    """Gemma 2's template refuses a system message; that is its answer to one conversation,
    not a template the gateway cannot run, so the engine builds and keeps it."""
    from family_chat_templates import GEMMA2

    source = copy_engine(checkpoints["opt-tiny"], tmp_path / "source")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": GEMMA2}))
    build_engine_dir(source, tmp_path / "out", BuildOptions(**SMALL))
    assert read_manifest(tmp_path / "out").chat_template
