"""In-process streaming for ``quanta generate --model``: the loop on its thread, deltas here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from quanta.core.config import EngineConfig
from quanta.core.request import SamplingParams
from quanta.frontends.engine import build_engine


def stream_generate(
    model: Path, prompt: str, params: SamplingParams, *, config: EngineConfig | None = None
) -> Iterator[str]:
    """Yield text as it is generated; raises the request's error if it fails."""
    engine = build_engine(config or EngineConfig(model=str(model)))
    request = engine.make_request(prompt, params)
    stream = engine.loop.submit(request)
    assert stream is not None
    engine.loop.start()
    try:
        for out in stream:
            if out.error is not None:
                raise out.error
            if out.new_text:
                yield out.new_text
    finally:
        engine.loop.stop()
