"""Compile a request's ``StructuredOutput`` into a grammar matcher of its own.

One ``Grammars`` per engine: xgrammar's tokenizer description is built once (on the first
structured request, so servers that never see one never import xgrammar), and compiled
grammars are cached by the compiler, so a schema sent by every call of an agent compiles once.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from quanta.core.errors import InvalidRequestError
from quanta.core.json_schema import SchemaNotEnforceable, enforced_schema
from quanta.core.structured import StructuredOutput
from quanta.structured.utf8 import Utf8Guard

if TYPE_CHECKING:
    import xgrammar as xgr

    from quanta.text.tokenizer import Tokenizer


class XGrammarConstraint:
    """One request's grammar state (``core.structured.TokenConstraint``) and its mask."""

    __slots__ = ("guard", "lead", "matcher")

    def __init__(self, matcher: xgr.GrammarMatcher, guard: Utf8Guard) -> None:
        self.matcher = matcher
        self.guard = guard
        self.lead = 0  # the lone UTF-8 lead byte the output ends with (``utf8``), or 0

    def accept(self, token_id: int) -> bool:
        if not self.matcher.accept_token(token_id):
            return False
        self.lead = self.guard.lead_after(token_id)
        return True

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of an xgrammar bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.guard.restrict(bitmask[row], self.lead)


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
        self._guard: Utf8Guard | None = None

    def __call__(self, spec: StructuredOutput) -> XGrammarConstraint:
        import xgrammar as xgr

        compiled = self._compile(spec)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop or None)
        assert self._guard is not None  # built with the compiler
        return XGrammarConstraint(matcher, self._guard)

    def warm(self) -> None:
        """Build the tokenizer description now rather than on the first request."""
        self._get_compiler()

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes as the grammar matches them (empty: never allowed)."""
        self._get_compiler()
        assert self._guard is not None
        return self._guard.decoded

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json_schema":
                return _compile_schema(compiler, json.loads(spec.json_schema or "true"))
            if kind == "json_object":
                # vLLM's json_object: any object (not an array), written as a schema's are
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if kind == "regex":
                return compiler.compile_regex(spec.regex or "")
            if kind == "choice":
                return compiler.compile_regex(choice_regex(spec.choice or ()))
            return compiler.compile_grammar(spec.grammar or "")
        except SchemaNotEnforceable as exc:
            raise InvalidRequestError(f"structured output: {exc}") from None
        except Exception as exc:  # the library's parse errors come as several types
            what = {"json_schema": "JSON schema", "grammar": "EBNF grammar"}.get(kind, kind)
            detail = _LOCATION.sub("", " ".join(str(exc).split())) or type(exc).__name__
            raise InvalidRequestError(
                f"structured output: the {what} cannot be compiled: {detail}"
            ) from None

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                decoded, add_prefix_space = self._vocabulary()
                self._guard = Utf8Guard(decoded, self._vocab_size)
                info = xgr.TokenizerInfo(
                    decoded,
                    vocab_type=xgr.VocabType.RAW,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop or None,
                    add_prefix_space=add_prefix_space,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _vocabulary(self) -> tuple[list[bytes], bool]:
        """xgrammar's vocabulary: each id's bytes as the tokenizer's ``decode`` writes them
        (and whether the tokenizer adds a prefix space). The model's tokens are decoded as
        xgrammar reads the tokenizer's kind (byte-level, byte-fallback). An added token is
        checked against ``decode``: whether it goes through the decoder depends on the
        tokenizer, and a special one is dropped (blank: xgrammar then never allows it, so
        ``<|im_end|>`` is never ten characters of a JSON string); one matching neither is
        blanked too."""
        import xgrammar as xgr

        backend = self._tokenizer.backend
        encoded = [""] * self._vocab_size
        for token, index in backend.get_vocab(with_added_tokens=True).items():
            if index < self._vocab_size:
                encoded[index] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        decoded = list(xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"]).decoded_vocab)
        for index, added in backend.get_added_tokens_decoder().items():
            if index < self._vocab_size:
                text = self._tokenizer.decode([index])
                candidates = (decoded[index], added.content.encode(), b"")
                decoded[index] = next(
                    (c for c in candidates if c.decode(errors="replace") == text), b""
                )
        return decoded, bool(meta["add_prefix_space"])


# The library's "[20:13:48] /project/cpp/json_schema_converter.cc:936: " before its message.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
# NOTE: xgrammar (0.2.8) writes a string with minLength/maxLength as characters of the class
# below, which lets control characters other than CR and LF through unescaped (JSON forbids
# them in a string: a strict parser refuses the answer). Its plain strings use the second
# class; the converted grammar is compiled with that one instead, from its EBNF text. That
# text writes U+0080-U+00FF as ``\xHH``, which its parser reads on into a hex digit after it
# (a property "\x800" would become U+0800): they are written ``\u00HH`` first.
_LENGTH_CHARS = r'[^\"\\\r\n]'
_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'
_HEX_ESCAPE = re.compile(r"(\\\\)|\\x([0-9a-fA-F]{2})")  # an escaped backslash, or \xHH


def _compile_schema(compiler: xgr.GrammarCompiler, schema: Any) -> xgr.CompiledGrammar:
    """A JSON schema's grammar (``enforced_schema``'s rewrite of it), written compactly."""
    import xgrammar as xgr

    text = json.dumps(enforced_schema(schema), ensure_ascii=False)
    if "Length" in text:
        ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True))
        if _LENGTH_CHARS in ebnf:
            ebnf = _HEX_ESCAPE.sub(lambda m: m[1] or f"\\u00{m[2]}", ebnf)
            return compiler.compile_grammar(ebnf.replace(_LENGTH_CHARS, _STRING_CHARS))
    return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)


def choice_regex(choices: Sequence[str]) -> str:
    """A regular expression matching exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in choices) + ")"


# NOTE: escape only the metacharacters: Python's re.escape also escapes characters (``-``,
# ``#``, spaces) that xgrammar's regular expressions do not take escaped.
_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}/]")
