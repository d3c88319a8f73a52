"""``quanta check-config``: every mistake ``config.pbtxt.template`` warns about is found before
Triton loads anything, in the words the load itself would use."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.cli import app
from quanta.frontends.triton.check import check_path
from quanta.frontends.triton.repository import render_config, write_model_repository
from quanta.frontends.triton.settings import ConfigParameterError, parse_parameters
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(opt_tiny) -> Path:
    return opt_tiny


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "opt-tiny"
    options = BuildOptions(max_batch_size=16, kv_cache_memory=1 << 22, host_cache_memory=0)
    build_engine_dir(checkpoint, out, options)
    return out


def repo_with(tmp_path: Path, model_dir: Path, **params: str) -> Path:
    """A one-model repository with the default parameters, minus ``preset`` (so model_dir is
    checked), plus ``params`` (a value of "" removes the key)."""
    repo = write_model_repository(tmp_path / "models", overrides={"model_dir": str(model_dir)})
    config = repo / "quanta" / "config.pbtxt"
    text = "\n".join(line for line in config.read_text().splitlines() if '"preset"' not in line)
    for key, value in params.items():
        text = re.sub(rf"parameters: {{ key: \"{key}\".*\n", "", text + "\n")
        if value:
            text += f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'
    config.write_text(text)
    return repo


def edit(tmp_path: Path, model_dir: Path, change: Callable[[str], str]) -> Path:
    repo = repo_with(tmp_path, model_dir)
    config = repo / "quanta" / "config.pbtxt"
    config.write_text(change(config.read_text()))
    return repo


def errors(repo: Path) -> str:
    problems = check_path(repo)
    return "\n".join(str(p) for p in problems if p.severity == "error")


def test_the_default_repository_and_a_plain_checkpoint_are_ok(checkpoint, engine, tmp_path):
    assert check_path(ROOT / "triton_models") == []
    assert check_path(repo_with(tmp_path / "a", checkpoint)) == []
    assert (
        check_path(repo_with(tmp_path / "b", engine, max_num_seqs="", num_device_blocks="")) == []
    )


PARAMETER_MISTAKES = [
    ({"max_num_seq": "8"}, r"parameter 'max_num_seq': Extra inputs are not permitted"),
    ({"max_num_seqs": "lots"}, r"parameter 'max_num_seqs': Input should be a valid integer"),
    ({"policy": "lifo"}, r"'policy'/'policy_options': .*lifo"),
    ({"policy_options": "{starve: 2}"}, r"parameter 'policy_options': Invalid JSON"),
    ({"dtype": "float64"}, r"dtype must be float32, float16 or bfloat16"),
    ({"device": "tpu"}, r"device must be cpu, cuda or cuda:N"),
    ({"device_bytes": "1048576"}, r"'num_device_blocks' and 'device_bytes': the device tier"),
    ({"host_bytes": "1048576"}, r"'num_host_blocks' and 'host_bytes': the host tier"),
    ({"device_memory_fraction": "1.5"}, r"parameter 'device_memory_fraction'"),
    ({"block_size": "0"}, r"parameter 'block_size': Input should be greater than or equal"),
    ({"enable_chunked_prefill": "maybe"}, r"parameter 'enable_chunked_prefill'"),
    ({"enable_prefix_caching": "maybe"}, r"parameter 'enable_prefix_caching'"),
    ({"max_seq_len": "100000"}, r"max_seq_len 100000 exceeds the model's context length 512"),
]


@pytest.mark.parametrize(("params", "message"), PARAMETER_MISTAKES)
def test_parameter_mistakes_are_found_in_the_loads_own_words(checkpoint, tmp_path, params, message):
    repo = repo_with(tmp_path, checkpoint, **params)
    found = errors(repo)
    assert re.search(message, found), found
    config = {k: v.string_value for k, v in _parse(repo).parameters.items()}
    try:
        parse_parameters(config)
    except ConfigParameterError as exc:  # what Triton's model load reports, word for word
        assert str(exc).removeprefix("config.pbtxt ") in found
    else:
        assert "max_seq_len" in params  # refused later, by the same engine check the load runs


def _parse(repo: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = (repo / "quanta" / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _no_version(repo: Path) -> None:
    (repo / "quanta" / "1").rmdir()


STRUCTURE_MISTAKES: list[tuple[Callable[[str], str] | None, Callable | None, str]] = [
    (lambda t: t.replace("max_batch_size: 0", "max_batch_size: 8"), None, r"max_batch_size 8"),
    (lambda t: t + "dynamic_batching { }\n", None, r"remove dynamic_batching"),
    (
        lambda t: t.replace("decoupled: true", "decoupled: false"),
        None,
        r"decoupled: false.*streams",
    ),
    (lambda t: t.replace("KIND_CPU", "KIND_GPU"), None, r"KIND_GPU with device cpu"),
    (lambda t: 'name: "other"\n' + t, None, r"name 'other' differs from the folder"),
    (lambda t: t.replace('string_value: "', 'value: "', 1), None, r"not a valid model config"),
    (lambda t: t + "max_batch_size 0\n", None, r"not a valid model config: \d+:\d+"),
    (
        lambda t: t + 'input [ { name: "max_tokens", data_type: TYPE_FP32, dims: [1] } ]\n',
        None,
        r"input 'max_tokens' is TYPE_INT32, not TYPE_FP32",
    ),
    (
        lambda t: t + 'output [ { name: "logits", data_type: TYPE_FP32, dims: [-1] } ]\n',
        None,
        r"output 'logits' is not one the quanta backend has",
    ),
    (None, _no_version, r"no version folder: create quanta/1/"),
]


@pytest.mark.parametrize(("change", "damage", "message"), STRUCTURE_MISTAKES)
def test_structure_mistakes_are_found(checkpoint, tmp_path, change, damage, message):
    repo = edit(tmp_path, checkpoint, change or (lambda t: t))
    if damage is not None:
        damage(repo)
    assert re.search(message, errors(repo)), errors(repo)


def test_model_dir_mistakes_name_the_working_directory(checkpoint, tmp_path):
    missing = repo_with(tmp_path / "a", Path("engines/nowhere"))
    found = [str(p) for p in check_path(missing, cwd=tmp_path)]
    assert any(
        f"{tmp_path}/engines/nowhere does not exist" in p and f"here {tmp_path}" in p for p in found
    ), found
    (tmp_path / "empty").mkdir()
    found = errors(repo_with(tmp_path / "b", tmp_path / "empty"))
    assert "not a checkpoint or engine (no config.json)" in found


def test_engine_limits_and_changed_weights_are_found(engine, tmp_path):
    over = repo_with(tmp_path / "a", engine, max_num_seqs="64", num_device_blocks="")
    assert "max_num_seqs 64 exceeds the 16 engine 'opt-tiny' was built for" in errors(over)
    tampered = tmp_path / "tampered"
    import shutil

    shutil.copytree(engine, tampered)
    weights = tampered / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only --verify sees it
    weights.write_bytes(bytes(data))
    repo = repo_with(tmp_path / "b", tampered, max_num_seqs="", num_device_blocks="")
    assert check_path(repo) == []
    found = "\n".join(str(p) for p in check_path(repo, verify=True))
    assert "model.safetensors does not match the engine's manifest (sha256 differs)" in found


def test_several_instances_are_a_warning_not_an_error(checkpoint, tmp_path):
    repo = edit(tmp_path, checkpoint, lambda t: t.replace("count: 1", "count: 2"))
    problems = check_path(repo)
    assert [p.severity for p in problems] == ["warning"]
    assert "each instance loads its own weights" in problems[0].message


def test_other_backends_models_are_left_alone(checkpoint, tmp_path):
    repo = repo_with(tmp_path, checkpoint)
    other = repo / "tokenizer"
    other.mkdir()
    (other / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 4\n')
    assert check_path(repo) == []


def test_command_exit_codes_and_output(checkpoint, tmp_path):
    runner = CliRunner()
    good = repo_with(tmp_path / "a", checkpoint)
    result = runner.invoke(app, ["check-config", str(good)])
    assert result.exit_code == 0 and result.output.strip() == f"{good}: OK"
    bad = repo_with(tmp_path / "b", checkpoint, max_num_seqs="lots", policy="lifo")
    result = runner.invoke(app, ["check-config", str(bad / "quanta" / "config.pbtxt")])
    assert result.exit_code == 1, result.output
    assert result.output.count("error:") == 1 and "1 error(s)" in result.output
    result = runner.invoke(app, ["check-config", str(tmp_path)])
    assert result.exit_code == 1 and "not a model repository" in result.output


def test_serve_refuses_a_repository_that_would_not_load_before_starting_triton(
    checkpoint, tmp_path
):
    repo = repo_with(tmp_path, checkpoint, block_size="big")
    proc = subprocess.run(
        [sys.executable, "-m", "quanta.cli", "serve", "--model-repository", str(repo)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "parameter 'block_size'" in proc.stderr
    assert "would not load; nothing started" in proc.stderr
    assert "tritonserver" not in proc.stdout + proc.stderr.split("would not load")[0]


def test_template_mistakes_are_all_covered():
    """Each rule the template states has a case above (a new rule needs a new case)."""
    text = (ROOT / "triton_models" / "config.pbtxt.template").read_text()
    for rule in (
        "create the (empty) version folder",
        "max_batch_size: 0",
        "decoupled: true",
        "KIND_CPU",
        "A bad value or an unknown key",
        "give ONE of num_device_blocks, device_bytes, device_memory_fraction",
        "num_host_blocks or host_bytes",
        "Relative paths are resolved against the server's working",
        "float32|float16|bfloat16",
        "cpu, cuda, cuda:1",
    ):
        assert rule in " ".join(text.split()), rule
    assert render_config({"model_dir": "x"}).count("parameters:") == 1
