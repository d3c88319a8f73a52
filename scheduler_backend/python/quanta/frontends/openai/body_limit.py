"""The request body limit of ``limits.py``, as ASGI middleware (imports Starlette, so it
lives apart from the limits the command line reads)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quanta.frontends.openai.errors import send_error
from quanta.frontends.openai.limits import too_large


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body passes its limit; the app's handler for
    ``HTTPException`` answers it (``too_large``) as nothing has been sent yet."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")
        self.limit = limit


class BodyLimit:
    """At most ``max_bytes`` of body per request; ``routes``: larger limits by path (POST
    ``/v1/files``). See the module docstring."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, routes: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.routes = dict(routes or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.routes.get(scope["path"], self.max_bytes)
        length = _content_length(scope)
        if length is not None and length > limit:
            # NOTE: the client is told at once and the connection closes; the body is never read
            await send_error(too_large(limit), send, {"Connection": "close"})
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's parser refuses it before we see it
    return None
