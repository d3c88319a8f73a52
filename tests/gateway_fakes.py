"""A Triton stand-in for gateway tests that need no server: it records what reached it.

``RecordingTriton`` answers every request at once with its prompt's first characters and
keeps each request's inputs, so a test can check what the gateway forwarded (the tenant a key
gave, the priority class) without a model. ``serve`` starts the real gateway (uvicorn on a
thread, every route and middleware as in production) in front of it.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

from quanta.frontends.openai.app import GatewaySettings
from quanta.frontends.openai.server import GatewayServer
from quanta.frontends.triton.launcher import free_port
from quanta.text.chat_template import ChatTemplate

MODEL = "quanta"


class RecordingTriton:
    """Answers with the prompt's first ``max_tokens`` characters; thread-safe record."""

    def __init__(self) -> None:
        self.served: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def stream(self, model: str, inputs: dict[str, Any], **_: Any) -> RecordingStream:
        return RecordingStream(self, inputs)

    async def is_model_ready(self, model: str) -> bool:
        return True

    async def close(self) -> None:
        pass

    def inputs(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.served)

    def answer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.served.append(inputs)
        if "text_input" not in inputs and "input_ids" not in inputs:
            return {}  # a control request: reset_prefix_cache, health_check
        prompt = inputs.get("text_input") or " ".join(map(str, inputs["input_ids"]))
        text = prompt[: inputs["max_tokens"]]
        return {
            "text_output": text,
            "finish_reason": "length",
            "num_prompt_tokens": len(prompt),
            "num_output_tokens": len(text),
        }


class RecordingStream:
    def __init__(self, upstream: RecordingTriton, inputs: dict[str, Any]) -> None:
        self._upstream = upstream
        self._inputs = inputs
        self.request_id = uuid.uuid4().hex
        self.done = False

    def __aiter__(self) -> RecordingStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        self.done = True
        return self._upstream.answer(self._inputs)

    def cancel(self) -> None:
        self.done = True


def serve(
    state_dir: Path,
    upstream: RecordingTriton,
    chat_template: ChatTemplate | None = None,
    **settings: Any,
) -> GatewayServer:
    """The gateway on a free loopback port in front of ``upstream``, started."""
    config = GatewaySettings(
        triton_grpc_url="127.0.0.1:1", model_name=MODEL, state_dir=state_dir, **settings
    )
    server = GatewayServer(
        config,
        port=free_port(),
        upstream=upstream,  # type: ignore[arg-type]
        chat_template=chat_template,
    )
    return server.start()
