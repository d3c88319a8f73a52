"""``quanta check-config``: every mistake a hand-written ``config.pbtxt`` can hold, found before
Triton loads anything.

Triton reports a bad model config only once the server runs, deep in its log, and some
mistakes (no version folder, a dynamic batcher, a GPU instance group on a CPU machine) never
reach the backend at all. This module parses ``config.pbtxt`` with Triton's own protobuf schema
and checks it with the very functions the backend runs at load (``parse_parameters``, the
engine manifest check), so ``check-config``, ``quanta serve``'s start-up check and a model load
say the same thing in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from quanta.frontends.triton.inputs import INPUTS
from quanta.frontends.triton.settings import ConfigParameterError, parse_parameters
from quanta.frontends.triton.tensors import OUTPUTS, TRTLLM_MAX_BATCH, TRTLLM_OUTPUTS

Severity = Literal["error", "warning"]
BACKEND = "quanta"


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding, tied to the ``config.pbtxt`` it is about."""

    where: Path
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        return f"{self.where}: {self.severity}: {self.message}"


def check_path(path: Path, *, cwd: Path | None = None, verify: bool = False) -> list[Problem]:
    """A model repository, one model folder, or one ``config.pbtxt`` file."""
    path = Path(path)
    if path.is_file():
        return check_model(path.parent, cwd=cwd, verify=verify, config_file=path)
    if (path / "config.pbtxt").is_file():
        return check_model(path, cwd=cwd, verify=verify)
    if not path.is_dir():
        return [Problem(path, "no such file or directory")]
    models = sorted(p for p in path.iterdir() if (p / "config.pbtxt").is_file())
    if not models:
        return [
            Problem(
                path,
                "not a model repository: no <name>/config.pbtxt inside "
                "(copy triton_models/config.pbtxt.template to <name>/config.pbtxt)",
            )
        ]
    return [p for model in models for p in check_model(model, cwd=cwd, verify=verify)]


def check_model(
    model: Path, *, cwd: Path | None = None, verify: bool = False, config_file: Path | None = None
) -> list[Problem]:
    """Problems of one model folder; a model of another backend is skipped."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    path = config_file or model / "config.pbtxt"
    problems: list[Problem] = []

    def error(message: str, severity: Severity = "error") -> None:
        problems.append(Problem(path, message, severity))

    try:
        config = text_format.Parse(path.read_text(encoding="utf-8"), pb.ModelConfig())
    except text_format.ParseError as exc:
        return [Problem(path, f"not a valid model config: {exc}")]
    if config.backend != BACKEND:
        return []  # another backend's model (an ensemble, a tokenizer): not ours to judge
    if config.name and config.name != model.name:
        error(
            f"name {config.name!r} differs from the folder name {model.name!r}; Triton requires "
            "them equal (or leave name out)"
        )
    if not any(p.is_dir() and p.name.isdigit() for p in model.iterdir()):
        error(f"no version folder: create {model.name}/1/ (empty), else Triton loads nothing")
    layout = config.parameters["io_layout"].string_value if "io_layout" in config.parameters else ""
    allowed = (0, TRTLLM_MAX_BATCH) if layout == "tensorrt_llm" else (0,)
    if config.max_batch_size not in allowed:
        error(
            f"max_batch_size {config.max_batch_size}: leave it out (or 0), the engine batches "
            "every iteration itself and takes one request per Triton request"
        )

    if config.HasField("dynamic_batching") or config.HasField("sequence_batching"):
        error("remove dynamic_batching/sequence_batching: the engine does its own batching")
    if config.HasField("model_transaction_policy") and not (
        config.model_transaction_policy.decoupled
    ):
        error(
            "model_transaction_policy { decoupled: false }: the quanta backend streams, "
            "set decoupled: true (or leave the block out)"
        )
    _check_tensors(config, pb, error)
    params = {key: value.string_value for key, value in config.parameters.items()}
    engine = _check_parameters(params, cwd, error)
    _check_instances(config, pb, engine, error)
    if engine is not None:
        _check_engine(engine, params, verify, error)
    return problems


def _check_tensors(config: Any, pb: Any, error: Any) -> None:
    """Hand-declared tensors must be the backend's (auto-complete adds the rest)."""
    inputs = {spec.name: spec.dtype for spec in INPUTS}
    outputs = {name: dtype for name, dtype, _ in (*OUTPUTS, *TRTLLM_OUTPUTS)}
    pairs = ((config.input, inputs, "input"), (config.output, outputs, "output"))
    for declared, known, kind in pairs:
        for tensor in declared:
            if tensor.name not in known:
                error(
                    f"{kind} {tensor.name!r} is not one the quanta backend has ({', '.join(known)})"
                )
                continue
            dtype = pb.DataType.Name(tensor.data_type)
            if dtype != known[tensor.name]:
                error(f"{kind} {tensor.name!r} is {known[tensor.name]}, not {dtype}")


def _check_parameters(params: dict[str, str], cwd: Path | None, error: Any) -> Any:
    """The backend's own parameter parsing, then the model directory it names."""
    try:
        engine, settings = parse_parameters(params, cwd=cwd)
    except ConfigParameterError as exc:
        error(str(exc).removeprefix("config.pbtxt "))
        return None
    model_dir = Path(engine.model)
    if settings.preset is not None:
        if (model_dir / "config.json").is_file():
            return engine
        return None  # built from the preset at load
    if not model_dir.is_dir():
        where = cwd or Path.cwd()
        error(
            f"parameter 'model_dir': {model_dir} does not exist (a relative model_dir resolves "
            f"against the server's working directory, here {where})"
        )
        return None
    if not (model_dir / "config.json").is_file():
        error(f"parameter 'model_dir': {model_dir} is not a checkpoint or engine (no config.json)")
        return None
    return engine


def _check_instances(config: Any, pb: Any, engine: Any, error: Any) -> None:
    device = engine.device if engine is not None else "cpu"
    for group in config.instance_group:
        kind = pb.ModelInstanceGroup.Kind.Name(group.kind)
        if kind == "KIND_GPU" and not device.startswith("cuda"):
            error(
                "instance_group kind KIND_GPU with device cpu: use KIND_CPU (the device "
                "parameter, not the instance kind, puts the engine on a GPU)"
            )
        if group.count > 1:
            error(
                f"instance_group count {group.count}: each instance loads its own weights "
                "and KV pools, and Triton spreads requests without regard to their load",
                "warning",
            )


def _check_engine(engine: Any, params: dict[str, str], verify: bool, error: Any) -> None:
    """What the engine will run with, by the check the load itself makes."""
    from quanta.build.manifest import EngineManifestError, read_manifest, sha256_file
    from quanta.frontends.engine import engine_config_for
    from quanta.runner.models.config import load_model_config

    model_dir = Path(engine.model)
    try:
        engine_config_for(engine, load_model_config(model_dir))
    except (EngineManifestError, ValueError, KeyError, NotImplementedError) as exc:
        error(f"parameter 'model_dir': {exc}")
        return
    if not verify:
        return
    manifest = read_manifest(model_dir)
    for weight in manifest.weights if manifest is not None else ():
        if sha256_file(model_dir / weight.name) != weight.sha256:
            error(
                f"parameter 'model_dir': {weight.name} does not match the engine's manifest "
                "(sha256 differs): the weights were changed; rebuild the engine"
            )
