"""Streaming plumbing of the gateway: merge several generation streams, watch for a client
that goes away, and write server-sent events.

Why apart from the routes: none of it knows OpenAI's request or response shapes, so the
routes module keeps to building requests and answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from quanta.frontends.openai.errors import OpenAIError

_END = object()


async def interleave(
    sources: list[AsyncIterator[dict[str, Any]]],
) -> AsyncIterator[dict[str, Any]]:
    """Items of all ``sources`` in the order they come; the first error ends it."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(source: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in source:
                await queue.put(item)
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(exc)
        finally:
            await queue.put(_END)

    tasks = [asyncio.create_task(pump(source)) for source in sources]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class DisconnectWatcher:
    """Calls ``on_disconnect`` when the HTTP client goes away; ``stop()`` when done.

    Why not rely on Starlette: it notices a disconnect only while it streams, so a request still
    waiting for its first token (or a non-streamed one) would keep running on the server.
    """

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self._task = asyncio.create_task(self._watch(request, on_disconnect))

    @staticmethod
    async def _watch(request: Request, on_disconnect: Callable[[], None]) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        on_disconnect()

    def stop(self) -> None:
        self._task.cancel()


async def event_stream(
    chunks: AsyncIterator[dict[str, Any]], cancel: Callable[[], None], watcher: DisconnectWatcher
) -> AsyncIterator[str]:
    """Server-sent events of ``chunks``; an error mid-stream is one ``{"error": ...}`` event."""
    try:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        watcher.stop()
        cancel()
