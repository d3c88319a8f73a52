"""Weights written as HF writes them: safetensors shards of bounded size, one file named
``model.safetensors`` or several numbered ones with their index."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file


@contextmanager
def shard_writer(
    out: Path, limit: int, shards: list[tuple[Path, list[str]]]
) -> Iterator[Callable[[str, torch.Tensor], None]]:
    """``add(name, tensor)`` collects tensors into hidden shard files of at most ``limit``
    bytes each (one tensor alone may be larger), appended to ``shards`` as written, so a
    build never holds more than one shard in memory."""
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal size
        if pending:
            path = out / f".shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, list(pending)))
            pending.clear()
            size = 0

    def add(name: str, tensor: torch.Tensor) -> None:
        nonlocal size
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > limit:
            flush()
        pending[name] = tensor
        size += nbytes

    yield add
    flush()


def name_shards(out: Path, shards: list[tuple[Path, list[str]]]) -> list[Path]:
    """One shard is ``model.safetensors``; more are numbered with an index, as HF writes."""
    if len(shards) == 1:
        final = out / "model.safetensors"
        shards[0][0].rename(final)
        final.chmod(0o644)
        return [final]
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(shards, start=1):
        final = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        path.rename(final)
        final.chmod(0o644)
        files.append(final)
        weight_map |= {name: final.name for name in names}
    total = sum(p.stat().st_size for p in files)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files
