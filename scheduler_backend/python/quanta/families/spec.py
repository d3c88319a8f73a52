"""What a model family supplies, as one record: ``FamilySpec``.

Why one record: every place that once asked ``family == "opt"`` (reading ``config.json``,
the tokenizer's BOS rules, preset checks, random-weight checkpoints, the model class) now asks
the family's spec, so a further family is a model file, a spec and its build steps, and the
tests that walk the registry check its parts against each other.

Nothing here imports torch: the model class is named by import path and loaded only when a
model is built, so reading a config, a preset or a tokenizer stays light. The engine builders
name their family instead (``quanta.build.steps``), so this layer knows nothing of building.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from quanta.build.presets import ModelPreset
    from quanta.families.config import ModelConfig

# HF's default initialiser width for both families' random checkpoints.
INIT_STD = 0.02

Init = Literal["normal", "ones", "zeros"]
TensorSpec = tuple[str, tuple[int, ...], Init]
"""One stored tensor of a checkpoint: HF name, shape, and how HF initialises it."""


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The family's special tokens, at the ids its real tokenizer gives them.

    ``tokens`` is in id order (the tokenizer builder trains them first, so ``tokens[i]`` has
    id ``i``). ``always_adds_bos`` says the family's HF tokenizer prepends ``bos`` even when
    no tokenizer file says so, and takes ``bos`` as BOS when no file names one (OPT's does).
    """

    tokens: tuple[str, ...]
    bos: str
    pad: str | None
    eos: str = "</s>"
    unk: str = "<unk>"
    always_adds_bos: bool = False

    def ids(self) -> dict[str, int | None]:
        """bos/eos/pad ids as config.json and generation_config.json name them."""
        return {
            "bos_token_id": self.tokens.index(self.bos),
            "eos_token_id": self.tokens.index(self.eos),
            "pad_token_id": self.tokens.index(self.pad) if self.pad is not None else None,
        }


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One decoder-only model family, keyed by its HF ``model_type`` (``name``).

    ``model`` is a ``"module:Class"`` path: the runner's ``nn.Module``, built from a
    ``ModelConfig``. ``parse_config(raw, common)`` turns ``config.json`` plus the fields every
    family shares (``families.config.common_fields``) into a ``ModelConfig`` and raises
    ValueError/NotImplementedError on what the runner cannot serve.
    ``check_preset`` raises ValueError on a preset the family's config could not express;
    ``hf_config`` and ``tensor_specs`` give the family's own ``config.json`` keys and stored
    tensors for a random-weight checkpoint of a preset. ``pad_embedding`` names the embedding
    whose padding row HF leaves zero (``nn.Embedding(padding_idx=...)``), if any.
    """

    name: str
    architecture: str
    model: str
    parse_config: Callable[[dict[str, Any], dict[str, Any]], ModelConfig]
    tokens: SpecialTokens
    check_preset: Callable[[ModelPreset], None]
    hf_config: Callable[[ModelPreset], dict[str, object]]
    tensor_specs: Callable[[ModelPreset], list[TensorSpec]]
    pad_embedding: str | None = None

    def model_class(self) -> type[Any]:
        """The runner's model class, imported now (this is where torch gets loaded)."""
        return _load(self.model)


def linear(prefix: str, rows: int, cols: int, *, bias: bool = False) -> list[TensorSpec]:
    """An ``nn.Linear(cols, rows)``'s stored tensors: a normal weight and a zero bias."""
    weight: TensorSpec = (f"{prefix}.weight", (rows, cols), "normal")
    return [weight, (f"{prefix}.bias", (rows,), "zeros")] if bias else [weight]


def layer_norm(prefix: str, width: int) -> list[TensorSpec]:
    """An ``nn.LayerNorm``'s stored tensors: unit weight, zero bias."""
    return [(f"{prefix}.weight", (width,), "ones"), (f"{prefix}.bias", (width,), "zeros")]


def _load(path: str) -> type[Any]:
    module, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not isinstance(cls, type):
        raise TypeError(f"{path} is not a class")
    return cls
