"""Incremental detokenization with stop strings, without torch or a tokenizer dependency.

The decoder callable is injected (the frontend's tokenizer). Each step decodes only a short
window: the tokens since the last complete character plus the chunk before them as context,
and takes the new text as the difference of the two decodes (the scheme of vLLM's
incremental detokenizer, which is exact where a decode of the window with its context ends
as the decode of the whole would: byte-level BPE, and SentencePiece's leading-space rule,
which the context chunk keeps). A request's per-step cost thus stays constant instead of
re-decoding every output token each step (quadratic over a long answer). Text that might
still become a stop string, or an incomplete UTF-8 character, is held back, so a client never
sees a partial stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[Sequence[int]], str]
_REPLACEMENT = "\ufffd"
# Ids in a window past which its text is decoded whole instead: a UTF-8 character is at most
# 4 bytes, so a longer run without a whole character is invalid text that will never resolve.
_MAX_WINDOW = 16


@dataclass(slots=True)
class Detokenizer:
    """Per-request text state: what was emitted so far and what the stop strings are."""

    decode: Decode
    stop: tuple[str, ...] = ()
    emitted: int = 0  # characters of the decoded text already sent
    text: str = field(default="")
    # ids[:read] decode to ``complete`` (whole characters); ids[prefix:read] is the context
    # the next window is decoded with.
    complete: str = ""
    prefix: int = 0
    read: int = 0

    def update(self, output_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """New text to emit and whether a stop string ended the request.

        On a stop string the text is cut before it and ``True`` is returned.
        """
        full = self._decoded(output_ids)
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            cut = _first_stop(full, self.stop, start)
            if cut is not None:
                return self._emit(full[:cut]), True
        if final:
            return self._emit(full), False
        safe = len(full) - _holdback(full, self.stop)
        return self._emit(full[:safe]), False

    def _decoded(self, ids: Sequence[int]) -> str:
        """The text of all of ``ids``, decoding only the window past the last whole character."""
        if len(ids) - self.prefix > _MAX_WINDOW:
            # Ids that never form whole characters (invalid UTF-8 from a random model): decode
            # all, as exact as ever, and restart the window at the end.
            return self._restart(ids, self.decode(ids))
        context = self.decode(ids[self.prefix : self.read])
        window = self.decode(ids[self.prefix :])
        if not window.startswith(context):  # a decoder this scheme does not fit
            return self._restart(ids, self.decode(ids))
        new = window[len(context) :]
        if new.endswith(_REPLACEMENT):  # a character still incomplete: wait for its bytes
            return self.complete + new
        self.complete += new
        if new:  # the new ids are the next window's context
            self.prefix = self.read
        self.read = len(ids)
        return self.complete

    def _restart(self, ids: Sequence[int], full: str) -> str:
        if not full.endswith(_REPLACEMENT):
            # the last id stays as context (SentencePiece drops a leading space without one)
            self.complete, self.prefix, self.read = full, max(len(ids) - 1, 0), len(ids)
        return full

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
