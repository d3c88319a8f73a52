"""xgrammar against outlines-core on one schema and one vocabulary (``--compare-outlines``).

What backs the choice of grammar library (``quanta/structured/__init__.py``): per library, the
one-off description of the vocabulary, the schema's compile, and the time to fill one token's
mask, walking calls of every tool token by token (their EOS included) as a decode would.
xgrammar runs exactly as the engine runs it (``quanta.structured.Grammars``, a fresh one per
compile so its cache never answers); outlines-core is a bench-only peer, not a dependency:
when it is not installed the comparison says so and measures xgrammar alone.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quanta.text.tokenizer import Tokenizer


@dataclass
class LibraryTimes:
    library: str
    version: str
    vocab_ms: float  # the vocabulary's description: once per model
    compile_ms: float  # the schema, median of fresh compiles
    fill_us_median: float  # one token's mask
    fill_us_mean: float
    fill_us_max: float
    tokens: int  # masks filled per walk


def compare_libraries(
    tokenizer: Tokenizer,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    schema: str,
    answers: Sequence[str],
    *,
    repeats: int = 5,
) -> tuple[list[LibraryTimes], str | None]:
    """Both libraries' times, or xgrammar's and why outlines-core was not measured."""
    eos = stop_token_ids[0]
    walks = [[*tokenizer.backend.encode(a, add_special_tokens=False).ids, eos] for a in answers]
    results = [_xgrammar(tokenizer, vocab_size, stop_token_ids, schema, walks, repeats)]
    try:
        import outlines_core  # noqa: F401
    except ImportError:
        return results, (
            "outlines-core is not installed (pip install outlines-core into this venv; it is "
            "a bench-only peer, not a dependency of Quanta): xgrammar measured alone"
        )
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return results, "outlines-core measured on byte-level BPE vocabularies only"
    results.append(_outlines(tokenizer, vocab_size, eos, schema, walks, repeats))
    return results, None


def _xgrammar(
    tokenizer: Tokenizer,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    schema: str,
    walks: list[list[int]],
    repeats: int,
) -> LibraryTimes:
    import xgrammar as xgr
    from quanta.core.structured import StructuredOutput
    from quanta.structured import Grammars, XGrammarConstraint

    spec = StructuredOutput(json_schema=schema)
    vocab, compiles = [], []
    for _ in range(repeats):
        grammars = Grammars(tokenizer, vocab_size, stop_token_ids)
        vocab.append(_timed(grammars.warm))
        compiles.append(_timed(lambda g=grammars: g(spec)))
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def walk(ids: list[int]) -> list[float]:
        constraint = grammars(spec)
        assert isinstance(constraint, XGrammarConstraint)
        fills = []
        for token in ids:
            fills.append(_timed(lambda: constraint.fill_mask(bitmask, 0)))
            if not constraint.accept(token):
                raise ValueError(f"xgrammar refused token {token} of a valid answer")
        return fills

    return _times("xgrammar", vocab, compiles, walks, walk, repeats)


def _outlines(
    tokenizer: Tokenizer,
    vocab_size: int,
    eos: int,
    schema: str,
    walks: list[list[int]],
    repeats: int,
) -> LibraryTimes:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Vocabulary:
        return Vocabulary(eos, _token_bytes(tokenizer, vocab_size, eos))

    vocab = [_timed(vocabulary) for _ in range(repeats)]
    built = vocabulary()
    compiles, index = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        index = Index(build_regex_from_schema(schema), built)
        compiles.append((time.perf_counter() - started) * 1e3)
    mask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)

    def walk(ids: list[int]) -> list[float]:
        guide = Guide(index)
        fills = []
        for token in ids:
            fills.append(_timed(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)))
            if token != eos:  # EOS ends the output; the guide has no state past it
                guide.advance(token, return_tokens=False)  # raises on a refused token
        return fills

    return _times("outlines-core", vocab, compiles, walks, walk, repeats)


def _times(
    library: str,
    vocab: list[float],
    compiles: list[float],
    walks: list[list[int]],
    walk: Callable[[list[int]], list[float]],
    repeats: int,
) -> LibraryTimes:
    fills = [f for _ in range(repeats) for ids in walks for f in walk(ids)]
    return LibraryTimes(
        library=library,
        version=importlib.metadata.version(library),
        vocab_ms=statistics.median(vocab),
        compile_ms=statistics.median(compiles),
        fill_us_median=statistics.median(fills) * 1e3,
        fill_us_mean=statistics.fmean(fills) * 1e3,
        fill_us_max=max(fills) * 1e3,
        tokens=sum(len(ids) for ids in walks),
    )


def _timed(fn: Callable[[], Any]) -> float:
    """Milliseconds ``fn`` took."""
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def _token_bytes(tokenizer: Tokenizer, vocab_size: int, eos: int) -> dict[bytes, list[int]]:
    """Each token's bytes (byte-level BPE spells byte ``b`` as the character
    ``_BYTE_CHARS[b]``), special tokens left out as xgrammar's description blanks them."""
    backend = tokenizer.backend
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    decode = {ch: b for b, ch in enumerate(_byte_chars())}
    out: dict[bytes, list[int]] = {}
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index >= vocab_size or index in special or index == eos:
            continue
        if all(ch in decode for ch in token):
            raw = bytes(decode[ch] for ch in token)
        else:  # an added token, kept as its text
            raw = token.encode()
        out.setdefault(raw, []).append(index)
    return out


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
