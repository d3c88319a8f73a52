"""The Batch API's input files: JSONL of requests, checked line by line on upload.

Kept apart from the store: parsing is pure (bytes in, requests or the first bad line out),
so the routes check a file before anything is written and the store only keeps files that
passed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class BatchFileError(ValueError):
    """An input file that is not a valid batch file; ``line`` is 1-based (None: the file)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of an input file; ``line`` is its 1-based line number there."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch_file(content: bytes) -> list[BatchLine]:
    """The requests of a JSONL batch file, or ``BatchFileError`` naming the first bad line.

    Each non-empty line is ``{"custom_id", "method": "POST", "url", "body"}``, with
    ``custom_id`` unique in the file and ``url`` one of ``ENDPOINTS``.
    """
    requests: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except UnicodeDecodeError:
            raise BatchFileError("not UTF-8 text", number) from None
        except json.JSONDecodeError as exc:
            raise BatchFileError(f"not valid JSON ({exc.msg})", number) from None
        if not isinstance(item, dict):
            raise BatchFileError("not a JSON object", number)
        custom_id, url = item.get("custom_id"), item.get("url")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchFileError("custom_id must be a non-empty string", number)
        if custom_id in seen:
            raise BatchFileError(f"custom_id {custom_id!r} is used by an earlier line", number)
        if item.get("method") != "POST":
            raise BatchFileError('method must be "POST"', number)
        if url not in ENDPOINTS:
            raise BatchFileError(f"url must be one of {', '.join(ENDPOINTS)}, not {url!r}", number)
        if not isinstance(item.get("body"), dict):
            raise BatchFileError("body must be a JSON object", number)
        extra = set(item) - {"custom_id", "method", "url", "body"}
        if extra:
            raise BatchFileError(f"unknown field(s) {', '.join(sorted(extra))}", number)
        seen.add(custom_id)
        requests.append(BatchLine(number, custom_id, url, item["body"]))
    if not requests:
        raise BatchFileError("the file holds no requests")
    return requests
