"""Model repositories for the ``quanta`` backend: the default tiny model and custom ones.

The default model's ``config.pbtxt`` is rendered from here, so ``quanta serve`` works from an
installed package without a checkout; ``triton_models/quanta/config.pbtxt`` in the repository is
the same text (a test keeps them equal).
"""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_MODEL_NAME = "quanta"
DEFAULT_PARAMETERS: dict[str, str] = {
    "model_dir": "engines/opt-tiny",
    "preset": "opt-tiny",
    "policy": "fcfs",
    "block_size": "16",
    "num_device_blocks": "256",
    "num_host_blocks": "512",
    "max_num_batched_tokens": "1024",
    "max_num_seqs": "64",
}
_HEADER = """\
# The default Quanta model: a tiny random-weight OPT served on CPU.
#
# The backend "quanta" adds the input/output tensors and decoupled mode itself
# (auto-complete), so a model only says which engine to run and how to schedule it.
# See ../config.pbtxt.template for every parameter.
"""


def render_config(
    parameters: dict[str, str], *, instance_count: int = 1, header: str = _HEADER
) -> str:
    """A ``config.pbtxt`` for the quanta backend with these (string) parameters."""
    lines = [
        header.rstrip("\n"),
        'backend: "quanta"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        f"instance_group [ {{ count: {instance_count}, kind: KIND_CPU }} ]",
        "",
    ]
    for key, value in parameters.items():
        escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'parameters: {{ key: "{key}", value: {{ string_value: "{escaped}" }} }}')
    return "\n".join(lines) + "\n"


def write_model_repository(
    root: Path,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    overrides: dict[str, str] | None = None,
    instance_count: int = 1,
) -> Path:
    """Write ``root/<model_name>/{config.pbtxt,1/}`` from the defaults plus ``overrides``."""
    params = {**DEFAULT_PARAMETERS, **(overrides or {})}
    model = Path(root) / model_name
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(render_config(params, instance_count=instance_count))
    return Path(root)


def model_dir_from_repository(repository: Path, model_name: str) -> Path | None:
    """The ``model_dir`` parameter of ``<repository>/<model_name>/config.pbtxt``, if any.

    Where a chat template is looked up for a repository given without a model; a relative
    path is taken as Triton takes it, from the current directory.
    """
    config = Path(repository) / model_name / "config.pbtxt"
    if not config.is_file():
        return None
    text = config.read_text(encoding="utf-8")
    found = re.search(
        r'key:\s*"model_dir"\s*,?\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', text
    )
    return Path(found.group(1).replace('\\"', '"').replace("\\\\", "\\")) if found else None
