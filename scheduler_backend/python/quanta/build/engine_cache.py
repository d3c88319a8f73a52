"""Engines built on demand from GGUF files, kept in the cache and reused.

Why: ``quanta serve MODEL.gguf`` and ``quanta fetch-model`` should cost a dequantization once,
not at every start. An engine is keyed by the GGUF file's digest and the serving dtype, so a
changed file or another dtype builds anew and a matching engine is reused as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quanta.build.engine_build import BuildOptions, Progress, build_engine_dir
from quanta.build.fetch import cache_dir
from quanta.build.manifest import ENGINE_FORMAT, read_manifest, sha256_file
from quanta.runner.model_runner import resolve_dtype


def engine_for_gguf(
    gguf: Path,
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    embedding: bool = False,
    head: str | None = None,
    cache: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """The engine directory for ``gguf`` in ``dtype`` (default: the machine's fastest) and
    ``quantization`` (``quanta build --quantization``; None dequantizes; ``embedding``: the
    token embedding's table too, ``--quantize-embedding``; ``head``: the quantized head's own
    mode, ``--lm-head-quantization``), built the first time and found in the cache
    afterwards."""
    gguf = Path(gguf)
    digest = sha256_file(gguf)
    dtype_name = str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")
    quant = f"-{quantization}" if quantization else ""
    quant += "-embedding" if embedding else ""
    quant += f"-head-{head}" if head else ""
    out = (cache or cache_dir()) / "engines" / f"{gguf.stem}-{dtype_name}{quant}-{digest[:12]}"
    if _matches(out, digest, dtype_name, quantization, embedding, head):
        return out
    options = BuildOptions(
        name=gguf.stem,
        dtype=dtype_name,  # type: ignore[arg-type]
        quantization=quantization,  # type: ignore[arg-type]
        quantize_embedding=embedding,
        quantize_lm_head=head is not None,
        lm_head_quantization=head,  # type: ignore[arg-type]
    )
    try:
        build_engine_dir(gguf, out, options, overwrite=True, progress=progress)
    except FileExistsError:
        if not _matches(out, digest, dtype_name, quantization, embedding, head):  # meanwhile
            raise
    return out


def _matches(
    engine: Path,
    digest: str,
    dtype: str,
    quantization: str | None,
    embedding: bool,
    head: str | None,
) -> bool:
    if not engine.is_dir():
        return False
    manifest = read_manifest(engine)
    if manifest is None or manifest.source.sha256 != digest or manifest.dtype != dtype:
        return False
    if manifest.format != ENGINE_FORMAT:  # built by an older Quanta: rebuilt in today's layout
        return False
    if manifest.quantization is None:
        return quantization is None
    q = manifest.quantization
    return (
        quantization is not None
        and q.embedding == embedding
        and (head is None or (q.lm_head and q.lm_head_mode == head))
    )
