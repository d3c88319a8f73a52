"""``quanta.config``: the option models, the command-line options derived from them, the
``--config`` file and the environment, and the docs' option tables rendered from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
import typer
from pydantic import ValidationError
from quanta.cli import app
from quanta.config import CacheArgs, EngineArgs, SchedulerArgs, ServingArgs
from quanta.config.cli import env_prefix, options_from
from quanta.config.docs import DOC, render_doc
from quanta.config.pbtxt import ConfigParameterError, parameters, parse
from typer.main import get_command
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]

# Every option `quanta serve` took before its options were derived from the models: the
# names, their spellings and their defaults are a public interface.
SERVE_OPTIONS = {
    "--model-repository": None,
    "--host": "127.0.0.1",
    "--triton-host": "127.0.0.1",
    "--triton-admin-key": None,
    "--http-port": 8000,
    "--grpc-port": 8001,
    "--metrics-port": 8002,
    "--tritonserver": None,
    "--backend-dir": None,
    "--log-file": None,
    "--log-verbose": 0,
    "--ready-timeout": 600.0,
    "--demo": None,
    "--model-name": None,
    "--openai-port": None,
    "--state-dir": Path("quanta-state"),
    "--api-key": None,
    "--api-key-file": None,
    "--max-request-bytes": 4194304,
    "--max-file-bytes": 209715200,
    "--max-prompt-bytes": None,
    "--allowed-hosts": None,
    "--served-model-name": None,
    "--policy": None,
    "--policy-option": None,
    "--state-url": None,
    "--dtype": None,
    "--device": None,
    "--linear-kernel": None,
    "--attention-kernel": None,
    "--safepoint-interval": None,
    "--max-num-seqs": None,
    "--max-num-batched-tokens": None,
    "--max-seq-len": None,
    "--block-size": None,
    "--enable-prefix-caching": None,
    "--speculative-config": None,
    "--tensor-parallel-size": None,
    "--enforce-eager": None,
    "--async-scheduling": None,
    "--kv-cache-memory": None,
    "--host-cache-memory": None,
    "--gpu-memory-utilization": None,
    "--torch-threads": None,
    "--io-layout": None,
    "--drain-timeout": 30.0,
    "--max-restarts": 0,
    "--max-restart-delay": 30.0,
    "--replicas": 1,
    "--router": "least-outstanding",
    "--tool-call-parser": None,
    "--pooler-config": None,
    "--config": None,
}
OPENAI_OPTIONS = {
    "--triton-grpc-url": "127.0.0.1:8001",
    "--host": "127.0.0.1",
    "--port": 9000,
    "--model-name": "quanta",
    "--triton-model": None,
    "--model-dir": None,
    "--chat-template": None,
    "--default-chat-max-tokens": 256,
    "--request-timeout": None,
    "--state-dir": Path("quanta-state"),
    "--batch-concurrency": 64,
    "--upstream": None,
    "--router": "least-outstanding",
    "--api-key": None,
    "--api-key-file": None,
    "--max-request-bytes": 4194304,
    "--max-file-bytes": 209715200,
    "--max-model-len": None,
    "--max-prompt-bytes": None,
    "--allowed-hosts": None,
    "--tool-call-parser": None,
    "--pooler-config": None,
    "--config": None,
}


def _options(command: str) -> dict[str, object]:
    params = get_command(app).commands[command].params  # type: ignore[attr-defined]
    return {p.opts[0]: p.default for p in params if p.opts[0].startswith("--")}


@pytest.mark.parametrize(
    ("command", "expected"), [("serve", SERVE_OPTIONS), ("openai", OPENAI_OPTIONS)]
)
def test_the_derived_options_keep_every_flag_name_and_default(command, expected):
    assert _options(command) == expected


def test_the_old_spellings_stay():
    params = {p.name: p for p in get_command(app).commands["serve"].params}  # type: ignore[attr-defined]
    assert params["tensor_parallel_size"].opts == [
        "--tensor-parallel-size",
        "--tp-size",
        "--tp_size",
        "-tp",
    ]
    assert params["enable_prefix_caching"].secondary_opts == ["--no-enable-prefix-caching"]
    assert params["http_port"].envvar == "QUANTA_HTTP_PORT"
    assert params["api_key"].envvar == "QUANTA_API_KEY"
    assert params["api_key"].multiple


def test_every_option_says_what_it_means():
    for model in (EngineArgs, CacheArgs, SchedulerArgs, ServingArgs):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


def test_the_models_refuse_unknown_fields_and_bad_values():
    with pytest.raises(ValidationError, match="max_num_seq"):
        SchedulerArgs(max_num_seq=8)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        SchedulerArgs(max_num_seqs=0)
    with pytest.raises(ValidationError, match="method"):
        EngineArgs(speculative_config='{"method": "nope"}')
    config = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config is not None
    assert config.speculative_config.num_speculative_tokens == 2


# A command built the way `quanta serve` is, to see where each value comes from.
probe = typer.Typer()


@probe.command(context_settings=env_prefix("probe"))
@options_from(scheduler=SchedulerArgs, serving=ServingArgs, only={"serving": ("api_key", "router")})
def show(
    label: Annotated[str, typer.Option(help="a command's own option")] = "none",
    *,
    scheduler: SchedulerArgs,
    serving: ServingArgs,
) -> None:
    typer.echo(f"{label} {scheduler.max_num_seqs} {scheduler.policy} {serving.api_key}")
    typer.echo(f"{serving.router}")


def _run(args: list[str], env: dict[str, str] | None = None) -> str:
    result = CliRunner().invoke(probe, args, env=env)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_command_line_wins_over_the_environment_over_the_file(tmp_path: Path):
    file = tmp_path / "options.yaml"
    file.write_text("max-num-seqs: 8\npolicy: fair\nlabel: from-file\napi-key: k1\n")
    assert _run([]) == "none None None None\nleast-outstanding\n"
    assert _run(["--config", str(file)]) == "from-file 8 fair ['k1']\nleast-outstanding\n"
    env = {"QUANTA_PROBE_MAX_NUM_SEQS": "16", "QUANTA_API_KEY": "k2"}
    assert _run(["--config", str(file)], env) == "from-file 16 fair ['k2']\nleast-outstanding\n"
    assert (
        _run(["--config", str(file), "--max-num-seqs", "32", "--router", "round-robin"], env)
        == "from-file 32 fair ['k2']\nround-robin\n"
    )


def test_a_file_may_give_lists_and_json_options(tmp_path: Path):
    file = tmp_path / "options.yaml"
    file.write_text("api-key: [a, b]\npolicy-option: [starve_limit=2]\n")
    assert "['a', 'b']" in _run(["--config", str(file)])


def test_an_unknown_key_in_the_file_is_an_error_naming_it(tmp_path: Path):
    file = tmp_path / "options.yaml"
    file.write_text("max-num-seq: 8\n")
    result = CliRunner().invoke(probe, ["--config", str(file)])
    assert result.exit_code == 2
    assert "unknown key 'max-num-seq'" in result.output
    assert "max-num-seqs" in result.output  # the key it was probably meant to be


def test_a_bad_value_from_the_file_is_a_usage_error(tmp_path: Path):
    file = tmp_path / "options.yaml"
    file.write_text("max-num-seqs: 0\n")
    result = CliRunner().invoke(probe, ["--config", str(file)])
    assert result.exit_code == 2
    assert "--max-num-seqs" in result.output


def test_serve_reads_its_options_from_the_file(tmp_path: Path):
    """A flag set next to a model repository is refused, so the file's option shows in the
    message before anything starts."""
    file = tmp_path / "serve.yaml"
    file.write_text(f"max-num-seqs: 8\nmodel-repository: {tmp_path}\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(file)])
    assert result.exit_code == 2
    assert "--max-num-seqs set the model served from MODEL" in " ".join(result.output.split())


def test_the_docs_option_tables_are_the_ones_the_models_give():
    text = (ROOT / DOC).read_text(encoding="utf-8")
    assert render_doc(text) == text, "run python -m quanta.config.docs"


def test_the_docs_command_checks_the_tables():
    done = subprocess.run(
        [sys.executable, "-m", "quanta.config.docs", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_models_load_without_torch_or_typer():
    code = (
        "import sys, quanta.config.models; "
        "assert 'torch' not in sys.modules and 'typer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_option_serve_writes_is_a_config_pbtxt_parameter():
    """``quanta serve MODEL`` hands its options to the model as ``config.pbtxt`` parameters,
    which the backend parses: each one it can write must be one the backend knows."""
    from quanta.frontends.triton.model_entry import served_parameters

    engine = EngineArgs(
        dtype="float32",
        device="cpu",
        linear_kernel="torch",
        attention_kernel="eager",
        safepoint_interval=2,
        max_seq_len=64,
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        tensor_parallel_size=1,
        torch_threads=1,
    )
    cache = CacheArgs(block_size=8, kv_cache_memory="1MiB", host_blocks=4)
    written = served_parameters(
        **engine.model_dump(exclude_none=True),
        **cache.model_dump(exclude_none=True),
        policy="fcfs",
        max_num_seqs=2,
        max_num_batched_tokens=64,
        io_layout="quanta",
    )
    assert set(written) <= set(parameters())
    assert written["device_bytes"] == str(1 << 20)
    assert written["num_host_blocks"] == "4"


# The config.pbtxt parameter names: a public interface, whatever fields they map to.
PBTXT_KEYS = {
    "model_dir", "preset", "preset_seed", "policy", "policy_options", "dtype", "quantization",
    "device", "linear_kernel", "attention_kernel", "safepoint_interval", "max_seq_len",
    "enable_prefix_caching", "speculative_config", "tensor_parallel_size", "block_size",
    "num_device_blocks", "device_bytes", "device_memory_fraction", "num_host_blocks",
    "host_bytes", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
    "torch_threads", "enforce_eager", "metrics_interval_ms", "max_tenant_labels",
    "cancel_check_interval_ms", "stall_timeout_s", "unhealthy_exit_s", "fault_injection",
    "io_layout", "gpu_memory_utilization", "async_scheduling",
}  # fmt: skip


def test_the_config_pbtxt_parameters_are_the_models_marked_fields():
    found = parameters()
    assert set(found) == PBTXT_KEYS
    assert (found["device_bytes"].model, found["device_bytes"].field) == (
        CacheArgs,
        "kv_cache_memory",
    )
    assert found["policy_options"].field == "policy_option"
    for key, param in found.items():
        assert param.description, f"config.pbtxt parameter {key} has no description"


def test_a_config_pbtxt_reads_into_the_models_the_commands_use():
    given = parse(
        {
            "model_dir": "engines/x",
            "num_device_blocks": "64",
            "device_bytes": "",  # an empty value is not given
            "policy_options": '{"starve_limit": 2, "memory": "reactive"}',
            "enable_prefix_caching": "false",
            "io_layout": "tensorrt_llm",
        }
    )
    assert given.cache == CacheArgs(device_blocks=64)
    assert given.scheduler.policy_options() == {"starve_limit": 2, "memory": "reactive"}
    assert given.engine == EngineArgs(enable_prefix_caching=False)
    assert given.serving.io_layout == "tensorrt_llm"
    assert given.backend.model_dir == "engines/x"
    with pytest.raises(ConfigParameterError, match="parameter 'num_device_blocks': Input"):
        parse({"model_dir": "x", "num_device_blocks": "none"})


def test_policy_options_are_the_same_as_pairs_or_a_mapping():
    pairs = SchedulerArgs(policy_option=["starve_limit=2", "memory=reactive"])
    mapping = SchedulerArgs(policy_option={"starve_limit": 2, "memory": "reactive"})
    assert pairs.policy_options() == mapping.policy_options()
    with pytest.raises(ValidationError, match="expected KEY=VALUE"):
        SchedulerArgs(policy_option=["starve_limit"])


def test_the_offline_options_are_checked_by_the_same_models():
    from quanta.config.models import offline_options

    engine, cache, scheduler = offline_options(
        {"max_num_seqs": 4, "kv_cache_memory": "2MiB", "attention_kernel": "eager"}
    )
    assert scheduler.runtime() == {"max_num_seqs": 4}
    assert cache.runtime() == {"device_bytes": 2 << 20}
    assert engine.runtime() == {"attention_kernel": "eager"}
    with pytest.raises(TypeError, match="'max_num_seq'"):
        offline_options({"max_num_seq": 4})
    with pytest.raises(ValidationError, match="not a memory size"):
        offline_options({"kv_cache_memory": "lots"})


@pytest.mark.engine
def test_llm_takes_the_options_by_name(opt_tiny: Path):
    import quanta

    llm = quanta.LLM(
        str(opt_tiny),
        scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256},
        max_num_seqs=2,
        block_size=8,
        device_blocks=16,
    )
    config = llm.engine.config
    assert config.scheduler.max_num_seqs == 2
    assert config.scheduler.max_num_batched_tokens == 256
    assert (config.cache.block_size, config.cache.num_device_blocks) == (8, 16)
    result = llm.generate("Hello", quanta.SamplingParams(max_tokens=4))[0]
    assert result.error is None and len(result.token_ids) == 4
