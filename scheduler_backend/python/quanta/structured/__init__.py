"""Structured output with xgrammar: guides compiled into per-request grammar matchers
(``grammar``), and the token bitmasks a runner applies to the logits (``masks``).

Why xgrammar: vLLM, SGLang and TensorRT-LLM use it, it compiles JSON schemas, regular
expressions and EBNF grammars alike, and on SmolLM2's 49k vocabulary it compiled a tool-call
schema in 6 ms and filled a mask in about 0.3 ms a token, against outlines-core's 105 ms and
0.5 ms (``docs/decoding.md``). It imports torch and transformers, so only the frontends and
the runner import this package, never the core.
"""

from quanta.structured.grammar import Grammars, XGrammarConstraint
from quanta.structured.masks import GrammarMasks

__all__ = ["GrammarMasks", "Grammars", "XGrammarConstraint"]
