"""Strict UTF-8 for structured output: the byte sequences xgrammar lets through that are not.

xgrammar matches text byte by byte and checks that a character's bytes are a lead byte and
continuation bytes, but not every range UTF-8 (RFC 3629) excludes: after the lead byte ED it
takes A0-BF (a UTF-16 surrogate, U+D800-U+DFFF), and in a regular expression (a schema's
``pattern`` or ``format``) also E0 80-9F and F0 80-8F (overlong encodings). A byte-level
tokenizer has a token for every byte, so a model can spell them, one token a byte. The
answer's text then decodes them as U+FFFD replacement characters: no longer the characters
the grammar counted (a ``maxLength`` or a ``pattern`` may no longer hold).

What it takes is the byte right after those four lead bytes. So each token's last byte is
remembered when it is a lone lead byte, and the next mask also forbids the tokens whose first
byte the lead does not allow; a token that holds such a pair inside itself is never allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

# The first continuation byte each lead byte allows where it differs from 80-BF.
_FIRST_AFTER = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class Utf8Guard:
    """The tokens each lone lead byte forbids next, as bitmask rows (xgrammar's layout:
    int32 words, bit ``i % 32`` of word ``i // 32`` for token ``i``) to AND into a mask."""

    def __init__(self, decoded: Sequence[bytes], vocab_size: int) -> None:
        """``decoded``: each token id's bytes, as the grammar matched them."""
        self.decoded = list(decoded[:vocab_size])
        words = -(-vocab_size // 32)
        self._lead = bytearray(vocab_size)  # a token's last byte where it is a lone lead
        forbidden: dict[int, list[int]] = {lead: [] for lead in _FIRST_AFTER}
        never: list[int] = []
        for token, data in enumerate(self.decoded):
            if not data:
                continue
            if data[-1] in _FIRST_AFTER:
                self._lead[token] = data[-1]
            if any(not _allowed(a, b) for a, b in pairwise(data)):
                never.append(token)
            if 0x80 <= data[0] <= 0xBF:
                for lead in _FIRST_AFTER:
                    if not _allowed(lead, data[0]):
                        forbidden[lead].append(token)
        self._after = {
            lead: _keep_row(tokens + never, words) for lead, tokens in forbidden.items()
        }
        self._always = _keep_row(never, words) if never else None

    def lead_after(self, token: int) -> int:
        """The lone lead byte ``token`` ends with (0 for none): the state the next mask
        depends on."""
        return self._lead[token] if 0 <= token < len(self._lead) else 0

    def restrict(self, row: torch.Tensor, lead: int) -> None:
        """Clear, in ``row`` (one request's mask, in place), the tokens that would make the
        text invalid UTF-8 after a token that ended with ``lead``."""
        if lead:
            row.bitwise_and_(self._after[lead])
        elif self._always is not None:
            row.bitwise_and_(self._always)


def _allowed(lead: int, byte: int) -> bool:
    """Whether ``byte`` may follow ``lead`` (as far as the leads xgrammar misjudges go)."""
    bounds = _FIRST_AFTER.get(lead)
    return bounds is None or bounds[0] <= byte <= bounds[1]


def _keep_row(forbidden: list[int], words: int) -> torch.Tensor:
    """An all-ones bitmask row with the bits of ``forbidden`` cleared."""
    row = [0xFFFFFFFF] * words
    for token in forbidden:
        row[token >> 5] &= ~(1 << (token & 31))
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in row]  # as int32 holds them
    return torch.tensor(signed, dtype=torch.int32)
