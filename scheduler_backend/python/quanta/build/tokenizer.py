"""Byte-level BPE tokenizers for locally built checkpoints.

Why train one: real tokenizers cannot be downloaded here, and a checkpoint is only useful end to
end (text in, text out) with one. Byte-level BPE round-trips any UTF-8 text, so prompts in tests
and benchmarks never hit an unknown token. Training is deterministic (fixed corpus, fixed
settings; the `tokenizers` trainer breaks ties by token id), so the same files come out on every
run. Special tokens sit at the ids the real families use, so code that hard-codes or reads them
from config.json behaves as it would with a real OPT or LLaMA checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from quanta.build.corpus import CORPUS
from quanta.build.presets import Family

TOKENIZER_VOCAB_TARGET = 512

# Special tokens in id order, and the token each family prepends as BOS. HF's OPT tokenizer
# prepends `</s>` (id 2), not `<s>`; LLaMA prepends `<s>` (id 1).
SPECIAL_TOKENS: dict[Family, tuple[str, ...]] = {
    "opt": ("<s>", "<pad>", "</s>", "<unk>"),
    "llama": ("<unk>", "<s>", "</s>"),
}
BOS_TOKEN: dict[Family, str] = {"opt": "</s>", "llama": "<s>"}
EOS_TOKEN = "</s>"
PAD_TOKEN: dict[Family, str | None] = {"opt": "<pad>", "llama": None}
UNK_TOKEN = "<unk>"


def special_token_ids(family: Family) -> dict[str, int | None]:
    """bos/eos/pad ids as config.json and generation_config.json name them."""
    specials = SPECIAL_TOKENS[family]
    pad = PAD_TOKEN[family]
    return {
        "bos_token_id": specials.index(BOS_TOKEN[family]),
        "eos_token_id": specials.index(EOS_TOKEN),
        "pad_token_id": specials.index(pad) if pad is not None else None,
    }


def build_tokenizer(family: Family, vocab_size: int = TOKENIZER_VOCAB_TARGET) -> Tokenizer:
    """Train the family's byte-level BPE tokenizer on the embedded corpus.

    The result has exactly `vocab_size` tokens when the corpus allows that many merges (it does
    for the default target); `get_vocab_size()` is the truth either way.
    """
    specials = SPECIAL_TOKENS[family]
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
    bos = BOS_TOKEN[family]
    bos_id = specials.index(bos)
    if tokenizer.token_to_id(bos) != bos_id:
        raise AssertionError(f"{bos} trained to id {tokenizer.token_to_id(bos)}, not {bos_id}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)],
    )
    return tokenizer


def tokenizer_config(family: Family, model_max_length: int) -> dict[str, object]:
    """The tokenizer_config.json HF's fast tokenizer loader needs to match our post-processor."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN[family],
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN[family],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


def write_tokenizer(family: Family, out_dir: Path, model_max_length: int) -> Tokenizer:
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
