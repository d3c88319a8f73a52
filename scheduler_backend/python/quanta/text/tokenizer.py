"""Text <-> token ids, from a checkpoint directory.

Why a wrapper and not transformers' AutoTokenizer: the serving path must not depend on
transformers (a test-only package here), and it needs only encode, decode and a few special ids.
This reads the same files HF does: tokenizer.json when present, otherwise the vocab.json +
merges.txt pair that real OPT/GPT-2 checkpoints ship, and tokenizer_config.json /
special_tokens_map.json / config.json for the special tokens and whether to prepend BOS (with
the family's own rule, from its spec, where the files say nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from quanta.families import FAMILIES

# Tokens treated as special when a vocab.json + merges.txt checkpoint does not list its own.
_KNOWN_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<|endoftext|>")


class Tokenizer:
    """Encode prompts and decode outputs the way HF's fast tokenizer does for this checkpoint.

    `encode` prepends BOS when the checkpoint asks for it (tokenizer_config's `add_bos_token`,
    or a post-processor that adds it); `decode` drops special tokens and ignores ids beyond the
    vocabulary (models may have more embedding rows than the tokenizer has tokens).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool | None = None,
    ) -> None:
        """add_bos None keeps what the post-processor does; True/False force BOS on/off."""
        self._tokenizer = tokenizer
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        bos = [] if bos_token_id is None else [bos_token_id]
        # NOTE: probe whether the post-processor itself adds BOS, so encode never adds it twice.
        processor_adds = bool(bos) and tokenizer.encode("").ids[:1] == bos
        want = processor_adds if add_bos is None else add_bos
        self._prefix: list[int] = bos if want and not processor_adds else []
        self._strip_first = processor_adds and not want

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`, for callers that need offsets or batching."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, with BOS first when the checkpoint prepends one (unless
        ``add_special_tokens`` is false: a piece of text, such as a word to ban)."""
        if not add_special_tokens:
            return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        ids: list[int] = self._tokenizer.encode(text).ids
        return self._prefix + ids[1:] if self._strip_first else self._prefix + ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids without special tokens; unknown ids decode to nothing."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of an HF-layout checkpoint directory.

    Raises FileNotFoundError when the directory has neither tokenizer.json nor
    vocab.json + merges.txt.
    """
    model_dir = Path(model_dir)
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json")
    model_config = _read_json(model_dir / "config.json")
    family = FAMILIES.get(str(model_config.get("model_type")))
    rules = family.tokens if family is not None else None

    if (model_dir / "tokenizer.json").is_file():
        tokenizer = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    elif (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file():
        tokenizer = _byte_level_bpe(model_dir, tok_config, special_map)
    else:
        raise FileNotFoundError(
            f"no tokenizer in {model_dir}: expected tokenizer.json, or vocab.json and merges.txt"
        )

    bos_id = _special_id(tokenizer, "bos_token", tok_config, special_map, model_config)
    eos_id = _special_id(tokenizer, "eos_token", tok_config, special_map, model_config)
    add_bos = tok_config.get("add_bos_token")
    if rules is not None and rules.always_adds_bos:
        # Where the files are silent, do as the family's HF tokenizer: OPT's prepends </s>.
        if bos_id is None:
            bos_id = tokenizer.token_to_id(rules.bos)
        if add_bos is None:
            add_bos = True
    return Tokenizer(tokenizer, bos_token_id=bos_id, eos_token_id=eos_id, add_bos=add_bos)


def _byte_level_bpe(
    model_dir: Path, tok_config: dict[str, Any], special_map: dict[str, Any]
) -> HFTokenizer:
    """GPT-2 style tokenizer from vocab.json + merges.txt (how real OPT checkpoints ship it)."""
    tokenizer = HFTokenizer(
        models.BPE.from_file(str(model_dir / "vocab.json"), str(model_dir / "merges.txt"))
    )
    add_prefix_space = bool(tok_config.get("add_prefix_space", False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    declared = [
        text
        for source in (tok_config, special_map)
        for key, value in sorted(source.items())
        if key.endswith("_token") and (text := _token_text(value)) is not None
    ]
    specials = dict.fromkeys([*_KNOWN_SPECIALS, *declared])  # ordered, without repeats
    tokenizer.add_special_tokens([t for t in specials if tokenizer.token_to_id(t) is not None])
    return tokenizer


def _special_id(
    tokenizer: HFTokenizer,
    key: str,
    tok_config: dict[str, Any],
    special_map: dict[str, Any],
    model_config: dict[str, Any],
) -> int | None:
    """Id of a special token: tokenizer files first, then config.json's `<key>_id`."""
    for source in (tok_config, special_map):
        text = _token_text(source.get(key))
        if text is not None and tokenizer.token_to_id(text) is not None:
            return tokenizer.token_to_id(text)
    value = model_config.get(f"{key}_id")
    if isinstance(value, list):  # some configs list several EOS ids; the first is canonical
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
