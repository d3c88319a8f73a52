"""Compile a request's ``StructuredOutput`` into a grammar matcher of its own.

One ``Grammars`` per engine: xgrammar's tokenizer description is built once (on the first
structured request, so servers that never see one never import xgrammar), and compiled
grammars are cached by the compiler, so a schema sent by every call of an agent compiles once.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from quanta.core.errors import InvalidRequestError
from quanta.core.structured import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

    from quanta.frontends.tokenizer import Tokenizer


class XGrammarConstraint:
    """One request's grammar state (``core.structured.TokenConstraint``) and its mask."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of an xgrammar bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """The engine's grammar compiler: ``grammars(spec)`` is a ``ConstraintCompiler``."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        """``vocab_size`` is the model's (its logits' width, which may exceed the
        tokenizer's); ``stop_token_ids`` end a finished output (the model's EOS ids)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None

    def __call__(self, spec: StructuredOutput) -> XGrammarConstraint:
        import xgrammar as xgr

        compiled = self._compile(spec)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop or None)
        return XGrammarConstraint(matcher)

    def warm(self) -> None:
        """Build the tokenizer description now rather than on the first request."""
        self._get_compiler()

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec.json_schema or "", any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(spec.regex or "")
            if kind == "choice":
                return compiler.compile_regex(choice_regex(spec.choice or ()))
            return compiler.compile_grammar(spec.grammar or "")
        except Exception as exc:  # the library's parse errors come as several types
            what = {"json_schema": "JSON schema", "grammar": "EBNF grammar"}.get(kind, kind)
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise InvalidRequestError(
                f"structured output: the {what} cannot be compiled: {detail}"
            ) from None

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1)
            return self._compiler

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        """xgrammar's description of the vocabulary: each id's token as the tokenizer stores
        it, with special tokens blanked (xgrammar then never allows them; otherwise
        ``<|im_end|>`` would count as its ten characters inside a JSON string)."""
        import xgrammar as xgr

        backend = self._tokenizer.backend
        encoded = [""] * self._vocab_size
        for token, index in backend.get_vocab(with_added_tokens=True).items():
            if index < self._vocab_size:
                encoded[index] = token
        for index, added in backend.get_added_tokens_decoder().items():
            if added.special and index < self._vocab_size:
                encoded[index] = ""
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        return xgr.TokenizerInfo(
            encoded,
            vocab_type=meta["vocab_type"],
            vocab_size=self._vocab_size,
            stop_token_ids=self._stop or None,
            add_prefix_space=meta["add_prefix_space"],
        )


def choice_regex(choices: Sequence[str]) -> str:
    """A regular expression matching exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in choices) + ")"


# NOTE: escape only the metacharacters: Python's re.escape also escapes characters (``-``,
# ``#``, spaces) that xgrammar's regular expressions do not take escaped.
_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}/]")
