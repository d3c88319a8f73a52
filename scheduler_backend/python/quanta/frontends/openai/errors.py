"""Errors in OpenAI's shape, and the HTTP status of a Triton error message.

Why the message has to be classified: a gRPC *stream* response carries only an error message
(``ModelStreamInferResponse`` has no status field), so the INVALID_ARG / UNAVAILABLE code the
backend set is lost on the way. The backend therefore starts every message with its code
(``[resource_exhausted] ...``, see ``quanta.frontends.triton.backend.TritonResponses.error``),
and the tag decides. Messages of Triton itself carry no tag (unknown model, malformed
tensors): known phrases of those decide, and anything else is a 500.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# HTTP status -> (OpenAI error type, default code)
_TYPES: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", None),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "backend_unavailable"),
}
_TAGS = {
    "invalid_argument": 400,
    "not_found": 404,
    "resource_exhausted": 429,  # a policy throttled the request
    "unavailable": 429,  # the tag older backends gave throttling
    "cancelled": 503,
    "shutting_down": 503,  # draining before a shutdown: retry on another replica
    "internal": 500,
}
_TAG = re.compile(r"^\[(?P<tag>[a-z_]+)\]\s*")
_RETRY = re.compile(r"retry after (?P<s>\d+(?:\.\d+)?) ?s\b")
# Phrases of Triton's own (untagged) messages, lower case.
_PHRASES: tuple[tuple[str, int], ...] = (
    ("unknown model", 404),
    ("is not found", 404),
    ("unable to parse", 400),
    ("unexpected shape", 400),
    ("unexpected datatype", 400),
)


class OpenAIError(Exception):
    """An error the gateway answers with ``{"error": {...}}`` and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _TYPES.get(status, _TYPES[500])[1]
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, rounded up) when the limit says when it clears."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, _TYPES[500])[0]
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """A 400: the request can never be served as given."""
    return OpenAIError(400, message, param=param)


def unknown_model(model: str) -> OpenAIError:
    """A 404 for a ``model`` this gateway does not serve, as OpenAI words it."""
    return OpenAIError(
        404, f"The model '{model}' does not exist", param="model", code="model_not_found"
    )


def classify(message: str) -> OpenAIError:
    """The OpenAI error for a Triton error ``message``; see the module docstring."""
    tagged = _TAG.match(message)
    if tagged and tagged["tag"] in _TAGS:
        status = _TAGS[tagged["tag"]]
        retry = _RETRY.search(message) if status == 429 else None
        return OpenAIError(
            status, message[tagged.end() :], retry_after=float(retry["s"]) if retry else None
        )
    lowered = message.lower()
    for phrase, status in _PHRASES:
        if phrase in lowered:
            return OpenAIError(status, message, code="model_not_found" if status == 404 else None)
    return OpenAIError(500, message)


async def send_error(exc: OpenAIError, send: Any, headers: dict[str, str] | None = None) -> None:
    """``exc`` as a whole JSON response on an ASGI ``send``, for middleware that answers
    before the app sees the request."""
    body = json.dumps(exc.body()).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(
            (k.lower().encode(), v.encode())
            for k, v in {**(headers or {}), **exc.headers()}.items()
        ),
    ]
    await send({"type": "http.response.start", "status": exc.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
