"""Structured output with xgrammar: guides compiled into per-request grammar matchers
(``grammar``), and the token bitmasks a runner applies to the logits (``masks``).

Why xgrammar: vLLM, SGLang and TensorRT-LLM use it, it compiles JSON schemas, regular
expressions and EBNF grammars alike, and on SmolLM2's 49k vocabulary it compiled the
tool-call schema of ``quanta bench structured`` in 9 ms against outlines-core's 333 ms; both
fill a token's mask in microseconds (2.4 and 9.9 us on average), far below a decode step
(``quanta bench structured --compare-outlines``, ``docs/decoding.md``). It imports torch and
transformers, so only the frontends and the runner import this package, never the core.
"""

from quanta.structured.grammar import Grammars, XGrammarConstraint
from quanta.structured.masks import GrammarMasks

__all__ = ["GrammarMasks", "Grammars", "XGrammarConstraint"]
