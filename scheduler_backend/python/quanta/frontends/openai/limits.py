"""Size limits the gateway enforces before work grows with the request.

Two limits, cheapest first:

- **body bytes** (``--max-request-bytes``; the Batch API's file upload has its own,
  ``--max-file-bytes``): ``body_limit.BodyLimit`` answers 413 from ``Content-Length`` before
  a byte of the body is read, and counts the bytes of a body without one (chunked) as the
  app reads them, so a body past the limit is never held whole. (Starlette's own limiter
  does the same but answers in plain text, replacing any response; the gateway's errors are
  OpenAI's JSON.)
- **prompt bytes** (``--max-prompt-bytes``): a text prompt longer in UTF-8 bytes than
  ``max_model_len`` times the vocabulary's longest token cannot fit the context however it
  is tokenized, so it is refused with a 400 naming ``prompt`` (or ``messages``) before
  anything tokenizes it; a prompt of token ids is refused when it has more than
  ``max_model_len`` ids. The bound is derived from the checkpoint (``config.json``'s
  ``max_position_embeddings``, or ``--max-model-len``, and its tokenizer) when the gateway
  knows it, and tighter prompts are the engine's to refuse with the exact count.

Why the longest token is a sound divisor: every token of a byte-level or SentencePiece
vocabulary stands for at most as many bytes of text as its own vocabulary string has (its
byte alphabet and ``▁`` take at least as many UTF-8 bytes as the bytes they stand for), so a
text of B bytes has at least B / longest tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quanta.frontends.openai.errors import OpenAIError, invalid

if TYPE_CHECKING:
    from quanta.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_SPECIALS = 8  # tokens a tokenizer may add around a text (BOS, EOS, ...), at most


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt the gateway forwards: ``max_bytes`` of text, ``max_ids`` ids."""

    max_bytes: int | None = None
    max_ids: int | None = None

    def check(self, prompt: str | list[int], param: str) -> None:
        """Raise a 400 naming ``param`` for a prompt that cannot fit the context."""
        if isinstance(prompt, str):
            if self.max_bytes is None or len(prompt) * 4 <= self.max_bytes:
                return  # NOTE: a character is at most 4 UTF-8 bytes: no encoding needed
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.max_bytes:
                raise invalid(
                    f"{param} is {size} bytes of text; this server takes at most "
                    f"{self.max_bytes} bytes per prompt (its context cannot hold more)",
                    param,
                )
        elif self.max_ids is not None and len(prompt) > self.max_ids:
            raise invalid(
                f"{param} has {len(prompt)} token ids; the model's context holds {self.max_ids}",
                param,
            )

    def check_tokens(self, prompt: str, count: Callable[[str], int] | None, param: str) -> None:
        """Count the tokens of a text prompt that may not fit, and refuse it if it does not.

        Runs on the gateway's worker thread, so an over-long prompt is refused here rather
        than tokenized again by the engine's server; a prompt with fewer UTF-8 bytes than the
        context has tokens always fits (a token stands for at least one byte) and is not
        counted."""
        if self.max_ids is None or count is None or len(prompt) * 4 + _SPECIALS <= self.max_ids:
            return
        if len(prompt.encode("utf-8", "surrogatepass")) + _SPECIALS <= self.max_ids:
            return
        tokens = count(prompt)
        if tokens > self.max_ids + 1:  # NOTE: +1: the engine may drop or add a BOS the count has
            raise invalid(
                f"{param} is {tokens} tokens; the model's context holds {self.max_ids}", param
            )


def prompt_limit(
    model_dir: Path | None,
    tokenizer: Tokenizer | None,
    *,
    max_model_len: int | None = None,
    max_prompt_bytes: int | None = None,
) -> PromptLimit:
    """The gateway's prompt limit: ``max_prompt_bytes`` if given, else derived from the
    context length (``max_model_len``, else the checkpoint's) and the tokenizer's longest
    token; no text bound where either is unknown."""
    length = max_model_len or _context_length(model_dir)
    if max_prompt_bytes is None and length is not None and tokenizer is not None:
        longest = longest_token_bytes(tokenizer)
        if longest is not None:
            max_prompt_bytes = length * longest
    return PromptLimit(max_prompt_bytes, length)


def token_counter(tokenizer: Tokenizer | None) -> Callable[[str], int] | None:
    """Counts a text's tokens, releasing the GIL while it does: the tokenizers library's
    ``encode`` holds it (a 1 MB prompt stalled the event loop for seconds), its
    ``encode_batch`` does not, and ``len`` of the encoding builds no list of ids."""
    if tokenizer is None:
        return None
    backend = tokenizer.backend
    return lambda text: len(backend.encode_batch([text])[0])


def longest_token_bytes(tokenizer: Tokenizer) -> int | None:
    """UTF-8 bytes of the vocabulary's longest token string, added tokens included."""
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    except Exception:  # a tokenizer without a vocabulary to list: no bound
        return None
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


def _context_length(model_dir: Path | None) -> int | None:
    """``max_position_embeddings`` of the checkpoint's ``config.json``, if it says."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def too_large(limit: int | None, param: str | None = None) -> OpenAIError:
    """The 413 for a body past ``limit`` bytes."""
    size = "" if limit is None else f" of {limit} bytes"
    return OpenAIError(
        413,
        f"the request body is larger than this server's limit{size} "
        "(--max-request-bytes; --max-file-bytes for file uploads)",
        param=param,
    )
