"""Incremental detokenization with stop strings, without torch or a tokenizer dependency.

The decoder callable is injected (the frontend's tokenizer). Text is re-decoded from all
output ids each step, which is exact for byte-level BPE (a token may end mid-character) and
cheap at the lengths we serve. Text that might still become a stop string, or an incomplete
UTF-8 character, is held back, so a client never sees a partial stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[Sequence[int]], str]
_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class Detokenizer:
    """Per-request text state: what was emitted so far and what the stop strings are."""

    decode: Decode
    stop: tuple[str, ...] = ()
    emitted: int = 0  # characters of the decoded text already sent
    text: str = field(default="")

    def update(self, output_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """New text to emit and whether a stop string ended the request.

        On a stop string the text is cut before it and ``True`` is returned.
        """
        full = self.decode(output_ids)
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            cut = _first_stop(full, self.stop, start)
            if cut is not None:
                return self._emit(full[:cut]), True
        if final:
            return self._emit(full), False
        safe = len(full) - _holdback(full, self.stop)
        return self._emit(full[:safe]), False

    def _emit(self, visible: str) -> str:
        if len(visible) <= self.emitted:
            return ""
        delta = visible[self.emitted :]
        self.emitted = len(visible)
        self.text = visible
        return delta


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end that may still turn into a stop string or a whole character."""
    partial = len(text) - len(text.rstrip(_REPLACEMENT))
    body = text[: len(text) - partial]
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(body)), longest, -1):
            if body.endswith(s[:k]):
                longest = k
                break
    return partial + longest
