"""The model families Quanta serves, one ``FamilySpec`` each, keyed by HF ``model_type``.

Adding a family: its model module under ``quanta/runner/models/`` (a subclass of the layer
kit's decoder, ``quanta.runner.layers``, for most), a spec module here
(parser, special tokens, preset check, checkpoint layout), listed in ``FAMILIES``, and its
build steps under ``quanta/build/steps/``; ``tests/build/test_families.py`` then checks the parts
against each other. Pure Python: no torch until a spec's ``model_class()`` is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from quanta.families.config import ModelConfig, RopeScaling
from quanta.families.gemma2 import GEMMA2
from quanta.families.llama import LLAMA
from quanta.families.mistral import MISTRAL
from quanta.families.opt import OPT
from quanta.families.phi3 import PHI3
from quanta.families.qwen2 import QWEN2
from quanta.families.qwen3 import QWEN3
from quanta.families.spec import FamilySpec, SpecialTokens, TensorSpec

FAMILIES: Mapping[str, FamilySpec] = MappingProxyType(
    {spec.name: spec for spec in (OPT, LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA2)}
)


def family_names() -> tuple[str, ...]:
    """Registered family names, in registration order."""
    return tuple(FAMILIES)


def get_family(name: str) -> FamilySpec:
    """The spec of ``name``; ValueError naming the known families when there is none."""
    spec = FAMILIES.get(name)
    if spec is None:
        raise ValueError(f"unknown model family {name!r}; known families: {family_names()}")
    return spec


def known_family(name: str) -> str:
    """``name`` when it is a registered family (a pydantic validator for ``family`` fields)."""
    return get_family(name).name


__all__ = [
    "FAMILIES",
    "FamilySpec",
    "ModelConfig",
    "RopeScaling",
    "SpecialTokens",
    "TensorSpec",
    "family_names",
    "get_family",
    "known_family",
]
