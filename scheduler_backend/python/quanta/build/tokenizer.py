"""Byte-level BPE tokenizers for locally built checkpoints.

Why train one: real tokenizers cannot be downloaded here, and a checkpoint is only useful end to
end (text in, text out) with one. Byte-level BPE round-trips any UTF-8 text, so prompts in tests
and benchmarks never hit an unknown token. Training is deterministic (fixed corpus, fixed
settings; the `tokenizers` trainer breaks ties by token id), so the same files come out on every
run. Special tokens sit at the ids the real families use (each family spec's ``tokens``), so code
that hard-codes or reads them from config.json behaves as it would with a real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from quanta.build.corpus import CORPUS
from quanta.families import get_family

TOKENIZER_VOCAB_TARGET = 512


def special_token_ids(family: str) -> dict[str, int | None]:
    """bos/eos/pad ids as config.json and generation_config.json name them."""
    return get_family(family).tokens.ids()


def build_tokenizer(family: str, vocab_size: int = TOKENIZER_VOCAB_TARGET) -> Tokenizer:
    """Train the family's byte-level BPE tokenizer on the embedded corpus.

    The result has exactly `vocab_size` tokens when the corpus allows that many merges (it does
    for the default target); `get_vocab_size()` is the truth either way.
    """
    tokens = get_family(family).tokens
    specials = tokens.tokens
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    bos = tokens.bos
    bos_id = specials.index(bos)
    if tokenizer.token_to_id(bos) != bos_id:
        raise AssertionError(f"{bos} trained to id {tokenizer.token_to_id(bos)}, not {bos_id}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)],
    )
    return tokenizer


def tokenizer_config(family: str, model_max_length: int) -> dict[str, object]:
    """The tokenizer_config.json HF's fast tokenizer loader needs to match our post-processor."""
    tokens = get_family(family).tokens
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": tokens.bos,
        "eos_token": tokens.eos,
        "unk_token": tokens.unk,
        "pad_token": tokens.pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


def write_tokenizer(family: str, out_dir: Path, model_max_length: int) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    tokenizer = build_tokenizer(family)
    config = tokenizer_config(family, model_max_length)
    special_map = {
        key: config[key]
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if config[key] is not None
    }
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return tokenizer


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
